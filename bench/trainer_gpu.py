"""The embedded trainer on N ranks (GPUs with NCCL, or CPU gloo ranks): sequence parallelism (sp=1, 2, 4)
and expert parallelism (ep=4, X-MoE ``dedup`` dispatch vs ``per-expert``), issue 20 part 3.

One forked process group per case (ranks joined as torchrun joins them: ``init_distributed``, NCCL on
CUDA), the trainer's own ``build`` / forward-backward / ZeRO-1 AdamW on the trainer's data:

- **throughput** at ``--seq``: ``--warmup`` steps, then ``--steps`` timed steps; step time = the
  slowest rank's wall time of a whole step (CUDA synchronized), median over the timed steps;
  tokens/s = global tokens per step / that median.
- **all-to-all** (ep cases): bytes each rank sends per step to other EP ranks (the dispatch's own
  counters, :class:`ckpt.trainer.ep.DispatchStats`, forward + the backward they cause) and the time
  spent in ``all_to_all_single`` per step (CUDA events around each call on the compute stream, so
  waiting for the slowest peer is included; wall time on CPU), the slowest rank's, median over steps.
  **LASP-2H** (sp cases): the K/V all-gather + reduce-scatter bytes received per rank and their time.
- **peak memory**: ``torch.cuda.max_memory_allocated`` over the timed steps, the largest over ranks
  (weights, grads and optimizer state included); on CPU the bytes of the tensors autograd saves for
  backward in one forward (as ``python -m bench sp``), the largest over ranks.
- **longest sequence** (sp cases): from ``--sweep-start`` doubling up to ``--max-seq``, one step per
  length (two when the first is quick) with a per-GPU memory budget ``--mem-budget-gib``
  (``torch.cuda.set_per_process_memory_fraction``: weights, optimizer and activations together). A rank
  that hits ``torch.OutOfMemoryError`` records it and exits; its peers (possibly blocked in a collective
  with it) are terminated by the parent, so the sweep ends without a hang and the case's results so far
  are kept. On CPU a length "fits" while its activation bytes stay within ``--cpu-budget-mib``.
  Besides the longest measured length, a quadratic fit of peak memory vs length gives the length at
  which the budget is reached.
- **kill + resume**: the same layout trained ``--resume-steps`` steps uninterrupted (sync saves every
  ``--resume-steps / 2``), then again with the last rank SIGKILLed before the last step (fault
  injection, ``fail_at_step``), the group torn down and restarted (``CKPT_ATTEMPT=1``) to resume from
  the newest checkpoint; every tensor of the final checkpoints (model and AdamW state) is compared
  bitwise, and so are the checkpoints written before the kill (a control: if those differ the kernels
  themselves are not run-to-run deterministic). These runs use
  ``torch.use_deterministic_algorithms(True, warn_only=True)`` and ``CUBLAS_WORKSPACE_CONFIG``.

Results are printed as each point is measured and the JSON (``--json``) is rewritten after each case,
so a run cut short still leaves its data.

    python -m bench trainer-gpu --device cuda --ranks 4 --json trainer_gpu.json     # 4 GPUs, ~3-4 min
    python -m bench trainer-gpu --device cpu --quick                               # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any

import torch

from bench.common import activation_bytes, fmt, median, print_tables, write_json_atomic
from bench.ranks import OOM_EXIT, cuda_sync, exit_rank, fork_ranks, in_child, nccl_version, scratch_dir

CASES = ("sp=1", "sp=2", "sp=4", "ep=4 dedup", "ep=4 per-expert")


def case_layout(case: str, ranks: int) -> tuple[str, str]:
    """(layout text, MoE dispatch) of a case on ``ranks`` ranks: the rest of the ranks are data parallel."""
    kind, _, dispatch = case.partition(" ")
    axis, _, size = kind.partition("=")
    n = int(size)
    if axis not in ("sp", "ep") or ranks % n:
        raise SystemExit(f"case {case!r}: needs sp=N or ep=N with N dividing --ranks {ranks}")
    extra = f",{axis}={n}" if n > 1 else ""
    return f"dp={ranks // n}{extra},zero=1", dispatch or "dedup"


# ----------------------------------------------------------------------------- in the ranks


class _Comm:
    """Time and bytes of the collectives a case cares about (patched in this forked rank only)."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        import ckpt.trainer.sp as sp_mod

        self.device = device
        self.events: list[tuple[Any, Any]] = []
        self.a2a_s = 0.0
        self.sp_s = 0.0
        self.sp_events: list[tuple[Any, Any]] = []
        self.sp_bytes = 0
        a2a, gather, scatter = dist.all_to_all_single, sp_mod.all_gather_flat, sp_mod.reduce_scatter_flat

        def timed(fn: Any, events: list[tuple[Any, Any]], attr: str) -> Any:
            def run(*a: Any, **k: Any) -> Any:
                if device.type == "cuda":
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    out = fn(*a, **k)
                    e1.record()
                    events.append((e0, e1))
                    return out
                t = time.perf_counter()
                out = fn(*a, **k)
                setattr(self, attr, getattr(self, attr) + time.perf_counter() - t)
                return out
            return run

        def counted_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
            self.sp_bytes += x.numel() * x.element_size() * (group.size - 1)  # received from the others
            return gather(x, group)

        def counted_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
            self.sp_bytes += x.numel() * x.element_size() * (group.size - 1) // group.size
            return scatter(x, group)

        dist.all_to_all_single = timed(a2a, self.events, "a2a_s")
        sp_mod.all_gather_flat = timed(counted_gather, self.sp_events, "sp_s")  # type: ignore[assignment]
        sp_mod.reduce_scatter_flat = timed(counted_scatter, self.sp_events, "sp_s")  # type: ignore[assignment]

    def reset(self) -> None:
        self.events.clear()
        self.sp_events.clear()
        self.a2a_s = self.sp_s = 0.0
        self.sp_bytes = 0

    def seconds(self) -> tuple[float, float]:
        """(all-to-all seconds, LASP-2H seconds) since the last reset (call after a CUDA sync)."""
        if self.device.type == "cuda":
            return (sum(a.elapsed_time(b) for a, b in self.events) / 1e3,
                    sum(a.elapsed_time(b) for a, b in self.sp_events) / 1e3)
        return self.a2a_s, self.sp_s


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _emit(out: str, rec: dict[str, Any]) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _deterministic(on: bool) -> None:
    torch.use_deterministic_algorithms(on, warn_only=True)


def _train_worker(rank: int, world: int, device: torch.device, cfg_dict: dict[str, Any], layout_text: str,
                  deterministic: bool) -> None:
    """One attempt of the trainer (``train``), as a torchrun worker runs it."""
    from ckpt.layout import Layout
    from ckpt.trainer.config import TrainConfig
    from ckpt.trainer.train import train

    _deterministic(deterministic)
    train(TrainConfig.from_dict(cfg_dict), Layout.parse(layout_text), device=device)


def _case_worker(rank: int, world: int, device: torch.device, spec: dict[str, Any], out: str) -> None:
    import gc

    import torch.distributed as dist

    from ckpt.layout import Layout
    from ckpt.trainer.config import TrainConfig
    from ckpt.trainer.data import SampleSource, rank_batch
    from ckpt.trainer.ep import DispatchStats, ParallelMoEBlock
    from ckpt.trainer.parallel import all_reduce_
    from ckpt.trainer.pp import ForwardBackward
    from ckpt.trainer.sp import split_batch
    from ckpt.trainer.train import build

    layout = Layout.parse(spec["layout"])
    cuda = device.type == "cuda"
    if spec.get("uninterrupted"):  # the reference run of the kill + resume check, first (before any OOM)
        _deterministic(True)
        from ckpt.trainer.train import train

        train(TrainConfig.from_dict(spec["uninterrupted"]), layout, device=device)
        _deterministic(False)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        budget = spec["budget_bytes"]
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
        if rank == 0:
            _emit(out, {"kind": "device", "name": torch.cuda.get_device_name(device), "total_bytes": total,
                        "torch": torch.__version__, "cuda": torch.version.cuda,
                        "nccl": nccl_version()})
    comm = _Comm(device)
    cfg = TrainConfig.from_dict(spec["config"])
    ctx, pm, opt, _ = build(cfg, layout, device)
    world_group = ctx.groups["world"]
    blocks = [m for m in pm.module.modules() if isinstance(m, ParallelMoEBlock)]
    params = {p.untyped_storage().data_ptr() for p in pm.module.parameters()}
    fb = ForwardBackward(pm, 1)
    gb = ctx.data_world * spec["batch_per_rank"]
    step_no = [0]

    def one_step(src: SampleSource) -> float:
        if spec.get("fake_oom_seq") and src.seq_len >= spec["fake_oom_seq"] and rank == world - 1:
            raise torch.OutOfMemoryError("fake out of memory (--fake-oom-seq, a test of the sweep's ending)")
        ids = rank_batch(src, step_no[0] * gb, gb, ctx.data_rank, ctx.data_world).to(device)
        step_no[0] += 1
        all_reduce_(torch.zeros(1, device=device), world_group)  # a barrier on the training backend
        cuda_sync(device)
        t0 = time.perf_counter()
        fb(*split_batch(ids, ctx.sp)) if layout.sp > 1 else fb(ids)
        opt.step(1e-4)
        cuda_sync(device)
        return time.perf_counter() - t0

    def agree_max(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        all_reduce_(t, world_group, dist.ReduceOp.MAX)
        return t.tolist()

    def activations(src: SampleSource) -> int:
        ids = rank_batch(src, 0, gb, ctx.data_rank, ctx.data_world).to(device)
        inputs = split_batch(ids, ctx.sp) if layout.sp > 1 else (ids, ids)
        return activation_bytes(lambda: pm.loss_fn(pm.module(inputs[0]), inputs[1]), params)[1]

    def measure(seq: int, warmup: int, steps: int, kind: str) -> dict[str, Any]:
        src = SampleSource(seq, cfg.seed)
        for _ in range(warmup):
            one_step(src)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for b in blocks:
            b.stats = DispatchStats()
        times, a2a, lasp, lasp_bytes = [], [], [], 0
        for i in range(steps):
            comm.reset()
            times.append(one_step(src))
            a, s = comm.seconds()
            a2a.append(a)
            lasp.append(s)
            lasp_bytes += comm.sp_bytes
            if kind == "sweep" and i == 0 and steps > 1 and agree_max([times[0]])[0] > spec["quick_step_s"]:
                break  # one step is enough for the memory figure: keeps a long sweep within its time
        n = len(times)
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        act = activations(src) if not cuda else 0
        remote = sum(b.stats.remote_ep_bytes for b in blocks) / n
        rows = sum(b.stats.remote_rows for b in blocks) / n
        # per step, the slowest rank: every timed step's wall and comm times, then peaks and bytes
        agreed = agree_max([*times, *a2a, *lasp, float(peak), float(act), remote, lasp_bytes / n])
        t, a2a_t, lasp_t = agreed[:n], agreed[n:2 * n], agreed[2 * n:3 * n]
        peak_all, act_all, remote_max, lasp_max = agreed[3 * n:]
        total = torch.tensor([remote, rows], dtype=torch.float64, device=device)
        all_reduce_(total, world_group)
        step_s = t[-1] if kind == "sweep" else median(t)  # a sweep's second step, when there is one, is warm
        return {"kind": kind, "case": spec["case"], "layout": spec["layout"], "dispatch": spec["dispatch"],
                "seq": seq, "global_batch": gb, "tokens_per_step": gb * seq, "steps": n,
                "step_s": step_s, "step_s_all": t, "tokens_per_s": gb * seq / step_s,
                "a2a_s": median(a2a_t), "a2a_bytes_per_rank_max": remote_max,
                "a2a_bytes_all_ranks": float(total[0]), "a2a_remote_rows_all_ranks": float(total[1]),
                "lasp_s": median(lasp_t), "lasp_bytes_per_rank": lasp_max,
                "peak_bytes": int(peak_all), "activation_bytes": int(act_all)}

    def say(rec: dict[str, Any]) -> None:
        if rank == 0:
            _emit(out, rec)
            print(f"  [{rec['case']}] {rec['kind']} seq {rec['seq']}: {rec['step_s'] * 1e3:.1f} ms/step, "
                  f"{rec['tokens_per_s']:.0f} tok/s, peak {rec['peak_bytes'] / 2**30:.2f} GiB, act "
                  f"{rec['activation_bytes'] / 2**20:.1f} MiB, a2a {rec['a2a_bytes_per_rank_max'] / 1e6:.2f} MB "
                  f"{rec['a2a_s'] * 1e3:.1f} ms, lasp {rec['lasp_bytes_per_rank'] / 1e6:.2f} MB "
                  f"{rec['lasp_s'] * 1e3:.1f} ms", flush=True)

    trying: int | None = None  # the sweep length in progress: a rank out of memory names it itself
    try:
        say(measure(spec["seq"], spec["warmup"], spec["steps"], "throughput"))
        for seq in spec["sweep"]:
            trying = seq
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            if rank == 0:
                _emit(out, {"kind": "sweep_try", "case": spec["case"], "seq": seq})
            rec = measure(seq, 0, spec["sweep_steps"], "sweep")
            say(rec)
            if not cuda and rec["activation_bytes"] > spec["cpu_budget_bytes"]:
                break  # every rank sees the same agreed figure: all stop together
    except Exception as e:  # noqa: BLE001 - only OOM ends a rank quietly; anything else is re-raised
        if not _is_oom(e):
            raise
        print(f"  [{spec['case']}] rank {rank}: out of memory ({str(e).splitlines()[0][:120]}); "
              "ending the case's group", flush=True)
        if trying is not None:  # rank 0's record of this try may never be written: the group ends now
            _emit(out, {"kind": "sweep_try", "case": spec["case"], "seq": trying})
        exit_rank(OOM_EXIT)  # reported as this rank's failure; the launcher terminates the peers (in a collective)


# ----------------------------------------------------------------------------- the parent


def _read(out: str) -> list[dict[str, Any]]:
    if not os.path.exists(out):
        return []
    with open(out) as f:
        return [json.loads(line) for line in f if line.strip()]


def fit_longest(points: list[tuple[int, int]], budget: float, multiple: int) -> int | None:
    """The length where a least-squares quadratic of (length, bytes) reaches ``budget`` (rounded down
    to ``multiple``), or None with fewer than 3 points or no positive root."""
    import numpy as np

    if len(points) < 3:
        return None
    c2, c1, c0 = np.polyfit([s for s, _ in points], [b for _, b in points], 2)
    roots = [r.real for r in np.roots([c2, c1, c0 - budget]) if abs(r.imag) < 1e-9 and r.real > 0]
    if not roots:
        return None
    return int(min(roots) // multiple * multiple)


def _compare(a_url: str, b_url: str) -> dict[str, Any]:
    from tests.trainer.trainer_utils import checkpoint_tensors

    a, b = checkpoint_tensors(a_url), checkpoint_tensors(b_url)
    differ = sorted(k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k]))
    max_abs = max((float((a[k].double() - b[k].double()).abs().max()) for k in differ), default=0.0)
    return {"tensors": len(a), "same_keys": a.keys() == b.keys(), "differ": len(differ),
            "first_differing": differ[:5], "max_abs_diff": max_abs,
            "bitwise": a.keys() == b.keys() and not differ}


def kill_resume(case: str, layout: str, cfg_base: dict[str, Any], root: str, ranks: int, device: str,
                threads: int, uninterrupted_dir: str) -> dict[str, Any]:
    """The killed run (attempt 0 dies at the last step, attempt 1 resumes) vs the uninterrupted one."""
    from ckpt.manager import step_dir
    from ckpt.trainer.metrics import MetricsLog, read_metrics

    steps = cfg_base["steps"]
    save_every = cfg_base["save_every"]
    run = os.path.join(root, "killed")
    cfg = {**cfg_base, "ckpt_dir": run, "fail_at_step": steps - 1, "fail_rank": ranks - 1}
    t = time.perf_counter()
    rc0 = fork_ranks(ranks, _train_worker, cfg, layout, True, device=device, threads=threads,
                     env={"CKPT_ATTEMPT": "0"})
    MetricsLog(os.path.join(run, "metrics.jsonl")).write({"event": "attempt_end", "attempt": 0, "rc": rc0})
    rc1 = fork_ranks(ranks, _train_worker, cfg, layout, True, device=device, threads=threads,
                     env={"CKPT_ATTEMPT": "1"})
    wall = time.perf_counter() - t
    res: dict[str, Any] = {"kind": "resume", "case": case, "layout": layout, "attempt0_rc": rc0, "attempt1_rc": rc1,
                           "fail_at_step": steps - 1, "fail_rank": ranks - 1, "wall_s": wall}
    recs = read_metrics(os.path.join(run, "metrics.jsonl"))
    resumed = [r for r in recs if r.get("event") == "resume"]
    rec = [r for r in recs if r.get("event") == "recovery"]
    res["resumed_from"] = resumed[0]["step"] if resumed else None
    if rec:
        res["recovery"] = {k: rec[0].get(k) for k in ("tier", "step", "bytes", "steps_lost", "restart_ms",
                                                      "restore_ms", "first_step_ms", "total_ms")}
    if rc1 == 0:
        res["final"] = in_child(_compare, os.path.join(uninterrupted_dir, step_dir(steps)),
                                os.path.join(run, step_dir(steps)))
        pre = (steps - 1) // save_every * save_every
        if pre > 0:
            res["before_kill_step"] = pre
            res["before_kill"] = in_child(_compare, os.path.join(uninterrupted_dir, step_dir(pre)),
                                          os.path.join(run, step_dir(pre)))
    res["bitwise"] = bool(res.get("final", {}).get("bitwise"))
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ckpt.trainer.config import TrainConfig
    from ckpt.trainer.model import CONFIGS

    quick = args.quick
    device = args.device
    model_name = args.config or ("tiny" if quick else "100m")
    model = CONFIGS[model_name]
    if args.experts or args.top_k:
        model = dataclasses.replace(model, num_experts=args.experts or model.num_experts,
                                    num_experts_per_tok=args.top_k or model.num_experts_per_tok)
    seq = args.seq or (64 if quick else 4096)
    resume_seq = args.resume_seq or (32 if quick else 1024)
    sweep_start = args.sweep_start or (64 if quick else 4096)
    max_seq = args.max_seq or (512 if quick else 131072)
    cases = [c.strip() for c in args.cases.split(",")] if args.cases else list(CASES)
    resume_cases = set(cases if args.resume_cases is None else
                       [c.strip() for c in args.resume_cases.split(",") if c.strip()])
    budget = int(args.mem_budget_gib * 2**30)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before any rank creates a cuBLAS handle
    result: dict[str, Any] = {"device": device, "ranks": args.ranks, "model": model_name,
                              "parameters": param_count(model), "model_config": model.to_dict(), "seq": seq,
                              "batch_per_rank": args.batch_per_rank, "mem_budget_bytes": budget,
                              "cpu_budget_bytes": int(args.cpu_budget_mib * 2**20), "max_seq": max_seq,
                              "resume_seq": resume_seq, "resume_steps": args.resume_steps, "cases": []}
    t_all = time.perf_counter()
    for case in cases:
        layout, dispatch = case_layout(case, args.ranks)
        if time.perf_counter() - t_all > args.time_budget_s:
            print(f"== {case}: skipped, --time-budget-s {args.time_budget_s:g} spent", flush=True)
            result["cases"].append({"case": case, "layout": layout, "dispatch": dispatch, "skipped": "time budget"})
            continue
        sp = int(case.split()[0].split("=")[1]) if case.startswith("sp=") else 1
        t_case = time.perf_counter()
        print(f"== {case}: layout {layout}, dispatch {dispatch}", flush=True)
        data_world = args.ranks // sp
        base = TrainConfig(model=model, seq_len=seq, global_batch=data_world * args.batch_per_rank, microbatches=1,
                           device=device, moe_dispatch=dispatch, warmup=1, steps=1000)
        need = 5 * 12 * param_count(model)  # four checkpoints of fp32 weights + AdamW state, and slack
        root = scratch_dir("ckpt-bench-trainer-gpu-", need, prefer_shm=not args.no_shm)
        out = os.path.join(root, "results.jsonl")
        spec: dict[str, Any] = {
            "case": case, "layout": layout, "dispatch": dispatch, "config": base.to_dict(), "seq": seq,
            "warmup": args.warmup, "steps": args.steps, "batch_per_rank": args.batch_per_rank,
            "sweep": [] if args.no_sweep or not case.startswith("sp") else
            [s for s in _doubling(sweep_start, max_seq) if s % (2 * sp) == 0],
            "sweep_steps": args.sweep_steps, "quick_step_s": args.quick_step_s, "budget_bytes": budget,
            "cpu_budget_bytes": int(args.cpu_budget_mib * 2**20), "fake_oom_seq": args.fake_oom_seq}
        resume_cfg: dict[str, Any] | None = None
        if case in resume_cases and args.resume_steps >= 2:
            half = max(args.resume_steps // 2, 1)
            resume_cfg = dataclasses.replace(base, seq_len=resume_seq, steps=args.resume_steps, save_every=half,
                                             async_save=False, keep_last=3, warmup=1,
                                             ckpt_dir=os.path.join(root, "uninterrupted")).to_dict()
            spec["uninterrupted"] = resume_cfg
        entry: dict[str, Any] = {"case": case, "layout": layout, "dispatch": dispatch, "sp": sp}
        try:
            rc = fork_ranks(args.ranks, _case_worker, spec, out, device=device, threads=args.threads)
            recs = _read(out)
            entry["exit"] = "ok" if rc == 0 else "out of memory" if rc == OOM_EXIT else f"rank exit code {rc}"
            dev = [r for r in recs if r["kind"] == "device"]
            if dev:
                result["gpu"] = dev[0]
            thr = [r for r in recs if r["kind"] == "throughput"]
            entry["throughput"] = thr[0] if thr else None
            sweep = [r for r in recs if r["kind"] == "sweep"]
            tried = [r["seq"] for r in recs if r["kind"] == "sweep_try"]
            entry["sweep"] = sweep
            if spec["sweep"]:
                mem_key = "peak_bytes" if device == "cuda" else "activation_bytes"
                limit = budget if device == "cuda" else spec["cpu_budget_bytes"]
                fits = [r["seq"] for r in sweep if r[mem_key] <= limit]
                entry["longest_measured"] = max(fits, default=0)
                done = {r["seq"] for r in sweep}
                entry["out_of_memory_at"] = next((s for s in tried if s not in done), None) if rc == OOM_EXIT else None
                entry["first_failed"] = entry["out_of_memory_at"] or next(
                    (r["seq"] for r in sweep if r[mem_key] > limit), None)
                entry["reached_max_seq"] = bool(sweep) and sweep[-1]["seq"] == spec["sweep"][-1] and rc == 0
                entry["longest_fit"] = fit_longest([(r["seq"], r[mem_key]) for r in sweep], limit, 2 * sp)
            if resume_cfg is not None and time.perf_counter() - t_all > args.time_budget_s:
                entry["resume"] = {"error": "skipped: --time-budget-s spent"}
            elif resume_cfg is not None:
                if rc not in (0, OOM_EXIT) or not os.path.isdir(resume_cfg["ckpt_dir"]):
                    entry["resume"] = {"error": "the uninterrupted run did not finish"}
                else:
                    entry["resume"] = kill_resume(case, layout, resume_cfg, root, args.ranks, device, args.threads,
                                                  resume_cfg["ckpt_dir"])
                r = entry["resume"]
                print(f"  [{case}] kill + resume: resumed from step {r.get('resumed_from')}, final checkpoint "
                      f"bitwise {r.get('bitwise')} ({r.get('final', {}).get('differ', '?')} of "
                      f"{r.get('final', {}).get('tensors', '?')} tensors differ), before the kill: "
                      f"{r.get('before_kill', {}).get('bitwise')}", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        entry["wall_s"] = time.perf_counter() - t_case
        result["cases"].append(entry)
        result["wall_s"] = time.perf_counter() - t_all
        if args.json:
            write_json_atomic(args.json, result)
    return result


def param_count(m: Any) -> int:
    """Parameters of a model config (``ModelConfig.num_parameters``)."""
    return int(m.num_parameters())


def _doubling(start: int, stop: int) -> list[int]:
    out, s = [], start
    while s <= stop:
        out.append(s)
        s *= 2
    return out


def tables(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    gpu = res["device"] == "cuda"
    mem_col = "peak GiB/GPU" if gpu else "activations MiB/rank"

    def mem(r: dict[str, Any]) -> str:
        return fmt(r["peak_bytes"] / 2**30, 2) if gpu else fmt(r["activation_bytes"] / 2**20, 2)

    cols = ["case", "layout", "seq", "tokens/step", "step ms", "tokens/s", "a2a MB/step/rank", "a2a ms/step",
            "LASP-2H MB/step/rank", "LASP-2H ms/step", mem_col]
    rows = []
    for c in res["cases"]:
        r = c.get("throughput")
        if not r:
            rows.append([c["case"], c["layout"], "-", "-", "-", "-", "-", "-", "-", "-",
                         c.get("skipped") or c.get("exit", "-")])
            continue
        ep = c["case"].startswith("ep")
        rows.append([c["case"], c["layout"], str(r["seq"]), str(r["tokens_per_step"]), fmt(r["step_s"] * 1e3, 1),
                     fmt(r["tokens_per_s"], 0), fmt(r["a2a_bytes_per_rank_max"] / 1e6, 2) if ep else "-",
                     fmt(r["a2a_s"] * 1e3, 2) if ep else "-",
                     fmt(r["lasp_bytes_per_rank"] / 1e6, 2) if c["sp"] > 1 else "-",
                     fmt(r["lasp_s"] * 1e3, 2) if c["sp"] > 1 else "-", mem(r)])
    out = [("throughput", cols, rows)]
    sweep_rows = [[c["case"], str(r["seq"]), fmt(r["step_s"] * 1e3, 1), fmt(r["tokens_per_s"], 0), mem(r)]
                  for c in res["cases"] for r in c.get("sweep", [])]
    if sweep_rows:
        out.append(("memory against sequence length", ["case", "seq", "step ms", "tokens/s", mem_col], sweep_rows))
        limit = res["mem_budget_bytes"] if gpu else res["cpu_budget_bytes"]
        unit = f"{limit / 2**30:g} GiB per GPU" if gpu else f"{limit / 2**20:g} MiB of activations per rank"
        fit_rows = [[c["case"], str(c.get("longest_measured", "-")), str(c.get("first_failed") or "-"),
                     "yes" if c.get("reached_max_seq") else "no", str(c.get("longest_fit") or "-")]
                    for c in res["cases"] if "longest_measured" in c]
        out.append((f"longest sequence within {unit}",
                    ["case", "longest measured", "first over budget", "reached --max-seq", "quadratic fit"], fit_rows))
    res_rows = []
    for c in res["cases"]:
        r = c.get("resume")
        if not r:
            continue
        rec = r.get("recovery") or {}
        res_rows.append([c["case"], str(r.get("fail_at_step", "-")), str(r.get("resumed_from", "-")),
                         str(r.get("before_kill", {}).get("bitwise", "-")), str(r.get("bitwise", "-")),
                         str(r.get("final", {}).get("tensors", "-")), fmt(rec.get("restore_ms") or float("nan"), 0),
                         r.get("error", "")])
    if res_rows:
        out.append(("kill + resume, same layout (checkpoint tensors vs an uninterrupted run)",
                    ["case", "killed at", "resumed from", "bitwise before kill", "bitwise at end", "tensors",
                     "restore ms", "note"], res_rows))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda: NCCL on one GPU per rank")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="tiny model, short sequences (CPU smoke run)")
    p.add_argument("--config", default=None, help="model config (default 100m; tiny with --quick)")
    p.add_argument("--experts", type=int, default=None, help="override the config's experts per layer")
    p.add_argument("--top-k", type=int, default=None, help="override the config's experts per token")
    p.add_argument("--cases", default=None, help=f"comma-separated, default all: {', '.join(CASES)}")
    p.add_argument("--seq", type=int, default=None, help="sequence length of the throughput runs (4096; 64 quick)")
    p.add_argument("--batch-per-rank", type=int, default=1, help="samples per data-parallel rank and step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps of the throughput runs")
    p.add_argument("--sweep-start", type=int, default=None, help="first length of the memory sweep (4096; 64 quick)")
    p.add_argument("--max-seq", type=int, default=None, help="cap of the memory sweep (131072; 512 quick)")
    p.add_argument("--sweep-steps", type=int, default=2, help="steps per sweep length (1 if the first is slow)")
    p.add_argument("--quick-step-s", type=float, default=2.0, help="a sweep step slower than this is not repeated")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--mem-budget-gib", type=float, default=24.0, help="per-GPU memory budget of the sweep")
    p.add_argument("--cpu-budget-mib", type=float, default=4.0, help="CPU: activation budget per rank of the sweep")
    p.add_argument("--resume-cases", default=None, help="cases with a kill + resume check (default: all; '' none)")
    p.add_argument("--resume-steps", type=int, default=4, help="length of the kill + resume runs (killed at the last)")
    p.add_argument("--resume-seq", type=int, default=None, help="sequence length of those runs (1024; 32 quick)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-shm", action="store_true", help="keep the checkpoints of the resume runs off /dev/shm")
    p.add_argument("--time-budget-s", type=float, default=420.0,
                   help="start no case or kill + resume check after this many seconds (default 420)")
    p.add_argument("--fake-oom-seq", type=int, default=None, help=argparse.SUPPRESS)  # tests: the last rank OOMs
    p.add_argument("--json", default=None, help="write the results here (rewritten after each case)")


def main(args: argparse.Namespace) -> int:
    res = run(args)
    print_tables(tables(res))
    print(f"total wall time {res.get('wall_s', 0):.0f} s", flush=True)
    ok = all(c.get("throughput") and math.isfinite(c["throughput"]["step_s"]) for c in res["cases"])
    return 0 if ok and all(c["resume"].get("bitwise") for c in res["cases"] if "resume" in c) else 1
