"""FSDP2 x TP on CPU: 4 forked gloo ranks hold a (dp=2, tp=2) model (Colwise / Rowwise linears,
``fully_shard`` on dp: ``_StridedShard`` placements) plus its AdamW state, as ``get_state_dict``
returns them; ckpt.save vs dcp.save of that state, then a resharded load into the same model laid
out FSDP-only over 4 ranks (dp=4), ckpt.load vs dcp.load; alternating, medians; bytes on disk of
both; dd conv=fdatasync as the disk reference. Every load is checked against the saved values.

    python -m bench fsdp-tp [--size-gb 1.0] [--repeats 3] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckpt
from bench.common import (
    dir_bytes,
    fmt,
    gbps,
    machine_info,
    markdown_table,
    median,
    print_table,
    run_dd,
    timed_collective,
)

DIM = 1024


class _Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(DIM, hidden)
        self.down = torch.nn.Linear(hidden, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _model(layers: int, hidden: int, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(hidden) for _ in range(layers)])
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if "tp" in names:
        for blk in model:
            parallelize_module(blk, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for blk in model:
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _rank_main(rank: int, world: int, port: int, layers: int, hidden: int, root: str, repeats: int,
               out: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt = _model(layers, hidden, (2, 2), ("dp", "tp"))
    model(torch.randn(2, DIM)).square().mean().backward()  # same batch everywhere: replicas stay equal
    opt.step()
    src = _state(model, opt)
    model2, opt2 = _model(layers, hidden, (4,), ("dp",))  # FSDP only: another layout
    dst = _state(model2, opt2)
    times: dict[str, list[float]] = {"ckpt save": [], "dcp save": [], "ckpt load": [], "dcp load": []}
    disk: dict[str, int] = {}

    timed = timed_collective
    probe = "model.0.up.weight"
    want = src["model"]["0.up.weight"].full_tensor()
    for r in range(repeats):
        for name in ("ckpt", "dcp"):
            d = os.path.join(root, f"{name}-{r}")
            if name == "ckpt":
                times["ckpt save"].append(timed(lambda d=d: ckpt.save(src, d)))
                times["ckpt load"].append(timed(lambda d=d: ckpt.load(dst, d)))
            else:
                times["dcp save"].append(timed(lambda d=d: dcp.save(src, checkpoint_id=d)))
                times["dcp load"].append(timed(lambda d=d: dcp.load(dst, checkpoint_id=d)))
            got = dst["model"]["0.up.weight"].full_tensor()
            assert torch.equal(got, want), f"{name}: resharded load of {probe} differs"
            dist.barrier()
            if rank == 0:
                disk[name] = dir_bytes(d)
                shutil.rmtree(d, ignore_errors=True)
            for t in dst["model"].values():  # the next load must write every byte again
                t.to_local().zero_()
    nbytes = sum(t.numel() * t.element_size() for t in _leaves(src))  # global tensors, each once
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bytes": nbytes, "times": times, "disk_bytes": disk}, f)
    dist.destroy_process_group()


def _leaves(sd: Any) -> list[Any]:
    from torch.distributed.tensor import DTensor

    if isinstance(sd, dict):
        return [x for v in sd.values() for x in _leaves(v)]
    if isinstance(sd, list):
        return [x for v in sd for x in _leaves(v)]
    return [sd] if isinstance(sd, DTensor) else []


def run(size_gb: float, repeats: int, root: str) -> dict[str, Any]:
    hidden = 4096
    per_layer = (2 * DIM * hidden + hidden + DIM) * 4 * 3  # weights + AdamW exp_avg / exp_avg_sq, fp32
    layers = max(1, round(size_gb * 1e9 / per_layer))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(root, "result.json")
    mp.start_processes(_rank_main, args=(4, port, layers, hidden, root, repeats, out), nprocs=4, start_method="fork")
    with open(out) as f:
        res = json.load(f)
    dd = run_dd(os.path.join(root, "dd.bin"), count=max(1, int(res["bytes"] / (16 << 20))))
    res.update(layers=layers, repeats=repeats, dd_gbps=dd.gbps, machine=machine_info(root))
    return res


COLUMNS = ["operation", "ckpt s", "ckpt GB/s", "dcp s", "dcp GB/s", "ckpt speed-up"]


def rows_for(res: dict[str, Any]) -> list[list[str]]:
    n = res["bytes"]
    out = []
    for what in ("save", "load"):
        c, d = median(res["times"][f"ckpt {what}"]), median(res["times"][f"dcp {what}"])
        out.append([what if what == "save" else "resharded load", fmt(c, 3), fmt(gbps(n, c)), fmt(d, 3),
                    fmt(gbps(n, d)), fmt(d / c, 2)])
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=1.0, help="model + AdamW state, fp32 (default 1.0)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int:
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-fsdptp-")
    os.makedirs(root, exist_ok=True)
    res = run(args.size_gb, args.repeats, root)
    print_table("4 ranks FSDP2 x TP (dp=2, tp=2) saved; loaded as FSDP dp=4", COLUMNS, rows_for(res))
    n = res["bytes"]
    print(f"state {n / 1e9:.2f} GB in {res['layers']} layers; on disk: ckpt {res['disk_bytes']['ckpt'] / 1e9:.3f} GB, "
          f"dcp {res['disk_bytes']['dcp'] / 1e9:.3f} GB; dd conv=fdatasync {res['dd_gbps']:.2f} GB/s; "
          f"ckpt save = {gbps(n, median(res['times']['ckpt save'])) / res['dd_gbps']:.2f}x dd")
    print("\n" + markdown_table(COLUMNS, rows_for(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0
