"""Forked trainer ranks on CPU (gloo) or GPUs (NCCL), joined as torchrun joins them, for the GPU
benches (``trainer-gpu``, ``memtier-gpu``); a rank's death ends the whole group without a hang.

A thin layer over the one rank launcher of tests and benches, :func:`ckpt.testing.ranks.launch`.
Ranks are forked (no new interpreter, no ``import torch`` per rank), so the parent must not have
touched CUDA: forking after CUDA initialization breaks the children. Each rank gets the environment
torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) and joins
through :func:`ckpt.trainer.parallel.init_distributed` (gloo on CPU, NCCL with ``device_id`` on CUDA),
exactly as ``ckpt train``'s workers do.

When any rank exits abnormally (a SIGKILL from fault injection, :data:`OOM_EXIT` after an
out-of-memory error, through :func:`exit_rank`) the others may be blocked in a collective with it:
the launcher terminates them, and :func:`fork_ranks` returns the first failing rank's exit code
instead of raising (the first by when it failed, not by when the parent noticed).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from ckpt.testing.ranks import RankDied, exit_rank, free_port, launch

__all__ = ["BENCH_TIMEOUT_S", "OOM_EXIT", "cuda_sync", "exit_rank", "fork_ranks", "free_port", "gloo_ranks",
           "in_child", "nccl_version", "scratch_dir"]

OOM_EXIT = 17  # a rank's exit code after torch.OutOfMemoryError: the group stops, the parent records it


BENCH_TIMEOUT_S = 6 * 3600.0  # bounds a hung bench (and its gloo collectives), never a slow one


def gloo_ranks(world: int, fn: Callable[..., Any], *args: Any, **launch_kw: Any) -> None:
    """``fn(rank, world, *args)`` on ``world`` forked ranks of one gloo group (:func:`ckpt.testing.ranks.launch`
    with a bench's deadline); the first failing rank's error is raised."""
    launch_kw.setdefault("timeout", BENCH_TIMEOUT_S)
    launch(world, fn, *args, **launch_kw)


def _trainer_init(device_name: str) -> torch.device:
    from ckpt.trainer.parallel import init_distributed

    return init_distributed(device_name)


def fork_ranks(world: int, fn: Callable[..., Any], *args: Any, device: str = "cpu", threads: int = 1,
               env: dict[str, str] | None = None, timeout: float = 3600.0) -> int:
    """Run ``fn(rank, world, device, *args)`` on ``world`` forked ranks in one process group.

    Returns 0 when every rank returned, else the exit code of the first rank that died (negative:
    killed by that signal, e.g. -9; :data:`OOM_EXIT`); an exception in a rank is re-raised here.
    """
    try:
        launch(world, fn, *args, device=device, threads=threads, env=env, timeout=timeout, pass_device=True,
               barrier=False, init=_trainer_init, grace=2.0)
    except RankDied as e:
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
