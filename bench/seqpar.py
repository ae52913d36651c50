"""Sequence parallelism on CPU: per-rank activation memory and step time against sequence length for
sp = 1, 2, 4 (forked gloo ranks, the trainer's tiny MoE, LASP-2H attention), the longest sequence
that fits a fixed per-rank activation budget, and the K/V bytes LASP-2H moves per step vs a ring.

- **activation memory**: the bytes of every tensor autograd saves for backward during one forward
  (``torch.autograd.graph.saved_tensors_hooks``; unique storages, parameters excluded), the largest
  over the ranks. Deterministic, unlike a CPU process's RSS; it is what grows with the sequence.
- **step time**: forward + backward + ZeRO-1 AdamW step, median of ``--repeats`` after one warm-up,
  the slowest rank. The ranks share this machine's cores, so more ranks do not mean more compute.
- **LASP-2H bytes**: counted at the collectives (K/V all-gather forward, again in backward since
  layers keep only their local K/V, and the reduce-scatter), received per rank per step. **Ring**
  (Ring Attention, same zigzag split): ``sp - 1`` steps passing a K/V block forward, and in backward
  ``sp - 1`` steps passing K/V again plus ``sp - 1`` passing dK/dV, per layer.
- **longest sequence** (``--longest``): the longest sequence one training
  step fits within a fixed memory per GPU (or per CPU rank), searched by doubling then bisection,
  for each sp, with tokens/s per GPU; written to ``bench/results/sp_longest_<device>.json``.

    python -m bench sp [--seq 256,512,1024,2048] [--sp 1,2,4] [--batch 1] [--budget-mib 4] [--json PATH]
    python -m bench sp --longest [--device cuda] [--sp 1,2,4] [--gib-per-gpu 24] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from typing import Any

import torch

from bench.common import activation_bytes, fmt, markdown_table, median, print_table, write_json_atomic


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", default="256,512,1024,2048", help="sequence lengths (multiples of 2 * max sp)")
    p.add_argument("--sp", default="1,2,4", help="sequence-parallel degrees")
    p.add_argument("--batch", type=int, default=1, help="samples per step (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per point (default 3)")
    p.add_argument("--budget-mib", type=float, default=4.0, help="per-rank activation budget in MiB (default 4)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")
    g = p.add_argument_group("--longest: the longest sequence within a fixed memory per GPU (or CPU rank)")
    g.add_argument("--longest", action="store_true", help="run the longest-sequence search instead of the table")
    g.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per rank, NCCL")
    g.add_argument("--gib-per-gpu", type=float, default=24.0, help="CUDA memory per GPU (default 24)")
    g.add_argument("--config", default=None, help="model config (default 100m on cuda, tiny on cpu)")
    g.add_argument("--experts", type=int, default=None, help="override the config's experts per layer")
    g.add_argument("--top-k", type=int, default=None, help="override the config's experts per token")
    g.add_argument("--start", type=int, default=None, help="first length (default 2 x granule on cuda, granule on cpu)")
    g.add_argument("--granule", type=int, default=None, help="bisection resolution in tokens (2048 cuda, 32 cpu)")
    g.add_argument("--max-seq", type=int, default=1 << 20, help="cap of the search")
    g.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    g.add_argument("--time-budget-s", type=float, default=270.0,
                   help="no new group after this; each sp gets its share (default 270)")
    g.add_argument("--out", default=None, help="JSON path (default bench/results/sp_longest_<device>.json)")


def _rank(rank: int, world: int, seqs: list[int], batch: int, repeats: int, out: str) -> None:
    import time

    import torch.distributed as dist

    import ckpt.trainer.sp as sp_mod
    from ckpt.layout import Layout
    from ckpt.trainer.config import TrainConfig
    from ckpt.trainer.data import SampleSource
    from ckpt.trainer.pp import ForwardBackward
    from ckpt.trainer.train import build

    moved = {"bytes": 0}
    gather, scatter = sp_mod.all_gather_flat, sp_mod.reduce_scatter_flat

    def counted_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
        moved["bytes"] += x.numel() * x.element_size() * (group.size - 1)  # received from the others
        return gather(x, group)

    def counted_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
        moved["bytes"] += x.numel() * x.element_size() * (group.size - 1) // group.size  # ring reduce-scatter
        return scatter(x, group)

    sp_mod.all_gather_flat, sp_mod.reduce_scatter_flat = counted_gather, counted_scatter  # type: ignore[assignment]
    layout = Layout(sp=world, zero=1)
    results = []
    for seq in seqs:
        cfg = TrainConfig(seq_len=seq, global_batch=batch, microbatches=1, device="cpu", warmup=1)
        ctx, pm, opt, _ = build(cfg, layout)
        params = {p.untyped_storage().data_ptr() for p in pm.module.parameters()}
        fb = ForwardBackward(pm, 1)
        ids = SampleSource(seq, 0).batch(0, batch)
        inputs = sp_mod.split_batch(ids, ctx.sp) if world > 1 else (ids, ids)
        _, act = activation_bytes(lambda pm=pm, inputs=inputs: pm.loss_fn(pm.module(inputs[0]), inputs[1]), params)
        opt.zero_grad()
        times = []
        for r in range(repeats + 1):
            moved["bytes"] = 0
            dist.barrier()
            t0 = time.perf_counter()
            fb(*inputs)
            opt.step(1e-4)
            dt = time.perf_counter() - t0
            if r:
                times.append(dt)
        t = torch.tensor([act, median(times), moved["bytes"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        m = cfg.model
        # Ring Attention on the same split: a K/V block per ring step (forward), K/V + dK/dV (backward).
        block = 2 * batch * (seq // world) * m.num_key_value_heads * m.head_dim * 4
        ring = 3 * (world - 1) * block * m.num_hidden_layers
        results.append({"sp": world, "seq": seq, "activation_bytes": int(t[0]), "step_s": float(t[1]),
                        "lasp2h_bytes": int(t[2]), "ring_bytes": ring})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def run(seqs: list[int], sps: list[int], batch: int, repeats: int) -> list[dict[str, Any]]:
    """Every (sp, seq) point; one forked gloo group per sp."""
    from tests.dist_utils import run_ranks

    rows: list[dict[str, Any]] = []
    for sp in sps:
        fd, out = tempfile.mkstemp(prefix="bench-sp-", suffix=".json")
        os.close(fd)
        try:
            run_ranks(sp, _rank, seqs, batch, repeats, out)
            with open(out) as f:
                rows += json.load(f)
        finally:
            os.unlink(out)
    return rows


def largest_fitting(rows: list[dict[str, Any]], sp: int, budget: float) -> tuple[int, int]:
    """(largest measured seq within ``budget`` bytes, the seq where a quadratic least-squares fit of the
    measurements reaches ``budget``, rounded down to a multiple of ``2 * sp``).

    Quadratic so that a term growing with the square of the sequence would show (LASP-2H's blocks
    leave none: its fitted square coefficient is ~0, and ``--longest`` measures instead of fitting).
    """
    import numpy as np

    mine = sorted((r["seq"], r["activation_bytes"]) for r in rows if r["sp"] == sp)
    measured = max((s for s, b in mine if b <= budget), default=0)
    if len(mine) < 3:
        return measured, measured
    c2, c1, c0 = np.polyfit([s for s, _ in mine], [b for _, b in mine], 2)
    roots = [r.real for r in np.roots([c2, c1, c0 - budget]) if abs(r.imag) < 1e-9 and r.real > 0]
    step = 2 * sp  # zigzag: a multiple of 2 * sp
    return measured, int(min(roots, default=0) // step * step)


def main(args: argparse.Namespace) -> int:
    if args.longest:
        return longest_main(args)
    torch.set_num_threads(1)
    seqs = [int(x) for x in args.seq.split(",")]
    sps = [int(x) for x in args.sp.split(",")]
    bad = [s for s in seqs for p in sps if p > 1 and s % (2 * p)]
    if bad:
        raise SystemExit(f"--seq {bad}: every length must be a multiple of 2 * sp for sp in {sps}")
    rows = run(seqs, sps, args.batch, args.repeats)
    mib = 1 << 20
    cols = ["sp", "seq", "activations MiB/rank", "step ms", "LASP-2H KiB/rank", "ring KiB/rank", "ring / LASP-2H"]
    table = [[str(r["sp"]), str(r["seq"]), fmt(r["activation_bytes"] / mib), fmt(r["step_s"] * 1e3, 1),
              fmt(r["lasp2h_bytes"] / 1024, 1), fmt(r["ring_bytes"] / 1024, 1),
              fmt(r["ring_bytes"] / r["lasp2h_bytes"], 2) if r["lasp2h_bytes"] else "-"] for r in rows]
    print_table("sequence parallelism (tiny MoE, CPU gloo ranks)", cols, table)
    budget = args.budget_mib * mib
    fits = [[str(sp), *(str(x) for x in largest_fitting(rows, sp, budget))] for sp in sps]
    fit_cols = ["sp", f"longest measured seq <= {args.budget_mib:g} MiB", "quadratic fit"]
    print_table(f"longest sequence within {args.budget_mib:g} MiB of activations per rank", fit_cols, fits)
    print("\n" + markdown_table(cols, table) + "\n\n" + markdown_table(fit_cols, fits))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "budget_bytes": budget, "batch": args.batch,
                       "threads_per_rank": 1, "cpus": os.cpu_count(), "fits": fits}, f, indent=1)
    return 0 if all(math.isfinite(r["step_s"]) for r in rows) else 1


# ----------------------------------------------------------------------------- --longest


def _longest_rank(rank: int, world: int, device: torch.device, spec: dict[str, Any], out: str) -> None:
    """Search upward from ``spec["lo"]`` (fits) towards ``spec["hi"]`` (fails; None: unknown, so double)
    one training step per length; rank 0 records each try and result. A rank out of memory records
    the length itself and exits (:data:`bench.ranks.OOM_EXIT`); the parent starts a new group."""
    import gc
    import time

    from bench.ranks import OOM_EXIT, cuda_sync, exit_rank
    from ckpt.layout import Layout
    from ckpt.trainer.config import TrainConfig
    from ckpt.trainer.data import SampleSource
    from ckpt.trainer.parallel import all_reduce_
    from ckpt.trainer.pp import ForwardBackward
    from ckpt.trainer.sp import split_batch
    from ckpt.trainer.train import build

    def emit(rec: dict[str, Any], everyone: bool = False) -> None:
        if rank == 0 or everyone:
            with open(out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    cuda = device.type == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["budget_bytes"] / total), device)
        emit({"kind": "device", "name": torch.cuda.get_device_name(device), "total_bytes": total,
              "torch": torch.__version__})
    cfg = TrainConfig.from_dict(spec["config"])
    ctx, pm, opt, _ = build(cfg, Layout(sp=world, zero=1), device)
    params = {p.untyped_storage().data_ptr() for p in pm.module.parameters()}
    fb = ForwardBackward(pm, 1)
    lo, hi, unit = spec["lo"], spec["hi"], spec["granule"]

    def step(seq: int) -> tuple[float, float, float]:
        ids = SampleSource(seq, cfg.seed).batch(0, 1).to(device)
        inputs = split_batch(ids, ctx.sp) if world > 1 else (ids, ids)
        times = []
        for _ in range(2):  # the second step is warm, unless the first is already long
            all_reduce_(torch.zeros(1, device=device), ctx.groups["world"])
            cuda_sync(device)
            t0 = time.perf_counter()
            fb(*inputs)
            opt.step(1e-4)
            cuda_sync(device)
            times.append(time.perf_counter() - t0)
            if times[0] > spec["quick_step_s"]:
                break
        peak = float(torch.cuda.max_memory_allocated(device)) if cuda else 0.0
        act = 0.0 if cuda else float(activation_bytes(lambda: pm.loss_fn(pm.module(inputs[0]), inputs[1]),
                                                      params)[1])
        agreed = torch.tensor([times[-1], peak, act], dtype=torch.float64, device=device)
        all_reduce_(agreed, ctx.groups["world"], torch.distributed.ReduceOp.MAX)
        return float(agreed[0]), float(agreed[1]), float(agreed[2])

    seq = 0
    try:
        while True:
            seq = max(spec["start"], lo * 2) if hi is None else (lo + hi) // 2 // unit * unit
            if seq > spec["max_seq"] or (hi is not None and seq <= lo):
                return
            emit({"kind": "try", "seq": seq})
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            step_s, peak, act = step(seq)
            fits = cuda or act <= spec["budget_bytes"]
            emit({"kind": "fit" if fits else "over", "seq": seq, "step_s": step_s, "peak_bytes": peak,
                  "activation_bytes": act})
            lo, hi = (seq, hi) if fits else (lo, seq)
    except Exception as e:  # noqa: BLE001 - only running out of memory ends a rank quietly
        if not (isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()):
            raise
        emit({"kind": "oom", "seq": seq}, everyone=True)  # rank 0 may be killed before it writes
        exit_rank(OOM_EXIT)


def _device_tag(name: str) -> str:
    """``h100`` from ``NVIDIA H100 80GB HBM3`` (the first model-number-like word), else the name's first word."""
    import re

    found = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name.lower())
    return found.group(1) if found else (name.lower().split() or ["cuda"])[-1]


def longest(args: argparse.Namespace) -> dict[str, Any]:
    """The longest sequence per sp within the memory budget, searched from ``--start`` by doubling,
    then bisection to ``--granule`` tokens; one forked group per sp, restarted after an out of memory."""
    import dataclasses
    import time

    from bench.ranks import OOM_EXIT, fork_ranks
    from ckpt.trainer.config import TrainConfig
    from ckpt.trainer.model import CONFIGS

    cuda = args.device == "cuda"
    model = CONFIGS[args.config or ("100m" if cuda else "tiny")]
    model = dataclasses.replace(model, num_experts=args.experts or model.num_experts,
                                num_experts_per_tok=args.top_k or model.num_experts_per_tok)
    sps = [int(x) for x in args.sp.split(",")]
    granule = args.granule or (2048 if cuda else 32)
    start = args.start or (2 * granule if cuda else granule)
    budget = int(args.gib_per_gpu * 2**30) if cuda else int(args.budget_mib * 2**20)
    if granule % (2 * max(sps)) or start % granule:
        raise SystemExit(f"--granule {granule} must be a multiple of 2 * max sp and divide --start {start}")
    res: dict[str, Any] = {"device": args.device, "gib_per_gpu": budget / 2**30, "longest": {}, "tokens_per_s": {},
                           "memory": "peak allocated (set_per_process_memory_fraction)" if cuda else
                           "bytes autograd saves for backward (CPU)", "model": args.config or model_name(cuda),
                           "model_config": model.to_dict(), "batch_per_rank": 1, "granule": granule,
                           "tokens_per_s_is": "tokens per second per GPU (rank) at the longest length",
                           "step_s": {}, "peak_bytes": {}, "tries": {}}
    t_all = time.perf_counter()
    for i, sp in enumerate(sps):
        cfg = TrainConfig(model=model, seq_len=start, global_batch=1, microbatches=1, device=args.device, warmup=1)
        lo, hi, fits, tried = 0, None, [], []
        deadline = t_all + args.time_budget_s * (i + 1) / len(sps)  # each sp its share: none starves the next
        while time.perf_counter() < deadline and (hi is None or hi - lo > granule):
            fd, out = tempfile.mkstemp(prefix="bench-sp-longest-", suffix=".jsonl")
            os.close(fd)
            spec = {"config": cfg.to_dict(), "lo": lo, "hi": hi, "start": start, "granule": granule,
                    "max_seq": args.max_seq,
                    "budget_bytes": budget, "quick_step_s": 2.0}
            try:
                rc = fork_ranks(sp, _longest_rank, spec, out, device=args.device, threads=args.threads)
                with open(out) as f:
                    recs = [json.loads(line) for line in f if line.strip()]
            finally:
                os.unlink(out)
            for r in recs:
                if r["kind"] == "device":
                    res.update(gpu=r["name"], torch=r["torch"])
            fits += [r for r in recs if r["kind"] == "fit"]
            failed = [r["seq"] for r in recs if r["kind"] in ("over", "oom")]
            if rc == OOM_EXIT:  # the length being tried when a rank ran out (its own record, or rank 0's try)
                failed.append(max(r["seq"] for r in recs if r["kind"] in ("try", "oom")))
            elif rc:
                raise SystemExit(f"sp={sp}: a rank exited with code {rc}")
            tried += [{"seq": r["seq"], "result": r["kind"]} for r in recs if r["kind"] in ("fit", "over", "oom")]
            lo = max([lo, *(r["seq"] for r in fits)])
            hi = min(failed, default=hi)
            print(f"  sp={sp}: fits up to {lo}, fails at {hi}", flush=True)
            if hi is None and rc == 0:
                break  # reached --max-seq
        best = max(fits, key=lambda r: r["seq"], default=None)
        res["longest"][str(sp)] = best["seq"] if best else 0
        res["tokens_per_s"][str(sp)] = best["seq"] / best["step_s"] / sp if best else 0.0
        res["step_s"][str(sp)] = best["step_s"] if best else None
        res["peak_bytes"][str(sp)] = (best["peak_bytes"] if cuda else best["activation_bytes"]) if best else None
        res["tries"][str(sp)] = tried
        res["wall_s"] = time.perf_counter() - t_all
        write_json_atomic(args.out or _default_out(res), res)
    return res


def model_name(cuda: bool) -> str:
    return "100m" if cuda else "tiny"


def _default_out(res: dict[str, Any]) -> str:
    tag = _device_tag(res.get("gpu", "cuda")) if res["device"] == "cuda" else "cpu"
    return os.path.join(os.path.dirname(__file__), "results", f"sp_longest_{tag}.json")


def longest_main(args: argparse.Namespace) -> int:
    res = longest(args)
    base = res["longest"].get(str(min(int(x) for x in args.sp.split(","))), 0) or 1
    gpu = res["device"] == "cuda"
    rows = [[sp, str(n), fmt(n / base, 2), fmt(res["tokens_per_s"][sp], 0),
             fmt((res["peak_bytes"][sp] or 0) / 2 ** (30 if gpu else 20), 2)] for sp, n in res["longest"].items()]
    unit = f"{res['gib_per_gpu']:g} GiB per GPU" if gpu else f"{res['gib_per_gpu'] * 1024:g} MiB of activations/rank"
    cols = ["sp", "longest seq", "x sp=min", "tokens/s per GPU", "GiB at longest" if gpu else "MiB at longest"]
    print_table(f"longest sequence within {unit}", cols, rows)
    print("\n" + markdown_table(cols, rows))
    print(f"wrote {args.out or _default_out(res)} ({res['wall_s']:.0f} s)")
    return 0 if all(res["longest"].values()) else 1
