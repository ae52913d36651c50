"""Probe (issue 33): the host's share of a replayed ``ckpt.transfer``, on CPU ranks (gloo), anywhere.

Prints, on rank 0 of ``RANKS`` (default 4) forked ranks: the latency of one metadata exchange
(gloo's own gather + scatter of 256 bytes by hand, ckpt's ``Comm.exchange`` of a small message, and
gloo's all_reduce of the same bytes), then a replayed ``tp=2,ep=2 -> tp=4`` layout change of the
MoE of ``bench/transfer_moe.py`` with tiny tensors (its 170 tensors at 8 GB, ``LAYERS``=34, each a
few KB: the data costs nothing, what is left is the host): median call time and phases, and
``PROF=1``: where rank 0's Python spends it (cProfile, own time).

``DEVICE=cuda``: the same on GPUs (one per rank, NCCL; the exchange by hand over ckpt's gloo group,
the all_reduce over NCCL and read back on the host).

``ONLY=transfer``: the transfer alone; ``GC=0``: with Python's cyclic garbage collector off.

Run: [RANKS=4] [PROF=1] [DEVICE=cuda] [ONLY=transfer] [GC=0] python scripts/probes/host_costs.py
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import bench.transfer_moe as tm
import ckpt
from bench.ranks import fork_ranks
from ckpt._comm import Comm

LAYERS = int(os.environ.get("LAYERS", "34"))
CALLS = int(os.environ.get("CALLS", "300"))


def median_us(fn: Callable[[], Any], n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def exchanges(rank: int, world: int, device: torch.device) -> None:
    comm = Comm(None, timeout=60)
    pg = comm.cpu_group  # (the default group on CPU; on GPUs ckpt's gloo group beside NCCL)
    buf = torch.zeros(32, dtype=torch.int64)
    dbuf = buf.to(device)

    def by_hand() -> None:
        if rank == 0:
            for p in range(1, world):
                pg.recv([buf], p, 0).wait()
            for p in range(1, world):
                pg.send([buf], p, 1).wait()
        else:
            pg.send([buf], 0, 0).wait()
            pg.recv([buf], 0, 1).wait()

    def ours() -> None:
        comm.exchange({"v": None, "last": 3, "pc": "x" * 32}, lambda got: [{"cached": True, "version": 4}] * world,
                      timeout=60, what="probe")

    def reduced() -> None:
        dist.all_reduce(dbuf)
        dbuf[0].item()

    for name, fn in [("gloo send/recv gather+scatter", by_hand), ("ckpt Comm.exchange", ours),
                     (f"{dist.get_backend()} all_reduce + read", reduced)]:
        dist.barrier()
        median_us(fn, 50)
        dist.barrier()
        us = median_us(fn, CALLS)
        late = []  # the coordinator arrives 1 ms after the others, as in a transfer (they wait for it)
        for _ in range(CALLS // 3):
            dist.barrier()
            if rank == 0:
                end = time.perf_counter() + 0.001
                while time.perf_counter() < end:
                    pass
            late.append(median_us(fn, 1))
        if rank == 0:
            print(f"{name:32s} {us:8.1f} us back to back, {statistics.median(late):8.1f} us on the last to arrive",
                  flush=True)


def arrivals(rank: int, world: int, device: torch.device) -> None:
    """The exchange as a transfer meets it: ranks arrive 0.3-0.9 ms apart after Python of their own,
    with or without GPU work queued (a transfer's first packing), with a Comm made for the call or kept;
    the time from the last arrival to each rank's return, the slowest rank's (median)."""
    kept = Comm(None, timeout=60)
    a = torch.empty(2**26, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    from ckpt import _comm_wire

    blocking = _comm_wire._wait

    def spinning(work: Any, deadline: float | None, floor: float = 0.001) -> None:
        end = time.perf_counter() + 0.002
        while not work.is_completed():
            if time.perf_counter() > end:
                break
        blocking(work, deadline, floor)

    def reduced() -> None:
        flag = torch.ones(1, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        flag.item()

    for name, gpu, fresh, spin, nccl in [
            ("kept Comm", False, False, False, False), ("kept Comm, GPU copying", True, False, False, False),
            ("a Comm per call, GPU copying", True, True, False, False), ("spinning 2 ms", True, True, True, False),
            ("NCCL all_reduce + read instead", True, True, False, True)]:
        _comm_wire._wait = spinning if spin else blocking  # type: ignore[assignment]
        out = []
        for i in range(CALLS // 3 + 5):
            dist.barrier()
            end = time.perf_counter() + 0.0003 * (1 + (rank + i) % 3)
            while time.perf_counter() < end:
                pass
            if gpu:
                b.copy_(a)
            comm = Comm(None, timeout=60) if fresh else kept
            t_in = time.perf_counter()
            if nccl and device.type == "cuda":
                reduced()
            else:
                comm.exchange({"ok": True}, lambda got: [{"ok": True}] * world, timeout=60, what="probe")
            t_out = time.perf_counter()
            got: list[Any] = [None] * world
            dist.all_gather_object(got, (t_in, t_out))
            if i >= 5:
                out.append(max(o for _, o in got) - max(t for t, _ in got))
        _comm_wire._wait = blocking  # type: ignore[assignment]
        if rank == 0:
            print(f"exchange after the last arrival, {name:32s} {statistics.median(out) * 1e6:8.1f} us", flush=True)


def transfers(rank: int, world: int, device: torch.device) -> None:
    tm.D, tm.F, tm.E = 64, 32, 16  # (the module's shapes, tiny: the structure of the 8 GB model)
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(s, generator=g, dtype=torch.bfloat16) for k, s in tm.shapes(LAYERS).items()}
    lay = tm.layouts(world)
    src = tm._state(full, lay["same-src"][rank], device, zero=False)
    dst = tm._state(full, lay["same-dst"][rank], device, zero=True)
    for _ in range(5):
        res = ckpt.transfer(src, dst, in_place=True)
    assert res.replayed
    prof = cProfile.Profile() if rank == 0 and os.environ.get("PROF") else None
    ts, phases = [], []
    for _ in range(CALLS):
        dist.barrier()
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        res = ckpt.transfer(src, dst, in_place=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if prof is not None:
            prof.disable()
        ts.append(time.perf_counter() - t)
        phases.append(res.phases)
    if rank == 0:
        print(f"replayed transfer, {len(full)} tensors: {statistics.median(ts) * 1e3:.3f} ms  ("
              + ", ".join(f"{k} {statistics.median(p[k] for p in phases) * 1e3:.3f}" for k in phases[0]) + ")")
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            print(s.getvalue())


def main(rank: int, world: int, device: torch.device) -> None:
    if os.environ.get("GC") == "0":  # Python's cyclic collector off (does it make ranks uneven?)
        import gc

        gc.disable()
    if os.environ.get("ONLY") != "transfer":
        exchanges(rank, world, device)
        arrivals(rank, world, device)
    transfers(rank, world, device)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
    sys.exit(fork_ranks(int(os.environ.get("RANKS", "4")), main, device=os.environ.get("DEVICE", "cpu")))
