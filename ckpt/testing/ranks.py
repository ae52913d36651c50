"""Testing support, not used by the library: run a function on N forked ranks of one process group.

The one rank launcher of the test suite (``tests/dist_utils.run_ranks``) and the benches
(``bench/ranks.fork_ranks``). What it guarantees:

- ranks are forked (no new interpreter per rank; ``start_method="spawn"`` for CUDA tests whose parent
  already touched CUDA), each joins one group: gloo on CPU, NCCL on CUDA (one GPU per rank);
- each rank gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``);
- a deadline bounds the whole run: past ``timeout`` every rank is killed and :class:`RanksTimedOut` raised;
- when a rank fails the others are terminated (they may be blocked in a collective with it), and the
  error of the *first* rank to fail is raised: :class:`RankError` (an exception, its traceback in the
  message) or :class:`RankDied` (a signal or an exit code). "First" is decided by a ticket each failing
  rank takes from a shared counter before it reports, not by the order the parent happens to notice
  exits: on a loaded machine a peer's consequential error ("connection closed by peer") is often
  reaped first. A rank that dies without reporting (SIGKILL) is taken as first, since a rank that
  reports an error has seen it coming while a killed one is the usual cause of its peers' errors.

Nothing here imports the trainer; pass ``init=`` to join the group another way (the GPU benches use
:func:`ckpt.trainer.parallel.init_distributed`, as ``ckpt train``'s workers do).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

# bounds a hang only: far above what the slowest multi-rank test takes on a loaded small box (measured
# in docs/BENCHMARKS.md, section "Figures that code comments used to quote")
DEFAULT_TIMEOUT_S = 900.0


class RankError(ProcessRaisedException):
    """The first failing rank raised an exception; its traceback is in the message."""

    def __init__(self, msg: str, rank: int, pid: int, exc_type: str) -> None:
        super().__init__(msg, rank, pid)
        self.rank, self.exc_type = rank, exc_type


class RankDied(ProcessExitedException):
    """The first failing rank died: killed by a signal (``exit_code`` < 0) or exited with a nonzero code."""

    def __init__(self, msg: str, rank: int, pid: int, exit_code: int, signal_name: str | None = None) -> None:
        super().__init__(msg, rank, pid, exit_code, signal_name)
        self.rank = rank


class RanksTimedOut(TimeoutError):
    """The ranks were still running at the deadline; all were killed."""


@dataclass
class _Shared:
    """What the parent and its ranks share: the failure ticket counter and the report directory."""

    counter: Any  # multiprocessing.Value("i")
    report_dir: str


@dataclass
class _Options:
    device: str = "cpu"
    threads: int = 1
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    store: str = ""
    timeout: float = DEFAULT_TIMEOUT_S
    pass_device: bool = False
    barrier: bool = True
    group: bool = True
    init: Callable[[str], torch.device] | None = None


_CURRENT: tuple[_Shared, int] | None = None  # in a rank: what exit_rank reports through


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpu_count() -> int:
    """NVIDIA GPUs on this machine, counted by ``nvidia-smi`` without touching CUDA: in this process
    ``torch.cuda.is_available()`` or ``device_count()`` would make every CUDA rank forked from it
    fail ("Cannot re-initialize CUDA in forked subprocess")."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _report(shared: _Shared, rank: int, record: dict[str, Any]) -> None:
    with shared.counter.get_lock():
        shared.counter.value += 1
        record["ticket"] = shared.counter.value
    tmp = os.path.join(shared.report_dir, f".{rank}.json")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(shared.report_dir, f"{rank}.json"))


def exit_rank(code: int) -> None:
    """End this rank now with exit code ``code``, reported as its failure (no cleanup: peers may be
    blocked in a collective with it; the launcher terminates them). Outside a launched rank: ``os._exit``."""
    if _CURRENT is not None:
        _report(_CURRENT[0], _CURRENT[1], {"exit_code": code})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _join_group(rank: int, world: int, o: _Options) -> torch.device:
    import torch.distributed as dist

    if o.init is not None:
        return o.init(o.device)
    device = torch.device("cpu")
    kwargs: dict[str, Any] = {}
    if o.device == "cuda":
        local = rank % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{o.store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=o.timeout), **kwargs)
    return device


def _rank_main(rank: int, world: int, fn: Callable[..., Any], args: tuple[Any, ...], o: _Options,
               shared: _Shared) -> None:
    global _CURRENT
    _CURRENT = (shared, rank)
    import torch.distributed as dist

    try:
        os.environ.update(o.env)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(o.port))
        # a forked child must not enter an OpenMP pool its parent started (threads are not forked)
        torch.set_num_threads(o.threads)
        device = _join_group(rank, world, o) if o.group else torch.device(o.device)
        fn(rank, world, device, *args) if o.pass_device else fn(rank, world, *args)
        if o.barrier and dist.is_initialized():
            dist.barrier()
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent, then the rank ends
        _report(shared, rank, {"type": type(e).__name__, "traceback": traceback.format_exc()})
        sys.stderr.flush()
        os._exit(1)  # no group teardown: a peer may be dead, and NCCL's teardown could then wait for it
    if dist.is_initialized():
        dist.destroy_process_group()


def _kill_all(procs: list[Any], grace: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _first_failure(procs: list[Any], report_dir: str) -> Exception:
    """The error of the first rank to fail: one killed without reporting, else the lowest ticket."""
    reports: dict[int, dict[str, Any]] = {}
    for r in range(len(procs)):
        path = os.path.join(report_dir, f"{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[r] = json.load(f)
    failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    silent = [r for r in failed if r not in reports]
    rank = silent[0] if silent else min(reports, key=lambda r: reports[r]["ticket"])
    p, rep = procs[rank], reports.get(rank, {})
    others = sorted(set(failed) - {rank})
    also = f" (ranks {others} failed after it)" if others else ""
    if "traceback" in rep:
        return RankError(f"rank {rank} raised {rep['type']}{also}:\n\n{rep['traceback']}", rank, p.pid, rep["type"])
    code = int(rep.get("exit_code", p.exitcode if p.exitcode is not None else -1))
    if code < 0:
        name = signal.Signals(-code).name
        return RankDied(f"process {rank} terminated with signal {name}{also}", rank, p.pid, code, name)
    return RankDied(f"process {rank} terminated with exit code {code}{also}", rank, p.pid, code)


def launch(world: int, fn: Callable[..., Any], *args: Any, device: str = "cpu", threads: int = 1,
           env: dict[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT_S, pass_device: bool = False,
           barrier: bool = True, init: Callable[[str], torch.device] | None = None, start_method: str = "fork",
           grace: float = 2.0, group: bool = True) -> None:
    """Call ``fn(rank, world, *args)`` (``fn(rank, world, device, *args)`` with ``pass_device``) on
    ``world`` ranks of one process group (gloo for ``device="cpu"``, NCCL for ``"cuda"``).

    ``init(device)`` joins the group instead of the default (a ``file://`` store); ``group=False``
    joins none (``fn`` makes its own). Returns when every rank returned (after a final barrier
    unless ``barrier=False``). Raises the
    first failing rank's :class:`RankError` or :class:`RankDied` after terminating the others (SIGTERM,
    SIGKILL after ``grace`` seconds), or :class:`RanksTimedOut` past ``timeout`` seconds.
    """
    if start_method == "fork" and device != "cpu" and torch.cuda.is_initialized():
        # CPU ranks forked from a parent that used CUDA are fine (they never touch it); CUDA ranks are not
        raise RuntimeError("launch: CUDA is initialized in the parent; forked ranks could not use it "
                           "(use start_method='spawn')")
    ctx: Any = mp.get_context(start_method)  # typeshed's BaseContext lacks Process
    work = tempfile.mkdtemp(prefix="ckpt-ranks-")
    shared = _Shared(ctx.Value("i", 0), work)
    opts = _Options(device=device, threads=threads, env=dict(env or {}), port=free_port(),
                    store=os.path.join(work, "store"), timeout=timeout, pass_device=pass_device, barrier=barrier,
                    init=init, group=group)
    procs: list[Any] = []
    try:
        for rank in range(world):
            p = ctx.Process(target=_rank_main, args=(rank, world, fn, args, opts, shared), daemon=False)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        waiting = {p.sentinel: p for p in procs}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                alive = [r for r, p in enumerate(procs) if p.is_alive()]
                _kill_all(procs, grace)
                raise RanksTimedOut(f"ranks {alive} of {world} still running after {timeout:g} s "
                                    f"({getattr(fn, '__name__', fn)}); all were killed")
            ready = multiprocessing.connection.wait(list(waiting), timeout=left)
            for s in ready:
                waiting.pop(s).join()
            if any(p.exitcode not in (None, 0) for p in procs):
                error = _first_failure(procs, work)  # before terminating: those exits are not failures
                _kill_all(procs, grace)
                raise error
    except BaseException:
        _kill_all(procs, grace)  # an interrupt or a launch error leaves no rank behind
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["DEFAULT_TIMEOUT_S", "RankError", "RankDied", "RanksTimedOut", "free_port", "gpu_count", "exit_rank",
           "launch"]
