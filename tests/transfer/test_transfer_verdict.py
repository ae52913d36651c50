"""The commit verdict's choice of error (``ckpt._transfer_coord.pick_error``), pure: over generated wait
graphs, a failure that left ranks waiting for it (and ranks waiting for those) is what every rank
raises, not a wait of a rank that was itself waiting."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt._transfer_coord import pick_error, rank_payload
from ckpt.errors import CollectiveError


def _wait(rank: int, peer: int) -> dict[str, Any]:
    return rank_payload(CollectiveError(f"transfer data: no message to or from rank {peer} within 2 s"), rank,
                        primary=False, timed_out=True, waited=peer)


@st.composite
def _graphs(draw: Any) -> tuple[list[dict[str, Any]], int]:
    """Every rank's report: the culprit's own failure (a primary error, or a post that failed, which is
    not), ranks that waited for a rank already in the graph (so every wait leads to the culprit), and ranks
    that succeeded; returns the reports and the culprit."""
    world = draw(st.integers(2, 9))
    culprit = draw(st.integers(0, world - 1))
    got: list[dict[str, Any]] = [{"ok": True} for _ in range(world)]
    got[culprit] = rank_payload(RuntimeError("injected"), culprit, primary=draw(st.booleans()))
    in_graph = [culprit]
    for r in draw(st.permutations([r for r in range(world) if r != culprit])):
        if draw(st.booleans()):
            got[r] = _wait(r, draw(st.sampled_from(in_graph)))
            in_graph.append(r)
    return got, culprit


@settings(max_examples=300, deadline=None)
@given(_graphs())
def test_the_waits_are_followed_to_the_rank_that_failed(graph: tuple[list[dict[str, Any]], int]) -> None:
    got, culprit = graph
    chosen = pick_error(got)
    if got[culprit]["primary"] or all("waited" not in g for g in got):
        assert chosen is got[culprit]  # its own failure (or nobody waited for it)
    else:  # a consequence on the culprit (e.g. its post failed): the last wait of the chain names it
        assert chosen is not None and chosen.get("waited") == culprit and chosen["timed_out"], chosen


def test_a_wait_for_a_rank_that_succeeded_stands_and_circles_end() -> None:
    got = [_wait(0, 2), {"ok": True}, {"ok": True}]
    assert pick_error(got) is got[0]  # (rank 2 was slow and got there after all: rank 0's wait names it)
    got = [_wait(0, 1), _wait(1, 0)]
    assert pick_error(got) in got  # (each waited for the other: no end, no loop)
    got = [_wait(0, 7), {"ok": True}]
    assert pick_error(got) is got[0]  # (a rank out of range: the wait stands)
    own = rank_payload(RuntimeError("packing failed"), 1)
    got = [_wait(0, 2), own, _wait(2, 0)]
    assert pick_error(got) is own  # (a rank's own failure first, as before)
    # a hung sender (rank 0) whose late post found the connection closed by the rank that gave up on it
    closed = rank_payload(CollectiveError("transfer data: could not post messages (connection closed)"), 0,
                          primary=False)
    got = [closed, _wait(1, 0)]
    assert pick_error(got) is got[1]  # "no message to or from rank 0 within 2 s", not the closed connection
    assert pick_error([{"ok": True}] * 3) is None


def test_a_report_says_whom_its_wait_was_for_only_when_it_ran_out() -> None:
    assert rank_payload(RuntimeError("x"), 0, timed_out=True, waited=3)["waited"] == 3
    assert "waited" not in rank_payload(RuntimeError("x"), 0, timed_out=False, waited=3)
