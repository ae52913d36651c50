"""Probe (issue 33): can ranks of one host move bytes faster by pulling from each other's memory
through CUDA IPC (copy engines, or P2P copy kernels for strided views) than NCCL's own send/recv of
the same bytes? Each of W ranks holds SIZE_MB of bf16 split in W parts; part p of every rank goes to
rank p (an all-to-all of whole parts), timed as NCCL batch_isend_irecv, as IPC pulls of contiguous
parts (one stream per peer), and as IPC pulls of strided column blocks of the same bytes.

Run: W=4 SIZE_MB=1536 python scripts/probes/ipc_pull.py   (CUDA only; prints medians)
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

W = int(os.environ.get("W", "4"))
SIZE = int(os.environ.get("SIZE_MB", "1536")) << 20
REPS = int(os.environ.get("REPS", "5"))


def timed(fn, gloo) -> float:
    out = []
    for _ in range(REPS + 1):
        torch.cuda.synchronize()
        dist.barrier(group=gloo)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dist.barrier(group=gloo)
        out.append(time.perf_counter() - t)
    return statistics.median(out[1:])


def worker(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=W, device_id=torch.device("cuda", rank))
    gloo = dist.new_group(backend="gloo")
    n = SIZE // 2
    rows = 4096
    cols = n // rows // W * W
    src = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    part = cols // W
    # contiguous parts: flat chunks
    flat_s, flat_d = src.view(-1), dst.view(-1)
    chunk = flat_s.numel() // W

    def nccl() -> None:
        ops = []
        for p in range(W):
            if p == rank:
                flat_d[p * chunk:(p + 1) * chunk].copy_(flat_s[p * chunk:(p + 1) * chunk])
                continue
            ops.append(dist.P2POp(dist.isend, flat_s[p * chunk:(p + 1) * chunk], p))
            ops.append(dist.P2POp(dist.irecv, flat_d[p * chunk:(p + 1) * chunk], p))
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    handles = [None] * W
    dist.all_gather_object(handles, reduce_tensor(src), group=gloo)
    peers = [fn(*args) if p != rank else src for p, (fn, args) in enumerate(handles)]
    streams = [torch.cuda.Stream() for _ in range(W)]
    cur = torch.cuda.current_stream()

    def pull(strided: bool) -> None:
        ev = torch.cuda.Event()
        ev.record(cur)
        for p in range(W):
            s = streams[p]
            s.wait_event(ev)
            with torch.cuda.stream(s):
                if strided:  # my column block of peer p's matrix, into column block p of mine
                    dst[:, p * part:(p + 1) * part].copy_(peers[p][:, rank * part:(rank + 1) * part],
                                                          non_blocking=True)
                else:
                    flat_d[p * chunk:(p + 1) * chunk].copy_(peers[p].view(-1)[rank * chunk:(rank + 1) * chunk],
                                                            non_blocking=True)
        for s in streams:
            cur.wait_stream(s)

    nbytes = SIZE * (W - 1) / W  # bytes each rank receives from its peers
    res = {"nccl": timed(nccl, gloo), "ipc contiguous": timed(lambda: pull(False), gloo),
           "ipc strided": timed(lambda: pull(True), gloo)}
    # check: contiguous pull equals NCCL's result
    nccl()
    want = dst.clone()
    pull(False)
    torch.cuda.synchronize()
    ok = torch.equal(want, dst)
    if rank == 0:
        for k, v in res.items():
            print(f"{k:16s} {v * 1e3:8.2f} ms  {nbytes / v / 1e9:7.1f} GB/s per rank in  "
                  f"({res['nccl'] / v:.2f}x NCCL)", flush=True)
        print(f"contiguous pull bitwise equal to NCCL's: {ok}", flush=True)
    dist.barrier(group=gloo)
    del peers
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(worker, nprocs=W, start_method="spawn")
