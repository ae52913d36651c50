"""Probe (issue 33): what costs NCCL's point-to-point time on one host, for ckpt.transfer's data path?

On 2 ranks (one GPU each), medians of 7, milliseconds:
- ``nccl1`` / ``nccl4`` / ``nccl2x2`` / ``nccl4x1``: 1 GiB each way as one message, as four of
  256 MiB in one ``batch_isend_irecv``, as two batches of two, as four batches of one;
- ``contig`` / ``strided`` / ``foreach``: a 1 GiB device copy alone (contiguous; half the columns of
  rows, strided; 64 contiguous pieces in one ``torch._foreach_copy_``), and ``nccl+...`` the same copy
  on a side stream while the 1 GiB message travels;
- ``exchange_us`` / ``allreduce_us``: ckpt's gloo metadata exchange of a small message against an
  NCCL all-reduce of a dozen int64 (with its copies to and from the GPU), microseconds.

Run: python scripts/probes/nccl_messages.py   (CUDA only, 2 GPUs; prints one line)
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import torch.distributed as dist

from bench.ranks import fork_ranks
from ckpt._comm import Comm
from scripts.probes import _gpu


def _main(rank: int, world: int, device: torch.device) -> None:
    n = 1 << 30
    send = torch.ones(n, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    a, b = torch.ones_like(send), torch.empty_like(send)
    x = torch.ones(n // 2048, 4096, dtype=torch.uint8, device=device)
    y = torch.empty(n // 2048, 2048, dtype=torch.uint8, device=device)
    xv, yv = x.view(torch.int64)[:, :256], y.view(torch.int64)
    outs = [b[i * (16 << 20): (i + 1) * (16 << 20)].view(torch.int64) for i in range(64)]
    ins = [a[i * (16 << 20): (i + 1) * (16 << 20)].view(torch.int64) for i in range(64)]
    side = torch.cuda.Stream(device)
    peer = 1 - rank

    timeit = functools.partial(_gpu.timeit, reps=7)

    def batches(k: int, per: int) -> list[Any]:
        m, ops = n // k, []
        for i in range(k):
            ops += [dist.P2POp(dist.isend, send[i * m: (i + 1) * m], peer),
                    dist.P2POp(dist.irecv, recv[i * m: (i + 1) * m], peer)]
        return [w for i in range(0, len(ops), 2 * per) for w in dist.batch_isend_irecv(ops[i: i + 2 * per])]

    res: dict[str, float] = {}
    for name, (k, per) in {"nccl1": (1, 1), "nccl4": (4, 4), "nccl2x2": (4, 2), "nccl4x1": (4, 1)}.items():
        res[name] = timeit(lambda k=k, per=per: [w.wait() for w in batches(k, per)])
    copies = {"contig": lambda: b.copy_(a), "strided": lambda: yv.copy_(xv),
              "foreach": lambda: torch._foreach_copy_(outs, ins)}
    for name, fn in copies.items():
        res[name] = timeit(fn)

        def beside(fn: Any = fn) -> None:
            works = batches(1, 1)
            with torch.cuda.stream(side):
                fn()
            for w in works:
                w.wait()
            torch.cuda.current_stream(device).wait_stream(side)

        res["nccl+" + name] = timeit(beside)
    assert torch.equal(y, x[:, :2048])
    comm = Comm(None, timeout=60)
    vec = list(range(12))

    def exchange() -> None:
        comm.exchange({"v": 1, "pc": "0" * 32}, lambda got: [{"ok": 1}] * world, timeout=60)

    def allreduce() -> None:
        t = torch.tensor(vec, dtype=torch.int64).to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        t.cpu()

    for name, fn in (("exchange_us", exchange), ("allreduce_us", allreduce)):
        for _ in range(20):
            fn()
        res[name] = timeit(fn, reps=200) * 1e3
    if rank == 0:
        print({k: round(v, 3) for k, v in res.items()})


if __name__ == "__main__":
    sys.exit(fork_ranks(2, _main, device="cuda"))
