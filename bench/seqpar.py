"""Sequence parallelism on CPU: per-rank activation memory and step time against sequence length for
sp = 1, 2, 4 (forked gloo ranks, the trainer's tiny MoE, LASP-2H attention), the longest sequence
that fits a fixed per-rank activation budget, and the K/V bytes LASP-2H moves per step vs a ring.

- **activation memory**: the bytes of every tensor autograd saves for backward during one forward
  (``torch.autograd.graph.saved_tensors_hooks``; unique storages, parameters excluded), the largest
  over the ranks. Deterministic, unlike a CPU process's RSS; it is what grows with the sequence.
- **step time**: forward + backward + ZeRO-1 AdamW step, median of ``--repeats`` after one warm-up,
  the slowest rank. The ranks share this machine's cores, so more ranks do not mean more compute.
- **LASP-2H bytes**: counted at the collectives (K/V all-gather forward, reduce-scatter backward),
  received per rank per step. **Ring** (Ring Attention, same zigzag split): ``sp - 1`` steps passing
  a K/V block forward, and in backward ``sp - 1`` steps passing K/V again plus ``sp - 1`` passing
  dK/dV, per layer.

    python -m bench sp [--seq 256,512,1024,2048] [--sp 1,2,4] [--batch 1] [--budget-mib 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from typing import Any

import torch

from bench.common import activation_bytes, fmt, markdown_table, median, print_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", default="256,512,1024,2048", help="sequence lengths (multiples of 2 * max sp)")
    p.add_argument("--sp", default="1,2,4", help="sequence-parallel degrees")
    p.add_argument("--batch", type=int, default=1, help="samples per step (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per point (default 3)")
    p.add_argument("--budget-mib", type=float, default=4.0, help="per-rank activation budget in MiB (default 4)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")


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

    Quadratic because on CPU the attention masks (``local seq x keys``, shared by the layers) grow
    with the square of the sequence under ``sp > 1``.
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
