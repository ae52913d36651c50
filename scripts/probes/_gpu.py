"""What the GPU probes share: timing one step of every rank, capturing a step as a CUDA graph, running
work on a side stream beside the caller's, and running a probe on forked ranks with rank 0's figures
printed. CUDA only (the probes are)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.ranks import fork_ranks


def timeit(fn: Callable[[], Any], reps: int = 9, warm: bool = False) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs, each started together on every rank (a barrier)
    on an idle GPU and ended when the GPU is done; ``warm``: one untimed run first."""
    if warm:
        fn()
    ts = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def graphed(fn: Callable[[], Any], device: torch.device) -> Callable[[], None]:
    """``fn`` captured as a CUDA graph (after one eager run: NCCL's connections and allocations are made
    outside the capture); returns its replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        g.capture_begin()
        fn()
        g.capture_end()
    torch.cuda.current_stream(device).wait_stream(s)
    torch.cuda.synchronize()
    return g.replay


def beside(stream: Any, work: Callable[[], Any], then: Callable[[], Any] | None = None) -> None:
    """``work`` on ``stream`` after what the current stream (the capturing one, inside a capture) has
    queued, ``then`` on the current stream meanwhile, and the current stream joined to ``stream``."""
    main = torch.cuda.current_stream(stream.device)
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        work()
    if then is not None:
        then()
    main.wait_stream(stream)


def run_ranks(world: int, main: Callable[..., dict[str, Any]], *args: Any, label: str = "") -> int:
    """``main(rank, world, device, *args)`` on ``world`` forked ranks, one GPU each; prints rank 0's dict
    (floats rounded) after ``label``; returns the exit code."""
    out = os.path.join(tempfile.mkdtemp(), "r.json")

    def body(rank: int, world: int, device: torch.device) -> None:
        r = main(rank, world, device, *args)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(r, f)

    rc = fork_ranks(world, body, device="cuda")
    if rc == 0:
        with open(out) as f:
            print(label + str({k: (round(v, 3) if isinstance(v, float) else v) for k, v in json.load(f).items()}))
    return rc
