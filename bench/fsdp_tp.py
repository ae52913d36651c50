"""FSDP2 x TP: forked ranks hold a (dp, tp) model (Colwise / Rowwise linears, ``fully_shard`` on
dp: ``_StridedShard`` placements) plus its AdamW state, as ``get_state_dict`` returns them;
ckpt.save vs dcp.save of that state (and, with ``--async``, ckpt.async_save vs dcp.async_save:
blocking time and time to done), then a resharded load into the same model laid out FSDP-only over
``--load-ranks`` of the ranks (the others load nothing), ckpt.load vs dcp.load; alternating,
medians; bytes on disk of both; dd conv=fdatasync as the disk reference. Every load is checked
bitwise against the saved values (all parameters, gathered).

CPU: gloo ranks (default 4, dp=2 x tp=2, loaded as dp=4). ``--device cuda``: one NCCL rank per GPU
(``--ranks`` GPUs; the parent never touches CUDA before forking), ``--dtype bf16`` for a bf16 model.

    python -m bench fsdp-tp [--size-gb 1.0] [--repeats 3] [--dir DIR] [--json FILE]
    python -m bench fsdp-tp --device cuda --ranks 4 --tp 2 --load-ranks 2 --dtype bf16 --size-gb 8 --async
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist

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
    same_bytes,
    timed_collective,
)
from bench.ranks import gloo_ranks

DIM = 1024


class _Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(DIM, hidden)
        self.down = torch.nn.Linear(hidden, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _initial(layers: int, hidden: int, device: str, dtype: torch.dtype) -> torch.nn.Sequential:
    """The model's initial values, the same on every rank (built before any sharding)."""
    torch.manual_seed(0)
    with torch.device("meta" if device == "cuda" else "cpu"):  # no host copy of a large GPU model
        model = torch.nn.Sequential(*[_Block(hidden) for _ in range(layers)]).to(dtype)
    if device == "cuda":
        model.to_empty(device="cuda")
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator("cuda").manual_seed(p.numel() % 9973),
                                    device="cuda").to(dtype) * 0.02)
    with torch.no_grad():  # residual scaling (GPT-2): 159 blocks would otherwise overflow bf16, and NaN != NaN
        for blk in model:
            blk.down.weight.mul_(1 / math.sqrt(2 * layers))
    return model


def _model(layers: int, hidden: int, mesh_shape: tuple[int, ...], names: tuple[str, ...], device: str = "cpu",
           dtype: torch.dtype = torch.float32, mesh: Any = None) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _initial(layers, hidden, device, dtype)
    mesh = mesh if mesh is not None else init_device_mesh(device, mesh_shape, mesh_dim_names=names)
    if "tp" in names:
        for blk in model:
            parallelize_module(blk, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for blk in model:
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    # lr 0: the step fills AdamW's state (exp_avg, exp_avg_sq) and leaves the weights at their initial
    # values, which every rank can rebuild on its own: the bitwise check then needs no collective
    # (a _StridedShard full_tensor() is what it would otherwise trust)
    return model, torch.optim.AdamW(model.parameters(), lr=0.0)


def _state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _async_times(start: Any, wait: Any) -> tuple[float, float]:
    """(blocking, done) seconds of an async save, the slowest rank's."""
    import time

    dist.barrier()
    t0 = time.perf_counter()
    h = start()
    t1 = time.perf_counter()
    wait(h)
    t2 = time.perf_counter()
    both = torch.tensor([t1 - t0, t2 - t0], dtype=torch.float64, device=_dev())
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return float(both[0]), float(both[1])


def _dev() -> str:
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


def _rank_main(rank: int, world: int, port: int, layers: int, hidden: int, root: str, repeats: int,
               out: str, device: str = "cpu", tp: int = 2, load_ranks: int = 4, dtype: str = "fp32",
               with_async: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1 if device == "cpu" else 4)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    # dcp.async_save needs a CPU backend beside NCCL (it refuses a plain "nccl" group)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    model, opt = _model(layers, hidden, (world // tp, tp), ("dp", "tp"), device, dt)
    model(torch.randn(2, DIM, device=device, dtype=dt)).float().square().mean().backward()  # replicas stay equal
    opt.step()
    # a non-finite weight would make the bitwise check meaningless (and the state unrealistic)
    nonfinite = sum(int((~torch.isfinite(p.to_local())).sum()) for p in model.parameters())
    src = _state(model, opt)
    # FSDP only over the first load_ranks ranks: another mesh (and, with fewer ranks, other GPUs)
    sub = dist.new_group(list(range(load_ranks)))
    if rank < load_ranks:
        lmesh = init_device_mesh(device, (load_ranks,), mesh_dim_names=("dp",)) if load_ranks == world else \
            _sub_mesh(device, sub)
        model2, opt2 = _model(layers, hidden, (load_ranks,), ("dp",), device, dt, mesh=lmesh)
        dst = _state(model2, opt2)
    times: dict[str, list[float]] = {"ckpt save": [], "dcp save": [], "ckpt load": [], "dcp load": []}
    if with_async:
        times.update({"ckpt async blocking": [], "ckpt async done": [], "dcp async blocking": [],
                      "dcp async done": []})
    disk: dict[str, int] = {}
    timed = timed_collective
    want = {k: v.detach().cpu() for k, v in _initial(layers, hidden, device, dt).state_dict().items()}
    mismatches: list[str] = []
    for r in range(repeats):
        for name in ("ckpt", "dcp"):
            d = os.path.join(root, f"{name}-{r}")
            if name == "ckpt":
                times["ckpt save"].append(timed(lambda d=d: ckpt.save(src, d)))
            else:
                times["dcp save"].append(timed(lambda d=d: dcp.save(src, checkpoint_id=d)))
            if with_async:
                a = d + "-async"
                if name == "ckpt":
                    b, t = _async_times(lambda a=a: ckpt.async_save(src, a), lambda h: h.done())
                else:
                    b, t = _async_times(lambda a=a: dcp.async_save(src, checkpoint_id=a), lambda f: f.result())
                times[f"{name} async blocking"].append(b)
                times[f"{name} async done"].append(t)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(a, ignore_errors=True)
            if rank < load_ranks:
                if name == "ckpt":
                    times["ckpt load"].append(_timed_on(sub, lambda d=d: ckpt.load(dst, d, group=sub)))
                else:
                    times["dcp load"].append(_timed_on(sub, lambda d=d: dcp.load(dst, checkpoint_id=d,
                                                                                process_group=sub)))
                for k, v in dst["model"].items():
                    if not same_bytes(v.full_tensor().cpu(), want[k]):
                        mismatches.append(f"{name} {k}")
                for t in dst["model"].values():  # the next load must write every byte again
                    t.to_local().zero_()
            dist.barrier()
            if rank == 0:
                disk[name] = dir_bytes(d)
                shutil.rmtree(d, ignore_errors=True)
    nbytes = sum(t.numel() * t.element_size() for t in _leaves(src))  # global tensors, each once
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bytes": nbytes, "times": times, "disk_bytes": disk, "mismatches": mismatches,
                       "nonfinite": nonfinite, "device": device,
                       "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                       "world": world, "tp": tp, "load_ranks": load_ranks, "dtype": dtype}, f)
    dist.destroy_process_group()


def _sub_mesh(device: str, group: Any) -> Any:
    """A 1-D mesh over an existing group: DeviceMesh(...) on a subset of ranks would create its group
    on those ranks alone, and the per-process group counters (new_group's names) would then differ."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device, mesh_dim_names=("dp",))


def _timed_on(group: Any, fn: Any) -> float:
    """Seconds of ``fn`` on the ranks of ``group``, the slowest one's."""
    import time

    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=_dev())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0])


def _leaves(sd: Any) -> list[Any]:
    from torch.distributed.tensor import DTensor

    if isinstance(sd, dict):
        return [x for v in sd.values() for x in _leaves(v)]
    if isinstance(sd, list):
        return [x for v in sd for x in _leaves(v)]
    return [sd] if isinstance(sd, DTensor) else []


def run(size_gb: float, repeats: int, root: str, device: str = "cpu", ranks: int = 4, tp: int = 2,
        load_ranks: int | None = None, dtype: str = "fp32", with_async: bool = False) -> dict[str, Any]:
    hidden = 4096
    isz = 2 if dtype == "bf16" else 4
    per_layer = (2 * DIM * hidden + hidden + DIM) * isz * 3  # weights + AdamW exp_avg / exp_avg_sq
    layers = max(1, round(size_gb * 1e9 / per_layer))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(root, "result.json")
    # its own group: a CPU backend beside NCCL, for dcp.async_save
    gloo_ranks(ranks, _rank_main, port, layers, hidden, root, repeats, out, device, tp, load_ranks or ranks, dtype,
               with_async, group=False)
    with open(out) as f:
        res = json.load(f)
    dd = run_dd(os.path.join(root, "dd.bin"), count=max(1, int(res["bytes"] / (16 << 20))))
    res.update(layers=layers, repeats=repeats, dd_gbps=dd.gbps, machine=machine_info(root))
    return res


COLUMNS = ["operation", "ckpt s", "ckpt GB/s", "dcp s", "dcp GB/s", "ckpt speed-up"]


def rows_for(res: dict[str, Any]) -> list[list[str]]:
    n = res["bytes"]
    out = []
    for what in ("save", "async blocking", "async done", "load"):
        if f"ckpt {what}" not in res["times"]:
            continue
        c, d = median(res["times"][f"ckpt {what}"]), median(res["times"][f"dcp {what}"])
        out.append([what if what != "load" else "resharded load", fmt(c, 3), fmt(gbps(n, c)), fmt(d, 3),
                    fmt(gbps(n, d)), fmt(d / c, 2)])
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=1.0, help="model + AdamW state, fp32 (default 1.0)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    # never "auto": asking CUDA in the parent breaks the forked ranks
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one NCCL rank per GPU")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the saved mesh (dp = ranks / tp)")
    p.add_argument("--load-ranks", type=int, default=None, help="ranks of the FSDP-only load mesh (default: all)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--async", dest="with_async", action="store_true", help="also ckpt.async_save vs dcp.async_save")


def main(args: argparse.Namespace) -> int:
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-fsdptp-")
    os.makedirs(root, exist_ok=True)
    res = run(args.size_gb, args.repeats, root, args.device, args.ranks, args.tp, args.load_ranks, args.dtype,
              args.with_async)
    title = (f"{res['world']} {res['device']} ranks ({res.get('gpu') or 'gloo'}) FSDP2 x TP "
             f"(dp={res['world'] // res['tp']}, tp={res['tp']}) saved; loaded as FSDP dp={res['load_ranks']}")
    print_table(title, COLUMNS, rows_for(res))
    print("bitwise: " + ("every loaded parameter equals the saved one" if not res["mismatches"]
                         else f"MISMATCHES {res['mismatches'][:6]}")
          + (f"; {res['nonfinite']} non-finite weights on rank 0" if res.get("nonfinite") else ""))
    n = res["bytes"]
    print(f"state {n / 1e9:.2f} GB in {res['layers']} layers; on disk: ckpt {res['disk_bytes']['ckpt'] / 1e9:.3f} GB, "
          f"dcp {res['disk_bytes']['dcp'] / 1e9:.3f} GB; dd conv=fdatasync {res['dd_gbps']:.2f} GB/s; "
          f"ckpt save = {gbps(n, median(res['times']['ckpt save'])) / res['dd_gbps']:.2f}x dd")
    print("\n" + markdown_table(COLUMNS, rows_for(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0
