"""Probe (issue 33): where one replayed ``ckpt.transfer`` call's time goes, on 2 GPUs (or ``RANKS``).

The MoE of ``bench/transfer_moe.py`` (``SIZE_GB``, default 4) goes ``tp=2 -> ep=2`` in place
(``RANKS=4``: ``tp=2,ep=2 -> tp=4``, the bench's ``same`` layouts), nine
times after three warm calls; each step of the call is marked with the host clock and a CUDA event
on the stream it runs on (no profiler: torch's slows the host path it would measure): each recorded
copy batch (``c('pack', k)`` ...), each posting of messages (``post``), each metadata exchange
(``xchg``), each wait for NCCL (``polled``). Prints, per rank, the medians over the last seven calls
of every mark (host, and the GPU's when it reached the mark) in milliseconds from the call's start
on the first rank to start it (the host's monotonic clock is every rank's: ``start`` is each rank's
lag behind the first), then NCCL's own send/recv of the same bytes alone (``p2p_alone``).

``FINE=1``: marks around the host's steps too. ``TINY=1``: the same structure (as many layers) with
tensors of a few KB (the host alone).

Run: [RANKS=4] [SIZE_GB=8] [TINY=1] [FINE=1] python scripts/probes/transfer_timeline.py
(CUDA only; ``OUT=dir`` keeps one file per rank)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import ckpt
from bench.ranks import fork_ranks
from bench.transfer import raw_baselines
from bench.transfer_moe import _pair_bytes, _state, layers_for, layouts
from ckpt import _comm
from ckpt import _transfer_net as net

SIZE_GB = float(os.environ.get("SIZE_GB", "4"))
FINE = os.environ.get("FINE") == "1"  # marks around the host's steps of the call too
TINY = os.environ.get("TINY") == "1"  # the same 34-layer structure with tensors of a few KB: the host alone
MARKS: list[tuple[str, float, Any]] = []  # (label, host seconds, CUDA event or None)
ON = [False]


def mark(label: str, gpu: bool = True) -> None:
    if ON[0]:
        ev = None
        if gpu:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        MARKS.append((label, time.perf_counter(), ev))


def around(obj: Any, name: str, label: Callable[..., str], gpu_before: bool = False, gpu_after: bool = True) -> None:
    f = getattr(obj, name)

    def g(*a: Any, **k: Any) -> Any:
        mark(label(*a) + ">", gpu=gpu_before)
        out = f(*a, **k)
        mark(label(*a) + "<", gpu=gpu_after)
        return out

    setattr(obj, name, g)


def main(rank: int, world: int, device: torch.device) -> None:
    import bench.transfer_moe as tm
    from bench.transfer_moe import shapes

    layers = layers_for(SIZE_GB, 2)
    if TINY:
        tm.D, tm.F, tm.E = 64, 32, 16
    g = torch.Generator(device=device).manual_seed(0)
    full = {k: torch.randn(s, generator=g, device=device, dtype=torch.bfloat16)
            for k, s in shapes(layers).items()}
    lay = layouts(world)  # (2 ranks: tp=2 -> ep=2; 4: tp=2,ep=2 -> tp=4)
    src = _state(full, lay["same-src"][rank], device, zero=False)
    dst = _state(full, lay["same-dst"][rank], device, zero=True)
    around(net.Program, "copy", lambda self, key, *_: f"c{key}", gpu_before=True)
    around(net.NcclTransport, "post", lambda *_: "post")
    around(_comm.Comm, "exchange", lambda *_: "xchg", gpu_after=False)
    if FINE:  # the host's steps of the call (no GPU marks)
        import importlib

        tr = importlib.import_module("ckpt.transfer")
        for mod, names in [(tr, ["Comm", "run_items", "check_options", "_declaration", "_prepack",
                                 "plan_or_reuse", "_move", "_transport", "_agree", "_commit", "TransferResult"]),
                           (importlib.import_module("ckpt._transfer_front"), ["declared", "fingerprint_of"]),
                           (importlib.import_module("ckpt._transfer_replay"), ["signature", "same_tensors", "replay"]),
                           (net.Program, ["holds"])]:
            for name in names:
                around(mod, name, lambda *_, n=name: n, gpu_after=False)
    poll = net.poll

    def polled(work: Any, deadline: float | None) -> bool:
        out = poll(work, deadline)
        mark("polled")
        return out

    net.poll = polled  # type: ignore[assignment]
    res = None
    for _ in range(4):
        res = ckpt.transfer(src, dst, in_place=True)
    assert res is not None and res.replayed
    full_cpu = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in full.items()}
    pairs = _pair_bytes(full_cpu, lay["same-src"], lay["same-dst"], world)
    p2p = raw_baselines(rank, world, device, pairs)["send/recv"]
    runs = []
    for _ in range(9):
        dist.barrier()
        torch.cuda.synchronize()
        MARKS.clear()
        ON[0] = True
        mark("start")
        ckpt.transfer(src, dst, in_place=True)
        mark("return")
        ON[0] = False
        torch.cuda.synchronize()
        t0, e0 = MARKS[0][1], MARKS[0][2]
        starts: list[Any] = [None] * world
        dist.all_gather_object(starts, t0)  # (perf_counter is the host's monotonic clock: one for every rank)
        lag = (t0 - min(starts)) * 1e3  # this rank started after the first one by this much
        row = [(lab, (h - t0) * 1e3 + lag, None if ev is None else e0.elapsed_time(ev) + lag) for lab, h, ev in MARKS]
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        p2p()
        torch.cuda.synchronize()
        runs.append([*row, ("p2p_alone", (time.perf_counter() - t) * 1e3, None)])
    keep = [r for r in runs[2:] if [m[0] for m in r] == [m[0] for m in runs[-1]]]
    lines = [f"rank {rank} (medians of {len(keep)} calls; ms from the first rank's start of the call)"]
    for i, (lab, _, _) in enumerate(keep[0]):
        host = statistics.median(r[i][1] for r in keep)
        gpus = [r[i][2] for r in keep if r[i][2] is not None]
        lines.append(f"  {lab:22s} host {host:7.3f}" + (f"  gpu {statistics.median(gpus):7.3f}" if gpus else ""))
    text = "\n".join(lines)
    print(text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"transfer_timeline_r{rank}.txt"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
    sys.exit(fork_ranks(int(os.environ.get("RANKS", "2")), main, device="cuda"))
