"""The commit transaction: the one way any writer creates or replaces a checkpoint.

Every writer (``save``, ``async_save``, zarr saves, ``reshard``, HF import, the manager) calls, in
this order:

1. :func:`check_header` (and the state's own validation) before writing any byte: step, user
   metadata and layout must encode *and* decode with our own codec;
2. :func:`begin`: the existing checkpoint at the URL, or ``CheckpointExistsError`` when there is one
   and ``overwrite`` is not set (a first, early check);
3. writes of new data under fresh names only (never into a file a committed manifest lists);
4. :func:`commit_manifest`: the manifest is decoded by our own decoder before it is written, then
   committed by one atomic step, exclusive (no-clobber) unless overwriting; the loser of a race
   gets ``CheckpointExistsError`` and its own files are removed;
5. after the commit, :func:`remove_replaced` deletes only files the replaced manifest lists and the
   new one does not, and only data files of ours (:func:`in_data_area`: our writers' names under
   ``data/``, files of a ``zarr/`` or ``zarr-<id>/`` tree), never the manifest.

**Ownership** (this module is the one place that keeps it). A writer owns exactly the files it created
in this process: every name comes from :func:`fresh_data_file` / :func:`fresh_zarr_root` (a random
id: no other writer can produce it), is recorded in the writer's :class:`WrittenSet` before the file
is opened, and :func:`remove_files` deletes nothing but a written set. Nothing is ever deleted because
a listing shows it and a plan does not name it: another writer may be writing it right now. Files a
writer finds and re-uses (an interrupted reshard's finished files) are adopted only from a writer that
is provably gone (:func:`writer_gone`), and are never in the adopter's written set. Leftovers of a
killed writer are gc's to report, not the next writer's to delete.

docs/RELIABILITY.md lists these rules and the tests that hold them.
"""

from __future__ import annotations

import os
import posixpath
import re
import socket
import threading
import time
import uuid
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from ckpt import _lease as lease
from ckpt.errors import CheckpointError, CheckpointExistsError, ManifestError, ManifestIntegrityError, StateError
from ckpt.manifest import DATA_DIR, MANIFEST_NAME, Manifest, check_relpath
from ckpt.storage import Storage

# The files our zarr writer makes in a tree (ckpt._zarr_layout): the group's and each array's
# ``zarr.json`` and the chunks ``<key>/c/<i>/<j>...`` (keys never start with '.' nor hold '/'); a user's
# ``zarr/notes.md`` is not one, whatever its directory is called.
ZARR_FILE = re.compile(r"^zarr(-[0-9a-f]{6,32})?/(zarr\.json|[^/.][^/]*/(zarr\.json|c(/\d+)*))$")
# Names only our writers give data files (``planner.data_file_name`` and the fresh names of saves).
OUR_DATA_FILE = re.compile(r"^data/\d{5}-[0-9a-f]{12}\.(safetensors|zst)$")  # .zst: compressed (ckpt._codec)
# Scaffolding of our writers: reshard markers (``<plan id>-<rank>[-<writer token>].done``); leases and
# the temp names of atomic commits are ckpt._lease's to name (``lease.is_protected_name``).
OUR_SCAFFOLD = lease.RESHARD_MARKER
ID_LEN = 12  # hex digits of a random id: 48 bits, no collision between writers in practice
WRITER_GRACE_S = lease.LEASE_GRACE_S  # a writer on another machine counts as alive this long


def new_id() -> str:
    """A fresh random id (12 hex digits): the part of every name that no other writer can produce."""
    return uuid.uuid4().hex[:ID_LEN]


def fresh_data_file(rank: int) -> str:
    """A new data file name for ``rank`` (``data/<rank:05d>-<random>.safetensors``), never used before."""
    return f"{DATA_DIR}/{rank:05d}-{new_id()}.safetensors"


def data_file_rank(path: str) -> int | None:
    """The rank a data file name of ours was made for, None for any other name."""
    if OUR_DATA_FILE.match(path) is None:
        return None
    return int(path[len(DATA_DIR) + 1 : len(DATA_DIR) + 6])


def fresh_zarr_root() -> str:
    """A new zarr tree for one save (``zarr-<random>``): zarr fixes chunk names inside a tree, so the
    tree's name is what keeps two saves' chunks apart."""
    return f"zarr-{new_id()}"


class WrittenSet:
    """The files one writer created in this process: the only files it may ever delete (when it fails,
    or loses the commit). A path is recorded *before* the file is opened, so a failure half-way
    through creating it still removes it. Thread-safe (a writer's lanes record into one set).

    Files a writer adopts (found on storage, written by someone else) must never be recorded here.
    """

    def __init__(self, paths: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._paths: list[str] = []
        self._seen: set[str] = set()
        self.extend(paths)

    def append(self, path: str) -> None:
        """Record ``path`` (a name of this writer's own making) before creating it."""
        with self._lock:
            if path not in self._seen:
                self._seen.add(path)
                self._paths.append(path)

    add = append

    def extend(self, paths: Iterable[str]) -> None:
        for p in paths:
            self.append(p)

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._paths))

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, path: object) -> bool:
        return path in self._seen

    def __repr__(self) -> str:
        return f"WrittenSet({list(self)!r})"


# --- who is writing: adoption of an interrupted writer's files needs proof that it is gone -------

_LIVE: set[str] = set()  # tokens of the writers running in this process
_LIVE_LOCK = threading.Lock()


@contextmanager
def live_writer() -> Iterator[dict[str, Any]]:
    """This process's identity as one writer (``{"host", "machine", "pid", "start", "token", "time"}``)
    for records it leaves on storage (reshard markers): while the block runs, :func:`writer_gone`
    says False for it. The liveness rules are the leases' (:mod:`ckpt._lease`): one check, two users."""
    token = new_id()
    with _LIVE_LOCK:
        _LIVE.add(token)
    try:
        pid = os.getpid()
        yield {"host": socket.gethostname(), "machine": lease.machine_id(), "pid": pid,
               "start": lease.start_time(pid), "token": token, "time": time.time()}
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(token)


def writer_gone(record: Any) -> bool:
    """True only when the writer of ``record`` (from :func:`live_writer`) provably cannot touch its
    files again: a writer of this process that has returned, a process of this machine that no longer
    runs (:func:`ckpt._lease.process_alive`, pid reuse included); a writer elsewhere once its record
    is older than ``lease.LEASE_GRACE_S``. Anything unreadable: False (keep hands off).
    """
    try:
        host, pid, token, t = record["host"], int(record["pid"]), str(record["token"]), float(record["time"])
    except (TypeError, KeyError, ValueError):
        return False
    machine, start = record.get("machine"), record.get("start")
    if machine is None and host == socket.gethostname():
        machine = lease.machine_id()  # a record of an older version: same host taken as same machine
    if machine != lease.machine_id():
        return time.time() - t > WRITER_GRACE_S
    if pid == os.getpid():
        with _LIVE_LOCK:
            return token not in _LIVE
    return not lease.process_alive(pid, start if isinstance(start, int) else None)


def in_data_area(path: str) -> bool:
    """True for a data file of ours: ``data/<rank>-<id>.safetensors`` (the names our writers give)
    or a file our zarr writer makes in a zarr tree (``zarr/``, ``zarr-<id>/``: :data:`ZARR_FILE`).

    The only files a transaction may ever delete; the manifest and anything else are never touched.
    """
    try:
        check_relpath(path, "file")
    except ManifestError:
        return False
    # only names our writers give: a hostile manifest listing a user's data/train.jsonl (or zarr/notes.md)
    # cannot make a clean-up delete it, nor gc take such a file for an unfinished save of ours
    return OUR_DATA_FILE.match(path) is not None or ZARR_FILE.match(path) is not None


def is_ours(path: str) -> bool:
    """Whether a file of a checkpoint directory (``path`` relative to it) has a name only our writers
    give: the manifest, a data file (:func:`in_data_area`), a reshard marker, a lease or the temp file
    of an atomic commit (:func:`ckpt._lease.is_protected_name`). The one test of "ours" by name that
    writers (refusing a destination) and gc (removing an unfinished save) share; anything else is a
    user's file, never deleted."""
    return (path == MANIFEST_NAME or in_data_area(path) or OUR_SCAFFOLD.match(path) is not None
            or lease.is_protected_name(path))


def foreign_files(listing: Iterable[str], previous: Manifest | None) -> list[str]:
    """Files in a destination listing that neither a checkpoint (``previous``) nor an unfinished
    write of ours explains: a user's files. Writers refuse such a destination rather than mix in."""
    known = set(previous.files) if previous is not None else set()
    return sorted(f for f in listing if f not in known and not is_ours(f))


def check_header(step: Any, user_metadata: Any, layout: Any = None) -> tuple[int | None, dict[str, Any]]:
    """Validate the manifest's header fields before anything is written; return ``(step, metadata)``
    normalized (numpy/torch integer scalars become ``int``; metadata scalars become Python values).

    Raises StateError naming the field when the value cannot be stored and read back by this package.
    """
    from ckpt.formats import msgpack_codec as codec

    step = codec.normalize_step(step)
    meta = _metadata(user_metadata, "user_metadata")
    lay = _metadata(layout, "layout") if layout is not None else None
    probe = Manifest(tensors={}, objects={}, files={}, step=step, layout=lay, user_metadata=meta)
    try:
        codec.decode_manifest(codec.encode_manifest(probe))
    except (CheckpointError, TypeError, ValueError, OverflowError, UnicodeError) as e:
        raise StateError(f"user_metadata/layout/step cannot be stored and read back ({e}); use plain ints, "
                         "floats, str, bytes, bools, lists and dicts with str keys") from None
    return step, meta


def _metadata(value: Any, where: str) -> dict[str, Any]:
    from ckpt.formats.msgpack_codec import normalize_metadata

    if value is None:
        return {}
    if not isinstance(value, dict):
        raise StateError(f"{where} must be a dict, got {type(value).__name__}")
    return normalize_metadata(value, where)  # type: ignore[no-any-return]


def read_current(storage: Storage, *, overwrite: bool) -> Manifest | None:
    """The committed manifest at ``storage``'s root (None when there is none).

    A damaged manifest (wrong checksum) is returned as None when overwriting: its files cannot be
    listed, so they stay unreferenced rather than being guessed at. Without ``overwrite`` its error
    is raised (the same type a reader gets); a manifest of a newer format is never replaced.
    """
    from ckpt.formats.msgpack_codec import decode_manifest

    if storage.size(MANIFEST_NAME) is None:
        return None
    try:
        return decode_manifest(storage.read_file(MANIFEST_NAME), url=f"{storage.url}/{MANIFEST_NAME}")
    except ManifestError as e:
        if not overwrite:  # the same error type a reader gets, and what to do about it
            raise type(e)(f"{e}; a checkpoint is there: pass overwrite=True to replace it, or save to a new "
                          "path") from None
        if isinstance(e, ManifestIntegrityError) or type(e) is ManifestError:
            return None
        raise


def begin(storage: Storage, *, overwrite: bool) -> Manifest | None:
    """Step 2: the checkpoint being replaced, or ``CheckpointExistsError`` when one exists and
    ``overwrite`` is False. The commit checks again (exclusively) at the end."""
    previous = read_current(storage, overwrite=overwrite)
    if previous is not None and not overwrite:
        raise CheckpointExistsError(
            f"{storage.url}: already holds a committed checkpoint (step {previous.step}); "
            "pass overwrite=True to replace it, or save to a new path")
    return previous


def commit_manifest(storage: Storage, data: bytes, *, overwrite: bool,
                    written: WrittenSet | Iterable[str] = ()) -> Manifest:
    """Steps 4-5: check that our own decoder accepts ``data``, commit it atomically (exclusively
    unless ``overwrite``), then delete what the replaced checkpoint alone used.

    ``written``: the writer's own written set (files this attempt created under fresh names); they
    are removed when the commit fails, so a loser leaves nothing behind (any of them that the
    manifest now committed there lists is kept). Returns the committed manifest (decoded from ``data``).

    Raises StateError (the manifest would not be readable: nothing is committed),
    CheckpointExistsError (another writer committed first), StorageError.
    """
    from ckpt.formats.msgpack_codec import decode_manifest

    written = written if isinstance(written, WrittenSet) else WrittenSet(written)
    try:
        try:
            manifest = decode_manifest(data, url=f"{storage.url}/{MANIFEST_NAME}")
        except ManifestError as e:
            raise StateError(f"refusing to commit a manifest this ckpt cannot read back ({e}); nothing was "
                             "committed and any previous checkpoint is intact") from None
        for d in sorted({posixpath.dirname(f) for f in manifest.files}):
            storage.sync_dir(d)  # data file names durable before the commit (a no-op where not needed)
        previous = read_current(storage, overwrite=True) if overwrite else None  # what we actually replace
        storage.commit(MANIFEST_NAME, data, exclusive=not overwrite)
    except BaseException:
        if not _holds(storage, data):  # a failure after the rename (e.g. a directory fsync) keeps the files
            # Our names are fresh: only a writer that adopted them could list them, and adoption
            # waits for us to be gone; keeping what the committed manifest lists guards that rule.
            remove_files(storage, written, keep=committed_files(storage) or ())
        raise
    remove_replaced(storage, previous, manifest)
    return manifest


def committed_files(storage: Storage) -> set[str] | None:
    """The files the manifest committed at ``storage`` lists (empty: none there); None when one is
    there that cannot be read (then nothing may be assumed unreferenced)."""
    try:
        current = read_current(storage, overwrite=True)
    except Exception:  # noqa: BLE001 - a newer format, an I/O error: cannot tell
        return None
    if current is None:
        return None if storage.size(MANIFEST_NAME) is not None else set()
    return set(current.files)


def _holds(storage: Storage, data: bytes) -> bool:
    try:
        return storage.size(MANIFEST_NAME) == len(data) and storage.read_file(MANIFEST_NAME) == data
    except Exception:  # noqa: BLE001 - cannot tell: keep the files (gc reports leftovers)
        return True


def remove_replaced(storage: Storage, previous: Manifest | None, new: Manifest) -> list[str]:
    """After a commit: delete files ``previous`` lists that ``new`` does not, inside the data area
    only. Best effort (gc reports leftovers); returns what it deleted."""
    if previous is None:
        return []
    doomed = [f for f in previous.files if f not in new.files and in_data_area(f)]
    _delete(storage, doomed)
    return doomed


def remove_files(storage: Storage, written: WrittenSet, *, keep: Collection[str] = ()) -> list[str]:
    """Best-effort delete of a writer's own files (its :class:`WrittenSet`), except ``keep``; only
    data-area files (anything else is refused silently: never the manifest). Returns what it deleted.

    The only clean-up a writer may run besides :func:`remove_replaced`: it takes a written set, never
    a listing, so a writer cannot delete a file another writer is writing or has committed.
    """
    if not isinstance(written, WrittenSet):
        raise TypeError("remove_files takes a writer's own WrittenSet, never a listing")
    doomed = [f for f in written if f not in keep and in_data_area(f)]
    _delete(storage, doomed)
    return doomed


def _delete(storage: Storage, files: Iterable[str]) -> None:
    for f in files:
        if not in_data_area(f):
            continue
        try:
            storage.delete(f)
        except CheckpointError:
            pass  # never mask the error being handled; gc reports leftovers
        except OSError:
            pass


__all__ = ["begin", "check_header", "commit_manifest", "committed_files", "data_file_rank", "foreign_files",
           "fresh_data_file", "fresh_zarr_root", "in_data_area", "is_ours", "live_writer", "new_id", "read_current",
           "remove_files", "remove_replaced", "writer_gone", "WrittenSet", "OUR_DATA_FILE"]
