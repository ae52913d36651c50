"""Forked trainer ranks on CPU (gloo) or GPUs (NCCL), joined as torchrun joins them, for the GPU
benches (``trainer-gpu``, ``memtier-gpu``); a rank's death ends the whole group without a hang.

Ranks are forked (no new interpreter, no ``import torch`` per rank), so the parent must not have
touched CUDA: forking after CUDA initialization breaks the children. Each rank gets the environment
torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) and joins
through :func:`ckpt.trainer.parallel.init_distributed` (gloo on CPU, NCCL with ``device_id`` on CUDA),
exactly as ``ckpt train``'s workers do.

When any rank exits abnormally (a SIGKILL from fault injection, :data:`OOM_EXIT` after an
out-of-memory error) the others may be blocked in a collective with it: torch.multiprocessing
terminates them, and :func:`fork_ranks` returns the first failing exit code instead of raising.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

OOM_EXIT = 17  # a rank's exit code after torch.OutOfMemoryError: the group stops, the parent records it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, device_name: str, threads: int, env: dict[str, str],
           fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    from ckpt.trainer.parallel import init_distributed

    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    device = init_distributed(device_name)
    try:
        fn(rank, world, device, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fork_ranks(world: int, fn: Callable[..., Any], *args: Any, device: str = "cpu", threads: int = 1,
               env: dict[str, str] | None = None) -> int:
    """Run ``fn(rank, world, device, *args)`` on ``world`` forked ranks in one process group.

    Returns 0 when every rank returned, else the exit code of the first rank that died (negative:
    killed by that signal, e.g. -9; :data:`OOM_EXIT`); an exception in a rank is re-raised here.
    """
    if torch.cuda.is_initialized():
        raise RuntimeError("fork_ranks: CUDA is initialized in the parent; forked ranks could not use it")
    ctx = mp.start_processes(_entry, args=(world, free_port(), device, threads, dict(env or {}), fn, args),
                             nprocs=world, start_method="fork", join=False)
    try:
        while not ctx.join(grace_period=1.0):  # peers of a dead rank: SIGTERM after 1 s, SIGKILL after 2
            pass
    except mp.ProcessExitedException as e:
        return int(e.exit_code)
    return 0


def cuda_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def scratch_dir(prefix: str, need_bytes: int, prefer_shm: bool = True) -> str:
    """A fresh directory under /dev/shm when it has ``need_bytes`` free (fast, no disk), else under
    the temporary directory."""
    import tempfile

    base = None
    if prefer_shm and os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need_bytes:
        base = "/dev/shm"
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def _child(fn: Callable[..., Any], args: tuple[Any, ...], out: str) -> None:
    import json

    # a forked child must not enter the OpenMP pool its parent may have started (it would wait for
    # threads that were not forked: the CI suite hung here in a plain tensor copy)
    torch.set_num_threads(1)
    with open(out, "w") as f:
        json.dump(fn(*args), f)


def in_child(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` (JSON-able result) in a forked process, so that whatever it initializes (CUDA, by
    loading into pinned memory) stays out of the parent that forks the ranks."""
    import json
    import tempfile

    fd, out = tempfile.mkstemp(prefix="ckpt-bench-child-", suffix=".json")
    os.close(fd)
    try:
        p = mp.get_context("fork").Process(target=_child, args=(fn, args, out))
        p.start()
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in its child process (exit code {p.exitcode})")
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def nccl_version() -> str:
    """NCCL's version as text (torch returns a tuple, or an int in some builds)."""
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return "?"
    return ".".join(map(str, v)) if isinstance(v, tuple | list) else str(v)
