"""Putting a Hugging Face export into its output directory: one export at a time, and an overwrite that a
failure or a kill at any moment leaves loadable (docs/HF.md, "Overwrite, crash safety and concurrency").

A model directory has no single commit point: transformers finds the weights through
``model.safetensors.index.json`` (or ``model.safetensors``) and the architecture in ``config.json``, and an
export with ``overwrite`` replaces files of the *same names* (``model-0000k-of-0000n.safetensors``). So:

1. **One export at a time** (:class:`ExportLock`): ``OUT/.ckpt-export.lock``. On a local directory it is held
   with ``flock`` (the kernel drops it when the process dies: a killed export never locks the next one out);
   a second export into the directory fails at once with :class:`~ckpt.errors.DirectoryInUseError`. On other
   storage it is an exclusive PUT of the lock object, taken over only from a writer that provably is gone
   (:func:`ckpt._transaction.writer_gone`: a dead pid of this machine; elsewhere after a day).
2. **Local directories: new files under fresh names first.** The weight files are written into a directory of
   this export's own, ``OUT/.ckpt-export-<id>/`` (made with ``mkdir``, files opened ``O_NOFOLLOW``, fsynced),
   then published:

   - *no final name in use* (a first export, or ``n`` changed): each file is moved into place without ever
     replacing anything (``link`` + ``unlink``), then ``config.json`` and the side files are committed, then the
     index, **last**. Until that rename the old index describes old, intact files;
   - *a final name in use* (a re-export with as many files: the old index lists them): ``config.json`` and the
     side files, then a *staging index* naming the new files inside ``.ckpt-export-<id>/`` is committed: from
     that rename on the directory is the new model (transformers and ckpt read index paths relative to the
     directory), and the old files are referenced by nothing. Only then is each new file linked to its final
     name (replacing the old file), then the final index is committed and the staging directory removed.

   Small files (index, config, side files) are committed the same way: written into the staging directory,
   fsynced, renamed onto their name (a kill leaves nothing outside the staging directory but the lock file).
   A failure before the commit point (the index rename) removes exactly what this export created (its
   :class:`~ckpt._transaction.WrittenSet`: its staging files, the files it moved into place, the config and side
   files it created) and puts back the config and side files it replaced; after it, nothing new is removed.
   Then the old model's weight files the new index does not list are deleted (names of :data:`WEIGHTS_NAME`
   only, regular files only: a link, or a user's ``adapter_model.safetensors``, stays), and staging directories
   of killed exports (provably dead: the lock is held, and no index names them; our file names only). Why not
   always the staging index: moving files whose names are free costs no second index write and no links.
3. **Object stores** (no rename): files go under their final names, each one PUT (atomic), the index last. When
   a final name is in use, the old index is first replaced by a *tombstone* (an index with no ``weight_map``):
   until the new index lands the directory is not a model, and ckpt's import says why
   (``ManifestError``: run the export again); transformers fails on it too.

The remaining window, on every storage: ``config.json`` and the side files are replaced just before the index;
an export killed between the two leaves the previous weights with the new ``config.json`` (the same file when
re-exporting the same architecture and dtype). On object stores, the tombstone window above.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ckpt import _transaction as transaction
from ckpt.errors import CheckpointError, CheckpointExistsError, DirectoryInUseError, StorageError
from ckpt.hf.directory import INCOMPLETE_KEY, INCOMPLETE_MESSAGE, INDEX_NAME, WEIGHTS_NAME, read_json
from ckpt.storage import Storage
from ckpt.storage.local import open_new, write_all

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the exclusive-create lock of object stores
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".ckpt-export.lock"
STAGE_PREFIX = ".ckpt-export-"
LOCK_TAG = "ckpt-export-lock"  # what a lock file of ours holds (a user's file at the name is never adopted)
_STAGE = re.compile(r"^\.ckpt-export-[0-9a-f]{12}$")
# what an export leaves in its staging directory: weight files (a link on its way to the final name, the temp
# file of a commit), and the index, config.json and side files on their way to theirs
_STAGE_FILE = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors(\.link|\.tmp\.\d+\.\d+)?|"
                         r"model\.safetensors\.index\.json|config\.json|[\w.-]+\.(json|jinja|txt|model))$")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK)

_HELD: set[int] = set()  # descriptors of export locks this process holds


def _in_child() -> None:
    for fd in list(_HELD):  # a forked child does not keep its parent's lock held
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)


# ---------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------


def _parse(data: bytes | None) -> dict[str, Any] | None:
    try:
        d = json.loads(data or b"")
    except (ValueError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) and d.get("ckpt") == LOCK_TAG else None


def _holder(data: bytes | None) -> str:
    d = _parse(data)
    if d is None:
        return "another process"
    return f"pid {d.get('pid')} on {d.get('host')}"


def _busy(where: str, data: bytes | None) -> DirectoryInUseError:
    return DirectoryInUseError(f"{where}: another export into this directory is running ({_holder(data)} holds "
                               f"{LOCK_NAME}); one export into a directory at a time: wait for it to finish, or "
                               "export elsewhere")


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    f = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (f.st_dev, f.st_ino)


class ExportLock:
    """One export into a directory at a time (module docstring, 1). ``record``: this writer's
    (:func:`ckpt._transaction.live_writer`), written into the lock for whoever finds it held."""

    def __init__(self, dst: Storage, record: dict[str, Any]) -> None:
        self.dst = dst
        self.data = json.dumps({"ckpt": LOCK_TAG, **record}).encode()
        self._fd: int | None = None
        self._path: str | None = None
        self._put = False

    def __enter__(self) -> ExportLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Raises DirectoryInUseError (held by another export), StorageError (cannot write the lock, or
        something that is not our lock file is at its name)."""
        root = self.dst.local_dir
        if root is not None and fcntl is not None:
            self._acquire_local(root)
        else:
            self._acquire_put()

    def _acquire_local(self, root: str) -> None:
        path = os.path.join(root, LOCK_NAME)
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as e:
            raise StorageError(f"{root}: cannot create the output directory ({e.strerror})") from e
        for _ in range(100):
            made = True
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
            except FileExistsError:
                made = False
                try:
                    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
                except FileNotFoundError:
                    continue  # its holder released it meanwhile
                except OSError as e:
                    raise _lock_error(path, e) from e
            except OSError as e:
                raise _lock_error(path, e) from e
            locked = False
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise StorageError(f"{path}: not a regular file, at the name of the export's lock; remove it")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise _busy(root, os.pread(fd, 4096, 0)) from None
                locked = True
                if not _same_file(fd, path):  # its holder removed it between our open and our lock
                    os.close(fd)
                    continue
                old = os.pread(fd, 64 << 10, 0)
                if old and _parse(old) is None:  # (empty: a killed export's, before it wrote its record)
                    raise StorageError(f"{path}: a file ckpt did not write is at the name of the export's lock; "
                                       "move it away, then export again")
                os.ftruncate(fd, 0)
                os.pwrite(fd, self.data, 0)
            except BaseException:
                if made and locked and _same_file(fd, path):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            self._fd, self._path = fd, path
            _HELD.add(fd)
            return
        raise _busy(root, None)

    def _acquire_put(self) -> None:
        for attempt in range(2):
            try:
                self.dst.commit(LOCK_NAME, self.data, exclusive=True)
                self._put = True
                return
            except CheckpointExistsError:
                try:
                    old: bytes | None = self.dst.read_file(LOCK_NAME)
                except CheckpointError:
                    old = None  # released meanwhile
                if old is not None:
                    rec = _parse(old)
                    if rec is None:
                        raise StorageError(f"{self.dst.url}/{LOCK_NAME}: an object ckpt did not write is at the "
                                           "name of the export's lock; remove it, then export again") from None
                    if attempt or not transaction.writer_gone(rec):
                        raise _busy(self.dst.url, old) from None
                    # a killed export's lock: taken over (two exports doing so at the very same moment can
                    # both proceed: object stores have no lock that dies with its process)
                    with contextlib.suppress(CheckpointError):
                        self.dst.delete(LOCK_NAME)
        raise _busy(self.dst.url, None)

    def release(self) -> None:
        """Drop the lock (idempotent; only ours: never another export's)."""
        fd, path = self._fd, self._path
        if fd is not None and path is not None:
            self._fd = None
            _HELD.discard(fd)
            try:
                if _same_file(fd, path):
                    os.unlink(path)
            except OSError:
                pass  # a leftover lock file is free for the next export (nobody holds its flock)
            finally:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self._put:
            self._put = False
            with contextlib.suppress(CheckpointError):
                if self.dst.read_file(LOCK_NAME) == self.data:
                    self.dst.delete(LOCK_NAME)


def _lock_error(path: str, e: OSError) -> StorageError:
    if e.errno == errno.ELOOP:
        return StorageError(f"{path}: is a symbolic link; an export never writes through one (remove it)")
    return StorageError(f"{path}: cannot take the export's lock ({e.strerror}); check that the directory is "
                        "writable")


# ---------------------------------------------------------------------------------------------
# Publishing
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outputs:
    """What an export puts into its directory."""

    weights: list[str]  # the streamed weight files' final names (model-k-of-n), in order
    index: dict[str, Any]  # the index's body (weight_map values: final names)
    computed: dict[str, bytes] = field(default_factory=dict)  # small weight files written whole: name -> bytes
    meta: dict[str, bytes] = field(default_factory=dict)  # config.json and side files: name -> bytes

    @property
    def names(self) -> list[str]:
        return [*self.weights, *self.computed]


WriteWeights = Callable[[str, transaction.WrittenSet], int]
"""``write(prefix, written)``: stream the weight files to ``prefix + name`` (recording each path in
``written`` before opening it); returns the most buffer bytes held at once."""


def _index_bytes(index: dict[str, Any]) -> bytes:
    return (json.dumps(index, indent=2) + "\n").encode()


def _wrap(what: str, e: OSError) -> StorageError:
    return StorageError(f"{what}: {e.strerror or e}; the previous model is unchanged unless the export reached its "
                        "commit (then the directory holds the new one)")


def publish(dst: Storage, out: Outputs, write: WriteWeights, *, token: str, replaced: Iterable[str]) -> int:
    """Write the export ``out`` into ``dst`` (module docstring, 2 and 3) and delete the ``replaced``
    weight files the new index does not list; the caller holds the :class:`ExportLock`. ``token``: this
    writer's random id (its staging directory's name). Returns the most buffer bytes held at once."""
    root = dst.local_dir
    if root is not None:
        got = _publish_local(dst, root, out, write, STAGE_PREFIX + token)
    else:
        got = _publish_put(dst, out, write)
    _remove_stale(dst, replaced, set(out.names))
    return got


def _regular_or_absent(root: str, names: Iterable[str]) -> None:
    """Refuse (StorageError) a link, a directory or anything but a regular file at a name the export writes:
    an export never writes through a link nor replaces one (it is a user's)."""
    for name in names:
        full = os.path.join(root, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StorageError(f"{full}: cannot stat ({e.strerror})") from e
        if stat.S_ISLNK(st.st_mode):
            raise StorageError(f"{full}: is a symbolic link; an export never writes through one nor replaces it "
                               "(remove it, or export elsewhere)")
        if not stat.S_ISREG(st.st_mode):
            raise StorageError(f"{full}: not a regular file, at a name the export writes; remove it, or export "
                               "elsewhere")


def _stages_named(dst: Storage) -> set[str] | None:
    """The staging directories the committed index names (None: an index that cannot be read)."""
    try:
        if dst.size(INDEX_NAME) is None:
            return set()
        idx = read_json(dst, INDEX_NAME)
    except CheckpointError:
        return None
    wmap = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wmap, dict):
        return set() if isinstance(idx, dict) and INCOMPLETE_KEY in idx else None
    return {v.split("/", 1)[0] for v in wmap.values() if isinstance(v, str) and "/" in v}


def remove_leftovers(dst: Storage) -> list[str]:
    """Staging directories of exports that are gone (local; call it holding the lock): every export
    holds the lock while it has a staging directory that no index names, so any such directory found
    under the lock is a killed export's. Only our file names are removed inside it; returns them."""
    root = dst.local_dir
    if root is None:
        return []
    named = _stages_named(dst)
    if named is None:
        return []  # an index we cannot read: cannot tell what it names, touch nothing
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    out: list[str] = []
    for d in entries:
        if _STAGE.match(d) and d not in named:
            out += _remove_stage(root, d)
    return out


def _remove_stage(root: str, stage: str) -> list[str]:
    full = os.path.join(root, stage)
    try:
        if not stat.S_ISDIR(os.lstat(full).st_mode):
            return []
        names = os.listdir(full)
    except OSError:
        return []
    gone = []
    for n in names:
        p = os.path.join(full, n)
        with contextlib.suppress(OSError):
            if _STAGE_FILE.match(n) and stat.S_ISREG(os.lstat(p).st_mode):
                os.unlink(p)
                gone.append(f"{stage}/{n}")
    with contextlib.suppress(OSError):
        os.rmdir(full)  # only when empty: anything else in it is kept
    return gone


def _holds(dst: Storage, name: str, data: bytes) -> bool:
    try:
        return dst.size(name) == len(data) and dst.read_file(name) == data
    except Exception:  # noqa: BLE001 - cannot tell: count it as committed (keep the files)
        return True


@dataclass(slots=True)
class _Undo:
    """What a failure before the commit point puts back: this export's own files (removed) and the
    config / side files it replaced (their previous bytes, committed again). ``put(name, data)``: how a
    whole small file is committed atomically here."""

    dst: Storage
    put: Callable[[str, bytes], None]
    written: transaction.WrittenSet = field(default_factory=transaction.WrittenSet)
    saved: dict[str, bytes] = field(default_factory=dict)

    def commit_meta(self, meta: dict[str, bytes]) -> None:
        for name, data in meta.items():
            if self.dst.size(name) is None:
                self.written.append(name)  # created by this export: removed on failure
            elif name not in self.saved:
                self.saved[name] = self.dst.read_file(name)  # replaced: put back on failure
            self.put(name, data)

    def run(self) -> None:
        for name, data in self.saved.items():
            with contextlib.suppress(Exception):
                self.put(name, data)
        for p in self.written:
            if p not in self.saved:
                with contextlib.suppress(CheckpointError, OSError):
                    self.dst.delete(p)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_local(root: str, stage: str, name: str, data: bytes) -> None:
    """Commit a whole small file: written into the staging directory (created exclusively, never through a
    link), fsynced, renamed onto ``name`` (atomic: readers see the old file or the new one), the directory
    fsynced. A kill leaves at most a file in the staging directory (removed by the next export)."""
    tmp = os.path.join(root, stage, name)
    full = os.path.join(root, name)
    made = False
    try:
        fd = open_new(tmp)
        made = True
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, full)
        made = False
        _fsync_dir(root)
    except OSError as e:
        if made:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise _wrap(f"{full}: cannot commit", e) from e


def _publish_local(dst: Storage, root: str, out: Outputs, write: WriteWeights, stage: str) -> int:
    names = out.names
    _regular_or_absent(root, [*names, INDEX_NAME, *out.meta])

    def put(name: str, data: bytes) -> None:
        _regular_or_absent(root, [name])
        _put_local(root, stage, name, data)

    undo = _Undo(dst, put)
    stage_dir = os.path.join(root, stage)
    committed = False
    trying: bytes | None = None  # the index being committed (a failure after its rename is a commit)
    try:
        try:
            os.mkdir(stage_dir, 0o755)  # exclusive: this export's own directory
        except OSError as e:
            raise _wrap(f"{stage_dir}: cannot create the export's staging directory", e) from e
        buffer_bytes = write(f"{stage}/", undo.written)
        for name, data in out.computed.items():
            undo.written.append(f"{stage}/{name}")
            dst.commit(f"{stage}/{name}", data)
        dst.sync_dir(stage)
        final = _index_bytes(out.index)
        if any(os.path.lexists(os.path.join(root, n)) for n in names):
            undo.commit_meta(out.meta)
            staging = dict(out.index, weight_map={k: f"{stage}/{v}" for k, v in out.index["weight_map"].items()})
            trying = _index_bytes(staging)
            put(INDEX_NAME, trying)
            committed = True  # the new model, read from the staging directory: nothing references the old files
            for n in names:
                _link_into_place(root, stage, n)
            dst.sync_dir("")
            put(INDEX_NAME, final)
        else:
            for n in names:
                _move_no_clobber(root, f"{stage}/{n}", n)
                undo.written.append(n)
            dst.sync_dir("")
            undo.commit_meta(out.meta)
            trying = final
            put(INDEX_NAME, final)
            committed = True
    except BaseException:
        if not committed and not (trying is not None and _holds(dst, INDEX_NAME, trying)):
            undo.run()
            with contextlib.suppress(OSError):
                os.rmdir(stage_dir)
        raise
    with contextlib.suppress(OSError):
        _fsync_dir(os.path.dirname(root) or ".")  # the directory's own name, when this export made it
    _remove_stage(root, stage)
    return buffer_bytes


def _move_no_clobber(root: str, src_rel: str, dst_rel: str) -> None:
    """Give the file ``src_rel`` the name ``dst_rel``, never replacing anything there."""
    src, dst = os.path.join(root, src_rel), os.path.join(root, dst_rel)
    try:
        os.link(src, dst)
    except FileExistsError:
        raise StorageError(f"{dst}: appeared while the export was publishing (another program writes into this "
                           "directory); nothing of the previous model was changed") from None
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise _wrap(f"{dst}: cannot move the new file into place", e) from e
        if os.path.lexists(dst):  # no hard links here: check, then rename
            raise StorageError(f"{dst}: appeared while the export was publishing") from None
        try:
            os.rename(src, dst)
        except OSError as e2:
            raise _wrap(f"{dst}: cannot move the new file into place", e2) from e2
        return
    with contextlib.suppress(OSError):
        os.unlink(src)


def _link_into_place(root: str, stage: str, name: str) -> None:
    """Give the staged file ``name`` its final name too (replacing the old model's file, which no index
    references any more); the staged name stays until the final index is committed."""
    src = os.path.join(root, stage, name)
    tmp = f"{src}.link"
    dst = os.path.join(root, name)
    _regular_or_absent(root, [name])
    try:
        try:
            os.link(src, tmp)
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
            _copy_file(src, tmp)
        os.replace(tmp, dst)
    except OSError as e:
        raise _wrap(f"{dst}: cannot put the new file in place", e) from e


def _copy_file(src: str, dst: str) -> None:
    """Copy ``src`` to a new file ``dst`` (created exclusively, never through a link), fsynced."""
    fd = open_new(dst)
    try:
        with open(src, "rb") as f:
            while chunk := f.read(16 << 20):
                write_all(fd, chunk)
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_put(dst: Storage, out: Outputs, write: WriteWeights) -> int:
    """Object stores and other storage without rename (module docstring, 3)."""
    undo = _Undo(dst, dst.commit)
    committed = False
    final = _index_bytes(out.index)
    try:
        if any(dst.size(n) is not None for n in out.names) and dst.size(INDEX_NAME) is not None:
            # the names are in use: the old index would describe files being replaced
            dst.commit(INDEX_NAME, _index_bytes({INCOMPLETE_KEY: INCOMPLETE_MESSAGE}))
        buffer_bytes = write("", undo.written)
        for name, data in out.computed.items():
            undo.written.append(name)
            dst.commit(name, data)
        undo.commit_meta(out.meta)
        dst.commit(INDEX_NAME, final)
        committed = True
    except BaseException:
        if not committed and not _holds(dst, INDEX_NAME, final):
            undo.run()
        raise
    return buffer_bytes


def _remove_stale(dst: Storage, replaced: Iterable[str], keep: set[str]) -> list[str]:
    """After the commit: the old model's weight files the new index does not list (names of
    :data:`WEIGHTS_NAME` only; locally regular files only). Best effort."""
    root = dst.local_dir
    gone = []
    for p in replaced:
        if p in keep or not WEIGHTS_NAME.match(p):
            continue
        if root is not None:
            try:
                if not stat.S_ISREG(os.lstat(os.path.join(root, p)).st_mode):
                    continue  # a link (or anything else) at a weight name: a user's, kept
            except OSError:
                continue
        try:
            dst.delete(p)
            gone.append(p)
        except (CheckpointError, OSError):
            pass
    if root is not None:
        gone += remove_leftovers(dst)  # the staging directory the replaced index named, if it did
    return gone


__all__ = ["ExportLock", "Outputs", "publish", "remove_leftovers", "LOCK_NAME", "STAGE_PREFIX", "INCOMPLETE_KEY",
           "INCOMPLETE_MESSAGE"]
