"""Run a function on N ranks of a real gloo process group, forked (spawn costs ~5 s per process).

A thin wrapper of the suite's one launcher, :func:`ckpt.testing.ranks.launch` (deadline, termination
of the other ranks when one fails, the first failing rank's error re-raised)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckpt.testing.ranks import launch


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, **launch_kw: Any) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` forked processes sharing a gloo group.

    An exception in any rank fails the caller: the first failing rank's :class:`~ckpt.testing.ranks.RankError`
    (a ``torch.multiprocessing.ProcessRaisedException``, its traceback in the message) or ``RankDied``
    (a ``ProcessExitedException``). ``launch_kw`` goes to :func:`~ckpt.testing.ranks.launch` (``timeout``...).
    """
    launch(world, fn, *args, **launch_kw)
