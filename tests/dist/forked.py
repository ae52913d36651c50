"""A small fork runner for the failure tests of ckpt._comm / save / load that never hangs, and what
those tests share: :func:`outcome`, :func:`assert_typed`, :func:`stall`.

Unlike :func:`tests.dist_utils.run_ranks` it collects one result per rank and allows a rank to crash
(``os._exit``): after a timeout gloo closes the group's connections, so the ranks here never run a
final barrier: each writes its outcome to a file and leaves with ``os._exit``, and the runner kills
(by pid) any rank still alive after a hard limit, then fails.

Timing: a "stalled" rank used to sleep ``timeout + 1.5`` s, racing its peers' timeouts; on a loaded
machine a peer could start late and still be waiting when the sleeper woke, so the test saw no
error. :func:`stall` instead stays silent until every other rank has written its result (bounded by
:data:`STALL_BOUND_S`), and the upper bounds (:data:`SLACK`) are generous: they only catch a wait
that is not bounded by the timeout at all, which would last until the stall bound.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ckpt import errors

SLACK = 20.0  # seconds a rank may take past its timeout (fork, gloo, the coordinator's verdict, a loaded machine)
STALL_BOUND_S = 60.0  # a stalled rank's longest silence: well past timeout + SLACK, so a wait not bounded shows
HANG_LIMIT_S = 240.0  # the runner's hard limit: only a hang reaches it

_RESULTS: str | None = None  # in a forked rank: the directory of the ranks' result files


def _child(rank: int, world: int, init: str, out_dir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    global _RESULTS
    _RESULTS = out_dir
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        # every rank has its connections before any may crash: a rank that exits right after joining
        # could close them while a peer is still connecting ("connectFullMesh failed", a flake)
        dist.barrier()
        res = fn(rank, world, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        res = {"harness": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    tmp = os.path.join(out_dir, f".{rank}.json")
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, os.path.join(out_dir, f"{rank}.json"))  # whole, for a stalled rank polling for it
    os._exit(0)  # no barrier / destroy: the group may be closed after a timeout


def run_forked(world: int, fn: Callable[..., Any], *args: Any, limit: float = HANG_LIMIT_S) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, *args) -> dict`` on ``world`` forked gloo ranks; their results, by rank.

    A rank that leaves without a result (``os._exit`` in ``fn``: a crash) gives ``{"crashed": True}``.
    Ranks still alive after ``limit`` seconds are killed and the test fails.
    """
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="ckpt-ranks-") as out_dir:
        init = f"file://{os.path.join(out_dir, 'pg')}"
        procs = [ctx.Process(target=_child, args=(r, world, init, out_dir, fn, args), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + limit
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.0))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        assert not hung, f"rank(s) {hung} still running after {limit} s"
        out: list[dict[str, Any]] = []
        for r in range(world):
            path = os.path.join(out_dir, f"{r}.json")
            if not os.path.exists(path):
                out.append({"crashed": True})
                continue
            with open(path) as f:
                res = json.load(f)
            assert "harness" not in res, f"rank {r}: {res['harness']}"
            out.append(res)
        return out


def stall(rank: int, world: int, bound: float = STALL_BOUND_S) -> None:
    """Stay alive but silent (a stalled rank) until every other rank of :func:`run_forked` has written
    its result, at most ``bound`` seconds. A rank that crashes never writes one: only one rank of a
    test may crash or stall."""
    assert _RESULTS is not None, "stall() is for ranks of run_forked"
    others = [os.path.join(_RESULTS, f"{r}.json") for r in range(world) if r != rank]
    end = time.monotonic() + bound
    while time.monotonic() < end and not all(os.path.exists(p) for p in others):
        time.sleep(0.05)  # polls a condition: not a race with the peers


def fire(kind: str, where: str, rank: int, world: int, root: str) -> None:
    """An injected fault of ``kind`` at ``where`` on this rank: ``raise`` (a RuntimeError), ``typed`` (a
    StorageError), ``exit`` (the process ends with code 3) or ``stall`` (silent until every other rank
    has reported, then gone, as a hung rank killed by its launcher: it never acts late). Writes
    ``<root>/fired`` first, for the parent: the fault did happen."""
    with open(os.path.join(root, "fired"), "w") as f:
        f.write(where)
    if kind == "raise":
        raise RuntimeError(f"injected fault at {where}")
    if kind == "typed":
        raise errors.StorageError(f"injected typed fault at {where}")
    sys.stdout.flush()
    sys.stderr.flush()
    if kind == "exit":
        os._exit(3)
    stall(rank, world)
    os._exit(0)


def names_rank(msg: str, r: int) -> bool:
    """Whether error ``msg`` names rank ``r`` ("rank r", or r in a list "rank(s) [...]"). "(rank 1 relays
    rank(s) [3, 4])" names the ranks a missing relay carries, not the failed one: it does not count."""
    msg = re.sub(r"rank \d+ relays rank\(s\) \[[^\]]*\]", "", msg)
    return re.search(rf"\brank {r}\b", msg) is not None or re.search(rf"rank\(s\) \[[^\]]*\b{r}\b", msg) is not None


def outcome(call: Callable[[], Any]) -> dict[str, Any]:
    """Run ``call``; what it raised (class, whether a CheckpointError, message, cause) and how long it took."""
    t0 = time.monotonic()
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - recorded for the parent's assertions
        cause = type(e.__cause__).__name__ if e.__cause__ is not None else None
        return {"elapsed": time.monotonic() - t0, "type": type(e).__name__,
                "typed": isinstance(e, errors.CheckpointError), "msg": str(e), "cause": cause}
    return {"elapsed": time.monotonic() - t0, "type": None}


def assert_typed(res: dict[str, Any], bound: float, *, cls: str | None = None, has: tuple[str, ...] = ()) -> None:
    """``res`` (from :func:`outcome`) is a typed CheckpointError (of class ``cls``, its message holding
    each of ``has``) raised within ``bound`` seconds."""
    assert not res.get("crashed") and res["type"] is not None, f"no error: {res}"
    assert res["typed"], f"not a CheckpointError: {res}"
    if cls is not None:
        assert res["type"] == cls, res
    for s in has:
        assert s in res["msg"], (s, res)
    assert res["elapsed"] < bound, res
