"""The training loop: data -> forward/backward (any layout) -> ZeRO-1 AdamW, with async checkpoints,
resume from the newest committed checkpoint (same or another layout) and fault injection.

One step, on every rank::

    ids = rank_batch(...)            # this rank's samples of the global batch at sample_index
    local = forward_backward(ids)    # pipeline schedule when pp > 1
    mgr.maybe_wait_for_staging()     # the saves in flight have copied the state out
    opt.step(lr)                     # reduce grads, clip, AdamW on the ZeRO range, all-gather
    mgr.maybe_save(step, state, last_step=...)  # the manager's policy: every N steps persistent (async),
                                     # every M steps to the memory tier; the last step waits for its commit
    log the previous save's figures  # once its handle is done (never waited for): "checkpoint" record

The trainer holds no checkpoint policy of its own: :class:`ckpt.manager.CheckpointManager` decides
what is due, and ``mgr.restore(..., fallback=True)`` is the whole restart.

Resume takes the newest step complete across tiers: the memory tier (each rank's own copy, else the
copy a peer node keeps, every checksum checked) when it is at least as new as the newest persistent
checkpoint, else storage; a "recovery" record says which tier, how many bytes, how long detection,
restart, restore and the first step took, and how many steps were lost.

Example::

    result = train(TrainConfig(steps=10), Layout())      # single process
    result.losses[10]                                   # loss of the 10th step
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt import Manifest, SaveHandle
from ckpt.layout import Layout
from ckpt.manager import CheckpointManager, Restored, SaveReport, node_of
from ckpt.trainer.checkpoint import (
    Resume,
    load_weights,
    model_state,
    optim_state,
    restore,
    save_metadata,
    training_state,
)
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.data import SampleSource, rank_batch
from ckpt.trainer.metrics import MetricsLog, load_fields, save_record
from ckpt.trainer.parallel import ParallelContext, all_reduce_, pick_device
from ckpt.trainer.parallelize import ParallelModel, parallelize
from ckpt.trainer.pp import ForwardBackward
from ckpt.trainer.sp import split_batch
from ckpt.trainer.zero import AdamWConfig, LRSchedule, ZeroAdamW


@dataclass(slots=True)
class TrainResult:
    """What a call of :func:`train` did on this rank."""

    losses: dict[int, float] = field(default_factory=dict)  # step number (1-based) -> global mean loss
    start_step: int = 0
    final_step: int = 0
    resumed: Resume | None = None
    last_checkpoint: str | None = None
    pm: ParallelModel | None = None
    opt: ZeroAdamW | None = None


def restart_count() -> int:
    """How many times this job was restarted: by ``ckpt.trainer.launch`` (``CKPT_ATTEMPT``) and by
    torchrun's own restarts when run under plain torchrun (0 outside both)."""
    return int(os.environ.get("CKPT_ATTEMPT", "0")) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def build(cfg: TrainConfig, layout: Layout, device: torch.device | None = None
          ) -> tuple[ParallelContext, ParallelModel, ZeroAdamW, LRSchedule]:
    """Groups, this rank's model piece, its optimizer and the LR schedule (collective)."""
    ctx = build_context(cfg, layout, device)
    return (ctx, *build_model(cfg, ctx))


def build_context(cfg: TrainConfig, layout: Layout, device: torch.device | None = None) -> ParallelContext:
    """This rank's groups under ``layout`` (collective). Raises LayoutError for a layout the config
    cannot run."""
    cfg.check_layout(layout)
    return ParallelContext.create(layout, device or pick_device(cfg.device))


def build_model(cfg: TrainConfig, ctx: ParallelContext) -> tuple[ParallelModel, ZeroAdamW, LRSchedule]:
    """This rank's model piece, its optimizer and the LR schedule under ``ctx`` (collective)."""
    torch.manual_seed(cfg.seed)  # nothing random after init, but a defined RNG state for checkpoints
    pm = parallelize(cfg.model, ctx, seed=cfg.seed, moe_dispatch=cfg.moe_dispatch,
                     moe_sequence_shard=cfg.moe_sequence_shard)
    opt = ZeroAdamW(pm, AdamWConfig(cfg.weight_decay, cfg.beta1, cfg.beta2, cfg.eps, cfg.grad_clip))
    schedule = LRSchedule(cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
    return pm, opt, schedule


@dataclass(slots=True)
class Found:
    """What the restart restored (:class:`ckpt.manager.Restored`) and the trainer's own :class:`Resume`."""

    url: str
    resume: Resume
    seconds: float
    skipped: int
    tier: str = "storage"
    detail: dict[str, Any] = field(default_factory=dict)


def _resume(mgr: CheckpointManager, pm: ParallelModel, opt: Any, schedule: Any, cfg: TrainConfig,
            ctx: ParallelContext, log: MetricsLog) -> Found | None:
    """Restore the newest checkpoint every rank restores, across tiers, skipping damaged persistent
    ones for older ones (:meth:`CheckpointManager.restore` with ``fallback``); None when there is
    none. Failed sources are logged (``restore_failed``). Raises CheckpointError when every
    committed checkpoint failed."""

    def failed(rec: dict[str, Any]) -> None:
        log.write(rec)
        if "tier" in rec:  # the memory tier's (own, peer or resharded copies)
            if ctx.rank == 0:
                print(f"[rank 0] memory tier: {rec.get('error') or rec.get('notes')}", file=sys.stderr)
        else:
            print(f"[rank {ctx.rank}] cannot restore {rec['from']} ({rec['error']}); trying an older checkpoint",
                  file=sys.stderr)

    wanted = {"model": model_state(pm), "optim": optim_state(opt)}  # the pieces this rank restores
    mgr.restore(wanted, loader=lambda url, read: restore(url, pm, opt, schedule, cfg, load=read), fallback=True,
                on_failure=failed)
    got: Restored | None = mgr.restored
    if got is None:
        return None
    return Found(got.url, got.value, got.seconds, got.skipped, got.tier, got.detail)


def _prior(path: str | None) -> dict[str, float]:
    """The previous attempt as the metrics file tells it: its last step, when a rank failed, when the
    launcher saw the attempt end (rank 0, before this attempt writes anything)."""
    out: dict[str, float] = {}
    if not path or not os.path.exists(path):
        return out
    from ckpt.trainer.metrics import read_metrics

    fresh = False  # a new attempt started: its own steps replace the previous attempt's progress
    for r in read_metrics(path):
        if "loss" in r and "event" not in r:
            step = float(r["step"])
            out["last_step"] = step if fresh else max(out.get("last_step", 0), step)
            fresh = False
        elif r.get("event") == "fail":
            out.setdefault("fail_time", float(r["time"]))  # the first rank of a lost node
        elif r.get("event") == "attempt_end":
            out["end_time"] = float(r["time"])
        elif r.get("event") == "start":
            out.pop("fail_time", None)
            out.pop("end_time", None)
            fresh = True
    return out


def _recovery_record(found: Found, prior: dict[str, float], resume_wall: float, first_step_s: float,
                     total_bytes: int) -> dict[str, Any]:
    """The ``recovery`` record (ms): detect = the failure until the launcher saw the attempt end,
    restart = from there (or from the failure, with no launcher) to the restore's start."""
    now = time.time()
    rec: dict[str, Any] = {"event": "recovery", "tier": found.tier, "from": found.url, "step": found.resume.step,
                           "bytes": total_bytes, "restore_ms": round(found.seconds * 1e3, 3),
                           "first_step_ms": round(first_step_s * 1e3, 3), **found.detail}
    if "last_step" in prior:
        rec["steps_lost"] = max(int(prior["last_step"]) - found.resume.step, 0)
    fail, end = prior.get("fail_time"), prior.get("end_time")
    if fail is not None:
        if end is not None and end >= fail:
            rec["detect_ms"] = round((end - fail) * 1e3, 3)
            rec["restart_ms"] = round((resume_wall - end) * 1e3, 3)
        else:
            rec["restart_ms"] = round((resume_wall - fail) * 1e3, 3)  # detection included
        rec["total_ms"] = round((now - fail) * 1e3, 3)
    return rec


def _state_of(pm: ParallelModel, opt: ZeroAdamW, step: int, sample_index: int, schedule: LRSchedule
              ) -> Callable[[], dict[str, Any]]:
    """This step's training state, built only when a checkpoint asks for it."""
    return lambda: training_state(pm, opt, step, sample_index, schedule)


def _log_memory(log: MetricsLog, h: Any, rank0: bool, *, wait: bool = False) -> Any:
    """Write the ``memory_checkpoint`` record of ``h`` (a :class:`ckpt.tier.MemoryHandle` or None)
    once its background work is over (``wait``: wait for it). Returns ``h`` while it is still
    running, else None; raises its error."""
    if h is None or not (wait or h.done):
        return h
    mc = h.result()
    log.write(mc.to_record())
    if mc.skipped and rank0:
        print(f"[rank 0] warning: {mc.warning}", file=sys.stderr)
    return None


class _Records:
    """The metrics records of the checkpoints the manager runs: ``save`` when one starts, then
    ``checkpoint`` (or ``save_failed``) once it is over, and ``memory_checkpoint`` per memory
    checkpoint, each written without waiting for anything the loop does not wait for."""

    def __init__(self, log: MetricsLog, rank: int, result: TrainResult, mgr: CheckpointManager | None):
        self.log, self.rank, self.result, self.mgr = log, rank, result, mgr
        self.pending: SaveHandle | None = None  # the async save whose "checkpoint" record is not written yet
        self.seen: SaveHandle | None = None  # the newest async save this knows of
        self.mem: Any = None  # the memory checkpoint whose record is not written yet

    def saved(self, rep: SaveReport | None) -> None:
        """After ``maybe_save`` returned (``rep``) or raised (None): the previous save is over when a
        save was due (written now), then the new save's records."""
        if rep is None or rep.saved is not None:
            self.pending = _log_finished(self.log, self.pending, self.rank)  # done now (or failed: recorded)
        if rep is None:
            last = self.mgr.last_save if self.mgr is not None else None
            if last is not None and last is not self.seen:  # started, then failed in the last step's wait
                self.seen = _log_finished(self.log, last, self.rank) or last
            return
        if rep.saved is not None and rep.url is not None:
            self.result.last_checkpoint = rep.url
            self.log.write({"event": "save", "step": rep.step, "url": rep.url})
            if isinstance(rep.saved, SaveHandle):
                self.pending = self.seen = rep.saved
            elif self.rank == 0 and isinstance(rep.saved, Manifest):
                self.log.write(save_record(rep.step, rep.url, self.rank, rep.saved, rep.stats, async_save=False,
                                           save_s=rep.save_s))
        if rep.memory is not None:  # it started: the previous one (one in flight) is over
            _log_memory(self.log, self.mem, self.rank == 0, wait=True)
            self.mem = rep.memory

    def poll(self, *, wait: bool = False) -> None:
        """Write the records of what has finished (``wait``: wait for the memory checkpoint)."""
        self.pending = _log_finished(self.log, self.pending, self.rank)
        self.mem = _log_memory(self.log, self.mem, self.rank == 0, wait=wait)


def _lose(cfg: TrainConfig, ctx: ParallelContext, mgr: CheckpointManager | None, step: int, node: int) -> None:
    """Fault injection: die hard, as a lost rank or node would (no cleanup at all). A lost node takes
    its shared memory with it: its memory-tier directory is deleted first. It dies between steps,
    after the memory checkpoint in flight (so the steps lost are exactly defined; kills inside a
    memory checkpoint are the kill harness's, tests/tier/kill_harness.py)."""
    rec: dict[str, Any] = {"event": "fail", "step": step, "rank": ctx.rank}
    if cfg.fail_node is not None:
        rec["node"] = node
        if mgr is not None and mgr.memory is not None:
            shutil.rmtree(mgr.memory.node_dir, ignore_errors=True)
    MetricsLog(cfg.metrics_file).write(rec)
    os.kill(os.getpid(), signal.SIGKILL)


def _manager(cfg: TrainConfig) -> CheckpointManager | None:
    if not cfg.ckpt_dir:
        return None
    return CheckpointManager(cfg.ckpt_dir, keep_last=cfg.keep_last, async_save=cfg.async_save,
                             save_every=cfg.save_every,
                             max_staging_bytes=cfg.max_staging_bytes, memory_every=cfg.memory_every,
                             replicas=cfg.replicas, memory_keep=cfg.memory_keep, shm_dir=cfg.shm_dir,
                             run_id=cfg.run_id, nodes=cfg.nodes, memory_busy=cfg.memory_busy,
                             memory_stage_on_device=cfg.memory_stage_on_device, memory_max_gbps=cfg.memory_max_gbps,
                             memory_max_overhead=cfg.memory_max_overhead)


def _global_loss(ctx: ParallelContext, local: torch.Tensor | None) -> float:
    # The mean over data-parallel ranks of their mean losses: the last stage's TP rank 0 of each
    # data-parallel rank contributes (each sp rank its share of the mean), everyone else adds zero.
    counts = local is not None and ctx.is_last_stage and ctx.coord.tp == 0
    value = float(local) if counts and local is not None else 0.0
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    all_reduce_(t, ctx.groups["world"])
    return float(t) / ctx.data_world


def _log_finished(log: MetricsLog, h: SaveHandle | None, rank: int) -> SaveHandle | None:
    """Write the ``checkpoint`` (or ``save_failed``) record of ``h`` if it has finished; never blocks.

    Returns ``h`` while it is still running (to try again later), else None.
    """
    if h is None or not h.is_done:
        return h
    if not log.path or h.skipped:
        return None
    if h.error is not None:
        log.write({"event": "save_failed", "step": h.step, "url": h.url,
                   "error": f"{type(h.error).__name__}: {h.error}"})
    else:
        log.write(save_record(h.step if h.step is not None else -1, h.url, rank, h.manifest, h.stats,
                              async_save=True))
    return None


def train(cfg: TrainConfig, layout: Layout, *, device: torch.device | None = None) -> TrainResult:
    """Train (or resume) under ``layout`` until ``cfg.last_step``; collective over the world.

    Resumes from the newest committed checkpoint under ``cfg.ckpt_dir`` (resharding when it was
    saved under another layout), else starts from ``cfg.init_from``'s weights, else from init.
    Raises LayoutError when ``layout`` cannot run the config or the world size differs.
    """
    run = _Run(cfg, layout, device)
    run.restore()
    source = SampleSource(cfg.seq_len, cfg.seed)
    fb = ForwardBackward(run.pm, cfg.microbatches, cfg.schedule)
    records = _Records(run.log, run.ctx.rank, run.result, run.mgr)
    t_start = time.perf_counter()
    first_step = run.found is not None  # the recovery record is written once the first step is done
    while run.step < cfg.last_step:
        if run.fault_due():
            records.mem = _log_memory(run.log, records.mem, run.rank0, wait=True)
            _lose(cfg, run.ctx, run.mgr, run.step, run.node)
        dt = run.one_step(source, fb, records)
        records.poll()  # only what is already over: no waiting
        if first_step and run.found is not None:
            first_step = False
            run.log.write(_recovery_record(run.found, run.prior, run.resume_wall, dt, run.restored_bytes))
    records.poll(wait=True)
    run.result.final_step = run.step
    run.log.write({"event": "end", "step": run.step, "wall_s": round(time.perf_counter() - t_start, 3)})
    return run.result


class _Run:
    """One call of :func:`train` on this rank: what it built, and where its loop stands (``step``
    optimizer steps done, ``sample_index`` samples consumed)."""

    def __init__(self, cfg: TrainConfig, layout: Layout, device: torch.device | None):
        self.cfg, self.layout = cfg, layout
        self.ctx = ctx = build_context(cfg, layout, device)
        # the manager first: its memory tier maps (and pins, on a GPU) this rank's newest memory
        # checkpoint while the model is built, so that a restore reads it in place
        self.mgr = _manager(cfg)
        memory = self.mgr.memory if self.mgr is not None else None
        if memory is not None:
            memory.pin_ahead(ctx.device)
        self.pm, self.opt, self.schedule = build_model(cfg, ctx)
        self.rank0 = ctx.rank == 0
        self.prior = _prior(cfg.metrics_file) if self.rank0 else {}
        self.log = MetricsLog(cfg.metrics_file, enabled=self.rank0)
        self.log.write({"event": "start", "layout": layout.to_dict(), "layout_text": str(layout),
                        "world": layout.world_size, "restart": restart_count(), "device": str(ctx.device)})
        self.node = (memory.node if memory is not None else
                     node_of(ctx.rank, layout.world_size, nodes=cfg.nodes) if cfg.fail_node is not None else 0)
        self.result = TrainResult(pm=self.pm, opt=self.opt)
        self.metadata = save_metadata(cfg, layout)
        self.step, self.sample_index = 0, 0
        self.found: Found | None = None
        self.restored_bytes = 0
        self.resume_wall = time.time()

    def restore(self) -> None:
        """Resume from the newest checkpoint (any tier), else load ``init_from``'s weights, else keep
        the initial weights; logs ``resume`` or ``init_from``."""
        cfg, ctx, result = self.cfg, self.ctx, self.result
        self.resume_wall = time.time()
        mgr = self.mgr
        self.found = _resume(mgr, self.pm, self.opt, self.schedule, cfg, ctx, self.log) if mgr is not None else None
        found = self.found
        if found is not None:  # (the manager overwrites the damaged checkpoints it skipped when it saves them again)
            result.resumed = found.resume
            self.step, self.sample_index = found.resume.step, found.resume.sample_index
            mine = int(found.resume.load_stats.get("bytes_read", 0))
            self.restored_bytes = int(all_reduce_(torch.tensor([float(mine)], dtype=torch.float64,
                                                               device=ctx.device), ctx.groups["world"]).item())
            self.log.write({"event": "resume", "step": self.step, "from": found.url, "tier": found.tier,
                            "resharded": found.resume.resharded, "layout_text": str(self.layout),
                            "restore_ms": round(found.seconds * 1e3, 3), **load_fields(found.resume.load_stats)})
        elif cfg.init_from:
            t = time.perf_counter()
            stats = load_weights(cfg.init_from, self.pm, verify=cfg.verify_restore)
            self.log.write({"event": "init_from", "step": 0, "from": cfg.init_from,
                            "restore_ms": round((time.perf_counter() - t) * 1e3, 3), **load_fields(stats)})
        result.start_step = self.step

    def fault_due(self) -> bool:
        """Fault injection: this rank (or its node) dies now, in the first attempt only."""
        cfg = self.cfg
        if cfg.fail_at_step != self.step or restart_count() != 0:
            return False
        return self.node == cfg.fail_node if cfg.fail_node is not None else self.ctx.rank == cfg.fail_rank

    def one_step(self, source: SampleSource, fb: ForwardBackward, records: _Records) -> float:
        """One optimizer step, the checkpoints the manager says are due, and the step's record;
        returns the step's seconds (less the wait for a last commit)."""
        cfg, ctx = self.cfg, self.ctx
        t0 = time.perf_counter()
        ids = rank_batch(source, self.sample_index, cfg.global_batch, ctx.data_rank, ctx.data_world).to(ctx.device)
        # Under sp each rank trains on its zigzag slice of the same samples (labels shifted first).
        local = fb(*split_batch(ids, ctx.sp)) if self.layout.sp > 1 else fb(ids)
        # the optimizer is about to change what the saves in flight are copying
        stall = self.mgr.maybe_wait_for_staging() if self.mgr is not None else 0.0
        lr = self.schedule.lr(self.step)
        grad_norm = self.opt.step(lr)
        self.step += 1
        self.sample_index += cfg.global_batch
        self.schedule.last_step = self.step
        loss = _global_loss(ctx, local)
        self.result.losses[self.step] = loss
        save_stall, commit_wait = self._save(records)
        dt = time.perf_counter() - t0 - commit_wait
        self.log.write({"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                        "tokens_per_s": round(cfg.global_batch * cfg.seq_len / dt, 1),
                        "ckpt_stall_ms": round((stall + save_stall) * 1e3, 3), "step_ms": round(dt * 1e3, 3)})
        return dt

    def _save(self, records: _Records) -> tuple[float, float]:
        """The checkpoints due after this step (the manager's policy); ``(stall, commit wait)`` seconds."""
        if self.mgr is None:
            return 0.0, 0.0
        rep = None
        try:
            rep = self.mgr.maybe_save(self.step, _state_of(self.pm, self.opt, self.step, self.sample_index,
                                                           self.schedule),
                                      last_step=self.step == self.cfg.last_step, user_metadata=self.metadata,
                                      layout=self.layout.to_dict())
            return rep.stall_s, rep.commit_wait_s
        finally:
            records.saved(rep)


__all__ = ["TrainResult", "restart_count", "build", "build_context", "build_model", "Found", "train"]
