"""The training loop: data -> forward/backward (any layout) -> ZeRO-1 AdamW, with async checkpoints,
resume from the newest committed checkpoint (same or another layout) and fault injection.

One step, on every rank::

    ids = rank_batch(...)            # this rank's samples of the global batch at sample_index
    local = forward_backward(ids)    # pipeline schedule when pp > 1
    handle.staged()                  # the previous async save has copied the state out
    opt.step(lr)                     # reduce grads, clip, AdamW on the ZeRO range, all-gather
    save every N steps (async)       # CheckpointManager: plan now, stage + write in the background
    log the previous save's figures  # once its handle is done (never waited for): "checkpoint" record

Example::

    result = train(TrainConfig(steps=10), Layout())      # single process
    result.losses[10]                                   # loss of the 10th step
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt.async_save import SaveHandle
from ckpt.comm import Comm
from ckpt.errors import CheckpointError, IntegrityError, ManifestError, StorageError
from ckpt.manager import CheckpointManager
from ckpt.manifest import Manifest
from ckpt.resharders.layout import Layout
from ckpt.trainer.checkpoint import Resume, load_weights, restore, save_metadata, training_state
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.data import SampleSource, rank_batch
from ckpt.trainer.metrics import MetricsLog, load_fields, save_record
from ckpt.trainer.parallel import ParallelContext, all_reduce_, pick_device
from ckpt.trainer.parallelize import ParallelModel, parallelize
from ckpt.trainer.pp import ForwardBackward
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
    cfg.check_layout(layout)
    ctx = ParallelContext.create(layout, device or pick_device(cfg.device))
    torch.manual_seed(cfg.seed)  # nothing random after init, but a defined RNG state for checkpoints
    pm = parallelize(cfg.model, ctx, seed=cfg.seed)
    opt = ZeroAdamW(pm, AdamWConfig(cfg.weight_decay, cfg.beta1, cfg.beta2, cfg.eps, cfg.grad_clip))
    schedule = LRSchedule(cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
    return ctx, pm, opt, schedule


def _committed(mgr: CheckpointManager) -> list[tuple[int, str]]:
    # Rank 0 lists (newest first), so that every rank tries the same checkpoints in the same order
    # even if one commits meanwhile.
    comm = Comm(None)
    found = [(c.step, c.url) for c in reversed(mgr.list()) if c.committed] if comm.rank == 0 else None
    return [tuple(x) for x in comm.broadcast(found)] if comm.enabled and comm.world > 1 else (found or [])


def _resume(mgr: CheckpointManager, pm: ParallelModel, opt: Any, schedule: Any, cfg: TrainConfig,
            ctx: ParallelContext, log: MetricsLog) -> tuple[str, Resume, float, int] | None:
    """Restore the newest committed checkpoint that every rank restores; None when there is none.
    Returns its URL, what was restored, the time it took and the newest step skipped (-1: none;
    the run replaces the skipped checkpoints when it saves those steps again).

    A checkpoint that fails on any rank with damaged or missing data (IntegrityError with
    ``verify_restore``, StorageError, ManifestError) is skipped for the next older one, and a
    ``restore_failed`` record says why: a damaged newest checkpoint must not cost the run the good
    one before it. Ranks agree through a one-element all-reduce after each attempt (a load raises
    on one rank only). Raises CheckpointError when every committed checkpoint failed.
    """
    urls = _committed(mgr)
    skipped = -1
    for ckpt_step, url in urls:
        t = time.perf_counter()
        err: CheckpointError | None = None
        try:
            res: Resume | None = restore(url, pm, opt, schedule, cfg)
        except (IntegrityError, StorageError, ManifestError) as e:
            err, res = e, None
        failed = all_reduce_(torch.tensor([0.0 if err is None else 1.0], device=ctx.device), ctx.groups["world"])
        if float(failed.item()) == 0 and res is not None:
            return url, res, time.perf_counter() - t, skipped
        skipped = max(skipped, ckpt_step)
        why = f"{type(err).__name__}: {err}" if err is not None else "failed on another rank"
        print(f"[rank {ctx.rank}] cannot restore {url} ({why}); trying an older checkpoint", file=sys.stderr)
        log.write({"event": "restore_failed", "from": url, "error": why, "ranks_failed": int(failed.item())})
    if urls:
        raise CheckpointError(f"{cfg.ckpt_dir}: none of the {len(urls)} committed checkpoint(s) could be restored "
                              "(see the restore_failed records and the errors above); run `ckpt verify --deep` on "
                              "them, or pass verify_restore=False / --no-verify-restore to load them as they are")
    return None


def _barrier(ctx: ParallelContext) -> None:
    # A one-element all-reduce: a barrier on the training group's backend (gloo or NCCL alike).
    all_reduce_(torch.zeros(1, device=ctx.device), ctx.groups["world"])


def _global_loss(ctx: ParallelContext, local: torch.Tensor | None) -> float:
    # The mean over data-parallel ranks of their mean losses: the last stage's TP rank 0 of each
    # data-parallel rank contributes, everyone else adds zero.
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
    ctx, pm, opt, schedule = build(cfg, layout, device)
    rank0 = ctx.rank == 0
    log = MetricsLog(cfg.metrics_file, enabled=rank0)
    log.write({"event": "start", "layout": layout.to_dict(), "layout_text": str(layout), "world": layout.world_size,
               "restart": restart_count(), "device": str(ctx.device)})
    mgr = (CheckpointManager(cfg.ckpt_dir, keep_last=cfg.keep_last, async_save=cfg.async_save,
                             max_staging_bytes=cfg.max_staging_bytes)
           if cfg.ckpt_dir else None)
    result = TrainResult(pm=pm, opt=opt)
    step, sample_index = 0, 0
    found = _resume(mgr, pm, opt, schedule, cfg, ctx, log) if mgr is not None else None
    redo_upto = -1  # steps up to this hold checkpoints skipped as damaged: saving them replaces them
    if found is not None:
        latest, result.resumed, restore_s, redo_upto = found
        restore_ms = round(restore_s * 1e3, 3)
        step, sample_index = result.resumed.step, result.resumed.sample_index
        log.write({"event": "resume", "step": step, "from": latest, "resharded": result.resumed.resharded,
                   "layout_text": str(layout), "restore_ms": restore_ms, **load_fields(result.resumed.load_stats)})
    elif cfg.init_from:
        t = time.perf_counter()
        stats = load_weights(cfg.init_from, pm, verify=cfg.verify_restore)
        log.write({"event": "init_from", "step": 0, "from": cfg.init_from,
                   "restore_ms": round((time.perf_counter() - t) * 1e3, 3), **load_fields(stats)})
    result.start_step = step

    source = SampleSource(cfg.seq_len, cfg.seed)
    fb = ForwardBackward(pm, cfg.microbatches, cfg.schedule)
    metadata = save_metadata(cfg, layout)
    handle: SaveHandle | None = None  # the save to wait for (staged) before the next optimizer step
    pending: SaveHandle | None = None  # the async save whose "checkpoint" record is not written yet
    t_start = time.perf_counter()
    while step < cfg.last_step:
        if (cfg.fail_at_step == step and ctx.rank == cfg.fail_rank and restart_count() == 0):
            MetricsLog(cfg.metrics_file).write({"event": "fail", "step": step, "rank": ctx.rank})
            os.kill(os.getpid(), signal.SIGKILL)  # die hard, as a lost node would: no cleanup at all
        t0 = time.perf_counter()
        ids = rank_batch(source, sample_index, cfg.global_batch, ctx.data_rank, ctx.data_world).to(ctx.device)
        local = fb(ids)
        stall = 0.0
        if handle is not None:
            t = time.perf_counter()
            handle.staged()  # the optimizer is about to change what the save is copying
            stall += time.perf_counter() - t
            handle = None
        lr = schedule.lr(step)
        grad_norm = opt.step(lr)
        step += 1
        sample_index += cfg.global_batch
        schedule.last_step = step
        loss = _global_loss(ctx, local)
        result.losses[step] = loss
        if mgr is not None and ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.last_step):
            t = time.perf_counter()
            # Every rank starts a save only once the previous one (and its retention) is over
            # everywhere. The manager itself spares later steps from retention (a rank with a cached
            # plan may create the new step directory before rank 0's lease exists); this barrier
            # keeps save starts aligned anyway, at the cost of one tiny all-reduce per save.
            try:
                mgr.wait()
            finally:
                pending = _log_finished(log, pending, ctx.rank)  # done now (or failed: recorded, then raised)
            _barrier(ctx)
            state = training_state(pm, opt, step, sample_index, schedule)
            t_save = time.perf_counter()
            own: dict[str, float] = {}  # a synchronous save's figures for this rank
            saved = mgr.save(step, state, user_metadata=metadata, layout=layout.to_dict(),
                             overwrite=step <= redo_upto, stats=own)
            t_end = time.perf_counter()
            handle = saved if isinstance(saved, SaveHandle) else None  # None: --sync-save committed it
            stall += t_end - t
            result.last_checkpoint = mgr.url_for(step)
            log.write({"event": "save", "step": step, "url": result.last_checkpoint})
            if handle is not None:
                pending = handle
            elif rank0 and isinstance(saved, Manifest):
                log.write(save_record(step, result.last_checkpoint, ctx.rank, saved, own, async_save=False,
                                      save_s=t_end - t_save))
        dt = time.perf_counter() - t0
        log.write({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                   "tokens_per_s": round(cfg.global_batch * cfg.seq_len / dt, 1),
                   "ckpt_stall_ms": round(stall * 1e3, 3), "step_ms": round(dt * 1e3, 3)})
        pending = _log_finished(log, pending, ctx.rank)  # only if it already committed: no waiting
    if mgr is not None:
        try:
            mgr.wait()  # the last checkpoint is committed before this returns
        finally:
            pending = _log_finished(log, pending, ctx.rank)
    result.final_step = step
    log.write({"event": "end", "step": step, "wall_s": round(time.perf_counter() - t_start, 3)})
    return result
