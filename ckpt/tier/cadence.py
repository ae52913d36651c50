"""Which calls of :meth:`ckpt.tier.MemoryTier.save_async` start a memory checkpoint.

With ``busy="wait"`` every call does (after waiting for the one in flight). With ``busy="skip"`` a
call while the previous memory checkpoint still runs is skipped, and every rank must skip the same
calls (a memory checkpoint is collective): the agreement of each one says where the next may start,
``next_at = max(step each rank reported) + 1``, each rank reporting the newest step its training
thread had called with when its background thread sent its part (read under one lock). So while a
rank has not reported yet, its report will be >= the step it is called with: skip; once it reported
``r``, every step <= ``r`` is before the next one: skip; otherwise the caller waits for the verdict,
in transit, and the verdict decides, the same on every rank.

A :class:`ckpt.tier.pace.Governor` (``max_overhead``) also needs steps with nothing in flight to
compare with: the first :data:`WARM_CALLS` calls after the tier is made or reset start nothing (the
same calls on every rank: the ranks agreed at setup that all or none have a governor). The governor
is told of every call (:meth:`Cadence.skip`, :meth:`Cadence.start`) and when every slot has been
used once (:meth:`Cadence.completed`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ckpt.tier.pace import Governor

if TYPE_CHECKING:
    from ckpt.tier.types import MemoryHandle

WARM_CALLS = 4  # a governed tier's first calls start no memory checkpoint: steps without traffic to time


class Cadence:
    """The skip decisions of one tier (the training thread asks; its background thread reports and
    takes the verdicts)."""

    def __init__(self, busy: str, governor: Governor | None):
        self.busy = busy
        self.governor = governor
        self._lock = threading.Lock()
        self._called = -1  # the newest step the training thread called with (under the lock)
        self.next_at: int | None = None  # the agreed first step of the next memory checkpoint
        self.skips = 0  # calls skipped since the last memory checkpoint started
        self._warm = WARM_CALLS if governor is not None else 0
        self._completes = 0  # complete memory checkpoints while the governor was not settled

    def in_flight_skip(self, step: int, h: MemoryHandle | None) -> bool:
        """busy="skip": whether ``step`` is provably before the next agreed memory checkpoint while
        ``h`` (the one in flight) still runs (see the module docstring)."""
        if self.busy != "skip":
            return False
        with self._lock:
            self._called = max(self._called, step)
            if h is None or h.done:
                return False
            return h.reported is None or step <= h.reported

    def later(self, step: int) -> bool:
        """After the previous memory checkpoint ended: whether ``step`` still starts none (before the
        agreed next one, or one of a governor's first calls: the same on every rank)."""
        if self.busy == "skip" and self.next_at is not None and step < self.next_at:
            return True
        if self._warm > 0:
            self._warm -= 1
            return True
        return False

    def skip(self, step: int, now: float, *, busy: bool) -> None:
        """A call that starts nothing; ``busy``: the previous memory checkpoint still runs."""
        self.skips += 1
        if self.governor is not None:
            self.governor.tick(now, step, busy=busy)

    def start(self, step: int, now: float) -> int:
        """A call that starts a memory checkpoint; returns the calls skipped since the last one."""
        if self.governor is not None:
            self.governor.tick(now, step, busy=True, starts=True)
        skipped, self.skips = self.skips, 0
        return skipped

    def report(self, step: int) -> int:
        """What this rank reports in the agreement on ``step`` (background thread): the newest step
        called with so far; it bounds the steps :meth:`in_flight_skip` skips meanwhile."""
        with self._lock:
            return max(self._called, step)

    def agreed(self, next_at: int) -> None:
        self.next_at = next_at

    def completed(self, keep: int) -> None:
        """A memory checkpoint completed on every rank: once ``keep + 1`` have (every slot, own and
        peers' copies, used once: first use costs seconds per step once), the governor judges."""
        if self.governor is not None and not self.governor.settled:
            self._completes += 1
            self.governor.settled = self._completes > keep

    def reset(self) -> None:
        """The run continues from a restored step: no memory checkpoint is due later than asked, and
        a governor times its first calls again."""
        self.next_at = None
        self._warm = WARM_CALLS if self.governor is not None else 0


__all__ = ["WARM_CALLS", "Cadence"]
