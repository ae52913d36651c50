"""Threads of one process saving (and loading) their own checkpoints at the same time.

The plan cache of a group (``ckpt.save``) holds one save's plan from planning to commit; shared by
two threads' saves it was cleared and refilled under each other, and the commit then compared this
save's fingerprint with another save's (a spurious CollectiveError, or an IndexError on an emptied
list). The async saver of a group (``ckpt.async_save``) was shared the same way: two threads' saves
staged through one pool at once (a committed checkpoint held the other thread's bytes) and joined a
thread not yet started. Every save here must succeed and read back bitwise, with no process group
and inside a one-rank gloo group (where ``group=None`` is the default group).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.save import _SYNC_CACHES
from tests.dist_utils import run_ranks
from tests.helpers import random_state

# structures: shapes of the state's tensors; threads sharing one reuse each other's cached plan
_SHAPES: list[list[tuple[int, ...]]] = [[(6, 5)], [(6, 5), (3,)], [(2, 3, 4)], [(7, 1), (4, 4)], [(129, 33)]]


def _round_trip(url: str, structure: int, seed: int, use_async: bool) -> None:
    """Save a state at ``url``, load it into a fresh one, and require the very same bits."""
    state = {"model": random_state(seed, {f"t{i}": s for i, s in enumerate(_SHAPES[structure])}),
             "meta": {"seed": seed}}
    if use_async:
        ckpt.async_save(state, url).done()
    else:
        ckpt.save(state, url)
    out = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "meta": None}
    got = ckpt.load(out, url)
    assert got["meta"] == {"seed": seed}, (url, got["meta"])
    for k, v in state["model"].items():
        assert torch.equal(out["model"][k].view(torch.int32), v.view(torch.int32)), (url, k)


def _run_threads(schedules: list[list[tuple[int, bool]]], root: str) -> None:
    """Thread t performs ``schedules[t]`` (structure, async?) in order; every step starts together
    (a barrier) so that the saves overlap. Re-raises the first failure of any thread."""
    steps = max(len(s) for s in schedules)
    barrier = threading.Barrier(len(schedules), timeout=120)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        for i in range(steps):
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                return
            if i >= len(schedules[t]):
                continue
            structure, use_async = schedules[t][i]
            try:
                _round_trip(f"{root}/t{t}-s{i}", structure, seed=1000 * t + i, use_async=use_async)
            except BaseException as e:  # noqa: BLE001 - reported by the caller, with the thread and step
                errors.append(RuntimeError(f"thread {t} step {i}: {type(e).__name__}: {e}"))
                barrier.abort()
                return

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(schedules))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
        assert not th.is_alive(), "a saving thread hung"
    if errors:
        raise errors[0]


def _mixed_schedules(threads: int, steps: int, use_async: bool) -> list[list[tuple[int, bool]]]:
    # half the threads share one structure (cache hits), the others change theirs every step
    # (the cache is cleared and refilled while the first half's saves use it)
    return [[(0 if t < threads // 2 else (t + i) % len(_SHAPES), use_async) for i in range(steps)]
            for t in range(threads)]


def test_threads_save_and_load_their_own_checkpoints(tmp_path):
    _run_threads(_mixed_schedules(8, 6, use_async=False), str(tmp_path))


def test_threads_async_save_their_own_checkpoints(tmp_path):
    _run_threads(_mixed_schedules(6, 4, use_async=True), str(tmp_path))


def test_a_plan_cached_by_one_thread_serves_the_next_thread(tmp_path):
    """The cache is per group, not per thread: a save of the same structure from another thread,
    after the first finished, reuses the plan (no planning exchange) and reads back bitwise."""
    _SYNC_CACHES.clear()
    done: list[int] = []

    def one(i: int) -> None:
        _round_trip(str(tmp_path / f"c{i}"), 1, seed=i, use_async=False)
        done.append(i)

    for i in range(3):
        th = threading.Thread(target=one, args=(i,))
        th.start()
        th.join()
    assert done == [0, 1, 2]
    assert _SYNC_CACHES[id(None)].hits == 2


@settings(max_examples=12, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, len(_SHAPES) - 1), st.booleans()), min_size=1, max_size=3),
                min_size=2, max_size=5))
def test_generated_thread_schedules_all_round_trip(schedules):
    """Any schedule of sync and async saves of any structures, from 2-5 threads at once."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        _run_threads(schedules, root)


def _in_one_rank_group(rank: int, world: int, root: str, body: Callable[[str], None]) -> None:
    assert torch.distributed.is_initialized() and world == 1
    body(root)


def _sync_and_async(root: str) -> None:
    _run_threads(_mixed_schedules(6, 4, use_async=False), f"{root}/sync")
    _run_threads(_mixed_schedules(4, 3, use_async=True), f"{root}/async")


@pytest.mark.multiproc
def test_threads_save_in_a_one_rank_gloo_group(tmp_path):
    run_ranks(1, _in_one_rank_group, str(tmp_path), _sync_and_async)
