"""CheckpointManager: periodic (async) saves under one root, ``latest``, ``restore``, retention, gc.

Layout: ``<root>/step-<step:010d>/`` per checkpoint. ``latest`` is found by listing and reading
manifests, never from a pointer file that could lie. Every rank of a save (as of any save:
``ckpt.save.take_lease``) takes its own lease (``<dir>/.writing-<rank>-...``, :mod:`ckpt._lease`) before
it writes anything there and drops it when the save is over, so ``gc`` never touches a directory a live
save is writing, however skewed the ranks.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt import _lease as leases
from ckpt._comm import Comm
from ckpt._retention import (  # noqa: F401 - re-exported: retention and gc were part of this module
    LEASE_GRACE_S,
    STEP_DIR,
    CheckpointInfo,
    _gc,
    gc,
    list_checkpoints,
    select_removals,
    step_dir,
)
from ckpt._staging import check_cap
from ckpt.async_save import AsyncSaver, SaveHandle
from ckpt.errors import CheckpointError, CheckpointExistsError, IntegrityError, ManifestError, StorageError
from ckpt.formats.msgpack_codec import decode_manifest
from ckpt.load import load
from ckpt.manifest import MANIFEST_NAME, Manifest
from ckpt.save import save
from ckpt.storage import get_storage, join_url

if TYPE_CHECKING:
    from ckpt.tier import MemoryHandle, MemoryTier, TierRestore

LEASE = leases.LEGACY  # the single lease of older versions (still honoured); leases are per writer now
LINEAGE = ".ckpt-lineage"  # at the root: a token of its life (the memory tier's guard against stale copies)


# What a restore callback gets: ``loader(url, read)`` restores from ``url`` through ``read(state, url, **kw)``
# (``ckpt.load``'s signature: ``ckpt.load`` itself for storage, the memory tier's own readers for its copies).
Loader = Callable[[str, Callable[..., dict[str, Any]]], Any]


def node_of(rank: int, world: int, *, nodes: int | None = None) -> int:
    """The node index of ``rank`` as the memory tier counts nodes (``nodes``: simulated nodes on one
    host; else ``$CKPT_NODE`` or torchrun's ``LOCAL_WORLD_SIZE`` grouping; else 0)."""
    from ckpt.tier.nodes import node_identity

    return node_identity(rank, world, nodes=nodes)


@dataclass(slots=True)
class Restored:
    """What :meth:`CheckpointManager.restore` restored: the checkpoint's ``step``, its ``tier``
    (``storage``, ``memory``, ``memory-peer`` or ``memory-reshard``), ``url``, what the load returned
    (``value``), how long the successful attempt took (``seconds``), the newest persistent step
    skipped as damaged (``skipped``, -1: none) and the memory tier's figures (``detail``)."""

    step: int
    tier: str
    url: str
    value: Any = field(default=None, repr=False)  # the state: printing a Restored must not print it
    seconds: float = 0.0
    skipped: int = -1
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SaveReport:
    """What :meth:`CheckpointManager.maybe_save` did at ``step``. ``saved``: the persistent save it
    started (a handle, async) or committed (the manifest, sync), None when none was due; ``stats``:
    a synchronous save's figures for this rank and ``save_s`` its duration; ``memory``: the memory
    checkpoint it started (None: none due, or skipped as busy); ``stall_s``: how long the call held
    the training thread before the final commit wait; ``commit_wait_s``: that wait (``last_step``)."""

    step: int
    saved: SaveHandle | Manifest | None = None
    url: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    save_s: float = 0.0
    memory: MemoryHandle | None = None
    stall_s: float = 0.0
    commit_wait_s: float = 0.0


class CheckpointManager:
    """Periodic checkpoints under ``root_url`` with retention and resume.

    Example::

        mgr = ckpt.CheckpointManager("/ckpts/run1", keep_last=3)
        start = mgr.restore(state) or 0
        for step in range(start, steps):
            ...
            if step % 100 == 0:
                h = mgr.save(step, state)   # async: returns quickly
            h.staged() ... optimizer.step()

    With a memory tier (``memory_every=N``), ``save_memory`` keeps recent checkpoints in node-local
    shared memory with a copy of each rank's pieces on a peer node (:mod:`ckpt.tier`), and
    ``restore`` takes the newest complete step across tiers::

        mgr = ckpt.CheckpointManager("/ckpts/run1", memory_every=1, replicas=1)
        start = mgr.restore(state) or 0      # memory (own copy, else a peer's), else storage
        ...
            if mgr.memory_due(step):
                mgr.save_memory(step, state)  # copies to host, then /dev/shm + peer in the background
            if step % 50 == 0:
                mgr.save(step, state)         # persistent, async

    Memory-tier arguments: ``memory_every`` (steps between memory checkpoints; None: no tier),
    ``replicas`` (copies on other nodes), ``memory_keep`` (complete memory checkpoints kept),
    ``shm_dir`` (base, default ``$CKPT_SHM_DIR`` or ``/dev/shm``), ``run_id`` (default
    ``$CKPT_RUN_ID`` or a hash of the root), ``node`` / ``nodes`` (this rank's node, or simulated
    nodes; default ``$CKPT_NODE`` or torchrun's ``LOCAL_WORLD_SIZE`` grouping), ``memory_timeout`` (s),
    ``memory_busy`` (``wait``: a memory checkpoint due while the previous one still runs waits for it;
    ``skip``: it is skipped, see :class:`ckpt.tier.TierConfig`), ``memory_stage_on_device`` (GPU
    pieces staged in device memory first: the optimizer step waits for a device copy only) and
    ``memory_max_gbps`` (a budget for the tier's background traffic, GB/s per rank) and
    ``memory_max_overhead`` (the slowdown of a step the tier may cost, e.g. 0.05: the budget then
    follows from the step times; needs ``memory_busy="skip"``); see :class:`ckpt.tier.TierConfig`.

    ``lease_grace_s``: how long this manager's gc (at start and in retention) counts a lease written
    on another machine as live (:mod:`ckpt._lease`; same-machine leases are checked exactly).
    """

    def __init__(self, root_url: str, *, keep_last: int | None = 3, keep_every: int | None = None,
                 async_save: bool = True, group: Any = None, policy: str = "wait",
                 storage_options: dict[str, Any] | None = None, gc_on_start: bool = True,
                 max_staging_bytes: int | None = None,
                 memory_every: int | None = None, replicas: int = 1, memory_keep: int = 1,
                 shm_dir: str | None = None, run_id: str | None = None, node: int | None = None,
                 nodes: int | None = None, memory_timeout: float = 120.0, memory_busy: str = "wait",
                 memory_stage_on_device: bool = False, memory_max_gbps: float | None = None,
                 memory_max_overhead: float | None = None, lease_grace_s: float = LEASE_GRACE_S,
                 save_every: int | None = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
        if save_every is not None and (not isinstance(save_every, int) or save_every < 0):
            raise ValueError(f"save_every must be a step count >= 0 or None (only the last step), got {save_every!r}")
        self.save_every = save_every  # maybe_save: persistent saves at its multiples (and the last step)
        self.redo_upto = -1  # steps up to this hold checkpoints restore() skipped as damaged: saving replaces them
        self.restored: Restored | None = None  # what the last restore() restored, from which tier
        self._staging: SaveHandle | None = None  # the async save maybe_wait_for_staging() waits for
        self._memory_staging: MemoryHandle | None = None  # ... and the memory checkpoint (a stream wait)
        self.root = root_url.rstrip("/")
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.group = group
        self.policy = policy
        self.storage_options = storage_options or {}
        self.lease_grace_s = lease_grace_s
        check_cap(max_staging_bytes)
        self.max_staging_bytes = max_staging_bytes  # async saves: host staging memory cap (a ring below it)
        self._saver = AsyncSaver(group)
        self._last: SaveHandle | None = None
        self._rank = Comm(group).rank
        self.retention_errors: list[str] = []  # failures of retention after committed saves (warnings)
        if memory_every is not None and (not isinstance(memory_every, int) or memory_every < 1):
            from ckpt.errors import StateError

            raise StateError(f"memory_every must be a positive step count or None (no memory tier), got "
                             f"{memory_every!r}")
        self.memory_every = memory_every
        self.memory: MemoryTier | None = None  # the memory tier (collective to create: every rank, same order)
        self.last_restore: TierRestore | None = None  # what restore() took from the memory tier, if it did
        if memory_every is not None:
            from ckpt.tier import MemoryTier, TierConfig

            self.memory = MemoryTier(TierConfig(self.root, run_id=run_id, shm_dir=shm_dir, node=node, nodes=nodes,
                                                keep=memory_keep, replicas=replicas, timeout=memory_timeout,
                                                lineage=self._lineage(memory_timeout), busy=memory_busy,
                                                stage_on_device=memory_stage_on_device, max_gbps=memory_max_gbps,
                                                max_overhead=memory_max_overhead),
                                     group=group)
        if gc_on_start and self._rank == 0:
            # Incomplete leftovers of a crash. No save of this job can have started yet: the first
            # save of a process plans collectively, so it waits for the coordinator to get here.
            storage = get_storage(self.root, **self.storage_options)
            try:
                _gc(storage, self.root, None, None, False, None, lease_grace_s)
            finally:
                storage.close()

    def url_for(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives."""
        return join_url(self.root, step_dir(step))

    def save(self, step: int, state: dict[str, Any], *, user_metadata: dict[str, Any] | None = None,
             layout: dict[str, Any] | None = None, overwrite: bool = False,
             stats: dict[str, float] | None = None) -> SaveHandle | Manifest:
        """Save ``state`` as the checkpoint of ``step`` (collective); async unless disabled.

        Returns the async handle, or the manifest for a synchronous manager. Retention runs after
        the commit, on the coordinator. ``overwrite``: replace a committed checkpoint of the same
        step (e.g. a damaged one a resumed run is redoing); otherwise that is CheckpointExistsError.
        ``stats``: a synchronous manager fills in this rank's figures (``ckpt.save(stats=)``); an
        async one puts them on the handle (``h.stats``).
        """
        url = self.url_for(step)
        # Every rank's save takes its own lease before it writes a byte there (ckpt.save.take_lease) and
        # drops it when the save is over: gc leaves the directory alone from the first byte any rank
        # writes, whatever the skew between ranks (no collective needed).
        if not self.async_save:
            m = save(state, url, group=self.group, step=step, user_metadata=user_metadata, layout=layout,
                     storage_options=self.storage_options, overwrite=overwrite, stats=stats)
            if self._rank == 0:
                self._after_commit(m)
            return m
        self._last = self._saver.save(state, url, step=step, user_metadata=user_metadata, layout=layout,
                                      overwrite=overwrite, storage_options=self.storage_options, policy=self.policy,
                                      on_commit=self._after_commit, max_staging_bytes=self.max_staging_bytes)
        if not self._last.skipped:
            self._staging = self._last
        return self._last

    def _after_commit(self, m: Manifest, held: leases.Lease | None = None) -> None:
        """Apply retention (the coordinator, after the commit; ``held``: a lease to drop first). The
        checkpoint is committed already: a failure here is a warning (kept in ``retention_errors``),
        never the save's failure."""
        assert m.step is not None
        try:
            if held is not None:
                held.release()
            # Later steps may be starting already: spare them (their writers' leases protect them too).
            gc(self.root, keep_last=self.keep_last, keep_every=self.keep_every, storage_options=self.storage_options,
               spare_after_step=m.step, lease_grace_s=self.lease_grace_s)
        except Exception as e:  # noqa: BLE001 - retention is best effort after a successful commit
            msg = f"step {m.step} is committed, but retention under {self.root} failed: {e}"
            self.retention_errors.append(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)

    def wait(self) -> None:
        """Block until the save in flight has finished; raise its error if it failed."""
        self._saver.wait()
        if self._last is not None and self._last.error is not None and not self._last._error_seen:
            self._last._error_seen = True
            raise self._last.error

    def list(self) -> list[CheckpointInfo]:
        """All checkpoint directories under the root, oldest first."""
        return list_checkpoints(self.root, self.storage_options, missing_ok=True, lease_grace_s=self.lease_grace_s)

    def latest(self) -> str | None:
        """URL of the newest committed checkpoint (manifest present and readable), or None."""
        committed = [c for c in self.list() if c.committed]
        return committed[-1].url if committed else None

    def _lineage(self, timeout: float) -> str:
        """The token of this root's life, ``<root>/.ckpt-lineage`` (created once, exclusively, by the
        coordinator; the same on every rank). Memory checkpoints carry it: a new run in an emptied
        root gets a new token, so the old run's memory tier is never restored into it."""
        import uuid

        from ckpt._comm import error_payload, raise_payload

        comm = Comm(self.group, timeout=timeout)
        got: dict[str, Any] | None = None
        if comm.rank == 0:
            storage = get_storage(self.root, **self.storage_options)
            try:
                if storage.size(LINEAGE) is None:
                    with contextlib.suppress(CheckpointExistsError):  # another job's manager won the race
                        storage.commit(LINEAGE, uuid.uuid4().hex.encode(), exclusive=True)
                got = {"ok": storage.read_file(LINEAGE).decode("ascii", "replace").strip()}
            except Exception as e:  # noqa: BLE001 - every rank raises it, typed
                got = error_payload(e, comm.who)
            finally:
                storage.close()
        if comm.world > 1:
            got = comm.broadcast(got, timeout=timeout, what="memory tier lineage")
        assert got is not None
        if "err" in got:
            raise_payload(got)
        return str(got["ok"])

    def memory_due(self, step: int) -> bool:
        """Whether ``step`` gets a memory checkpoint (``memory_every`` divides it)."""
        return self.memory is not None and self.memory_every is not None and step % self.memory_every == 0

    def save_memory(self, step: int, state: dict[str, Any], *, user_metadata: dict[str, Any] | None = None,
                    layout: dict[str, Any] | None = None, deferred: bool = False) -> MemoryHandle:
        """Start the memory checkpoint of ``step`` (collective; see
        :meth:`ckpt.tier.MemoryTier.save_async`): returns once this rank's pieces are copied into
        host buffers (after the previous memory checkpoint, if still running, has finished); the
        write to shared memory and the copy to a peer node run in the background. ``result()`` on
        the handle waits and returns the :class:`ckpt.tier.MemoryCheckpoint`; a full shared memory
        skips it on every rank with a warning (``result().skipped``); persistent saves are not
        affected. ``deferred=True``: GPU copies overlap later work; call ``handle.staged()`` before
        changing ``state``'s tensors in place (e.g. before ``optimizer.step()``).

        Raises StateError when the manager has no memory tier (``memory_every`` None), and the
        previous memory checkpoint's error (a lost peer, a state ``ckpt.save`` refuses) if nothing
        has raised it yet.
        """
        if self.memory is None:
            from ckpt.errors import StateError

            raise StateError(f"{self.root}: this CheckpointManager has no memory tier; pass memory_every=N")
        h = self.memory.save_async(step, state, user_metadata=user_metadata, layout=layout, deferred=deferred)
        if not h.busy:  # it started (a busy one was skipped: the previous one is still the one in flight)
            self._memory_staging = h
        return h

    @property
    def last_save(self) -> SaveHandle | None:
        """The handle of the async save started last (None: none yet)."""
        return self._last

    def save_due(self, step: int, *, last_step: bool = False) -> bool:
        """Whether :meth:`maybe_save` saves ``step`` persistently: ``save_every`` divides it, or it
        is the last step."""
        return last_step or bool(self.save_every and step % self.save_every == 0)

    def maybe_wait_for_staging(self) -> float:
        """Before changing the saved tensors in place (e.g. ``optimizer.step()``): wait until the
        async persistent save started last has copied them out (once per save), and make the
        current CUDA stream wait for the memory checkpoint's device-to-host copies (never blocks the
        host). Returns immediately when nothing is in flight. Returns the seconds waited for the
        persistent save (the training stall). Not collective."""
        t = time.perf_counter()
        h, self._staging = self._staging, None
        if h is not None:
            h.staged()
        waited = time.perf_counter() - t
        m = self._memory_staging
        if m is not None:
            m.staged()
            if m.done:
                self._memory_staging = None
        return waited

    def maybe_save(self, step: int, state: dict[str, Any] | Callable[[], dict[str, Any]], *, last_step: bool = False,
                   user_metadata: dict[str, Any] | None = None, layout: dict[str, Any] | None = None) -> SaveReport:
        """The checkpoint policy of one training step, after the optimizer step (collective: every
        rank calls it at every step, with the same ``step`` and ``last_step``).

        Persistent save when :meth:`save_due` (``save_every``, or ``last_step``): once the previous
        save is over everywhere (its error raised here) and the ranks are aligned, async unless the
        manager is sync; a step at or below ``redo_upto`` (a checkpoint restore() skipped as damaged)
        is overwritten. Memory checkpoint when :meth:`memory_due` and not ``last_step`` (deferred:
        call :meth:`maybe_wait_for_staging` before the next optimizer step). On ``last_step``: waits
        for the save to commit and for the memory checkpoint in flight, then gives the memory tier
        back (the last step is persistent). ``state``: the state, or a function building it (called
        only when something is due). Returns what it did (:class:`SaveReport`).
        """
        rep = SaveReport(step)
        t = time.perf_counter()
        built: dict[str, Any] | None = None

        def get() -> dict[str, Any]:
            nonlocal built
            if built is None:
                built = state() if callable(state) else state
            return built

        if self.save_due(step, last_step=last_step):
            # Every rank starts a save only once the previous one (and its retention) is over everywhere.
            # save() spares later steps from retention anyway (a rank with a cached plan may create the
            # new step directory before rank 0's lease exists); the barrier keeps save starts aligned.
            self.wait()
            self._barrier()
            rep.stats = {}
            t_save = time.perf_counter()
            rep.saved = self.save(step, get(), user_metadata=user_metadata, layout=layout,
                                  overwrite=step <= self.redo_upto, stats=rep.stats)
            rep.save_s, rep.url = time.perf_counter() - t_save, self.url_for(step)
        if self.memory_due(step) and not last_step:
            h = self.save_memory(step, get(), user_metadata=user_metadata, layout=layout, deferred=True)
            rep.memory = None if h.busy else h
        rep.stall_s = time.perf_counter() - t
        if last_step:
            t = time.perf_counter()
            self.wait()  # the last checkpoint is committed before this returns
            if self.memory is not None:
                self.memory.pacer.release()  # training is over: the memory checkpoint in flight at full speed
                self.memory.drain(raise_error=True)
                self.memory.clear()  # the last step is persistent now: give the shared memory back
            rep.commit_wait_s = time.perf_counter() - t
        return rep

    def _barrier(self) -> None:
        """Every rank of the manager's group is here (gather + broadcast of nothing; bounded)."""
        comm = Comm(self.group)
        if comm.single:
            return
        comm.gather(None, what="save barrier")
        comm.broadcast(None, what="save barrier")

    def _committed(self, comm: Comm) -> builtins.list[tuple[int, str]]:
        # Rank 0 lists (newest first), so that every rank tries the same checkpoints in the same order
        # even if one commits meanwhile.
        found = [(c.step, c.url) for c in reversed(self.list()) if c.committed] if comm.rank == 0 else None
        if comm.single:
            return found or []
        return [(int(a), str(b)) for a, b in comm.broadcast(found, what="committed checkpoints")]

    @staticmethod
    def _ranks_failed(comm: Comm, failed: bool) -> int:
        """How many ranks failed an attempt (collective: ``ckpt.load`` fails on every rank or none, but a
        custom ``loader`` may fail on one rank only, and every rank must skip the same checkpoint)."""
        if comm.single:
            return int(failed)
        flags = comm.gather(int(failed), what="restore agreement")
        return int(comm.broadcast(sum(flags) if flags is not None else None, what="restore agreement"))

    def restore(self, state: dict[str, Any], *, strict: bool = True, loader: Loader | None = None,
                fallback: bool = False, on_failure: Callable[[dict[str, Any]], None] | None = None) -> int | None:
        """Load the newest checkpoint into ``state`` (collective); return its step or None.
        ``restored`` then says what was restored (:class:`Restored`: step, tier, url, figures).

        With a memory tier: its newest complete step when it is at least as new as the newest
        committed persistent checkpoint (own copies first, then peers' copies, every checksum
        checked; ``last_restore`` says how), else the persistent one; memory checkpoints the run
        does not continue from are dropped. Objects are loaded into ``state`` in place as well
        (the dict's values are replaced).

        ``loader``: restore through ``loader(url, read)`` instead (``read``: ``ckpt.load`` or the
        memory tier's reader, same signature); ``state`` then only names the pieces wanted (their
        tensors' keys, dtypes and shapes) and ``restored.value`` is what ``loader`` returned.
        ``fallback``: a persistent checkpoint that fails on any rank with damaged or missing data
        (IntegrityError, StorageError, ManifestError) is skipped for the next older one, reported to
        ``on_failure`` as a ``restore_failed`` record (the memory tier reports its failed sources
        there too), and ``redo_upto`` lets :meth:`maybe_save` overwrite it; CheckpointError when
        every committed checkpoint failed. Without it the newest one's error is raised.
        """
        self.last_restore = self.restored = None
        comm = Comm(self.group)
        urls = self._committed(comm)
        if self.memory is not None:
            got = self._restore_memory(state, urls[0][0] if urls else None, strict, loader, on_failure)
            if got is not None:
                return got.step
        read: Callable[..., dict[str, Any]] = functools.partial(load, group=self.group,
                                                                 storage_options=self.storage_options)
        skipped = -1
        for ckpt_step, url in urls if fallback else urls[:1]:
            t = time.perf_counter()
            if not fallback:
                value = loader(url, read) if loader is not None else read(state, url, strict=strict)
            else:
                err: CheckpointError | None = None
                try:
                    value = loader(url, read) if loader is not None else read(state, url, strict=strict)
                except (IntegrityError, StorageError, ManifestError) as e:
                    err, value = e, None
                failed = self._ranks_failed(comm, err is not None)
                if failed:
                    skipped = max(skipped, ckpt_step)
                    why = f"{type(err).__name__}: {err}" if err is not None else "failed on another rank"
                    if on_failure is not None:
                        on_failure({"event": "restore_failed", "from": url, "error": why, "ranks_failed": failed})
                    continue
            if loader is None:
                assert value is not None
                _update_in_place(state, value)
                step = self._step_of(url)
            else:
                step = ckpt_step
            self.redo_upto = skipped
            if step is not None:
                self.restored = Restored(step, "storage", url, value, time.perf_counter() - t, skipped)
            return step
        if urls:
            raise CheckpointError(f"{self.root}: none of the {len(urls)} committed checkpoint(s) could be restored "
                                  "(see the restore_failed records and the errors above); run `ckpt verify --deep` "
                                  "on them, or pass verify_restore=False / --no-verify-restore to load them as "
                                  "they are")
        if self.memory is not None and self.memory.restore_clobbered:
            from ckpt.tier.restore import clobbered_message

            raise IntegrityError(clobbered_message(self.root))
        return None

    def _restore_memory(self, state: dict[str, Any], newest: int | None, strict: bool, loader: Loader | None,
                        on_failure: Callable[[dict[str, Any]], None] | None) -> Restored | None:
        """The newest complete memory step at or above ``newest`` (the newest persistent step),
        restored on every rank (own copies, else peers' copies, else a resharding load of another
        layout's), or None. Collective."""
        from ckpt.tier.store import pieces_digest

        tier = self.memory
        assert tier is not None
        t = time.perf_counter()
        if loader is None:
            got = tier.restore_with(lambda url: tier.load_local(state, url, strict=strict),
                                    digest=pieces_digest(state), min_step=newest, on_failure=on_failure)
            if got is None:  # another layout or world size: the resharding load, when every piece is here
                got = tier.restore_resharded_with(lambda url: tier.load_view(state, url, strict=strict, verify=True),
                                                  min_step=newest, on_failure=on_failure, want=state)
        else:
            got = tier.restore_with(lambda url: loader(url, tier.load_local), digest=pieces_digest(state),
                                    min_step=newest, on_failure=on_failure)
            if got is None:
                got = tier.restore_resharded_with(lambda url: loader(url, tier.load_view), min_step=newest,
                                                  on_failure=on_failure, want=state)
        # a resharded step is not this layout's memory checkpoint: nothing of the old one is kept
        tier.reset(got.step if got is not None and got.tier != "memory-reshard" else None)
        if got is None:
            return None
        if loader is None:
            _update_in_place(state, got.value)
        self.last_restore = got
        pin = tier.pin_stats  # this rank's mapping ahead of the restore: how long, and how much of it waited
        detail = {"peer_ranks": got.peer_ranks, "fetched_bytes": got.fetched_bytes, "memory_bytes": got.bytes,
                  "failures": got.failures[:8], "pin_ahead_bytes": pin.get("bytes", 0),
                  "pin_ahead_pinned": bool(pin.get("pinned")), "pin_ahead_ms": pin.get("ms", 0.0),
                  "pin_ahead_wait_ms": pin.get("wait_ms", 0.0)}
        self.redo_upto = -1
        self.restored = Restored(got.step, got.tier, got.url, got.value, time.perf_counter() - t, -1, detail)
        return self.restored

    def _step_of(self, url: str) -> int | None:
        m = get_storage(url, **self.storage_options)
        try:
            return decode_manifest(m.read_file(MANIFEST_NAME)).step
        finally:
            m.close()

    def close(self) -> None:
        """Wait for the saves in flight, persistent and memory (clean shutdown), then give the memory
        tier's run id back (its checkpoints stay for a restarted job); the manager is not used after this."""
        try:
            self.wait()
        finally:
            if self.memory is not None:
                try:
                    self.memory.drain(raise_error=True)
                finally:
                    self.memory.close()


def _update_in_place(state: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(state.get(k), dict) and state[k]:
            _update_in_place(state[k], v)
        else:
            state[k] = v


__all__ = ["LEASE", "LINEAGE", "Loader", "node_of", "Restored", "SaveReport", "CheckpointManager"]
