"""The training loop: data -> forward/backward (any layout) -> ZeRO-1 AdamW, with async checkpoints,
resume from the newest committed checkpoint (same or another layout) and fault injection.

One step, on every rank::

    ids = rank_batch(...)            # this rank's samples of the global batch at sample_index
    local = forward_backward(ids)    # pipeline schedule when pp > 1
    handle.staged()                  # the previous async save has copied the state out
    opt.step(lr)                     # reduce grads, clip, AdamW on the ZeRO range, all-gather
    save every N steps (async)       # CheckpointManager: plan now, stage + write in the background
    memory checkpoint every M steps  # copy to host buffers; /dev/shm + a peer node's copy in the background
    log the previous save's figures  # once its handle is done (never waited for): "checkpoint" record

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
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt.async_save import SaveHandle
from ckpt.comm import Comm
from ckpt.errors import CheckpointError, IntegrityError, ManifestError, StorageError
from ckpt.layout import Layout
from ckpt.manager import CheckpointManager
from ckpt.manifest import Manifest
from ckpt.tier import MemoryHandle
from ckpt.tier.nodes import node_identity
from ckpt.tier.restore import clobbered_message
from ckpt.tier.store import pieces_digest
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


def _committed(mgr: CheckpointManager) -> list[tuple[int, str]]:
    # Rank 0 lists (newest first), so that every rank tries the same checkpoints in the same order
    # even if one commits meanwhile.
    comm = Comm(None)
    found = [(c.step, c.url) for c in reversed(mgr.list()) if c.committed] if comm.rank == 0 else None
    return [tuple(x) for x in comm.broadcast(found)] if comm.enabled and comm.world > 1 else (found or [])


@dataclass(slots=True)
class Found:
    """What :func:`_resume` restored: from where (``tier``: ``storage``, ``memory`` or ``memory-peer``),
    the time it took, the newest persistent step skipped as damaged (-1: none) and tier figures."""

    url: str
    resume: Resume
    seconds: float
    skipped: int
    tier: str = "storage"
    detail: dict[str, Any] = field(default_factory=dict)


def _resume_memory(mgr: CheckpointManager, pm: ParallelModel, opt: Any, schedule: Any, cfg: TrainConfig,
                   ctx: ParallelContext, log: MetricsLog, newest: int | None) -> Found | None:
    """The newest complete memory step at or above ``newest`` (the newest persistent step), restored
    on every rank (own copies, else peers' copies; checksums checked), or None; failed sources are
    logged (``restore_failed`` with ``tier: memory``). Collective."""
    tier = mgr.memory
    assert tier is not None
    t = time.perf_counter()

    def failed(rec: dict[str, Any]) -> None:
        log.write(rec)
        if ctx.rank == 0:
            print(f"[rank 0] memory tier: {rec.get('error') or rec.get('notes')}", file=sys.stderr)

    digest = pieces_digest({"model": model_state(pm), "optim": optim_state(opt)})
    got = tier.restore_with(lambda url: restore(url, pm, opt, schedule, cfg, load=tier.load_local), digest=digest,
                            min_step=newest, on_failure=failed)
    if got is None:  # written under another layout: the resharding load, when every piece is reachable
        got = tier.restore_resharded_with(lambda url: restore(url, pm, opt, schedule, cfg, load=tier.load_view),
                                          min_step=newest, on_failure=failed)
    # what the run does not continue from goes (all of it after a resharded restore: another layout's)
    tier.reset(got.step if got is not None and got.tier != "memory-reshard" else None)
    if got is None:
        return None
    pin = tier.pin_stats  # this rank's mapping ahead of the restore: how long, and how much of it waited
    detail = {"peer_ranks": got.peer_ranks, "fetched_bytes": got.fetched_bytes, "memory_bytes": got.bytes,
              "failures": got.failures[:8], "pin_ahead_bytes": pin.get("bytes", 0),
              "pin_ahead_pinned": bool(pin.get("pinned")), "pin_ahead_ms": pin.get("ms", 0.0),
              "pin_ahead_wait_ms": pin.get("wait_ms", 0.0)}
    return Found(got.url, got.value, time.perf_counter() - t, -1, got.tier, detail)


def _resume(mgr: CheckpointManager, pm: ParallelModel, opt: Any, schedule: Any, cfg: TrainConfig,
            ctx: ParallelContext, log: MetricsLog) -> Found | None:
    """Restore the newest checkpoint that every rank restores; None when there is none: the memory
    tier's newest complete step when it is at least as new as storage's (:func:`_resume_memory`),
    else the newest committed persistent checkpoint. Returns what was restored (:class:`Found`).

    A checkpoint that fails on any rank with damaged or missing data (IntegrityError with
    ``verify_restore``, StorageError, ManifestError) is skipped for the next older one, and a
    ``restore_failed`` record says why: a damaged newest checkpoint must not cost the run the good
    one before it. Ranks agree through a one-element all-reduce after each attempt (a load raises
    on one rank only). Raises CheckpointError when every committed checkpoint failed.
    """
    urls = _committed(mgr)
    if mgr.memory is not None:
        found = _resume_memory(mgr, pm, opt, schedule, cfg, ctx, log, urls[0][0] if urls else None)
        if found is not None:
            return found
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
            return Found(url, res, time.perf_counter() - t, skipped)
        skipped = max(skipped, ckpt_step)
        why = f"{type(err).__name__}: {err}" if err is not None else "failed on another rank"
        print(f"[rank {ctx.rank}] cannot restore {url} ({why}); trying an older checkpoint", file=sys.stderr)
        log.write({"event": "restore_failed", "from": url, "error": why, "ranks_failed": int(failed.item())})
    if urls:
        raise CheckpointError(f"{cfg.ckpt_dir}: none of the {len(urls)} committed checkpoint(s) could be restored "
                              "(see the restore_failed records and the errors above); run `ckpt verify --deep` on "
                              "them, or pass verify_restore=False / --no-verify-restore to load them as they are")
    if mgr.memory is not None and mgr.memory.restore_clobbered:
        raise IntegrityError(clobbered_message(mgr.root))
    return None


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


def _log_memory(log: MetricsLog, h: MemoryHandle | None, rank0: bool, *, wait: bool = False) -> MemoryHandle | None:
    """Write the ``memory_checkpoint`` record of ``h`` once its background work is over (``wait``:
    wait for it). Returns ``h`` while it is still running, else None; raises its error."""
    if h is None or not (wait or h.done):
        return h
    mc = h.result()
    log.write(mc.to_record())
    if mc.skipped and rank0:
        print(f"[rank 0] warning: {mc.warning}", file=sys.stderr)
    return None


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
                             max_staging_bytes=cfg.max_staging_bytes, memory_every=cfg.memory_every,
                             replicas=cfg.replicas, memory_keep=cfg.memory_keep, shm_dir=cfg.shm_dir,
                             run_id=cfg.run_id, nodes=cfg.nodes, memory_busy=cfg.memory_busy)


def _barrier(ctx: ParallelContext) -> None:
    # A one-element all-reduce: a barrier on the training group's backend (gloo or NCCL alike).
    all_reduce_(torch.zeros(1, device=ctx.device), ctx.groups["world"])


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
    ctx = build_context(cfg, layout, device)
    # the manager first: its memory tier maps (and pins, on a GPU) this rank's newest memory
    # checkpoint while the model is built, so that a restore reads it in place
    mgr = _manager(cfg)
    memory = mgr.memory if mgr is not None else None
    if memory is not None:
        memory.pin_ahead(ctx.device)
    pm, opt, schedule = build_model(cfg, ctx)
    rank0 = ctx.rank == 0
    prior = _prior(cfg.metrics_file) if rank0 else {}
    log = MetricsLog(cfg.metrics_file, enabled=rank0)
    log.write({"event": "start", "layout": layout.to_dict(), "layout_text": str(layout), "world": layout.world_size,
               "restart": restart_count(), "device": str(ctx.device)})
    node = (memory.node if memory is not None else
            node_identity(ctx.rank, layout.world_size, nodes=cfg.nodes) if cfg.fail_node is not None else 0)
    result = TrainResult(pm=pm, opt=opt)
    step, sample_index = 0, 0
    resume_wall = time.time()
    found = _resume(mgr, pm, opt, schedule, cfg, ctx, log) if mgr is not None else None
    redo_upto = -1  # steps up to this hold checkpoints skipped as damaged: saving them replaces them
    restored_bytes = 0
    if found is not None:
        result.resumed, redo_upto = found.resume, found.skipped
        restore_ms = round(found.seconds * 1e3, 3)
        step, sample_index = result.resumed.step, result.resumed.sample_index
        mine = int(result.resumed.load_stats.get("bytes_read", 0))
        restored_bytes = int(all_reduce_(torch.tensor([float(mine)], dtype=torch.float64, device=ctx.device),
                                         ctx.groups["world"]).item())
        log.write({"event": "resume", "step": step, "from": found.url, "tier": found.tier,
                   "resharded": result.resumed.resharded, "layout_text": str(layout), "restore_ms": restore_ms,
                   **load_fields(result.resumed.load_stats)})
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
    first_step = found is not None  # the recovery record is written once the first step is done
    mem: MemoryHandle | None = None  # the memory checkpoint running in the background
    while step < cfg.last_step:
        if cfg.fail_at_step == step and restart_count() == 0 and (
                node == cfg.fail_node if cfg.fail_node is not None else ctx.rank == cfg.fail_rank):
            mem = _log_memory(log, mem, rank0, wait=True)
            _lose(cfg, ctx, mgr, step, node)
        t0 = time.perf_counter()
        ids = rank_batch(source, sample_index, cfg.global_batch, ctx.data_rank, ctx.data_world).to(ctx.device)
        # Under sp each rank trains on its zigzag slice of the same samples (labels shifted first).
        local = fb(*split_batch(ids, ctx.sp)) if layout.sp > 1 else fb(ids)
        stall = 0.0
        if handle is not None:
            t = time.perf_counter()
            handle.staged()  # the optimizer is about to change what the save is copying
            stall += time.perf_counter() - t
            handle = None
        if mem is not None:
            mem.staged()  # ... and what the memory checkpoint copies (a stream wait: the host goes on)
        lr = schedule.lr(step)
        grad_norm = opt.step(lr)
        step += 1
        sample_index += cfg.global_batch
        schedule.last_step = step
        loss = _global_loss(ctx, local)
        result.losses[step] = loss
        state: dict[str, Any] | None = None  # this step's training state, when a save asked for it
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
        if mgr is not None and mgr.memory_due(step) and step < cfg.last_step:
            t = time.perf_counter()
            # deferred: its device-to-host copies overlap the next forward and backward (mem.staged() above)
            new = mgr.save_memory(step, state or training_state(pm, opt, step, sample_index, schedule),
                                  user_metadata=metadata, layout=layout.to_dict(), deferred=True)
            if not new.busy:  # it started: the previous one (one in flight) is over
                _log_memory(log, mem, rank0, wait=True)
                mem = new
            stall += time.perf_counter() - t
        dt = time.perf_counter() - t0
        log.write({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                   "tokens_per_s": round(cfg.global_batch * cfg.seq_len / dt, 1),
                   "ckpt_stall_ms": round(stall * 1e3, 3), "step_ms": round(dt * 1e3, 3)})
        pending = _log_finished(log, pending, ctx.rank)  # only if it already committed: no waiting
        mem = _log_memory(log, mem, rank0)
        if first_step and found is not None:
            first_step = False
            log.write(_recovery_record(found, prior, resume_wall, dt, restored_bytes))
    if mgr is not None:
        try:
            mgr.wait()  # the last checkpoint is committed before this returns
        finally:
            pending = _log_finished(log, pending, ctx.rank)
        if memory is not None:
            mem = _log_memory(log, mem, rank0, wait=True)
            memory.clear()  # the last step is persistent now: give the shared memory back
    result.final_step = step
    log.write({"event": "end", "step": step, "wall_s": round(time.perf_counter() - t_start, 3)})
    return result
