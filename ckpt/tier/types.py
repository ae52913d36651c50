"""The memory tier's plain types: its settings, what one memory checkpoint did, and the handle of one
running in the background."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ckpt.errors import StateError
from ckpt.tier.pace import check_budget, check_overhead

if TYPE_CHECKING:
    from ckpt._comm import Comm
    from ckpt.tier.store import NodeStore


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Settings of a memory tier; the same on every rank.

    Args:
        root: the persistent checkpoint root of the run (names the run when ``run_id`` is None and
            is recorded for ``ckpt ls``).
        run_id: the run's identity (default ``$CKPT_RUN_ID``, else a hash of ``root``); a tier is
            only restored by a job with the same run id, world size and layout.
        shm_dir: base directory (default ``$CKPT_SHM_DIR``, else ``/dev/shm``).
        node / nodes: this rank's node, or the number of simulated nodes (see
            :func:`ckpt.tier.nodes.node_identity`; default ``$CKPT_NODE`` or torchrun's grouping).
        keep: complete memory checkpoints kept per rank (plus the one being written).
        replicas: copies of each rank's pieces on other nodes (0: none).
        timeout: seconds any wait of the tier may take (a lost peer is named after it).
        lineage: a token of the persistent root's life (``CheckpointManager`` keeps one in
            ``<root>/.ckpt-lineage``): copies written under another token are never restored (a
            new run in an emptied or replaced root). None: not checked.
        busy: what a memory checkpoint due while the previous one still runs does: ``wait`` (the
            training thread waits for it: every due step is checkpointed) or ``skip`` (no wait: the
            step is skipped, and the next memory checkpoint starts at the first due step after the
            previous one finished, agreed by every rank; see :meth:`MemoryTier.save_async`).
        stage_on_device: copy GPU pieces into a device buffer kept across steps first, and from
            there to the host in the background (see :mod:`ckpt.tier.snapshot`): the optimizer step
            waits for a device-to-device copy only, at the price of the state's size in device
            memory. ``$CKPT_TIER_STAGE_ON_DEVICE`` (1 / 0) overrides it.
        max_gbps: a budget, in GB/s per rank, for the background's traffic through host memory (the
            staged snapshot's device-to-host drain and the copies to peers on this host; see
            :mod:`ckpt.tier.pace`); None: full speed. ``$CKPT_TIER_MAX_GBPS`` overrides it. A copy
            to a peer still running at ``timeout`` is abandoned (that memory checkpoint is skipped):
            keep the state's bytes per rank over the budget well below ``timeout``.
        max_overhead: the slowdown of training the tier may cost (a fraction, e.g. 0.05): a
            :class:`ckpt.tier.pace.Governor` then sets the budget from the step times (``max_gbps``
            its ceiling); it starts no memory checkpoint in the first 4 calls, and now and then
            pauses this rank's traffic for 3 steps, to time steps without it. Needs ``busy="skip"``.
            ``$CKPT_TIER_MAX_OVERHEAD`` overrides it.
    """

    root: str
    run_id: str | None = None
    shm_dir: str | None = None
    node: int | None = None
    nodes: int | None = None
    keep: int = 1
    replicas: int = 1
    timeout: float = 120.0
    lineage: str | None = None
    busy: str = "wait"
    stage_on_device: bool = False
    max_gbps: float | None = None
    max_overhead: float | None = None

    def __post_init__(self) -> None:
        if self.busy not in ("wait", "skip"):
            raise StateError(f"memory tier busy={self.busy!r}: use 'wait' (every due step) or 'skip' (never wait "
                             "for the previous memory checkpoint)")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise StateError(f"memory tier keep={self.keep!r}: keep at least 1 complete memory checkpoint")
        if not isinstance(self.replicas, int) or self.replicas < 0:
            raise StateError(f"memory tier replicas={self.replicas!r}: use 0 (no peer copies) or more")
        if not self.timeout > 0:
            raise StateError(f"memory tier timeout={self.timeout!r}: use a positive number of seconds")
        check_budget(self.max_gbps)
        self.governed(check_overhead(self.max_overhead))

    def governed(self, overhead: float | None) -> float | None:
        """``overhead`` (this config's ``max_overhead``, or the environment's), or StateError when it
        is set while ``busy`` is not ``skip``."""
        if overhead is not None and self.busy != "skip":
            raise StateError(f"memory tier max_overhead={overhead!r} needs busy='skip' (with 'wait' training "
                             "waits for every memory checkpoint, so slowing its traffic slows training)")
        return overhead

    def staging(self) -> bool:
        """``stage_on_device``, or ``$CKPT_TIER_STAGE_ON_DEVICE`` when set. Raises StateError for a
        value of it other than 1 / 0 / true / false."""
        env = os.environ.get("CKPT_TIER_STAGE_ON_DEVICE", "").strip().lower()
        if not env:
            return bool(self.stage_on_device)
        if env not in ("1", "0", "true", "false"):
            raise StateError(f"CKPT_TIER_STAGE_ON_DEVICE={env!r}: use 1 or 0")
        return env in ("1", "true")


@dataclass(slots=True)
class MemoryCheckpoint:
    """What one memory checkpoint did. ``complete``: on every rank, copies included; otherwise it
    was skipped (``warning`` says why, ``errors`` per rank). Sizes over all ranks; ``rank_*``
    durations (s) are this rank's, ``max_*`` the slowest rank's."""

    step: int
    complete: bool
    warning: str = ""
    errors: list[str] = field(default_factory=list)
    bytes: int = 0
    replica_bytes: int = 0
    rank_bytes: int = 0
    rank_write_s: float = 0.0
    rank_replicate_s: float = 0.0
    rank_agree_s: float = 0.0
    max_write_s: float = 0.0
    max_replicate_s: float = 0.0
    freed: list[int] = field(default_factory=list)
    busy: bool = False  # skipped because the previous one was still running (busy="skip"): no work done
    busy_skipped: int = 0  # due steps skipped that way since the previous memory checkpoint
    rank_wait_s: float = 0.0  # the training thread waiting for the previous memory checkpoint
    rank_snapshot_s: float = 0.0  # the training thread copying its pieces into host buffers
    snapshot_bytes: int = 0
    budget_gbps: float | None = None  # this rank's budget when it ended (None: full speed)
    overhead: float | None = None  # this rank's governor's last measured slowdown (None: no governor, or not yet)

    @property
    def skipped(self) -> bool:
        return not self.complete

    def to_record(self) -> dict[str, Any]:
        """The ``memory_checkpoint`` metrics record (durations in ms)."""
        ms = lambda s: round(s * 1e3, 3)  # noqa: E731
        rec: dict[str, Any] = {"event": "memory_checkpoint", "step": self.step, "complete": self.complete,
                               "skipped": self.skipped, "bytes": self.bytes, "replica_bytes": self.replica_bytes,
                               "write_ms": ms(self.rank_write_s), "replicate_ms": ms(self.rank_replicate_s),
                               "agree_ms": ms(self.rank_agree_s), "max_write_ms": ms(self.max_write_s),
                               "max_replicate_ms": ms(self.max_replicate_s), "wait_ms": ms(self.rank_wait_s),
                               "snapshot_ms": ms(self.rank_snapshot_s), "busy_skipped": self.busy_skipped}
        if self.budget_gbps is not None:
            rec["budget_gbps"] = round(self.budget_gbps, 3)
        if self.overhead is not None:
            rec["overhead"] = round(self.overhead, 4)
        if self.skipped:
            rec["warning"] = self.warning
            rec["errors"] = self.errors[:8]
        return rec


class MemoryHandle:
    """A memory checkpoint started by :meth:`MemoryTier.save_async`. ``wait_s`` / ``snapshot_s``: how
    long the training thread waited for the previous one and copied its pieces (its whole stall)."""

    def __init__(self, step: int, *, wait_s: float = 0.0, snapshot_s: float = 0.0):
        self.step, self.wait_s, self.snapshot_s = step, wait_s, snapshot_s
        self.error: BaseException | None = None
        self._result: MemoryCheckpoint | None = None
        self._done = threading.Event()
        self._error_seen = False
        self.reported: int | None = None  # the training step this rank reported in the agreement
        self.busy = False
        self._snapshot: Any = None  # the ckpt.tier.snapshot.Snapshot being written

    def staged(self) -> None:
        """For ``save_async(..., deferred=True)``: make the current CUDA stream wait for this memory
        checkpoint's device-to-host copies. Call it on the training thread before changing the saved
        tensors in place (e.g. before ``optimizer.step()``); it never blocks the host. Idempotent."""
        if self._snapshot is not None:
            self._snapshot.staged()

    @classmethod
    def skipped_busy(cls, step: int) -> MemoryHandle:
        """A handle for a due step skipped because the previous memory checkpoint still runs."""
        h = cls(step)
        h.busy = True
        h._result = MemoryCheckpoint(step, False, busy=True, warning="the previous memory checkpoint is still running")
        h._done.set()
        return h

    @property
    def done(self) -> bool:
        """Whether the background work has finished (completed, skipped or failed)."""
        return self._done.is_set()

    def result(self) -> MemoryCheckpoint:
        """Wait for the background work; its :class:`MemoryCheckpoint`, or raise its error."""
        self._done.wait()
        if self.error is not None:
            self._error_seen = True
            raise self.error
        assert self._result is not None
        return self._result


class TierView(Protocol):
    """What the restore paths (:mod:`ckpt.tier.restore`, :mod:`ckpt.tier.reshard`) use of a
    :class:`~ckpt.tier.tier.MemoryTier`: declared here so that they need not import the tier that
    calls them (the tier module stays above its restore paths)."""

    config: TierConfig
    timeout: float
    run_id: str
    base: str
    pg: Any
    comm: Comm
    rank: int
    world: int
    nodes: list[int]
    node: int
    hosts: list[Any]
    senders: list[list[int]]
    store: NodeStore
    restore_clobbered: bool
    copy_options: dict[str, Any]  # exchange's keywords for copies between ranks of one host (ckpt.tier.localcopy)

    def drain(self, *, raise_error: bool = False) -> MemoryHandle | None: ...


__all__ = ["TierConfig", "MemoryCheckpoint", "MemoryHandle", "TierView"]
