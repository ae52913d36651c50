"""The memory tier: recent checkpoints in node-local shared memory, each rank's pieces copied to a
peer on another node, restored newest-complete-first with every checksum checked.

One memory checkpoint of step N, on every rank (collective over the tier's own gloo group)::

    snapshot copy this rank's pieces into a reused slot (a shared-memory file)  training thread: its only stall
    ----- the rest on a background thread, over the tier's own gloo group (never the training group) -----
    write    commit the slot as <node>/rank-<r>/step-N (checksums, link, manifest last; single-rank)
    copy     send those files to the holders on other nodes; keep the copies sent to this rank
    agree    one gather + verdict: complete iff every rank wrote and every copy arrived
    free     complete: drop all but the newest `keep` complete steps; else drop step N's files

The snapshot's copies land in the data file itself: a slot (:mod:`ckpt.tier.slots`), a shared-memory
file reused from step to step (pinned for GPU pieces), so the write is only checksums, a hard link and
the manifest (:mod:`ckpt.tier.inplace`); where no slot fits, host buffers and an ordinary ``ckpt.save``.

Memory is bounded by ``keep`` complete checkpoints per rank (and per copy kept for a peer), plus
the one being written (``keep + 1`` slots, the spare one kept between steps); an older step is
freed only once a newer one is complete on every rank. A rank that cannot write (shared memory
full, ENOSPC) or keep a copy makes the step incomplete on every rank: it is skipped with a
warning, training goes on, the previous complete step stays.

Why a separate group and a background thread rather than an agreement at the next call: the tier's
group carries only the tier's messages, in the same order on every rank (one memory checkpoint in
flight; the next one, a restore, reset or clear first wait for it), so its collectives can never
interleave with training's collectives on another thread, and a step is known complete as soon as
every rank has it, not one step later. A background error (a lost peer, a state ``ckpt.save``
refuses) reaches the training thread at the handle's ``result()`` or the next ``save_async``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from ckpt._comm import Comm, describe, error_payload, raise_payload, side_group
from ckpt.errors import CheckpointError, CollectiveError, StateError
from ckpt.save import PlanCache
from ckpt.tier import reshard as _reshard
from ckpt.tier import restore as _restore
from ckpt.tier import safefs
from ckpt.tier.cadence import Cadence
from ckpt.tier.inplace import save_linked
from ckpt.tier.localcopy import threads_for
from ckpt.tier.nodes import (
    host_peers,
    local_copy_enabled,
    node_identity,
    replica_holders,
    run_id_for,
    senders_to,
    shm_base,
    tier_dir,
)
from ckpt.tier.pace import Governor, Pacer, budget_from_env, overhead_from_env
from ckpt.tier.pinahead import PinAhead
from ckpt.tier.runlock import RunLock, exclusive, host_key, lock_names, remove_locks
from ckpt.tier.slots import Slot, SlotPool, raw_layout
from ckpt.tier.snapshot import HostSnapshots, Snapshot
from ckpt.tier.store import (
    META_KEY,
    TIER_VERSION,
    NodeStore,
    committed_bytes,
    load_local,
    localize,
    localize_pieces,
    remove_step,
)
from ckpt.tier.transfer import after_copy, exchange, failed, package
from ckpt.tier.types import MemoryCheckpoint, MemoryHandle, TierConfig

BACKGROUND_NICE = 10  # the background thread's niceness with busy="skip" (see MemoryTier._background)


class MemoryTier:
    """Memory checkpoints of one job, on this rank. Create it on every rank of ``group`` (default:
    the world), in the same order (it creates ckpt's own gloo group of those ranks, see
    :func:`ckpt._comm.side_group`: collective over them only), after ``torch.distributed`` is
    initialized (or in a single process).

    Example::

        tier = MemoryTier(TierConfig("/ckpts/run1", nodes=2))
        got = tier.restore(state)                 # newest complete memory step, or None
        tier.reset(got.step if got else None)     # drop what the run will not continue from
        for step in ...:
            ... ; tier.save(step, state)          # every step: write, copy to a peer, agree, free
    """

    def __init__(self, config: TierConfig, *, group: Any = None):
        import torch.distributed as dist

        self.config = config
        self.timeout = float(config.timeout)
        self.run_id = run_id_for(config.root, config.run_id)
        self.base = shm_base(config.shm_dir)
        self.pg: Any = None
        self._single: Any = None
        if dist.is_available() and dist.is_initialized():
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            # the tier's own group: its members alone create it (never new_group, which is collective over
            # the world and names groups from per-process counters), fresh for each tier (a lost peer
            # leaves a group unusable; the next tier, after a restart or a new manager, gets a new one)
            self.pg = side_group(ranks, f"memory-tier/{self.run_id}", timeout=self.timeout, fresh=True)
            # ckpt.save / ckpt.load of one rank's copy go through a single-rank group: not collective
            # (and never on the training group, which another thread may be using)
            self._single = side_group([dist.get_rank()], "memory-tier-self", timeout=self.timeout)
        self.comm = Comm(self.pg, timeout=self.timeout)
        self.rank, self.world = self.comm.rank, self.comm.world
        bad: dict[str, Any] | None = None
        host: list[Any] | None = None
        self._run_lock: RunLock | None = None
        overhead: float | None = None
        try:
            # the environment may differ between ranks: a governor changes which calls start a memory
            # checkpoint, so every rank must have one or none (checked below)
            overhead = config.governed(overhead_from_env(config.max_overhead))
            node = node_identity(self.rank, self.world, node=config.node, nodes=config.nodes)
            # the run directory: ours, 0700, not a link (shared memory is writable by every local user)
            self.run_dir = safefs.trust_root(tier_dir(self.base, self.run_id), create=True)
            host = host_key(self.base)
        except (CheckpointError, OSError) as e:  # every rank raises it (nobody waits for this one)
            node, bad = 0, error_payload(e, self.comm.who)
        first = {"node": node, "epoch": uuid.uuid4().hex[:12], "bad": bad, "host": host,
                 "schedule": [config.busy, overhead is not None]}
        everyone = self.comm.exchange(first, lambda got: [got] * len(got), timeout=self.timeout,
                                      what="memory tier setup")
        for g in everyone:
            if g.get("bad"):
                raise_payload(g["bad"])
        _same_schedule([g["schedule"] for g in everyone])
        # one run id, one job: this rank's lock, by its index among the job's ranks on this host (see
        # ckpt.tier.runlock); agreed, so that a second job fails at once on every rank, not at a timeout
        local = [r for r, g in enumerate(everyone) if g["host"] == host].index(self.rank)
        try:
            self._run_lock = RunLock(self.run_dir, local, run_id=self.run_id, timeout=self.timeout)
        except (CheckpointError, OSError) as e:
            bad = error_payload(e, self.comm.who)
        locked = self.comm.exchange(bad, lambda got: [[g for g in got if g]] * len(got), timeout=self.timeout,
                                    what="memory tier run lock")
        if locked:
            if self._run_lock is not None:
                self._run_lock.release()
            raise_payload(locked[0])
        self.nodes = [int(g["node"]) for g in everyone]
        self.node = node
        self.epoch = str(everyone[0]["epoch"])  # this attempt of the job: copies of one step share it
        self.holders = replica_holders(self.nodes, config.replicas)
        self.hosts = [g["host"] for g in everyone]  # ranks with equal entries share this host's shared memory
        self.copy_options = self._copy_options(self.hosts)
        self.senders = senders_to(self.holders)
        self.store = NodeStore(self.base, self.run_id, node, self.rank, self.world, config.lineage)
        self._complete: list[int] = []
        self.warnings: list[str] = []
        budget = budget_from_env(config.max_gbps)
        self.pacer = Pacer(budget)  # the background's budget (ckpt.tier.pace)
        self.governor = None if overhead is None else Governor(self.pacer, overhead, max_gbps=budget, settled=False)
        self._snapshots = HostSnapshots(stage_on_device=config.staging(), pace=self.pacer, warn=self._warn)
        self._slots = SlotPool(self.store.own_root(), config.keep + 1)
        self._replica_slots: dict[int, SlotPool] = {}  # by owner: the files its copies are received into
        self._pin: PinAhead | None = None  # mapping the newest step's slot ahead of a restore (pin_ahead)
        self.pin_stats: dict[str, Any] = {}
        self._plan_cache = PlanCache()  # the one-rank plan of this rank's memory checkpoints
        # the last restore tried copies and every one failed: the state may hold parts of them (see
        # ckpt.tier.restore.run); the same on every rank
        self.restore_clobbered = False
        self._inflight: MemoryHandle | None = None  # the memory checkpoint on the background thread
        self._cadence = Cadence(config.busy, self.governor)  # which calls start a memory checkpoint
        if config.replicas and len(set(self.nodes)) < 2:
            self._warn(f"memory tier: replicas={config.replicas} but all {self.world} ranks are on node "
                       f"{self.nodes[0]}: no peer copies, so losing the node falls back to storage (set "
                       "CKPT_NODE per node, or `ckpt train --nodes N` to simulate nodes on one host)")
        if self.rank == min(r for r, n in enumerate(self.nodes) if n == node):
            self._describe_run()

    # --- paths and bookkeeping -----------------------------------------------------------------

    def _copy_options(self, hosts: list[Any]) -> dict[str, Any]:
        """:func:`ckpt.tier.transfer.exchange`'s keywords for this rank: peers sharing this host's shared
        memory read our files instead of receiving them through gloo (:mod:`ckpt.tier.localcopy`),
        their threads sharing the host's CPUs with its other ranks."""
        here = host_peers(hosts, self.rank, enabled=local_copy_enabled())
        return {"local": here, "run_dir": self.run_dir, "threads": threads_for(len(host_peers(hosts, self.rank)) + 1)}

    @property
    def node_dir(self) -> str:
        """This rank's node directory (losing the node = losing this directory)."""
        return self.store.dir

    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)
        if self.rank == 0:
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _describe_run(self) -> None:
        """``tier.json``: which run this is (read by ``ckpt ls ROOT``); best effort."""
        path = os.path.join(tier_dir(self.base, self.run_id), "tier.json")
        doc = {"version": TIER_VERSION, "run_id": self.run_id, "world": self.world, "nodes": len(set(self.nodes)),
               "root": self.config.root if "://" in self.config.root else os.path.abspath(self.config.root),
               "replicas": self.config.replicas, "keep": self.config.keep}
        try:
            safefs.write_atomic(path, json.dumps(doc).encode())  # (a link at tier.json is replaced, not followed)
        except OSError as e:
            self._warn(f"memory tier: cannot write {path} ({e.strerror or e}); memory checkpoints will likely fail "
                       "too")

    def _meta(self, digest: str, user_metadata: dict[str, Any] | None) -> dict[str, Any]:
        meta = dict(user_metadata or {})
        meta[META_KEY] = {"version": TIER_VERSION, "run_id": self.run_id, "owner": self.rank, "world": self.world,
                          "node": self.node, "digest": digest, "epoch": self.epoch, "lineage": self.config.lineage}
        return meta

    # --- save --------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, user_metadata: dict[str, Any] | None = None,
             layout: dict[str, Any] | None = None) -> MemoryCheckpoint:
        """:meth:`save_async`, then wait for it: the memory checkpoint of ``step`` is over on every
        rank when this returns (collective; with ``busy="skip"`` it may have been skipped:
        ``result.busy``). Raises what the background work raised."""
        return self.save_async(step, state, user_metadata=user_metadata, layout=layout).result()

    def save_async(self, step: int, state: dict[str, Any], *, user_metadata: dict[str, Any] | None = None,
                   layout: dict[str, Any] | None = None, deferred: bool = False) -> MemoryHandle:
        """Start the memory checkpoint of ``step`` (collective, in the same order on every rank).

        On the calling thread: wait for the previous memory checkpoint if it is still running (one
        in flight; its error, if any, is raised here), then copy this rank's pieces into reused
        host buffers (:mod:`ckpt.tier.snapshot`). The caller may change ``state`` as soon as this
        returns. On a background thread, over the tier's own gloo group (never the training
        group, so no collective of training can interleave with these): write the copy to shared
        memory, send it to its holders, agree, free the older step (see the module docstring).

        ``deferred``: GPU pieces' device-to-host copies are not waited for by the current stream at once;
        the caller must call the handle's ``staged()`` before changing ``state``'s tensors in place
        (e.g. right before ``optimizer.step()``), so that the copies overlap the next forward and
        backward (see :mod:`ckpt.tier.snapshot`). Without it (default) ``state`` may change at once.

        The handle's ``result()`` is the :class:`MemoryCheckpoint`. A full or failing shared memory
        never raises: the step is skipped on every rank with a warning. ``result()`` (or the next
        ``save_async``) raises StateError on every rank for a state ``ckpt.save`` refuses on any
        rank, and CollectiveError when a peer is lost (the job must restart; the previous complete
        step stays).
        """
        t0 = time.perf_counter()
        cadence = self._cadence
        if cadence.in_flight_skip(step, self._inflight):
            cadence.skip(step, t0, busy=True)
            return MemoryHandle.skipped_busy(step)
        self.drain(raise_error=True)
        if cadence.later(step):
            cadence.skip(step, t0, busy=False)
            return MemoryHandle.skipped_busy(step)
        busy = cadence.start(step, t0)
        t1 = time.perf_counter()
        problem: BaseException | None = None
        snap: Snapshot | None = None
        meta: dict[str, Any] = {}
        try:
            flat, _objects, digest, pieces = localize_pieces(state)
            meta = self._meta(digest, user_metadata)
            meta[META_KEY]["pieces"] = pieces
            snap = self._snapshots.take(flat, slot=self._slot_for(flat), deferred=deferred)
        except Exception as e:  # noqa: BLE001 - reported through the agreement: every rank skips or raises
            problem = e
        handle = MemoryHandle(step, wait_s=t1 - t0, snapshot_s=time.perf_counter() - t1)
        handle._snapshot = snap
        self._inflight = handle
        threading.Thread(target=self._background, args=(handle, snap, problem, meta, layout, busy), daemon=True,
                         name=f"ckpt-memory-tier-step-{step}").start()
        return handle

    def _slot_for(self, flat: dict[str, Any]) -> Slot | None:
        """A slot no committed step links, shaped for ``flat`` (None: none is free, or ``flat`` has no
        tensors; host buffers then). Raises OSError when shared memory cannot hold it."""
        import torch

        tensors = [v for v in flat.values() if isinstance(v, torch.Tensor)]
        if not tensors:
            return None
        try:
            layout = self._slots.layout(flat)
        except Exception:  # noqa: BLE001 - no slot then: the ordinary save says what is wrong, if anything
            return None
        cuda = [t.device for t in tensors if t.device.type == "cuda"]
        try:
            slot = self._slots.acquire(layout, pin=bool(cuda))
            self._slots.shape_ahead(layout, slot, pin=bool(cuda), device=cuda[0] if cuda else None)
            return slot
        except OSError:
            raise  # shared memory full: this memory checkpoint is skipped (on every rank)
        except Exception:  # noqa: BLE001 - anything else about the slot: the ordinary write instead
            return None

    def _replica_slot(self, owner: int, size: int) -> Slot | None:
        """A slot of ``size`` bytes for a copy of ``owner``'s data file that no kept copy links
        (``keep + 1`` per owner; see :func:`ckpt.tier.transfer.exchange`)."""
        pool = self._replica_slots.get(owner)
        if pool is None:
            pool = self._replica_slots[owner] = SlotPool(self.store.replica_root(owner), self.config.keep + 1)
        layout = raw_layout(size)
        slot = pool.acquire(layout, pin=False)
        pool.shape_ahead(layout, slot, pin=False)  # the next copies land in allocated pages
        return slot

    def drain(self, *, raise_error: bool = False) -> MemoryHandle | None:
        """Wait for the memory checkpoint in flight, if any, and return its handle (None: none was
        started). ``raise_error``: raise its error unless its ``result()`` already did."""
        self._pin_wait()
        h = self._inflight
        if h is None:
            return None
        h._done.wait()
        if raise_error and h.error is not None and not h._error_seen:
            h._error_seen = True
            raise h.error
        return h

    def _background(self, handle: MemoryHandle, snap: Snapshot | None, problem: BaseException | None,
                    meta: dict[str, Any], layout: dict[str, Any] | None, busy: int = 0) -> None:
        if self.config.busy == "skip":
            # nice +10 for this thread only (Linux: a thread is a task): where cores are short,
            # training gets them first and the memory checkpoint takes what is left (a due step finding
            # it still running is skipped). Not with busy="wait": training would then wait for work
            # that it starved itself. A thread per checkpoint: nothing to reset.
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        try:
            result = self._write_and_agree(handle, snap, problem, meta, layout)
            result.rank_wait_s, result.rank_snapshot_s, result.busy_skipped = handle.wait_s, handle.snapshot_s, busy
            result.snapshot_bytes = snap.nbytes if snap is not None else 0
            rate, gov = self.pacer.rate, self.governor
            result.budget_gbps = None if rate is None else rate / 1e9
            result.overhead = None if gov is None else gov.measured
            handle._result = result
        except BaseException as e:  # noqa: BLE001 - kept for the training thread (result() / the next save)
            handle.error = e
        finally:
            handle._done.set()

    def _write_and_agree(self, handle: MemoryHandle, snap: Snapshot | None, problem: BaseException | None,
                         meta: dict[str, Any], layout: dict[str, Any] | None) -> MemoryCheckpoint:
        """The background part of one memory checkpoint (collective over the tier's group)."""
        from ckpt.save import save

        step = handle.step
        t0 = time.perf_counter()
        own = self.store.own(step)
        err: str | None = None
        fatal: dict[str, Any] | None = None  # a state ckpt.save refuses: raised on every rank after the agreement
        nbytes = 0
        try:
            if problem is not None:
                raise problem
            assert snap is not None
            # the training thread goes first (see Snapshot.first_landed); inside the try: a failing
            # CUDA query is this rank's error in the agreement, like any other, never a missing rank
            snap.first_landed()
            safefs.makedirs(self.store.own_root())  # its node and rank directories: real, ours, 0700
            remove_step(own)  # leftovers of a write cut short: never a complete step (see reset)
            # a slot's pieces are checksummed as their copies land (the first while the last still copy)
            manifest = None if snap.slot is None else save_linked(
                snap.flat, own, snap.slot, group=self._single, step=step, user_metadata=meta, layout=layout,
                timeout=self.timeout, cache=self._plan_cache, wait_piece=snap.wait_piece)
            snap.ready()
            if manifest is None:
                manifest = save(snap.flat, own, group=self._single, step=step, user_metadata=meta, layout=layout,
                                timeout=self.timeout)
            nbytes = committed_bytes(own, manifest)  # from the commit's own decode: no second one
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - shared memory full, or anything else: the step is skipped
            err = f"rank {self.rank} (node {self.node}): writing {own}: {describe(e)}"
            if isinstance(e, StateError):
                fatal = error_payload(e, self.comm.who)
            remove_step(own)
        t1 = time.perf_counter()
        what = f"rank {self.rank}'s memory step {step}"
        sends = {h: package(own, what) if err is None else failed(f"{what} was not written")
                 for h in self.holders[self.rank]}
        recvs = {s: self.store.replica(s, step) for s in self.senders[self.rank]}
        arrived = exchange(self.pg, sends, recvs, rank=self.rank, timeout=self.timeout,
                           what=f"memory tier copy of step {step}", slots=self._replica_slot, pace=self.pacer.take,
                           **self.copy_options)
        copy_errs = [r.err for r in arrived.values() if not r.ok]
        t2 = time.perf_counter()
        mine = {"err": err, "copy": copy_errs, "bytes": nbytes, "sent": sum(p.nbytes for p in sends.values()),
                "w": t1 - t0, "r": t2 - t1, "fatal": fatal}
        handle.reported = mine["at"] = self._cadence.report(step)  # (see ckpt.tier.cadence)
        verdict = self.comm.exchange(mine, _verdict, timeout=after_copy(self.timeout),
                                     what=f"memory tier agreement on step {step}")
        self._cadence.agreed(int(verdict["next_at"]))
        t3 = time.perf_counter()
        if verdict.get("fatal"):
            self._free(lambda s: s == step)
            raise_payload(verdict["fatal"])
        result = MemoryCheckpoint(step, bool(verdict["complete"]), errors=list(verdict["errors"]),
                                  bytes=int(verdict["bytes"]), replica_bytes=int(verdict["sent"]), rank_bytes=nbytes,
                                  rank_write_s=t1 - t0, rank_replicate_s=t2 - t1, rank_agree_s=t3 - t2,
                                  max_write_s=float(verdict["max_w"]), max_replicate_s=float(verdict["max_r"]))
        if result.complete:
            self._cadence.completed(self.config.keep)
            self._complete = [s for s in self._complete if s != step] + [step]
            keep = set(self._complete[-self.config.keep:])
            self._complete = sorted(keep)
            result.freed = self._free(lambda s: s not in keep)
        else:
            self._free(lambda s: s == step)
            result.warning = (f"memory checkpoint of step {step} skipped on every rank ({len(result.errors)} "
                              f"error(s); first: {result.errors[0] if result.errors else '?'}); training goes on, "
                              f"the newest complete memory step stays {self._complete[-1] if self._complete else None}")
            self._warn(result.warning)
        return result

    def _free(self, doomed: Callable[[int], bool]) -> list[int]:
        """Remove this rank's own steps and the copies it keeps for which ``doomed(step)``."""
        freed: set[int] = set()
        for s, p in self.store.own_steps():
            if doomed(s):
                remove_step(p)
                freed.add(s)
        for owner in self.senders[self.rank]:
            for s, p in self.store.replica_steps(owner):
                if doomed(s):
                    remove_step(p)
        if freed:
            self._slots.trim()  # a freed step's slot beyond keep + 1 goes now, not at the next write
        for pool in self._replica_slots.values():
            pool.trim()
        return sorted(freed)

    # --- restore -----------------------------------------------------------------------------

    def pin_ahead(self, device: Any = None) -> None:
        """Start mapping this rank's newest committed memory checkpoint (pinned when ``device`` is a
        CUDA device: the job's) on a background thread and return at once; call it as early as the
        job can, before building the model, so that a restore reads it straight from the pinned
        mapping (see :mod:`ckpt.tier.pinahead`). The next restore or memory checkpoint waits for it;
        ``pin_stats`` then says what it mapped and how long the wait was. Not collective."""
        self.drain()
        self._pin = PinAhead(self._slots, self.store.own_steps(), device)

    def _pin_wait(self) -> None:
        if self._pin is not None:  # the slot pool is this thread's again once the mapping is done
            self.pin_stats = self._pin.wait()
            self._pin = None

    def load_local(self, state: dict[str, Any], url: str, *, strict: bool = True,
                   stats: dict[str, Any] | None = None, verify: bool = True) -> dict[str, Any]:
        """``ckpt.load``-like: fill ``state`` from this rank's memory checkpoint at ``url`` (not
        collective; every checksum checked). See :func:`ckpt.tier.store.load_local`."""
        self._pin_wait()
        return load_local(state, url, strict=strict, stats=stats, verify=verify, group=self._single,
                          mapped=self._slots.mapped())

    def restore_with(self, fn: Callable[[str], Any], *, digest: str, min_step: int | None = None,
                     on_failure: Callable[[dict[str, Any]], None] | None = None) -> _restore.TierRestore | None:
        """Restore the newest complete memory step at or above ``min_step`` through ``fn(url)``
        (collective); None when there is none or every source failed. ``digest``: the pieces this
        rank wants (:func:`ckpt.tier.store.pieces_digest` of its state). See :func:`ckpt.tier.restore.run`."""
        self.drain()  # the tier's group is the background thread's while a memory checkpoint runs
        return _restore.run(self, fn, digest=digest, min_step=min_step, on_failure=on_failure)

    def restore(self, state: dict[str, Any], *, min_step: int | None = None, strict: bool = True,
                on_failure: Callable[[dict[str, Any]], None] | None = None) -> _restore.TierRestore | None:
        """Fill ``state`` from the newest complete memory step (collective); None when there is none.

        Copies lost with a node are fetched from the peers keeping them; a copy that fails its
        checksums is dropped and the next one (or the next older step) is tried. ``min_step``: only
        steps at or above it (e.g. the newest persistent step). Non-tensor state comes back as
        ``ckpt.load`` returns it (``result.value``).
        """
        digest = localize(state)[2]
        return self.restore_with(lambda url: self.load_local(state, url, strict=strict), digest=digest,
                                 min_step=min_step, on_failure=on_failure)

    def restore_resharded_with(self, fn: Callable[[str], Any], *, min_step: int | None = None,
                               on_failure: Callable[[dict[str, Any]], None] | None = None,
                               want: dict[str, Any] | None = None) -> _restore.TierRestore | None:
        """Restore under another layout (collective): the newest step at or above ``min_step`` whose
        every old rank's copy some rank can reach, read through ``fn(url)`` (a resharding load of
        this rank's state from an ordinary checkpoint at ``url``, not collective); None when there
        is none or any rank failed. ``want``: the state ``fn`` fills (only the stored shards it
        overlaps cross hosts; None: whole copies). See :mod:`ckpt.tier.reshard`."""
        return _reshard.run(self, fn, min_step=min_step, on_failure=on_failure, want=want)

    def load_view(self, state: dict[str, Any], url: str, **kw: Any) -> dict[str, Any]:
        """``ckpt.load`` of this rank's ``state`` from a view (see :meth:`restore_resharded_with`),
        through a single-rank group: not collective."""
        from ckpt.load import load

        return load(state, url, group=self._single, **kw)

    def restore_resharded(self, state: dict[str, Any], *, min_step: int | None = None, strict: bool = True,
                          on_failure: Callable[[dict[str, Any]], None] | None = None) -> _restore.TierRestore | None:
        """:meth:`restore_resharded_with` through ``ckpt.load`` of ``state`` (every checksum checked):
        a memory tier written under another layout or world size, read as this job's pieces."""
        return self.restore_resharded_with(lambda url: self.load_view(state, url, strict=strict, verify=True),
                                           min_step=min_step, on_failure=on_failure, want=state)

    def reset(self, keep_step: int | None = None) -> None:
        """After a restore decision (every rank): keep only ``keep_step``'s memory checkpoint (the step
        the run continues from) and drop every other one this rank owns or keeps, together with
        directories no rank of this job uses (another world size or node mapping). Not collective
        (waits for the memory checkpoint in flight, if any)."""
        self.drain()
        self._cadence.reset()  # the run continues from keep_step: no memory checkpoint is due later than asked
        _reshard.clear_views(self)
        self._free(lambda s: s != keep_step)
        self._complete = [keep_step] if keep_step is not None else []
        here = [r for r, n in enumerate(self.nodes) if n == self.node]
        if self.rank == min(here):
            self.store.prune(here, sorted({o for h in here for o in self.senders[h]}))

    def close(self) -> None:
        """Unmap (and unpin) this rank's slots, keeping every memory checkpoint, and give the run id
        back (see :mod:`ckpt.tier.runlock`); the tier is not used after this (e.g. a process handing
        the node to its restarted self). Not collective."""
        self.pacer.release()  # (the memory checkpoint in flight, if any, finishes at full speed)
        self.drain()
        self._snapshots.stage.release()
        self._slots.close()
        for pool in self._replica_slots.values():
            pool.close()
        if self._run_lock is not None:
            self._run_lock.release()

    def clear(self) -> None:
        """Remove every memory checkpoint this rank owns or keeps (e.g. after the run's last persistent
        save) and give the run id back: the tier is not used after this. The directories go when
        empty, the run's when no rank of it is left. Not collective."""
        self.pacer.release()
        self.reset(None)
        self._snapshots.stage.release()
        self._slots.close(remove=True)
        for pool in self._replica_slots.values():
            pool.close(remove=True)
        self._replica_slots = {}
        empty = [self.store.own_root()] + [self.store.replica_root(o) for o in self.senders[self.rank]]
        for d in [*empty, os.path.dirname(self.store.replica_root(0)), self.store.dir]:
            with contextlib.suppress(OSError):
                safefs.rmdir(d)  # only when empty: other ranks of the node may still be clearing theirs
        if self._run_lock is not None:
            self._run_lock.release()
        run = self.run_dir
        with exclusive(run) as alone:  # no rank of a job holds the run: the last one out removes it
            names = safefs.listdir(run)
            if alone and not set(names) - {"tier.json", *lock_names(names)}:
                with contextlib.suppress(OSError):
                    safefs.unlink(os.path.join(run, "tier.json"))
                remove_locks(run)
                with contextlib.suppress(OSError):
                    safefs.rmdir(run)

    @property
    def complete_steps(self) -> list[int]:
        """Steps this rank knows complete on every rank (at most ``keep``), oldest first."""
        return list(self._complete)


def _same_schedule(got: list[Any]) -> None:
    """StateError (on every rank: each checks the same gathered list) when the ranks differ in what
    decides which calls start a memory checkpoint: ``busy``, and whether a governor runs
    (``max_overhead`` / ``$CKPT_TIER_MAX_OVERHEAD``). Otherwise their collectives would not pair."""
    if all(g == got[0] for g in got):
        return
    odd = [r for r, g in enumerate(got) if g != got[0]]
    raise StateError(f"memory tier: ranks {odd} differ from rank 0 in busy / max_overhead ({got[odd[0]]} vs "
                     f"{got[0]}: [busy, governed]); set the same TierConfig and CKPT_TIER_MAX_OVERHEAD on every rank")


def _verdict(got: list[Any]) -> list[Any]:
    errors = [g["err"] for g in got if g["err"]] + [e for g in got for e in g["copy"]]
    slow_w = max(range(len(got)), key=lambda r: got[r]["w"])
    slow_r = max(range(len(got)), key=lambda r: got[r]["r"])
    fatal = next((g["fatal"] for g in got if g.get("fatal")), None)
    v = {"complete": not errors, "errors": errors, "fatal": fatal, "bytes": sum(g["bytes"] for g in got),
         "next_at": max(int(g["at"]) for g in got) + 1,
         "sent": sum(g["sent"] for g in got), "max_w": got[slow_w]["w"], "max_r": got[slow_r]["r"]}
    return [v] * len(got)


__all__ = ["BACKGROUND_NICE", "MemoryTier"]
