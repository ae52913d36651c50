"""Local filesystem backend: positional reads, fsync'd writes, atomic rename for commits."""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Sequence

from ckpt.errors import CheckpointExistsError, ManifestError, StorageError
from ckpt.storage.base import Storage

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_new(path: str) -> int:
    """A file descriptor for writing a file created at ``path`` now, exclusively and never through a
    link (a name someone else made, or a link planted there, is an OSError: never truncated, never
    written through)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)


def write_all(fd: int, data: memoryview | bytes) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write less than asked)."""
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv):]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_regular(full: str) -> int:
    """Open ``full`` read-only, refusing anything but a regular file *before* it can block: a FIFO
    is opened non-blocking and checked with fstat (a plain open of a FIFO waits for a writer)."""
    fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StorageError(f"{full}: {_kind(st.st_mode)}, not a regular file; a checkpoint holds only regular "
                               "files (remove or replace it)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _link_no_clobber(src: str, dst: str) -> None:
    """Give ``src`` the name ``dst`` only if ``dst`` does not exist (FileExistsError otherwise).

    A hard link is atomic and never replaces; where links are not supported, an O_EXCL create of
    the name reserves it and a rename fills it (readers may then see it empty for a moment, which
    they report as a damaged manifest rather than a wrong one).
    """
    try:
        os.link(src, dst)
        return
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
    os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    os.replace(src, dst)


class LocalWriter:
    """Writes a file sequentially with ``os.write`` (no Python-level buffering, no extra copy)."""

    def __init__(self, full: str):
        self.full = full
        self.size = 0
        try:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            # O_NOFOLLOW: a link at the name (planted, or a user's in an output directory) is refused,
            # never written through: the file it points to is not this writer's to truncate
            self.fd: int | None = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW | _CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StorageError(f"{full}: is a symbolic link; a writer never writes through one (remove it, or "
                                   "write elsewhere)") from e
            raise StorageError(f"{full}: cannot create file ({e.strerror}); check the path and permissions") from e

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        assert self.fd is not None
        try:
            while mv:
                n = os.write(self.fd, mv)
                mv = mv[n:]
                self.size += n
        except OSError as e:
            raise StorageError(f"{self.full}: write failed after {self.size} bytes ({e.strerror})") from e

    def close(self) -> int:
        if self.fd is None:
            return self.size
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise StorageError(f"{self.full}: fsync failed ({e.strerror})") from e
        finally:
            os.close(self.fd)
            self.fd = None
        return self.size

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            os.unlink(self.full)
        except OSError:
            pass


class LocalStorage(Storage):
    """A checkpoint directory on a local (or network-mounted POSIX) filesystem."""

    coalesce_gap = 4096  # merge ranges a page apart: with many ranks, copied bytes cost more than syscalls
    maps_files = True

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.url = self.root
        self.local_dir = self.root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _full(self, path: str) -> str:
        full = os.path.join(self.root, path)
        # A symlink inside the checkpoint must not lead outside it.
        real = os.path.realpath(full)
        root = os.path.realpath(self.root)
        if real != root and not real.startswith(root + os.sep):
            raise ManifestError(f"{path}: resolves to {real}, outside the checkpoint {root}; refusing to use it")
        return full

    def open_writer(self, path: str) -> LocalWriter:
        return LocalWriter(self._full(path))

    def _fd(self, path: str) -> int:
        # One descriptor per (file, thread): each reader thread keeps its own readahead state, so
        # parallel readers at different offsets of one file all stay sequential for the kernel.
        key = f"{threading.get_ident()}:{path}"
        with self._lock:
            fd = self._fds.get(key)
            if fd is None:
                try:
                    fd = _open_regular(self._full(path))
                except FileNotFoundError:
                    raise StorageError(f"{os.path.join(self.root, path)}: file is missing; the checkpoint is "
                                       "incomplete (run `ckpt verify`)") from None
                except OSError as e:
                    raise StorageError(f"{os.path.join(self.root, path)}: cannot open ({e.strerror})") from e
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self._fds[key] = fd
            return fd

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        fd = self._fd(path)
        mv = memoryview(buf).cast("B")
        want = len(mv)
        got = 0
        try:
            while got < want:
                n = os.preadv(fd, [mv[got:]], offset + got)
                if n == 0:
                    raise StorageError(
                        f"{os.path.join(self.root, path)}: file ends before byte {offset + want} "
                        f"(read {got} of {want} bytes at offset {offset}); the file is truncated"
                    )
                got += n
        except OSError as e:
            raise StorageError(f"{os.path.join(self.root, path)}: read failed at {offset} ({e.strerror})") from e

    def readv(self, path: str, ranges: Sequence[tuple[int, int]], buf: memoryview, base: int) -> None:
        """Fill ``buf[off - base : off - base + n]`` for each ``(off, n)`` of ``path``: one
        ``preadv`` per range with no per-call overhead beyond it (many small runs of a reshard)."""
        fd = self._fd(path)
        preadv = os.preadv
        try:
            for off, n in ranges:
                if preadv(fd, [buf[off - base : off - base + n]], off) != n:
                    self.read_into(path, off, buf[off - base : off - base + n])  # short read: retry or raise
        except OSError as e:
            raise StorageError(f"{os.path.join(self.root, path)}: read failed ({e.strerror})") from e

    def map_range(self, path: str, offset: int, length: int) -> tuple[mmap.mmap, int] | None:
        """Bytes ``[offset, offset + length)`` of ``path`` as a private memory map: ``(map, index of
        offset in it)``; None where the file cannot be mapped (the caller reads instead).

        Readers copy straight out of the page cache through the map: no read call per byte run and
        no copy into a buffer. The map is copy-on-write (``ACCESS_COPY``) so that tensors can view
        it without a read-only warning; nothing writes to it, so no page is ever copied, and its
        commit charge is ``length`` (bounded by the planner's ``max_read``), not the file's size.
        Close the map when done. Raises StorageError when the file is shorter than the range (a
        map would turn the missing bytes into SIGBUS instead). Checkpoint data files are never
        modified after the commit; one truncated while it is being loaded also ends in SIGBUS.
        """
        if length <= 0:
            return None
        fd = self._fd(path)
        try:
            size = os.fstat(fd).st_size
        except OSError as e:
            raise StorageError(f"{os.path.join(self.root, path)}: cannot stat ({e.strerror})") from e
        if offset + length > size:
            raise StorageError(f"{os.path.join(self.root, path)}: file ends before byte {offset + length} "
                               f"(it has {size} bytes); the file is truncated")
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            return mmap.mmap(fd, offset + length - base, access=mmap.ACCESS_COPY, offset=base), offset - base
        except (OSError, ValueError, OverflowError):  # a filesystem without mmap, no address space: read
            return None

    def read_file(self, path: str) -> bytes:
        try:
            with os.fdopen(_open_regular(self._full(path)), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise StorageError(f"{os.path.join(self.root, path)}: file not found") from None
        except OSError as e:
            raise StorageError(f"{os.path.join(self.root, path)}: cannot read ({e.strerror})") from e

    def size(self, path: str) -> int | None:
        """Size of a regular file, None when there is none; StorageError for anything else there
        (a FIFO, a directory, a symlink loop, a path below a regular file)."""
        full = self._full(path)
        try:
            st = os.stat(full)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"{full}: cannot stat ({e.strerror}); check the path") from e
        if not stat.S_ISREG(st.st_mode):
            raise StorageError(f"{full}: {_kind(st.st_mode)}, not a regular file; a checkpoint holds only regular "
                               "files (remove or replace it)")
        return st.st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(self._full(path))

    def list(self, prefix: str = "") -> list[str]:
        base = os.path.join(self.root, prefix) if prefix else self.root
        out: list[str] = []
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                out.append(os.path.relpath(os.path.join(dirpath, f), self.root))
        return sorted(out)

    def delete(self, path: str) -> None:
        try:
            os.unlink(self._full(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"{os.path.join(self.root, path)}: cannot delete ({e.strerror})") from e

    def sync_dir(self, path: str = "") -> None:
        """fsync a directory so that the names created in it are durable."""
        try:
            _fsync_dir(os.path.join(self.root, path))
        except OSError as e:
            raise StorageError(f"{os.path.join(self.root, path)}: directory fsync failed ({e.strerror})") from e

    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync of the directories).

        ``exclusive``: never replace an existing ``path`` (a hard link of the temp file, which fails
        when the name exists): CheckpointExistsError then, and nothing is changed.
        """
        full = self._full(path)
        # The temp name is this commit's own: a random part (not the thread id) means no other process,
        # no stale file and no link planted at a guessed name can be there, and it is created
        # exclusively, so it is never opened through a link (which would write outside the checkpoint)
        # nor truncates a file someone else made. (``ckpt._lease.is_temp`` knows the name.)
        tmp = f"{full}.tmp.{os.getpid()}.{secrets.randbits(48)}"
        made = False
        try:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            fd = open_new(tmp)
            made = True
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                try:
                    _link_no_clobber(tmp, full)
                except FileExistsError:
                    raise CheckpointExistsError(f"{full}: another writer committed here first; nothing of this save "
                                                "was committed (pass overwrite=True to replace it)") from None
                _unlink_quiet(tmp)
            else:
                os.replace(tmp, full)
        except CheckpointExistsError:
            _unlink_quiet(tmp)
            raise
        except OSError as e:
            if made:  # never remove a name this commit did not create
                _unlink_quiet(tmp)
            raise StorageError(f"{full}: atomic commit failed ({e.strerror}); the previous state is unchanged") from e
        try:
            # The new name, and the names of the directories made for it up to the checkpoint
            # directory's own entry in its parent (a manager's step directory), must survive a
            # power loss together: otherwise the newest checkpoint can vanish whole after a crash.
            d, stop = os.path.dirname(full), os.path.dirname(self.root)
            while True:
                _fsync_dir(d)
                if len(d) <= len(stop):
                    break
                d = os.path.dirname(d)
        except OSError as e:
            raise StorageError(f"{full}: committed, but fsync of its directory failed ({e.strerror}); it may not "
                               "survive a power loss") from e

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


__all__ = ["LocalWriter", "LocalStorage", "open_new", "write_all"]
