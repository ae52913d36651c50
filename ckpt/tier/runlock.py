"""One run id, one job: the memory tier's locks in its run directory.

Why: two jobs started with the same run id on one host would hand out the same slot files and step
directories; each one's restore then passes every checksum and returns the other job's tensors. So
each tier holds, for its whole life, two ``flock`` locks in ``<base>/ckpt-<run_id>/``:

- ``.lock-<i>`` exclusively, ``i`` being the rank's index among the job's ranks on this host
  (ranks sharing the host name and the same base directory). Every job with ranks here has a rank
  of index 0, so a second job with the run id fails at once at its first ``.lock-0`` (every rank of
  it raises :class:`ckpt.errors.RunInUseError`, agreed in the tier's setup); the ranks of one job,
  even when they simulate several nodes on one host, take distinct indices and never conflict. Per
  rank rather than one lock taken by a leader: each process holds its own lock, so no rank relies
  on another being alive, and the kernel releases it when the process dies (a killed job's restart
  is never locked out);
- ``.lock`` shared: ``ckpt gc --memory`` and the last rank clearing the run take it exclusively
  before removing anything, so a run whose tier is alive is never touched, and a job starting while
  gc runs waits for it (up to the tier's timeout) instead of failing.

Lock files are removed only under the exclusive ``.lock``; a lock taken on a file unlinked
meanwhile is detected (its inode is no longer at its path) and taken again. A forked child does
not inherit a lock (its copies of the descriptors are closed at fork): the lock is its process's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
import weakref
from collections.abc import Iterator
from typing import Any

from ckpt.errors import RunInUseError
from ckpt.tier import safefs

USE_LOCK = ".lock"
LOCAL_PREFIX = ".lock-"
_OPEN: set[int] = set()  # descriptors of held locks in this process (closed in forked children)


def lock_names(names: list[str]) -> list[str]:
    """The lock files among a run directory's entries."""
    return [n for n in names if n == USE_LOCK or n.startswith(LOCAL_PREFIX)]


def host_key(base: str) -> list[Any]:
    """What ranks on one host share: the host name and the base directory's identity."""
    st = os.stat(base)
    return [socket.gethostname(), st.st_dev, st.st_ino]


def _close(fds: list[int]) -> None:
    for fd in fds:
        _OPEN.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _in_child() -> None:
    for fd in list(_OPEN):  # the parent's locks stay the parent's
        with contextlib.suppress(OSError):
            os.close(fd)
    _OPEN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)


def _open(path: str) -> int:
    fd = safefs.open_file(path, os.O_RDWR | os.O_CREAT)
    _OPEN.add(fd)
    return fd


def _current(fd: int, path: str) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not unlinked by a clearing rank meanwhile)."""
    st = safefs.lstat(path)
    f = os.fstat(fd)
    return st is not None and (st.st_dev, st.st_ino) == (f.st_dev, f.st_ino)


class RunLock:
    """The locks one tier holds for its life (released by :meth:`release`, or when the process dies)."""

    def __init__(self, run_dir: str, local: int, *, run_id: str, timeout: float):
        self.run_dir, self.local = run_dir, local
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, _close, self._fds)
        use, mine = os.path.join(run_dir, USE_LOCK), os.path.join(run_dir, f"{LOCAL_PREFIX}{local}")
        deadline = time.monotonic() + timeout
        while True:
            safefs.trust_root(run_dir, create=True)  # (again: a clearing rank may have removed it meanwhile)
            ufd = _open(use)
            self._fds.append(ufd)
            try:
                fcntl.flock(ufd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # gc or a clearing rank is removing things: wait for it
                _close(self._fds)
                if time.monotonic() > deadline:
                    raise RunInUseError(f"{run_dir}: still being cleaned (`ckpt gc --memory` or a job clearing its "
                                        f"memory tier) after {timeout:g} s; retry when it is done") from None
                time.sleep(0.05)
                continue
            if not _current(ufd, use):
                _close(self._fds)
                continue
            lfd = _open(mine)
            self._fds.append(lfd)
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(lfd, 256, 0).decode("utf-8", "replace").strip() or "another process"
                _close(self._fds)
                if holder.startswith(f"pid {os.getpid()} "):
                    raise RunInUseError(f"{run_dir}: another MemoryTier of this process holds run id {run_id!r} "
                                        f"(lock {mine}): close() or clear() it before making a new one") from None
                raise RunInUseError(
                    f"{run_dir}: memory tier run id {run_id!r} is in use on this host by another job ({holder}; its "
                    f"lock {mine} is held): one run id is one job at a time. Stop that job, or give this one "
                    "another run id (run_id= / $CKPT_RUN_ID)") from None
            if not _current(lfd, mine):
                _close(self._fds)
                continue
            os.ftruncate(lfd, 0)
            os.pwrite(lfd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}".encode(), 0)
            return

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def release(self) -> None:
        """Give the run id back (idempotent)."""
        _close(self._fds)


@contextlib.contextmanager
def exclusive(run_dir: str) -> Iterator[bool]:
    """Hold ``run_dir``'s ``.lock`` exclusively for the block: True when taken (no tier of the run
    is alive on this host, and none starts before the block ends), False when a tier holds it or
    the run directory is not a safe one of ours (then nothing may be touched)."""
    try:
        fd = _open(os.path.join(run_dir, USE_LOCK))
    except OSError:
        yield False
        return
    fds = [fd]
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        _close(fds)


def remove_locks(run_dir: str) -> None:
    """Unlink the lock files of ``run_dir`` (inside :func:`exclusive` only: no tier holds them)."""
    for name in lock_names(safefs.listdir(run_dir)):
        with contextlib.suppress(OSError):
            safefs.unlink(os.path.join(run_dir, name))


__all__ = ["USE_LOCK", "LOCAL_PREFIX", "lock_names", "host_key", "RunLock", "exclusive", "remove_locks"]
