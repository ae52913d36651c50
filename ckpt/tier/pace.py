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

What budget to pick depends on the step, the host and the state. A :class:`Governor` picks it from the
steps themselves (``max_overhead``: the slowdown of training the tier may cost, e.g. 0.05): it
compares the time per step while a memory checkpoint runs with the time per step without traffic,
and moves the pacer's rate so that the first stays within ``1 + max_overhead`` of the second. Steps
without traffic come from the tier's first calls (it starts no memory checkpoint in them), steps with
no memory checkpoint in flight, and short pauses of this rank's pacer (see :class:`Governor`).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable

from ckpt.errors import StateError

Pace = Callable[[int, float | None], None]  # ``take(nbytes, deadline)``: what the copies call before reading

BURST_S = 0.05  # the budget a pacer may run ahead by: short bursts at full speed, never a long one


def _from_env(name: str, value: float | None, check: Callable[[float | None], float | None],
              ok: Callable[[float], bool], usage: str) -> float | None:
    """``check(value)`` unless ``$name`` is set and not empty: then ``check`` of its number (0: None).
    Raises StateError naming the variable for a value that is not a number ``ok`` accepts (NaN never)."""
    env = os.environ.get(name)
    if env is None or env.strip() == "":
        return check(value)
    try:
        got = float(env)
    except ValueError:
        got = float("nan")
    if not ok(got):  # (NaN fails every comparison)
        raise StateError(f"{name}={env!r}: {usage}")
    return check(got or None)


def budget_from_env(value: float | None) -> float | None:
    """``value`` unless ``$CKPT_TIER_MAX_GBPS`` is set (GB/s per rank; 0 or empty: no budget).

    Raises StateError for a value that is not a number >= 0."""
    return _from_env("CKPT_TIER_MAX_GBPS", value, check_budget, lambda x: x >= 0,
                     "use GB/s per rank (e.g. 2 or 0.5), or 0 for no budget")


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
        self.released = False
        self._paused_until = float("-inf")  # (time.monotonic) no take proceeds before it: see pause
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
            while True:  # paused: nothing moves (never past the deadline)
                now = time.monotonic()
                until = self._paused_until if deadline is None else min(self._paused_until, deadline)
                if now >= until:
                    break
                self._lock.wait(until - now)
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
            self.released = True
            self._paused_until = float("-inf")
            self._lock.notify_all()

    def pause(self, seconds: float) -> None:
        """No take proceeds for ``seconds`` (or until :meth:`resume`): a :class:`Governor` times steps
        with no traffic while a memory checkpoint is in flight. Bounded, so that a pause nobody
        lifts (training stopped calling the tier) never holds a copy until its deadline."""
        with self._lock:
            if not self.released:
                self._paused_until = time.monotonic() + seconds

    def resume(self) -> None:
        """End a :meth:`pause` now."""
        with self._lock:
            self._paused_until = float("-inf")
            self._lock.notify_all()

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._paused_until

    def set_rate(self, gbps: float) -> None:
        """A new budget from now on (a :class:`Governor`'s); ignored once released. Waits under way
        keep the wake-up they computed (at most one burst plus one group's worth at the old rate)."""
        with self._lock:
            if not self.released:
                self.rate = gbps * 1e9


class Governor:
    """Sets ``pacer``'s rate so that a step with a memory checkpoint in flight takes at most
    ``1 + overhead`` times a step without traffic (this rank's view; the training thread calls
    :meth:`tick` once per memory-tier call).

    Each :data:`WINDOW` busy steps it compares their median time per step with the median of the
    last :data:`REFERENCE` steps without traffic. The traffic's cost grows with its rate, so it
    estimates the slowdown per GB/s (smoothed over windows: one window of noisy steps is not a
    signal) and sets the rate that costs ``overhead`` x :data:`AIM`, moving at most by [1/2, 3/2] per
    window and staying within [``min_gbps``, ``max_gbps``]. Steps without traffic are the steps with
    no memory checkpoint in flight, and pauses: when the reference is missing or :data:`STALE` windows
    old (a training step's own pace drifted by 19-30% over a run) while a memory checkpoint is in flight,
    it pauses the pacer for :data:`PAUSE` steps and times them (not the first, whose copies were
    already queued). Only this rank's copies wait, for about a second; a pause ends by itself after
    :data:`PAUSE_MAX_S`. A released pacer stays released.
    """

    WINDOW = 12  # busy steps per adjustment (launch-bound steps vary by 10-20%: one is not a signal)
    REFERENCE = 32  # steps without traffic kept for the reference (median)
    SMOOTH = 0.25  # weight of a new window in the estimated slowdown per GB/s
    AIM = 0.85  # of ``overhead``: the noise of the estimate then errs below the target more often
    STALE = 4  # windows after which the reference is renewed
    PAUSE = 3  # steps a pause lasts (the first one not timed)
    PAUSE_MAX_S = 10.0
    HISTORY = 64  # windows kept in ``history`` (diagnostics)
    START_GBPS = 1.0  # the first rate (when max_gbps is not lower): measured at ~1-6% on 4 x H100
    MIN_GBPS = 0.25  # never below: a 10 GB state and a peer's copy still complete within ~80 s

    def __init__(self, pacer: Pacer, overhead: float, *, max_gbps: float | None = None,
                 start_gbps: float | None = None, min_gbps: float | None = None, settled: bool = True):
        self.pacer = pacer
        check_overhead(overhead)
        self.overhead = float(overhead)
        self.max_gbps = max_gbps
        self.min_gbps = min_gbps if min_gbps is not None else self.MIN_GBPS
        first = start_gbps if start_gbps is not None else self.START_GBPS
        self.gbps = self._bound(first)
        pacer.set_rate(self.gbps)
        self.idle: list[float] = []  # seconds per step without traffic, newest last
        self.busy: list[float] = []  # the window being filled
        self.windows_since_idle = 0
        self.measured: float | None = None  # the last window's overhead
        self.per_gbps: float | None = None  # the estimated slowdown per GB/s of budget
        # (measured overhead, the rate it led to), the newest HISTORY windows: a run of a million
        # steps must not grow it without end
        self.history: list[tuple[float, float]] = []
        self.pauses = 0
        self._prev: tuple[float, int] | None = None  # (time, step) of the last tick
        self._kind: str | None = None  # of the interval since the last tick: idle, busy, pause0 or pause
        self._pause_left = 0  # paused intervals still to come
        # False: busy windows are not judged yet (the tier's first memory checkpoints allocate and pin
        # their slots beside training, a one-time cost of seconds per step that no budget changes)
        self.settled = settled

    def _bound(self, gbps: float) -> float:
        hi = self.max_gbps if self.max_gbps is not None else float("inf")
        return min(max(gbps, self.min_gbps), hi)

    def tick(self, now: float, step: int, busy: bool, *, starts: bool = False) -> None:
        """The training thread reached ``step`` at ``now`` (a monotonic clock, s); ``busy``: a memory
        checkpoint runs from here to the next tick (one in flight, or one started by this call:
        ``starts``, whose snapshot then runs in this interval)."""
        prev, self._prev = self._prev, (now, step)
        kind, self._kind = self._kind, None
        if prev is not None and kind is not None and step > prev[1] and now > prev[0]:
            self._record(kind, (now - prev[0]) / (step - prev[1]))  # (else a restart of the step count)
        if busy and not starts and self._pause_left > 0:  # (a snapshot never counts as a step without traffic)
            self._pause_left -= 1
            self._kind = "pause"
        elif busy and self.settled and not starts and self.wants_reference():
            self.pacer.pause(min(self.PAUSE_MAX_S, 3 * self.PAUSE * (statistics.median(self.idle) if self.idle
                                                                     else 1.0)))
            self.pauses += 1
            self._pause_left = self.PAUSE - 1
            self._kind = "pause0"
        else:
            if kind in ("pause0", "pause"):
                self.pacer.resume()
            self._pause_left = 0
            self._kind = "busy" if busy else "idle"

    def _record(self, kind: str, per: float) -> None:
        if kind in ("idle", "pause"):
            self.idle = (self.idle + [per])[-self.REFERENCE:]
            self.windows_since_idle = 0
            return
        if kind != "busy":
            return  # the first paused step: copies queued before the pause still landed in it
        self.busy.append(per)
        if len(self.busy) < self.WINDOW:
            return
        window, self.busy = self.busy, []
        if not self.idle or not self.settled:
            return  # nothing to compare with yet, or one-time costs
        self.windows_since_idle += 1
        self.measured = statistics.median(window) / statistics.median(self.idle) - 1.0
        seen = self.measured / self.gbps  # the slowdown per GB/s in this window (smoothed: one is noisy)
        est = seen if self.per_gbps is None else self.per_gbps + self.SMOOTH * (seen - self.per_gbps)
        self.per_gbps = est
        want = self.overhead * self.AIM / est if est > 0 else float("inf")
        self.gbps = self._bound(min(max(want, self.gbps * 0.5), self.gbps * 1.5))
        self.pacer.set_rate(self.gbps)
        self.history = (self.history + [(self.measured, self.gbps)])[-self.HISTORY:]

    @property
    def pausing(self) -> bool:
        """Whether the interval since the last tick is one of a pause (no traffic of this rank)."""
        return self._kind in ("pause0", "pause")

    def wants_reference(self) -> bool:
        """Whether steps without traffic should be timed (none yet, too few, or older than
        :data:`STALE` windows)."""
        return len(self.idle) < 3 or self.windows_since_idle >= self.STALE


def check_overhead(value: float | None) -> float | None:
    """``value`` (a fraction of the step time, 0 < value < 1; None: no governor) or StateError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise StateError(f"memory tier max_overhead={value!r}: use the slowdown of a step the tier may cost "
                         "as a fraction (e.g. 0.05 for 5%), or None for no governor")
    return float(value)


def overhead_from_env(value: float | None) -> float | None:
    """``value`` unless ``$CKPT_TIER_MAX_OVERHEAD`` is set (a fraction; 0 or empty: no governor).

    Raises StateError for a value that is not a number in [0, 1)."""
    return _from_env("CKPT_TIER_MAX_OVERHEAD", value, check_overhead, lambda x: 0 <= x < 1,
                     "use a fraction of the step time (e.g. 0.05), or 0 for no governor")


__all__ = ["BURST_S", "Governor", "Pace", "Pacer", "budget_from_env", "check_budget", "check_overhead",
           "overhead_from_env"]
