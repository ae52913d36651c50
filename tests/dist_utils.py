"""Run a function on N ranks of a real gloo process group, forked (spawn costs ~5 s per process)."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, init: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    fn(rank, world, *args)  # on an exception this rank exits first, so its traceback is the one reported
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` forked processes sharing a gloo group.

    An exception in any rank fails the caller (torch.multiprocessing re-raises it with its traceback).
    """
    fd, path = tempfile.mkstemp(prefix="ckpt-pg-")
    os.close(fd)
    os.unlink(path)
    init = f"file://{path}"
    try:
        mp.start_processes(_entry, args=(world, init, fn, args), nprocs=world, start_method="fork", join=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)
