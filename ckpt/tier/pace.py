"""A bandwidth budget for the memory tier's background work: bytes per second per rank.

Why: a memory checkpoint every step moves the whole state through host memory several times
(device to host, its CRCs, the copy to a peer). Run at full speed beside a training step that is
bound by its launching thread, that traffic slows the step even though no core or copy engine is
short (measured in docs/BENCHMARKS.md, "Memory tier, third pass" and "The memory tier over 44
steps"): the launching thread slows with the memory traffic. With ``busy="skip"`` a budget trades
how often a memory checkpoint completes for how much it slows training; nothing else changes (the
same bytes, checksums and commit).

One :class:`Pacer` per tier, shared by the device-to-host drain of a staged snapshot
(:mod:`ckpt.tier.snapshot`) and the peer copy threads (:mod:`ckpt.tier.localcopy`): a token bucket
whose waits sleep (no GIL, no spinning core); :meth:`Pacer.release` lifts it (the run's last step
waits for the memory checkpoint in flight at full speed).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from ckpt.errors import StateError

Pace = Callable[[int, float | None], None]  # ``take(nbytes, deadline)``: what the copies call before reading

BURST_S = 0.05  # the budget a pacer may run ahead by: short bursts at full speed, never a long one


def budget_from_env(value: float | None) -> float | None:
    """``value`` unless ``$CKPT_TIER_MAX_GBPS`` is set (GB/s per rank; 0 or empty: no budget).

    Raises StateError for a value that is not a number >= 0."""
    env = os.environ.get("CKPT_TIER_MAX_GBPS")
    if env is None or env.strip() == "":
        return check_budget(value)
    try:
        got = float(env)
    except ValueError:
        got = -1.0
    if not got >= 0:  # (NaN too)
        raise StateError(f"CKPT_TIER_MAX_GBPS={env!r}: use GB/s per rank (e.g. 2 or 0.5), or 0 for no budget")
    return check_budget(got or None)


def check_budget(value: float | None) -> float | None:
    """``value`` (GB/s per rank, None: no budget) or StateError when it is not a positive number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise StateError(f"memory tier max_gbps={value!r}: use a positive number of GB/s per rank, or None for "
                         "no budget")
    return float(value)


class Pacer:
    """A token bucket of ``gbps`` GB/s (None: :meth:`take` never waits). Thread-safe."""

    def __init__(self, gbps: float | None):
        self.rate = None if gbps is None else gbps * 1e9
        self._lock = threading.Condition()
        self._next = float("-inf")  # when the budget spent so far is paid back (-inf: idle)
        self.waited_s = 0.0  # total sleep
        self.taken = 0  # bytes accounted for

    def take(self, nbytes: int, deadline: float | None = None) -> None:
        """Account for ``nbytes`` about to move, sleeping first while the budget is overdrawn by more
        than :data:`BURST_S` seconds' worth; never past ``deadline`` (``time.monotonic()``: the
        caller's own timeout, which it then checks)."""
        if nbytes <= 0:
            return
        with self._lock:
            self.taken += nbytes
            if self.rate is None:
                return
            now = time.monotonic()
            start = max(self._next, now - BURST_S)  # an idle pacer lends at most one burst
            self._next = start + nbytes / self.rate
            wait = start - now if deadline is None else min(start - now, deadline - now)
            if wait > 0:
                self.waited_s += wait
                self._wait(wait)

    def _wait(self, seconds: float) -> None:
        """Sleep ``seconds`` with the lock released (woken early by :meth:`release`)."""
        self._lock.wait(seconds)

    def release(self) -> None:
        """No budget from now on, and no take waits any longer (e.g. training is over: the memory
        checkpoint in flight is waited for at full speed)."""
        with self._lock:
            self.rate = None
            self._lock.notify_all()


__all__ = ["BURST_S", "Pace", "Pacer", "budget_from_env", "check_budget"]
