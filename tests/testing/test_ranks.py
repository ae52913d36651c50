"""The one rank launcher (ckpt.testing.ranks.launch): a clean run, the first failing rank's error
whatever order the parent notices exits in, termination of blocked peers, a deadline on a hang."""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from ckpt.testing.ranks import RankDied, RankError, RanksTimedOut, exit_rank, launch

pytestmark = pytest.mark.multiproc


def _sum(rank: int, world: int, out: str) -> None:
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(world)
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(int(t.item())))


def test_every_rank_runs_in_one_gloo_group(tmp_path) -> None:
    launch(3, _sum, str(tmp_path / "r"))
    assert [(tmp_path / f"r.{r}").read_text() for r in range(3)] == ["6"] * 3


def _late_consequence(rank: int, world: int, how: str) -> None:
    """The last rank fails first; every other rank then fails in a collective with it."""
    if rank == world - 1:
        if how == "raise":
            raise ValueError("the cause")
        if how == "exit":
            exit_rank(17)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.zeros(1))  # raises once the last rank is gone


@pytest.mark.parametrize("how", ["raise", "exit", "kill"])
def test_the_first_failing_rank_is_reported_not_its_peers(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The parent notices every exit at once, rank 0's first: what a loaded machine does when the parent
    # wakes late (the trainer-gpu OOM test once saw rank 0's "connection closed" instead of the OOM).
    real_wait = multiprocessing.connection.wait

    def all_at_once(sentinels: list[int], timeout: float | None = None) -> list[int]:
        for s in sentinels:
            real_wait([s], timeout)
        return sorted(sentinels)

    monkeypatch.setattr(multiprocessing.connection, "wait", all_at_once)
    with pytest.raises((RankError, RankDied)) as info:
        launch(3, _late_consequence, how, grace=1.0)
    e = info.value
    assert e.rank == 2  # type: ignore[union-attr]
    if how == "raise":
        assert isinstance(e, RankError) and isinstance(e, ProcessRaisedException)
        assert e.exc_type == "ValueError" and "the cause" in str(e)
    else:
        assert isinstance(e, RankDied) and isinstance(e, ProcessExitedException)
        assert e.exit_code == (17 if how == "exit" else -signal.SIGKILL)
        assert ("SIGKILL" in str(e)) == (how == "kill")


def _hang_unless_rank0(rank: int, world: int) -> None:
    if rank == 0:
        raise RuntimeError("rank 0 gives up")
    time.sleep(3600)  # blocked forever (no collective: only the launcher can end it)


def test_peers_of_a_failed_rank_are_terminated() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 0 gives up"):
        launch(2, _hang_unless_rank0, grace=0.5)
    assert time.monotonic() - t0 < 120  # bounds a hang only


def _sleep(rank: int, world: int) -> None:
    time.sleep(3600)


@pytest.mark.slow
def test_a_hang_ends_at_the_deadline() -> None:
    with pytest.raises(RanksTimedOut, match=r"ranks \[0, 1\] of 2 still running after 3 s"):
        launch(2, _sleep, timeout=3.0, grace=0.5)


@pytest.mark.slow  # each spawned rank imports torch afresh (~5 s)
def test_spawned_ranks_for_a_parent_that_touched_cuda(tmp_path) -> None:
    launch(2, _sum, str(tmp_path / "s"), start_method="spawn")
    assert [(tmp_path / f"s.{r}").read_text() for r in range(2)] == ["3"] * 2
