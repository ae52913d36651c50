"""LASP-2 on forked gloo ranks (CPU): AllGather bytes per linear-attention layer against a ring, and time.

For each sequence-parallel size and sequence length, every rank holds its chunk(s) of q, k, v
(batch x heads x tokens x head_dim, fp32) and runs one lightning-attention layer:

- ``lasp2``: :func:`ckpt.trainer.lasp.lasp2_linear_attention`, forward and forward + backward; its
  collectives' sizes are counted as issued (``CommStats``), on contiguous and zigzag chunks;
- ``ring`` (LASP-1 style): the same layer with the memory state passed rank to rank, ``sp - 1``
  sequential point-to-point hops of one state in the forward (and as many in the backward), timed
  forward only; its bytes are the hops' sizes;
- a ring of K/V chunks (what Ring Attention moves for softmax layers): bytes only, computed.

Bytes are tensor sizes per layer and rank (not wire bytes: a ring all-gather algorithm moves the
gathered size minus one's own share into each rank). Times are medians over ``--repeats`` runs,
ranks synchronized by a barrier before and after; the ranks share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.common import machine_info, markdown_table, median, print_table
from bench.ranks import gloo_ranks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sp", default="2,4", help="comma-separated sequence-parallel sizes (default 2,4)")
    p.add_argument("--seq", default="1024,4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--heads", type=int, default=4, help="heads (default 4)")
    p.add_argument("--head-dim", type=int, default=64, help="head_dim = d_k = d_v (default 64)")
    p.add_argument("--block", type=int, default=64, help="lightning-attention block size (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (default 3)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, block: int,
                  rank: int, world: int) -> torch.Tensor:
    """LASP-1: wait for the previous rank's state, pass on this chunk's, then combine (no autograd)."""
    from ckpt.trainer.hybrid import lightning_attention

    out, local = lightning_attention(q, k, v, slopes, block)
    rate = slopes[:, None, None]
    n = q.shape[2]
    prefix = torch.zeros_like(local)
    if rank > 0:
        dist.recv(prefix, rank - 1)
    if rank < world - 1:
        dist.send((prefix * torch.exp(-rate * n) + local).contiguous(), rank + 1)
    return out + torch.matmul(q * torch.exp(-rate * (torch.arange(n) + 1)[:, None]), prefix)


def _timed(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return median(times)


def _rank(rank: int, world: int, cfg: dict[str, Any], out_path: str) -> None:
    from ckpt.trainer.hybrid import slope_rates
    from ckpt.trainer.lasp import CommStats, chunk_ids, lasp2_linear_attention, shard_sequence

    torch.set_num_threads(1)

    class _G:
        pg, size, index, trivial = dist.group.WORLD, world, rank, False

    h, d, block, reps = cfg["heads"], cfg["head_dim"], cfg["block"], cfg["repeats"]
    slopes = slope_rates(h, 0, 2)
    rows = []
    for n in cfg["seq"]:
        g = torch.Generator().manual_seed(n)
        full = [torch.randn(1, h, n, d, generator=g) * 0.1 for _ in range(3)]
        row: dict[str, Any] = {"sp": world, "seq": n}
        for layout in ("contiguous", "zigzag"):
            q, k, v = (shard_sequence(t, 2, rank, world, layout).requires_grad_() for t in full)
            stats = CommStats()
            lasp2_linear_attention(q, k, v, slopes, _G(), block_size=block, layout=layout, stats=stats).sum().backward()
            row[f"{layout}_sent"] = stats.all_gather_sent
            row[f"{layout}_gathered"] = stats.all_gather_received
            row[f"{layout}_reduce_scatter"] = stats.reduce_scatter_bytes
            row[f"{layout}_chunks_per_rank"] = len(chunk_ids(layout, rank, world))

            def fwd(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, layout: str = layout) -> None:
                with torch.no_grad():
                    lasp2_linear_attention(q, k, v, slopes, _G(), block_size=block, layout=layout)

            def fwd_bwd(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, layout: str = layout) -> None:
                lasp2_linear_attention(q, k, v, slopes, _G(), block_size=block, layout=layout).sum().backward()

            row[f"{layout}_fwd_s"] = _timed(fwd, reps)
            row[f"{layout}_fwd_bwd_s"] = _timed(fwd_bwd, reps)
        q, k, v = (shard_sequence(t, 2, rank, world, "contiguous") for t in full)
        row["ring_fwd_s"] = _timed(lambda q=q, k=k, v=v: _ring_forward(q, k, v, slopes, block, rank, world), reps)
        rows.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _run(world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="ckpt-lasp-") as tmp:
        out = os.path.join(tmp, "rows.json")
        gloo_ranks(world, _rank, cfg, out)
        with open(out) as f:
            rows: list[dict[str, Any]] = json.load(f)
            return rows


def _kib(n: float) -> str:
    return f"{n / 1024:.0f}"


def main(args: argparse.Namespace) -> int:
    cfg = {"seq": [int(x) for x in args.seq.split(",")], "heads": args.heads, "head_dim": args.head_dim,
           "block": args.block, "repeats": args.repeats}
    state = args.heads * args.head_dim * args.head_dim * 4  # one fp32 memory state, batch 1
    results = []
    for sp in (int(x) for x in args.sp.split(",")):
        results += _run(sp, cfg)
    byte_rows, time_rows = [], []
    for r in results:
        sp, n = r["sp"], r["seq"]
        kv_ring = (sp - 1) * 2 * args.heads * (n // sp) * args.head_dim * 4
        byte_rows.append([str(sp), str(n), _kib(r["contiguous_sent"]), _kib(r["contiguous_gathered"]),
                          _kib(r["zigzag_sent"]), _kib(r["zigzag_gathered"]), "1",
                          _kib((sp - 1) * state), str(sp - 1), _kib(kv_ring)])
        time_rows.append([str(sp), str(n), f"{r['contiguous_fwd_s'] * 1e3:.1f}", f"{r['ring_fwd_s'] * 1e3:.1f}",
                          f"{r['zigzag_fwd_s'] * 1e3:.1f}", f"{r['contiguous_fwd_bwd_s'] * 1e3:.1f}",
                          f"{r['zigzag_fwd_bwd_s'] * 1e3:.1f}"])
    byte_cols = ["sp", "seq", "LASP-2 contig sent KiB", "LASP-2 contig gathered KiB", "LASP-2 zigzag sent KiB",
                 "LASP-2 zigzag gathered KiB", "LASP-2 steps", "LASP-1 ring KiB (all hops)", "LASP-1 steps",
                 "K/V ring KiB per rank"]
    time_cols = ["sp", "seq", "LASP-2 contig fwd ms", "LASP-1 ring fwd ms", "LASP-2 zigzag fwd ms",
                 "LASP-2 contig fwd+bwd ms", "LASP-2 zigzag fwd+bwd ms"]
    title = (f"one linear layer, batch 1, {args.heads} heads x d {args.head_dim}, block {args.block}, fp32; "
             f"one state = {_kib(state)} KiB")
    print_table("Bytes per layer per rank (forward; the backward's reduce-scatter equals 'gathered') - " + title,
                byte_cols, byte_rows)
    print_table("Time per layer (median, ms)", time_cols, time_rows)
    print(markdown_table(byte_cols, byte_rows))
    print()
    print(markdown_table(time_cols, time_rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"machine": machine_info(tempfile.gettempdir()), "config": cfg, "rows": results}, f, indent=1)
    return 0
