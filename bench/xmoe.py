"""X-MoE dispatch on CPU: all-to-all bytes per training step with and without redundancy bypass.

Real training steps of the embedded MoE (the trainer's ``build``, forward/backward, ZeRO-1 AdamW)
on forked gloo ranks, on the trainer's data. Every MoE block counts the rows and payload bytes it
hands to its all-to-alls (:class:`ckpt.trainer.ep.DispatchStats`: forward and the backward they
cause; the tests check these counts against the all-to-alls' real inputs), summed over ranks and
layers and divided by the measured steps. For each EP size and top-k: ``per-expert`` (one row per
(token, expert)) vs ``dedup`` (one row per (token, EP rank)); under TP also with and without
sequence-sharded MoE blocks, with the MoE blocks' TP traffic (all-to-alls sent to other TP ranks,
plus what a ring all-reduce would send for the TP all-reduces). Step time is rank 0's median wall
time of a whole step.

    python -m bench xmoe [--steps 5] [--repeats 3] [--hidden 256] [--experts 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.common import fmt, machine_info, markdown_table, median, print_table
from bench.ranks import gloo_ranks

# (layout, top-k, dispatch, sequence_shard)
CASES: list[tuple[str, int, str, bool]] = [
    (f"ep={ep}", k, d, False) for ep in (2, 4) for k in (2, 4, 8) for d in ("per-expert", "dedup")
] + [("tp=2,ep=2", k, "dedup", s) for k in (2, 8) for s in (False, True)]


def _rank_main(rank: int, world: int, cfg_dict: dict[str, Any], layout: str, steps: int,
               out: str) -> None:
    from ckpt.layout import Layout
    from ckpt.trainer.config import TrainConfig
    from ckpt.trainer.data import SampleSource, rank_batch
    from ckpt.trainer.ep import DispatchStats, ParallelMoEBlock
    from ckpt.trainer.pp import ForwardBackward
    from ckpt.trainer.train import build

    torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(cfg_dict)
    ctx, pm, opt, schedule = build(cfg, Layout.parse(layout))
    blocks = [m for m in pm.module.modules() if isinstance(m, ParallelMoEBlock)]
    src = SampleSource(cfg.seq_len, cfg.seed)
    fb = ForwardBackward(pm, cfg.microbatches, cfg.schedule)
    times = []
    for step in range(steps + 1):  # step 0 warms up and is not counted
        if step == 1:
            for b in blocks:
                b.stats = DispatchStats()
        dist.barrier()
        t0 = time.perf_counter()
        fb(rank_batch(src, step * cfg.global_batch, cfg.global_batch, ctx.data_rank, ctx.data_world))
        opt.step(schedule.lr(step))
        times.append(time.perf_counter() - t0)
    fields = ("rows", "remote_rows", "ep_bytes", "remote_ep_bytes", "tp_bytes", "tp_allreduce_bytes")
    total = torch.tensor([sum(getattr(b.stats, f) for b in blocks) for f in fields], dtype=torch.int64)
    dist.all_reduce(total)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"per_step": {f: int(v) / steps for f, v in zip(fields, total.tolist(), strict=True)},
                       "step_s": median(times[1:])}, f)
    dist.destroy_process_group()


def run_case(cfg_dict: dict[str, Any], layout: str, steps: int) -> dict[str, Any]:
    """One layout and config on forked gloo ranks; per-step sums over ranks and rank 0's step time."""
    from ckpt.layout import Layout

    fd, out = tempfile.mkstemp(prefix="ckpt-bench-xmoe-", suffix=".json")
    os.close(fd)
    try:
        gloo_ranks(Layout.parse(layout).world_size, _rank_main, cfg_dict, layout, steps, out)
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    finally:
        os.unlink(out)
    return result


def run(steps: int, hidden: int, experts: int, seq_len: int, global_batch: int, repeats: int = 1
        ) -> dict[str, Any]:
    """Every case of :data:`CASES`, ``repeats`` times round-robin (fresh ranks each time): the step
    time is the median over repeats of each run's median; the counts are the same in every run."""
    from ckpt.trainer.config import TrainConfig
    from ckpt.trainer.model import CONFIGS

    model = dataclasses.replace(CONFIGS["tiny"], hidden_size=hidden, head_dim=hidden // 4,
                                moe_intermediate_size=hidden // 2, num_experts=experts, num_hidden_layers=2)
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(CASES))}
    for _ in range(repeats):
        for i, (layout, k, dispatch, shard) in enumerate(CASES):
            cfg = TrainConfig(model=dataclasses.replace(model, num_experts_per_tok=k), seq_len=seq_len,
                              global_batch=global_batch, steps=steps + 1, warmup=0, moe_dispatch=dispatch,
                              moe_sequence_shard=shard)
            runs[i].append(run_case(cfg.to_dict(), layout, steps))
    results = []
    for i, (layout, k, dispatch, shard) in enumerate(CASES):
        if any(r["per_step"] != runs[i][0]["per_step"] for r in runs[i]):
            raise RuntimeError(f"{layout} top-{k} {dispatch}: the byte counts differ between repeats")
        res = {"per_step": runs[i][0]["per_step"], "step_s": median([r["step_s"] for r in runs[i]]),
               "step_s_runs": [r["step_s"] for r in runs[i]]}
        results.append({"layout": layout, "top_k": k, "dispatch": dispatch, "sequence_shard": shard, **res})
        label = f"{layout} top-{k} {dispatch}" + (" sequence-sharded" if shard else "")
        print(f"  {label}: {res['per_step']['remote_ep_bytes'] / 1e6:.2f} MB remote a2a/step, "
              f"{res['step_s'] * 1e3:.0f} ms/step", flush=True)
    return {"steps": steps, "repeats": repeats, "hidden": hidden, "experts": experts, "layers": 2, "seq_len": seq_len,
            "global_batch": global_batch, "tokens_per_step": seq_len * global_batch, "results": results,
            "machine": machine_info(tempfile.gettempdir())}


COLUMNS = ["layout", "top-k", "dispatch", "seq-shard", "rows/step", "a2a MB/step", "remote a2a MB/step",
           "TP MB/step", "vs per-expert", "step ms"]


def rows_for(res: dict[str, Any]) -> list[list[str]]:
    """Table rows; ``vs per-expert``: remote a2a bytes over the per-expert run's (same layout, top-k)."""
    base = {(r["layout"], r["top_k"]): r["per_step"]["remote_ep_bytes"] for r in res["results"]
            if r["dispatch"] == "per-expert"}
    rows = []
    for r in res["results"]:
        p = r["per_step"]
        b = base.get((r["layout"], r["top_k"]))
        shard = ("on" if r["sequence_shard"] else "off") if "tp=" in r["layout"] else "-"
        rows.append([r["layout"], str(r["top_k"]), r["dispatch"], shard,
                     f"{p['rows']:.0f}", fmt(p["ep_bytes"] / 1e6, 2), fmt(p["remote_ep_bytes"] / 1e6, 2),
                     fmt((p["tp_bytes"] + p["tp_allreduce_bytes"]) / 1e6, 2),
                     fmt(p["remote_ep_bytes"] / b, 2) if b else "-",
                     fmt(r["step_s"] * 1e3, 0)])
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's options."""
    p.add_argument("--steps", type=int, default=5, help="measured steps per case (after one warm-up step)")
    p.add_argument("--repeats", type=int, default=3, help="runs per case (fresh ranks), round-robin")
    p.add_argument("--hidden", type=int, default=256, help="model width (expert width: half)")
    p.add_argument("--experts", type=int, default=16, help="experts per layer (top-k 8 and ep 4 need 8+)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int:
    """Run every case and print the table (and the markdown for docs/BENCHMARKS.md)."""
    res = run(args.steps, args.hidden, args.experts, args.seq_len, args.global_batch, args.repeats)
    title = (f"MoE all-to-all per step: {res['tokens_per_step']} tokens, hidden {res['hidden']}, "
             f"{res['experts']} experts, 2 layers")
    print_table(title, COLUMNS, rows_for(res))
    print("\n" + markdown_table(COLUMNS, rows_for(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0
