"""Asynchronous save: plan on the caller's thread, stage into a reused host pool, persist and commit
in a background thread over a dedicated gloo group.

Call order for the training loop::

    h = ckpt.async_save(state, url)   # returns after the (small) planning exchange
    ...forward/backward...            # may run while staging copies out
    h.staged()                        # before optimizer.step(): the state may change after this
    ...
    h.done()                          # optional: block until committed; raises the save's error
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from ckpt._comm import Comm, check_timeout, side_group
from ckpt._staging import Stager, StagingPool, check_cap
from ckpt.errors import CheckpointError
from ckpt.manifest import Manifest
from ckpt.save import (
    DEFAULT_TIMEOUT_S,
    PlanCache,
    Prepared,
    commit,
    open_state,
    persist_staged,
    prepare,
    resolve_compression,
    staged_views,
    take_lease,
)


def _commit_comm(comm: Comm, timeout: float | None) -> Comm:
    """A Comm over a separate gloo group, so the background commit never shares a group with the
    training thread's collectives (and never uses NCCL off the main thread). Created once, by the
    members only (:func:`ckpt._comm.side_group`)."""
    if not comm.enabled or comm.world == 1:
        return comm
    import torch.distributed as dist

    return Comm(side_group(dist.get_process_group_ranks(comm.group), "commit", timeout=timeout))


class SaveHandle:
    """A save in flight. ``staged()`` before changing the state; ``done()`` for the manifest."""

    def __init__(self, url: str, step: int | None, skipped: bool = False):
        self.url = url
        self.step = step
        self.skipped = skipped
        self._staged = threading.Event()
        self._done = threading.Event()
        self.manifest: Manifest | None = None
        # this rank's figures: durations (s) plan, stage (until staged), persist, commit, alloc
        # (allocating/pinning staging memory: the first save, or after the structure changed);
        # bytes (data written); staged_bytes, staging_bytes (host memory held for it), sent/received
        # (metadata bytes of the save protocol)
        self.stats: dict[str, float] = {}
        self.error: BaseException | None = None
        self._stage_error: BaseException | None = None
        self._error_seen = False
        if skipped:
            self._staged.set()
            self._done.set()

    def staged(self, timeout: float | None = None) -> None:
        """Block until every piece is copied out of the caller's tensors (call before optimizer.step()).

        With ``max_staging_bytes`` below the staged size, that is when the last chunk is copied,
        i.e. after all but the last ring's worth of data is written."""
        if not self._staged.wait(timeout):
            raise TimeoutError(f"{self.url}: staging did not finish within {timeout} s")

    def done(self, timeout: float | None = None) -> Manifest | None:
        """Block until the checkpoint is committed; return its manifest (None if skipped).

        Raises the save's error (CheckpointError subclass) if it failed.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.url}: save did not finish within {timeout} s")
        if self.error is not None:
            self._error_seen = True
            raise self.error
        return self.manifest

    @property
    def is_done(self) -> bool:
        return self._done.is_set()


class AsyncSaver:
    """Runs one async save at a time for one process group; reuses its staging pool across saves."""

    def __init__(self, group: Any = None, timeout: float | None = DEFAULT_TIMEOUT_S):
        self.group = group
        self.pool = StagingPool()
        self.cache = PlanCache()
        self.timeout = timeout
        self.inflight: SaveHandle | None = None
        self._thread: threading.Thread | None = None
        self._streams: dict[int, Any] = {}  # device index -> side stream of its device-to-host copies
        # held by async_save() around save(): threads sharing this saver start their saves one at a
        # time (save() reads and replaces the save in flight and reuses one staging pool)
        self.lock = threading.RLock()
        _SAVERS.add(self)

    def save(self, state: dict[str, Any], url: str, *, step: int | None = None,
             user_metadata: dict[str, Any] | None = None, overwrite: bool = False,
             layout: dict[str, Any] | None = None, storage_options: dict[str, Any] | None = None,
             policy: str = "wait", on_commit: Callable[[Manifest], None] | None = None,
             data_format: str = "safetensors", on_error: Callable[[BaseException], None] | None = None,
             max_staging_bytes: int | None = None, on_done: Callable[[], None] | None = None,
             compression: Any = None) -> SaveHandle:
        """Start saving ``state`` to ``url``; see :func:`async_save`. Callbacks, on the background
        thread: ``on_commit`` (coordinator, after the commit), ``on_error`` (every rank, on failure),
        ``on_done`` (every rank, once the save is over, before ``done()`` returns)."""
        if policy not in ("wait", "skip"):
            raise ValueError(f"policy must be 'wait' or 'skip', got {policy!r}")
        check_cap(max_staging_bytes, data_format)
        codec = resolve_compression(compression, data_format)  # ckpt._codec; as ckpt.save's
        prev = self.inflight
        comm = Comm(self.group)
        if prev is not None:
            busy = not prev.is_done
            if comm.enabled and comm.world > 1 and policy == "skip":
                # ranks must skip together: the coordinator decides
                busy = bool(comm.broadcast(busy, timeout=self.timeout, what="save skip decision"))
            if busy and policy == "skip":
                return SaveHandle(url, step, skipped=True)
            self.wait()
            if prev.error is not None and not prev._error_seen:
                prev._error_seen = True
                raise CheckpointError(f"the previous async save to {prev.url} failed: {prev.error}") from prev.error
        commit_comm = _commit_comm(comm, self.timeout)
        state, storage, failed = open_state(commit_comm, state, url, storage_options)
        t0 = time.perf_counter()
        # The planning exchange runs on the commit group too (idle now: the previous save is over): a rank
        # that plans (its structure changed, or its state failed) while the others, on a cached plan, go
        # straight to the commit exchange meets them there, and every rank raises at once (as ckpt.save).
        prep = prepare(commit_comm, storage, state, step=step, user_metadata=user_metadata, overwrite=overwrite,
                       layout=layout, cache=self.cache, timeout=self.timeout, data_format=data_format,
                       compression=codec, failed=failed)
        assert storage is not None  # (prepare raised the failure to open it)
        prep.stats["plan"] = time.perf_counter() - t0
        handle = SaveHandle(url, step)
        pieces = [e.piece for e in prep.assignment.entries]
        # plans the staging memory and records where the caller's GPU work stands; allocates nothing
        stager = Stager(self.pool, staged_views(prep), pieces, cap=max_staging_bytes,
                        split=prep.data_format != "zarr")
        self.inflight = handle
        # this rank's lease is taken by the background thread before it writes a byte (and released
        # there when the save is over): not here, where it would add a file creation (~5 ms locally,
        # a PUT on S3) to the time the caller is blocked
        self._thread = threading.Thread(target=self._run, name="ckpt-async-save", daemon=True,
                                        args=(handle, prep, stager, storage, comm, commit_comm, on_commit, on_error,
                                              on_done, (url, storage_options), self.timeout))
        self._thread.start()
        return handle

    def _run(self, handle: SaveHandle, prep: Prepared, stager: Stager, storage: Any, comm: Comm, commit_comm: Comm,
             on_commit: Callable[[Manifest], None] | None, on_error: Callable[[BaseException], None] | None,
             on_done: Callable[[], None] | None = None, lease_on: tuple[str, Any] | None = None,
             timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        staging = threading.Thread(target=self._stage, args=(stager, prep, handle), name="ckpt-stage", daemon=True)
        # (before persist_staged writes a byte; a lease that cannot be taken is this rank's error, in
        # prep.refused, which the commit exchange delivers to every rank)
        held = take_lease(lease_on[0], prep, comm, lease_on[1]) if lease_on is not None else None
        try:
            staging.start()
            t0 = time.perf_counter()
            result = persist_staged(storage, prep, stager, comm.who)
            staging.join()
            prep.stats["persist"] = time.perf_counter() - t0
            handle.manifest = commit(commit_comm, storage, prep, result, timeout=timeout, cache=self.cache)
            handle.stats = dict(prep.stats, commit=time.perf_counter() - t0 - prep.stats["persist"])
            if on_commit is not None and commit_comm.rank == 0:
                try:
                    on_commit(handle.manifest)
                except Exception as e:  # noqa: BLE001 - committed already: not the save's failure
                    warnings.warn(f"{handle.url}: committed, but the after-commit step failed: {e}", RuntimeWarning,
                                  stacklevel=1)
        except BaseException as e:  # noqa: BLE001 - surfaced on the handle and on the next save
            stager.abort()
            handle.error = e
            if on_error is not None:
                try:
                    on_error(e)
                except CheckpointError:
                    pass  # cleanup is best effort; the save's own error is what matters
        finally:
            staging.join()
            if held is not None:  # this rank's lease (ckpt.save.take_lease): the save is over
                with contextlib.suppress(CheckpointError):
                    held.release(tidy=handle.error is not None)
            if on_done is not None:
                with contextlib.suppress(CheckpointError):  # best effort (e.g. dropping a lease)
                    on_done()
            handle._staged.set()
            handle._done.set()
            storage.close()

    def _stage(self, stager: Stager, prep: Prepared, handle: SaveHandle) -> None:
        t0 = time.perf_counter()
        try:
            stager.run(self._streams)
        finally:
            prep.stats.update(stage=time.perf_counter() - t0, alloc=stager.alloc_s,
                              staged_bytes=stager.plan.staged, staging_bytes=self.pool.nbytes)
            handle._staged.set()

    def wait(self) -> None:
        """Block until the save in flight (if any) has finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class _Unset:
    """The default of an argument that, when not given, leaves the setting where it is."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()
_SAVERS: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()
_DEFAULT: dict[Any, AsyncSaver] = {}
_DEFAULT_LOCK = threading.Lock()  # two threads' first async_save on one group must share one saver


@atexit.register
def _drain() -> None:
    # Clean shutdown: never leave a half-written save behind when the interpreter exits normally.
    for s in list(_SAVERS):
        s.wait()


def async_save(state: dict[str, Any], url: str, *, group: Any = None, step: int | None = None,
               user_metadata: dict[str, Any] | None = None, overwrite: bool = False,
               layout: dict[str, Any] | None = None, storage_options: dict[str, Any] | None = None,
               policy: str = "wait", data_format: str = "safetensors",
               max_staging_bytes: int | None = None, compression: Any = None,
               timeout: float | None | _Unset = UNSET) -> SaveHandle:
    """Save ``state`` to ``url`` in the background; returns a :class:`SaveHandle` quickly.

    Collective over ``group`` (the planning exchange runs on the calling thread). One save is in
    flight per group: ``policy="wait"`` waits for the previous one, ``"skip"`` returns a skipped
    handle while one is running. An error of the previous save is raised by the next call if
    ``done()`` did not already raise it. Staging buffers are reused across saves of the same structure.

    Staging memory is allocated (and pinned, for GPU tensors) in the background, so the first call
    returns as fast as later ones. ``max_staging_bytes`` caps it: below the size of what this rank
    writes, data is staged and written through a ring of that many bytes, and ``staged()`` returns
    when the last of it has been copied (at about the write speed). ``compression``: as for
    :func:`ckpt.save` (``"zstd"``: compressed data files, ``ckpt._codec``). ``timeout``: as for
    :func:`ckpt.save`, each wait for another rank (planning, commit) in seconds (default: the
    group's saver's, ``DEFAULT_TIMEOUT_S``).
    """
    if not isinstance(timeout, _Unset):
        timeout = check_timeout(timeout)
    with _DEFAULT_LOCK:
        saver = _DEFAULT.get(id(group))
        if saver is None:
            saver = _DEFAULT[id(group)] = AsyncSaver(group)
    with saver.lock:  # threads of one process: one starts its save at a time (the next waits for it)
        if not isinstance(timeout, _Unset):
            saver.timeout = timeout  # (the save in flight keeps the timeout it started with)
        return saver.save(state, url, step=step, user_metadata=user_metadata, overwrite=overwrite, layout=layout,
                          storage_options=storage_options, policy=policy, data_format=data_format,
                          max_staging_bytes=max_staging_bytes, compression=compression)


__all__ = ["SaveHandle", "AsyncSaver", "async_save"]
