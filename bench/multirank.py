"""Multi-rank save and resharded load on CPU: 4 forked ranks on a gloo group, a DTensor state
sharded ``Shard(0)`` (rows) saved, then loaded as ``Shard(1)`` (columns), ckpt vs torch DCP
(``dcp.save`` / ``dcp.load``), alternating, medians; dd conv=fdatasync as the disk reference.
Rank 0's ``ckpt.load`` phase figures (plan, read, bytes, ops) go into the JSON too.

    python -m bench multirank [--ranks 4] [--size-gb 2] [--tensors 100] [--repeats 3] [--dir DIR]
                              [--gap BYTES] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import ckpt
from bench.common import (
    drop_caches,
    fmt,
    gbps,
    machine_info,
    markdown_table,
    median,
    print_table,
    run_dd,
    timed_collective,
)
from bench.ranks import gloo_ranks


def _shapes(total: int, n: int) -> list[tuple[int, int]]:
    side = int(math.sqrt(total / 4 / n))
    return [(side + (i % 7) * 8, side - (i % 5) * 8) for i in range(n)]


def _rank_main(rank: int, world: int, shapes: list[tuple[int, int]], root: str, repeats: int,
               gap: int | None, workers: int | None, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g) for s in shapes]
    rows = {f"w{i}": distribute_tensor(t, mesh, [Shard(0)]) for i, t in enumerate(full)}
    cols = {f"w{i}": distribute_tensor(torch.zeros(t.shape), mesh, [Shard(1)]) for i, t in enumerate(full)}
    del full
    nbytes = sum(math.prod(s) * 4 for s in shapes)
    opts: dict[str, Any] = {"max_gap": gap} | ({"workers": workers} if workers else {})
    load_stats: dict[str, list[dict[str, Any]]] = {"warm": [], "cold": []}
    cold_ok: list[bool] = []  # whether the page cache could be dropped before each cold load (root only)

    def ckpt_load(d: str, kind: str) -> None:
        st: dict[str, Any] = {}
        ckpt.load(cols, d, stats=st, **opts)
        load_stats[kind].append(st)
    times: dict[str, list[float]] = {"ckpt save": [], "dcp save": [], "ckpt load": [], "dcp load": [],
                                     "ckpt load cold": [], "dcp load cold": []}

    timed = timed_collective
    for r in range(repeats):
        for name in ("ckpt", "dcp"):
            d = os.path.join(root, f"{name}-{r}")
            if name == "ckpt":
                times["ckpt save"].append(timed(lambda d=d: ckpt.save(rows, d)))
                times["ckpt load"].append(timed(lambda d=d: ckpt_load(d, "warm")))
            else:
                times["dcp save"].append(timed(lambda d=d: dcp.save(rows, checkpoint_id=d)))
                times["dcp load"].append(timed(lambda d=d: dcp.load(cols, checkpoint_id=d)))
            if rank == 0:
                cold_ok.append(drop_caches() is None)
            dist.barrier()
            key = f"{name} load cold"
            if name == "ckpt":
                times[key].append(timed(lambda d=d: ckpt_load(d, "cold")))
            else:
                times[key].append(timed(lambda d=d: dcp.load(cols, checkpoint_id=d)))
            # correctness, once: the column shards hold the rows that were saved
            if r == 0:
                ref = rows["w0"].full_tensor()
                assert torch.equal(cols["w0"].full_tensor(), ref), f"{name}: resharded load differs"
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bytes": nbytes, "times": times, "ckpt_load_stats_rank0": load_stats,
                       "cold_cache_dropped": all(cold_ok)}, f)
    dist.destroy_process_group()


def run(ranks: int, size_gb: float, n: int, repeats: int, root: str, gap: int | None,
        workers: int | None = None) -> dict[str, Any]:
    shapes = _shapes(int(size_gb * 1e9), n)
    out = os.path.join(root, "result.json")
    gloo_ranks(ranks, _rank_main, shapes, root, repeats, gap, workers, out)
    with open(out) as f:
        res = json.load(f)
    dd = run_dd(os.path.join(root, "dd.bin"), count=max(1, int(res["bytes"] / (16 << 20))))
    res.update(ranks=ranks, tensors=n, repeats=repeats, dd_gbps=dd.gbps, machine=machine_info(root), gap=gap,
               workers=workers)
    return res


def rows_for(res: dict[str, Any]) -> list[list[str]]:
    n = res["bytes"]
    out = []
    for what in ("save", "load", "load cold"):
        c, d = median(res["times"][f"ckpt {what}"]), median(res["times"][f"dcp {what}"])
        out.append([what, fmt(c, 3), fmt(gbps(n, c)), fmt(d, 3), fmt(gbps(n, d)), fmt(d / c, 2)])
    return out


COLUMNS = ["operation", "ckpt s", "ckpt GB/s", "dcp s", "dcp GB/s", "ckpt speed-up"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gap", type=int, default=None, help="ckpt.load max_gap (default: ckpt._io.read_gap)")
    p.add_argument("--workers", type=int, default=None, help="ckpt.load workers (default: ckpt.load's)")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int:
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-mr-")
    os.makedirs(root, exist_ok=True)
    res = run(args.ranks, args.size_gb, args.tensors, args.repeats, root, args.gap, args.workers)
    print_table(f"{args.ranks} ranks, DTensor Shard(0) saved, loaded as Shard(1)", COLUMNS, rows_for(res))
    n = res["bytes"]
    c = median(res["times"]["ckpt save"])
    print(f"state {n / 1e9:.2f} GB; dd conv=fdatasync {res['dd_gbps']:.2f} GB/s; ckpt save = "
          f"{gbps(n, c) / res['dd_gbps']:.2f}x dd")
    print("\n" + markdown_table(COLUMNS, rows_for(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0
