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

docs/RELIABILITY.md lists these rules and the tests that hold them.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from typing import Any

from ckpt.errors import CheckpointError, CheckpointExistsError, ManifestError, ManifestIntegrityError, StateError
from ckpt.manifest import DATA_DIR, MANIFEST_NAME, Manifest, check_relpath
from ckpt.storage import Storage

ZARR_AREA = re.compile(r"^zarr(-[0-9a-f]{6,32})?$")
# Names only our writers give data files (``planner.data_file_name`` and the fresh names of saves).
OUR_DATA_FILE = re.compile(r"^data/\d{5}-[0-9a-f]{12}\.safetensors$")
# Scaffolding of our writers: reshard markers, the manager's lease, temp names of atomic commits.
OUR_SCAFFOLD = re.compile(r"^(\.reshard/[0-9a-f]{12}-\d{5}\.done|\.writing|(.*/)?[^/]+\.tmp\.\d+(\.\d+)?)$")


def in_data_area(path: str) -> bool:
    """True for a data file of ours: ``data/<rank>-<id>.safetensors`` (the names our writers give)
    or a file of a zarr tree (``zarr/``, ``zarr-<id>/``).

    The only files a transaction may ever delete; the manifest and anything else are never touched.
    """
    try:
        check_relpath(path, "file")
    except ManifestError:
        return False
    head, sep, rest = path.partition("/")
    if head == DATA_DIR:
        # only names our writers give: a hostile manifest listing a user's data/train.jsonl cannot
        # make a clean-up delete it
        return OUR_DATA_FILE.match(path) is not None
    return bool(sep and rest) and ZARR_AREA.match(head) is not None


def foreign_files(listing: Iterable[str], previous: Manifest | None) -> list[str]:
    """Files in a destination listing that neither a checkpoint (``previous``) nor an unfinished
    write of ours explains: a user's files. Writers refuse such a destination rather than mix in."""
    known = set(previous.files) if previous is not None else set()
    return sorted(f for f in listing
                  if f != MANIFEST_NAME and f not in known and not OUR_DATA_FILE.match(f) and not OUR_SCAFFOLD.match(f)
                  and not (in_data_area(f) and f.split("/", 1)[0] != DATA_DIR))


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


def commit_manifest(storage: Storage, data: bytes, *, overwrite: bool, written: Iterable[str] = ()) -> Manifest:
    """Steps 4-5: check that our own decoder accepts ``data``, commit it atomically (exclusively
    unless ``overwrite``), then delete what the replaced checkpoint alone used.

    ``written``: the files this attempt created (fresh names); they are removed when the commit
    fails, so a loser leaves nothing behind. Returns the committed manifest (decoded from ``data``).

    Raises StateError (the manifest would not be readable: nothing is committed),
    CheckpointExistsError (another writer committed first), StorageError.
    """
    from ckpt.formats.msgpack_codec import decode_manifest

    written = list(written)
    try:
        try:
            manifest = decode_manifest(data, url=f"{storage.url}/{MANIFEST_NAME}")
        except ManifestError as e:
            raise StateError(f"refusing to commit a manifest this ckpt cannot read back ({e}); nothing was "
                             "committed and any previous checkpoint is intact") from None
        sync_dir = getattr(storage, "sync_dir", None)
        if sync_dir is not None:  # data file names durable before the commit
            for d in sorted({posixpath.dirname(f) for f in manifest.files}):
                sync_dir(d)
        previous = read_current(storage, overwrite=True) if overwrite else None  # what we actually replace
        storage.commit(MANIFEST_NAME, data, exclusive=not overwrite)
    except BaseException:
        if not _holds(storage, data):  # a failure after the rename (e.g. a directory fsync) keeps the files
            remove_files(storage, written)
        raise
    remove_replaced(storage, previous, manifest)
    return manifest


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
    remove_files(storage, doomed)
    return doomed


def remove_files(storage: Storage, files: Iterable[str]) -> None:
    """Best-effort delete of data-area files (anything else is refused silently: never the manifest)."""
    for f in files:
        if not in_data_area(f):
            continue
        try:
            storage.delete(f)
        except CheckpointError:
            pass  # never mask the error being handled; gc reports leftovers
        except OSError:
            pass


__all__ = ["begin", "check_header", "commit_manifest", "foreign_files", "in_data_area", "read_current",
           "remove_files", "remove_replaced", "OUR_DATA_FILE"]
