"""The memory tier's governor (:class:`ckpt.tier.pace.Governor`): it sets the background budget
from the step times so that steps with a memory checkpoint in flight stay within ``max_overhead`` of
steps without one.

Simulated training on a fake clock: a step takes ``base`` seconds (with noise) plus ``cost`` x the
budget in GB/s while a memory checkpoint of ``size`` bytes runs at that budget; between memory
checkpoints the governor's asked-for rests leave steps idle, as the tier's agreement does. Over
generated bases, costs, sizes and noise the governor converges to a budget whose true slowdown is
within the target (with a margin for the noise), never starves the tier when the target allows
more, and never leaves its bounds."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.errors import StateError
from ckpt.tier import TierConfig
from ckpt.tier.cadence import WARM_CALLS
from ckpt.tier.pace import Governor, Pacer, check_overhead, overhead_from_env


def _train(gov: Governor, *, base: float, cost: float, size: float, noise: float, steps: int,
           seed: int) -> list[tuple[float, bool]]:
    """Run ``steps`` steps; returns (true slowdown of the step, busy) per step. ``cost``: the slowdown
    per GB/s of budget (the traffic's cost grows with its rate); a paused step moves nothing."""
    rng = random.Random(seed)
    now, left, warm, out = 0.0, 0.0, WARM_CALLS, []  # the first memory checkpoint after WARM_CALLS idle steps
    for step in range(1, steps + 1):
        starts = warm == 0 and left <= 0
        if warm > 0:
            warm -= 1
        elif starts:
            left = size  # the next memory checkpoint starts here
        busy = left > 0
        gov.tick(now, step, busy, starts=starts)
        gbps = 0.0 if gov.pausing else gov.gbps
        slow = cost * gbps if busy else 0.0
        dt = base * (1 + slow) * (1 + rng.uniform(-noise, noise))
        now += dt
        out.append((slow, busy))
        if busy:
            left -= gbps * 1e9 * dt
    return out


@settings(max_examples=150, deadline=None)
@given(base=st.floats(0.05, 2.0), cost=st.floats(0.005, 0.5), size=st.floats(1e8, 2e10),
       noise=st.floats(0.0, 0.05), target=st.sampled_from([0.02, 0.05, 0.1]), seed=st.integers(0, 2**16))
def test_the_governor_keeps_the_slowdown_near_its_target(base: float, cost: float, size: float, noise: float,
                                                        target: float, seed: int) -> None:
    pacer = Pacer(None)
    gov = Governor(pacer, target, max_gbps=20.0)
    got = _train(gov, base=base, cost=cost, size=size, noise=noise, steps=3000, seed=seed)
    assert gov.min_gbps <= gov.gbps <= 20.0 and pacer.rate == gov.gbps * 1e9
    late = [slow for slow, busy in got[-1000:] if busy]
    assert late, "the tier checkpoints on in the last third"
    mean = sum(late) / len(late)
    # within the target, with room for what the medians of noisy steps let through (steps varying
    # by +-5% cannot resolve a 2% target: the reference itself is off by up to about the jitter)
    floor = cost * gov.min_gbps  # the slowdown at the lowest budget: a target below it is out of reach
    assert mean <= max(target, floor) * 1.1 + noise, (mean, gov.history[-5:])
    if floor > target * 1.1 and noise == 0:
        assert gov.gbps == gov.min_gbps
    best = min(target / cost, 20.0)  # the budget whose slowdown is the target (or the ceiling)
    if best > gov.min_gbps * 4 and noise <= target / 3:  # (noisier steps than that hide the slope)
        assert gov.gbps >= best * 0.4, (gov.gbps, best, gov.history[-5:])  # not starved


def test_the_budget_grows_to_its_ceiling_when_steps_do_not_slow_and_halves_when_they_do() -> None:
    pacer = Pacer(None)
    gov = Governor(pacer, 0.05, max_gbps=8.0)
    assert gov.gbps == Governor.START_GBPS and gov.wants_reference()
    clock = {"t": 0.0, "step": 0}

    def steps(n: int, per: float, busy: bool) -> None:  # n intervals of ``per`` s, busy or idle
        for _ in range(n):
            clock["step"] += 1
            gov.tick(clock["t"], clock["step"], busy)
            clock["t"] += per

    def window(per: float) -> None:  # busy steps of ``per`` s until the governor judged one more window
        judged = len(gov.history)
        for _ in range(3 * Governor.WINDOW):
            steps(1, per, True)
            if len(gov.history) > judged:
                return
        raise AssertionError("no window judged")

    steps(5, 0.1, False)  # the reference: 0.1 s per idle step (the 5th tick closes the 4th interval)
    steps(1, 0.1, True)  # (closes the 5th idle interval)
    assert not gov.wants_reference() and len(gov.idle) == 5
    rates = []
    for _ in range(Governor.STALE):  # windows as fast as the reference: the budget grows by 3/2
        window(0.1)
        rates.append(gov.gbps)
    assert rates == pytest.approx([1.5, 2.25, 3.375, 5.0625])
    # STALE windows: the reference is renewed at once by pausing the traffic
    assert gov.wants_reference() and gov.pauses == 1 and gov.pausing and pacer.paused
    steps(Governor.PAUSE, 0.1, True)
    assert not gov.pausing and not pacer.paused and len(gov.idle) == 5 + Governor.PAUSE - 1
    assert not gov.wants_reference()
    window(0.1)
    window(0.1)
    assert gov.gbps == 8.0  # the ceiling
    window(0.2)  # steps twice as slow: at most halved per window
    assert gov.gbps == pytest.approx(4.0) and gov.measured == pytest.approx(1.0)
    for _ in range(12):
        window(0.2)
    assert gov.gbps == Governor.MIN_GBPS  # never below the floor
    pacer.resume()


def test_a_pause_ends_when_its_checkpoint_ends_or_a_new_one_starts() -> None:
    """A step that starts a memory checkpoint (its snapshot) or has none in flight ends the pause:
    the pacer resumes, and the snapshot's step is never timed as a step without traffic."""
    for ender in ("starts", "idle"):
        pacer = Pacer(None)
        gov = Governor(pacer, 0.05)
        for step in range(1, 6):
            gov.tick(step * 0.1, step, step == 5)
        gov.windows_since_idle = Governor.STALE  # the reference is old: the next busy step pauses
        gov.tick(0.6, 6, True)
        assert gov.pausing and pacer.paused
        gov.tick(0.7, 7, True)  # (the first paused step: not timed)
        n = len(gov.idle)
        if ender == "starts":
            gov.tick(0.8, 8, True, starts=True)  # the previous finished, a new one starts
            assert not gov.pausing and not pacer.paused and len(gov.idle) == n + 1
            gov.tick(5.0, 9, True)
            assert len(gov.idle) == n + 1 and gov.busy[-1] == pytest.approx(4.2)  # the snapshot's step: busy
        else:
            gov.tick(0.8, 8, False)
            assert not gov.pausing and not pacer.paused and len(gov.idle) == n + 1


def test_steps_are_per_step_across_memory_every_and_restarts_are_no_interval() -> None:
    gov = Governor(Pacer(None), 0.05)
    gov.tick(0.0, 10, False)
    gov.tick(1.0, 20, False)  # memory_every 10: 0.1 s per step
    gov.tick(0.5, 5, False)  # the step count restarted (a restore): not an interval
    gov.tick(0.6, 6, True)
    assert gov.idle == [pytest.approx(0.1), pytest.approx(0.1)]


def test_a_released_pacer_stays_released_whatever_the_governor_says() -> None:
    pacer = Pacer(None)
    gov = Governor(pacer, 0.05, start_gbps=2.0)
    assert pacer.rate == 2e9
    pacer.release()
    for step in range(1, 80):
        gov.tick(step * 0.1, step, step > 4)
    assert pacer.rate is None and pacer.released and not pacer.paused and gov.pauses > 0


def test_a_pause_holds_takes_until_resumed_expired_released_or_their_deadline() -> None:
    import threading
    import time

    pacer = Pacer(None)
    pacer.pause(30.0)
    assert pacer.paused
    t = time.monotonic()
    pacer.take(10, deadline=time.monotonic() + 0.2)  # the caller's deadline comes first
    assert 0.15 < time.monotonic() - t < 5 and pacer.taken == 10
    for lift in (pacer.resume, pacer.release):
        pacer.pause(30.0)
        done = threading.Event()
        th = threading.Thread(target=lambda d=done: (pacer.take(5), d.set()))
        th.start()
        assert not done.wait(0.2)  # held
        lift()
        assert done.wait(5) and not pacer.paused
        th.join()
    pacer.pause(30.0)  # released: a pause no longer holds
    assert not pacer.paused
    short = Pacer(None)
    short.pause(0.2)  # a pause nobody lifts ends by itself
    t = time.monotonic()
    short.take(1)
    assert 0.1 < time.monotonic() - t < 5


@pytest.mark.parametrize("bad", [0, 1, -0.1, 1.5, float("nan"), "0.05", True])
def test_bad_overheads_are_refused_by_name(bad: object) -> None:
    with pytest.raises(StateError, match="max_overhead"):
        check_overhead(bad)  # type: ignore[arg-type]
    with pytest.raises(StateError, match="max_overhead"):
        TierConfig("/r", busy="skip", max_overhead=bad)  # type: ignore[arg-type]


def test_a_governor_needs_busy_skip_and_the_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StateError, match="busy='skip'"):
        TierConfig("/r", max_overhead=0.05)
    assert TierConfig("/r", busy="skip", max_overhead=0.05).max_overhead == 0.05
    monkeypatch.setenv("CKPT_TIER_MAX_OVERHEAD", "0.1")
    assert overhead_from_env(None) == 0.1
    monkeypatch.setenv("CKPT_TIER_MAX_OVERHEAD", "0")
    assert overhead_from_env(0.05) is None  # 0: no governor
    for bad in ("fast", "1", "-0.2", "nan"):
        monkeypatch.setenv("CKPT_TIER_MAX_OVERHEAD", bad)
        with pytest.raises(StateError, match="CKPT_TIER_MAX_OVERHEAD"):
            overhead_from_env(None)
    monkeypatch.setenv("CKPT_TIER_MAX_OVERHEAD", "0.05")
    with pytest.raises(StateError, match="busy='skip'"):
        TierConfig("/r").governed(overhead_from_env(None))


def test_the_record_carries_the_budget_and_the_measured_slowdown() -> None:
    from ckpt.tier.types import MemoryCheckpoint

    rec = MemoryCheckpoint(3, True, budget_gbps=1.23456, overhead=0.031234).to_record()
    assert rec["budget_gbps"] == 1.235 and rec["overhead"] == 0.0312
    plain = MemoryCheckpoint(3, True).to_record()
    assert "budget_gbps" not in plain and "overhead" not in plain
    assert math.isfinite(rec["budget_gbps"])


def test_an_unsettled_governor_measures_but_never_moves_the_budget() -> None:
    """The tier's first memory checkpoints allocate and pin slots (seconds per step, once): the
    governor keeps its first budget until the tier says every slot was used once."""
    gov = Governor(Pacer(None), 0.05, settled=False)
    t = 0.0
    for step in range(1, 6):
        gov.tick(t, step, False)
        t += 0.1
    for step in range(6, 6 + 5 * Governor.WINDOW):
        gov.tick(t, step, True)
        t += 5.0 if step % 3 == 0 else 0.3  # slots pinned beside training
    assert gov.gbps == Governor.START_GBPS and gov.history == [] and gov.pauses == 0
    gov.settled = True
    first = step + 1
    for later in range(first, first + Governor.WINDOW + 1):  # (the window under way completes first)
        gov.tick(t, later, True)
        t += 0.3
        if gov.history:
            break
    assert gov.gbps == pytest.approx(Governor.START_GBPS / 2) and len(gov.history) == 1


def _mismatched(rank: int, world: int, shm: str, out: str, env: str) -> None:
    import json
    import os

    from ckpt.tier import MemoryTier

    if rank == 1:
        os.environ["CKPT_TIER_MAX_OVERHEAD"] = env
    try:
        MemoryTier(TierConfig("/r", shm_dir=shm, nodes=2, timeout=30, busy="skip"))
        got = "built"
    except StateError as e:
        got = str(e)
    with open(out, "a") as f:
        f.write(json.dumps({"rank": rank, "got": got}) + "\n")


@pytest.mark.multiproc
@pytest.mark.parametrize("env,says", [("0.05", "ranks [1] differ from rank 0"), ("lots", "CKPT_TIER_MAX_OVERHEAD")])
def test_ranks_that_differ_in_governing_are_refused_on_every_rank(shm: str, tmp_path: Path, env: str,
                                                                 says: str) -> None:
    """A governor changes which calls start a memory checkpoint: a rank with one beside a rank
    without (a per-process environment variable) would pair collectives of different steps. Every
    rank refuses at setup instead, naming the odd one; a bad value on one rank too."""
    import json

    from tests.dist_utils import run_ranks

    out = tmp_path / "out.jsonl"
    run_ranks(2, _mismatched, shm, str(out), env)
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == 2 and all(says in g["got"] for g in got), got
