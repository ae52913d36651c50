"""Every file-system operation of the memory tier below its run directory, none following a link.

Why: the tier lives in ``/dev/shm``, which every local user can write. A link planted where the tier
expects its own file or directory would make it truncate, overwrite or delete what the link points
to (a slot opened ``O_CREAT``, a symlinked ``.slots`` trimmed, a symlinked ``rank-N`` reset), and a
FIFO in place of a data file would block a restore forever. The rule, enforced here and nowhere
else (every tier module calls these functions instead of ``os`` / ``shutil`` on tier paths):

- the run directory ``<base>/ckpt-<run_id>`` (the *anchor*) is a real directory owned by this user,
  mode 0700 (:func:`trust_root`; a pre-existing one owned by someone else, writable by group or
  others, or a link, is refused by name). Other users then cannot create, rename or remove anything
  below it, so the checks below cannot be raced by them; they still refuse what this user's own
  stale processes (or root) left behind;
- no component below the anchor is followed if it is a link: every directory on the way is
  ``lstat``-ed (a real directory, ours, not writable by group or others) and the last component is
  opened with ``O_NOFOLLOW``;
- only regular files owned by this user are opened, and a file is opened ``O_NONBLOCK`` and checked
  with ``fstat`` before anything is read or written (a FIFO, device or socket is refused, never
  waited on; ``O_TRUNC`` is applied only after the check);
- directories the tier creates are 0700;
- deletion never follows a link: a link is unlinked itself, a directory removed by the file
  descriptor based ``shutil.rmtree`` (which never descends through a link), and nothing is removed
  through a path whose parents are not the tier's own directories.

A hostile object raises :class:`ckpt.errors.UnsafePathError` (a ``StorageError`` and an ``OSError``,
so the tier's existing handling of a failing write or an unreadable copy applies) naming the path
and what to do; listings treat it as holding nothing of ours.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
import uuid

from ckpt.errors import UnsafePathError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR = getattr(os, "O_DIRECTORY", 0)
_ROOTS: set[str] = set()  # run directories checked by trust_root (abspaths): the anchors of the checks below
_LOCK = threading.Lock()
ADVICE = "remove it (it is not the memory tier's), or point the tier elsewhere (CKPT_SHM_DIR / run id)"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _unsafe(path: str, what: str) -> UnsafePathError:
    return UnsafePathError(f"{path}: {what}; the memory tier opens only its own regular files in its own 0700 "
                           f"directories, never through a link: {ADVICE}")


def _check_dir_stat(path: str, st: os.stat_result) -> None:
    """A directory on the way: real, ours, not writable by group or others."""
    if not stat.S_ISDIR(st.st_mode):
        raise _unsafe(path, f"is {_kind(st.st_mode)} where the memory tier keeps a directory")
    if st.st_uid != os.geteuid():
        raise _unsafe(path, f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise _unsafe(path, f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def _check_file_stat(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _unsafe(path, f"is {_kind(st.st_mode)}, not a regular file")
    if st.st_uid != os.geteuid():
        raise _unsafe(path, f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")


def trust_root(path: str, *, create: bool) -> str:
    """Check (and with ``create``, make) the run directory ``path``: a real directory owned by this
    user, not writable by group or others (tightened to 0700 when only readable by them), in a base
    that others cannot rename it out of. Registers it as an anchor of every later check; returns
    its absolute path. Raises UnsafePathError naming what is wrong, OSError (FileNotFoundError when
    it does not exist and ``create`` is false)."""
    path = os.path.abspath(path).rstrip("/") or "/"
    base = os.path.dirname(path)
    if create:
        os.makedirs(base, mode=0o700, exist_ok=True)
    bst = os.stat(base)  # the base may be a link (/dev/shm -> /run/shm): the administrator's choice
    if bst.st_mode & 0o002 and not bst.st_mode & stat.S_ISVTX:
        raise _unsafe(base, f"is writable by everyone without the sticky bit (mode {stat.S_IMODE(bst.st_mode):04o}): "
                      "another user could rename the memory tier's directory away; use a base with mode 1777 "
                      "(as /dev/shm) or 0700")
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | _DIR | _NOFOLLOW | _CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            st = os.lstat(path)
            raise _unsafe(path, f"is {_kind(st.st_mode)}, not the memory tier's directory") from e
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _unsafe(path, f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): another user "
                          "made it first")
        if st.st_mode & 0o022:
            raise _unsafe(path, f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): anything "
                          "in it may have been planted")
        if create and st.st_mode & 0o077:
            os.fchmod(fd, 0o700)  # ours, only readable by others (an older version's 0755): private from now on
    finally:
        os.close(fd)
    with _LOCK:
        _ROOTS.add(path)
    return path


def _anchor(path: str) -> tuple[str, list[str]] | None:
    """The trusted run directory ``path`` lies in, and the components below it (None: none)."""
    path = os.path.abspath(path)
    best = ""
    for r in list(_ROOTS):
        if (path == r or path.startswith(r + os.sep)) and len(r) > len(best):
            best = r
    if not best:
        return None
    rest = path[len(best):].strip(os.sep)
    return best, rest.split(os.sep) if rest else []


def check_parents(path: str) -> None:
    """Every directory between the anchor and ``path`` (exclusive) is real, ours and private.
    Unanchored paths (not in a trusted run directory: a test's loose slot) have only their last
    component checked, by the caller's ``O_NOFOLLOW``. Raises UnsafePathError, FileNotFoundError."""
    found = _anchor(path)
    if found is None:
        return
    cur, parts = found
    _check_dir_stat(cur, os.lstat(cur))  # (the run directory itself: replaced since it was trusted?)
    for name in parts[:-1]:
        cur = os.path.join(cur, name)
        _check_dir_stat(cur, os.lstat(cur))


def open_file(path: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """``os.open`` of a tier file: never through a link, only a regular file of this user, never
    blocking on a FIFO (``O_NONBLOCK`` until checked), ``O_TRUNC`` only once checked. The caller
    closes the descriptor. Raises UnsafePathError, OSError."""
    check_parents(path)
    trunc = flags & os.O_TRUNC
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EMLINK):
            try:
                what = _kind(os.lstat(path).st_mode)
            except OSError:
                raise e from None
            raise _unsafe(path, f"is {what}") from e
        raise
    try:
        _check_file_stat(path, os.fstat(fd))
        os.set_blocking(fd, True)
        if trunc:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str, limit: int | None = None) -> bytes:
    """The whole of a tier file (see :func:`open_file`); UnsafePathError when it is larger than ``limit``."""
    fd = open_file(path)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise _unsafe(path, f"is {size} bytes, more than the {limit} a memory-tier file of this kind has")
        chunks, got = [], 0
        while True:
            b = os.read(fd, max(size - got, 1 << 16))
            if not b:
                break
            chunks.append(b)
            got += len(b)
            if limit is not None and got > limit:
                raise _unsafe(path, f"grew past {limit} bytes while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` by a file holding ``data``: written under a fresh name (exclusive, no link
    followed), then renamed over ``path`` (a link there is replaced, never written through)."""
    tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def lstat(path: str) -> os.stat_result | None:
    """``lstat`` of a tier path whose parents pass :func:`check_parents`; None when missing or unsafe."""
    try:
        check_parents(path)
        return os.lstat(path)
    except OSError:
        return None


def regular(path: str) -> os.stat_result | None:
    """The ``lstat`` of ``path`` when it is a regular file of this user (never a link), else None."""
    st = lstat(path)
    return st if st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() else None


def is_dir(path: str) -> bool:
    """Whether ``path`` is a real directory of this user (a link to one is not)."""
    st = lstat(path)
    return st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def listdir(path: str) -> list[str]:
    """Names in the tier directory ``path``; empty when it is missing, a link, not a directory, or
    reached through one (a link planted there holds nothing of ours to scan or delete)."""
    try:
        check_parents(path)
        fd = os.open(path, os.O_RDONLY | _DIR | _NOFOLLOW | _CLOEXEC)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return []
        return os.listdir(fd)
    except OSError:
        return []
    finally:
        os.close(fd)


def makedirs(path: str) -> None:
    """Make ``path`` and its missing parents below the anchor (mode 0700), checking each existing
    one (:func:`check_parents` rules, ``path`` included). Raises UnsafePathError, OSError."""
    found = _anchor(path)
    if found is None:
        os.makedirs(path, mode=0o700, exist_ok=True)
        _check_dir_stat(path, os.lstat(path))
        return
    cur, parts = found
    _check_dir_stat(cur, os.lstat(cur))
    for name in parts:
        cur = os.path.join(cur, name)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(cur, 0o700)
            st = os.lstat(cur)
        _check_dir_stat(cur, st)


def unlink(path: str) -> None:
    """Remove the file or link ``path`` itself (never what a link points to). Raises OSError."""
    check_parents(path)
    os.unlink(path)


def rmdir(path: str) -> None:
    """Remove the empty directory ``path`` (a link there is not removed). Raises OSError."""
    check_parents(path)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _unsafe(path, f"is {_kind(st.st_mode)}, not a directory")
    os.rmdir(path)


def rmtree(path: str) -> None:
    """Remove ``path`` without following any link: a link or file is unlinked itself, a directory
    removed by ``shutil.rmtree``'s descriptor-based walk (which never descends through a link).
    Nothing is removed when a parent is not a real tier directory. Best effort: never raises."""
    try:
        check_parents(path)
        st = os.lstat(path)
    except OSError:
        return
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
        else:  # (on Linux shutil.rmtree.avoids_symlink_attacks: a link met inside is unlinked, never entered)
            shutil.rmtree(path, ignore_errors=True)


def link(src: str, dst: str) -> None:
    """Hard-link the regular file ``src`` of this user as ``dst`` (exclusive; no link followed on
    either side). Raises UnsafePathError, OSError."""
    check_parents(src)
    check_parents(dst)
    _check_file_stat(src, os.lstat(src))
    os.link(src, dst, follow_symlinks=False)


def walk_files(path: str) -> list[str]:
    """Every regular file below the tier directory ``path`` (links and what they point to are
    left out; the walk never descends through one)."""
    out: list[str] = []
    for name in listdir(path):
        full = os.path.join(path, name)
        st = lstat(full)
        if st is None:
            continue
        if stat.S_ISDIR(st.st_mode):
            out += walk_files(full)
        elif stat.S_ISREG(st.st_mode):
            out.append(full)
    return out


__all__ = ["ADVICE", "trust_root", "check_parents", "open_file", "read_bytes", "write_atomic", "lstat", "regular",
           "is_dir", "listdir", "makedirs", "unlink", "rmdir", "rmtree", "link", "walk_files"]
