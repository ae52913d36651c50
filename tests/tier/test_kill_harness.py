"""SIGKILL during memory-tier snapshots and the background writes, copies, agreements and frees never
restores a torn state (see tests/tier/kill_harness.py; ``python -m tests.tier.kill_harness --trials 60``
runs more)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tier.kill_harness import KILL_POINTS, run_trials, summarize

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_kill_9_during_the_memory_tier_never_restores_a_torn_state(shm: str) -> None:
    trials = run_trials(str(Path(shm)), random_trials=14, targeted_rounds=1, seed=18)
    s = summarize(trials)
    assert s["ok"] == s["trials"] == 14 + len(KILL_POINTS), s["failures"]
    assert s["node_loss"] >= 8  # half of them lose a whole node, not just a process
    # the targeted kills land where they aim: the snapshot, the write, the copy, the agreement, the free
    assert {"snapshot", "write", "replicate", "agree", "free"} <= set(s["phases"]), s["phases"]
    assert sum(t.restored is not None and t.complete_before > 0 for t in trials) >= 10  # real restores
