"""A DCP checkpoint read two ways: saved by ``dcp.save`` on 4 forked gloo ranks (a DTensor state,
``Shard(0)``), then loaded resharded on 3 ranks as ``Shard(1)`` by ``dcp.load`` and by
``ckpt.load`` (which reads DCP directories in place), alternating, warm and cold page cache,
medians; dd conv=fdatasync and a plain ``cat`` of the files as the disk references.

    python -m bench dcp-source [--size-gb 2] [--tensors 100] [--repeats 3] [--save-ranks 4]
                               [--load-ranks 3] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import ckpt
from bench.common import (
    dir_bytes,
    drop_caches,
    fmt,
    gbps,
    machine_info,
    median,
    print_table,
    run_dd,
    timed_collective,
)
from bench.multirank import _shapes
from bench.ranks import gloo_ranks


def _state(world: int, shapes: list[tuple[int, int]], dim: int, fill: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": distribute_tensor(torch.randn(s, generator=g) if fill else torch.zeros(s), mesh,
                                                 [Shard(dim)]) for i, s in enumerate(shapes)}}


def _save_main(rank: int, world: int, shapes: list[tuple[int, int]], d: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dcp.save(_state(world, shapes, 0, True), checkpoint_id=d)
    dist.destroy_process_group()


def _load_main(rank: int, world: int, shapes: list[tuple[int, int]], d: str, repeats: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    cols = _state(world, shapes, 1, False)
    times: dict[str, list[float]] = {k: [] for k in ("dcp warm", "ckpt warm", "dcp cold", "ckpt cold")}
    cold_ok: list[bool] = []
    loads = {"dcp": lambda: dcp.load(cols, checkpoint_id=d), "ckpt": lambda: ckpt.load(cols, d)}
    loads["dcp"]()  # one untimed read each, so that the first warm figure is warm
    for r in range(repeats):
        for name in ("ckpt", "dcp") if r % 2 else ("dcp", "ckpt"):
            times[f"{name} warm"].append(timed_collective(loads[name]))
            if rank == 0:
                cold_ok.append(drop_caches() is None)
            dist.barrier()
            times[f"{name} cold"].append(timed_collective(loads[name]))
        if r == 0:  # both gave the columns of what was saved
            ref = _state(world, shapes[:1], 0, True)["model"]["w0"].full_tensor()
            assert torch.equal(cols["model"]["w0"].full_tensor(), ref), "resharded load differs"
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "cold_cache_dropped": all(cold_ok)}, f)
    dist.destroy_process_group()


def run(size_gb: float, n: int, repeats: int, root: str, save_ranks: int, load_ranks: int) -> dict[str, Any]:
    shapes = _shapes(int(size_gb * 1e9), n)
    d = os.path.join(root, "dcp")
    t0 = time.perf_counter()
    gloo_ranks(save_ranks, _save_main, shapes, d)
    save_s = time.perf_counter() - t0
    out = os.path.join(root, "result.json")
    gloo_ranks(load_ranks, _load_main, shapes, d, repeats, out)
    with open(out) as f:
        res = json.load(f)
    nbytes = sum(math.prod(s) * 4 for s in shapes)
    drop_caches()
    t0 = time.perf_counter()
    for name in os.listdir(d):  # the files read once, sequentially, cold: the disk's own figure
        with open(os.path.join(d, name), "rb") as f:
            while f.read(16 << 20):
                pass
    read_s = time.perf_counter() - t0
    dd = run_dd(os.path.join(root, "dd.bin"), count=max(1, int(nbytes / (16 << 20))))
    res.update(bytes=nbytes, disk_bytes=dir_bytes(d), tensors=n, repeats=repeats, save_ranks=save_ranks,
               load_ranks=load_ranks, dcp_save_s=save_s, cold_read_s=read_s, dd_gbps=dd.gbps,
               machine=machine_info(root))
    return res


COLUMNS = ["load on 3 ranks", "ckpt s", "ckpt GB/s", "dcp s", "dcp GB/s", "ckpt speed-up"]


def rows_for(res: dict[str, Any]) -> list[list[str]]:
    n, out = res["bytes"], []
    for what in ("warm", "cold"):
        c, d = median(res["times"][f"ckpt {what}"]), median(res["times"][f"dcp {what}"])
        out.append([what, fmt(c, 3), fmt(gbps(n, c)), fmt(d, 3), fmt(gbps(n, d)), fmt(d / c, 2)])
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--save-ranks", type=int, default=4)
    p.add_argument("--load-ranks", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int:
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-dcpsrc-")
    os.makedirs(root, exist_ok=True)
    res = run(args.size_gb, args.tensors, args.repeats, root, args.save_ranks, args.load_ranks)
    print_table(f"DCP checkpoint saved on {args.save_ranks} ranks (Shard(0)), loaded as Shard(1) on "
                f"{args.load_ranks} ranks", COLUMNS, rows_for(res))
    print(f"state {res['bytes'] / 1e9:.2f} GB ({res['disk_bytes'] / 1e9:.2f} GB on disk); cold sequential read of "
          f"the files {res['cold_read_s']:.2f} s ({gbps(res['bytes'], res['cold_read_s']):.2f} GB/s); "
          f"dd conv=fdatasync {res['dd_gbps']:.2f} GB/s; page cache dropped: {res['cold_cache_dropped']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
