"""The metadata exchange tree (ckpt._comm, fan-in ``FANIN``): its shape, the same results as the flat
star, fewer coordinator bytes for what every rank gets, and the failure semantics kept (every wait
bounded by ``timeout``, a missing rank named). Real gloo groups on forked processes, with a fan-in
of 2 so that a few ranks make a tree of depth 2: 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import ckpt
from ckpt import _comm as comm_mod
from ckpt._comm import Comm, tree_below, tree_children, tree_parent
from tests.dist.forked import SLACK, assert_typed, names_rank, outcome, run_forked, stall


@pytest.mark.parametrize("fanin", [0, 1, 2, 3, 8])
def test_tree_covers_every_rank_once(fanin: int) -> None:
    for world in range(1, 80):
        assert tree_below(0, world, fanin) == list(range(1, world))
        for v in range(1, world):
            p = tree_parent(v, world, fanin)
            assert p < v and v in tree_children(p, world, fanin)
        if fanin == 0 or world - 1 <= fanin:
            assert tree_children(0, world, fanin) == list(range(1, world))  # the flat star
        else:
            assert all(len(tree_children(v, world, fanin)) <= fanin for v in range(world))


def test_tree_depth_at_64_ranks_with_fanin_8() -> None:
    assert tree_children(0, 64, 8) == list(range(1, 9))
    assert tree_children(1, 64, 8) == list(range(9, 17)) and tree_children(7, 64, 8) == list(range(57, 64))
    assert all(not tree_children(v, 64, 8) for v in range(9, 64))  # depth 2
    assert comm_mod.FANIN == 8


def _happy(rank: int, world: int, fanin: int, timeout: float) -> dict[str, Any]:
    c = Comm(None, fanin=fanin)
    got = c.exchange({"r": rank, "pad": "x" * rank},
                     lambda objs: [{"to": i, "from": objs[i]["r"]} for i in range(world)], timeout=timeout, what="test")
    before = c.sent
    big = c.broadcast(b"\x01" * 100_000 if rank == 0 else None, timeout=timeout)
    bcast_sent = c.sent - before
    off_root = c.broadcast_bytes(b"\x02" * 1000 if rank == 3 else None, src=3, timeout=timeout)
    everyone = c.gather(rank * 10, timeout=timeout)
    before = c.sent
    verdict = {"ok": "y" * 50_000}
    same = c.send_each([verdict] * world, timeout=timeout) if rank == 0 else c.recv_one(timeout=timeout)
    verdict_sent = c.sent - before
    return {"got": got, "big": len(big), "off_root": off_root == b"\x02" * 1000, "all": everyone,
            "same": same == verdict, "bcast_sent": bcast_sent, "verdict_sent": verdict_sent}


@pytest.mark.multiproc
@pytest.mark.parametrize("fanin", [2, 0])
def test_tree_gives_the_flat_results_with_fewer_coordinator_bytes(fanin: int) -> None:
    world = 7
    res = run_forked(world, _happy, fanin, 10.0)
    for r, x in enumerate(res):
        assert x["got"] == {"to": r, "from": r} and x["big"] == 100_000 and x["off_root"] and x["same"]
        assert x["all"] == ([10 * i for i in range(world)] if r == 0 else None)
    root_copies = 2 if fanin == 2 else world - 1  # what the coordinator sends of a message for everyone
    assert 100_000 * root_copies <= res[0]["bcast_sent"] < 100_000 * root_copies + 1000
    assert 50_000 * root_copies <= res[0]["verdict_sent"] < 50_000 * root_copies + 1000
    if fanin == 2:  # a relaying rank passes each of its children one copy
        assert 200_000 <= res[1]["bcast_sent"] < 201_000 and res[3]["bcast_sent"] == 0


# --- failures inside the tree ---------------------------------------------------------------------

def _stall_or_crash(rank: int, world: int, culprit: int, how: str, timeout: float) -> dict[str, Any]:
    c = Comm(None, fanin=2)
    if rank == culprit:
        if how == "crash":
            os._exit(0)  # gone without a word
        stall(rank, world)  # alive but silent past everyone's deadline (until they have all reported)
        return {}
    return outcome(lambda: c.exchange({"r": rank}, lambda objs: objs, timeout=timeout, what="save test"))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("culprit,how", [(5, "stall"), (6, "crash"), (1, "stall"), (2, "crash")])
def test_a_failure_in_the_tree_reaches_every_rank_within_the_timeout(culprit: int, how: str) -> None:
    timeout = 1.5
    res = run_forked(7, _stall_or_crash, culprit, how, timeout)
    for r, x in enumerate(res):
        if r == culprit:
            continue
        # a rank waits at most one timeout per half of the exchange
        assert_typed(x, 2 * timeout + SLACK, cls="CollectiveError", has=("restart the job",))
    parent = (culprit - 1) // 2
    # the culprit is named by the rank waiting for it; the coordinator names it, or the rank that
    # relays it (with the ranks it relays)
    # (on a loaded machine a slow sibling may be named with it: "[5, 6]")
    assert names_rank(res[parent]["msg"], culprit), res[parent]
    assert str(culprit) in res[0]["msg"], res[0]
    if culprit in (1, 2):  # its children could not reach it
        for child in (2 * culprit + 1, 2 * culprit + 2):
            assert f"rank {culprit}" in res[child]["msg"], res[child]


def _lost_leaf_reported_by_its_relay(rank: int, world: int, timeout: float) -> dict[str, Any]:
    c = Comm(None, fanin=2)
    if rank == 6:
        os._exit(0)
    return outcome(lambda: c.gather({"r": rank}, timeout=timeout, what="save test"))


@pytest.mark.multiproc
def test_a_dead_leaf_is_named_on_the_coordinator() -> None:
    res = run_forked(7, _lost_leaf_reported_by_its_relay, 5.0)
    assert res[6].get("crashed")
    assert_typed(res[2], 5.0 + SLACK, cls="CollectiveError", has=("rank(s) [6] did not report",))
    # the coordinator gets the relay's own words (or, when the relay's send failed too, names the relay)
    assert "[6]" in res[0]["msg"] or "rank 2 relays rank(s) [5, 6]" in res[0]["msg"], res[0]
    assert res[0]["type"] == "CollectiveError"


def _dead_and_slow(rank: int, world: int, timeout: float, op: str) -> dict[str, Any]:
    import time

    c = Comm(None, fanin=0)
    if rank == 1:
        os._exit(0)  # gone at once: the coordinator sees the connection lost, long before the timeout
    if rank == 2:
        time.sleep(1.5)  # healthy, only slow: it reports after the coordinator has given up
    if op == "gather":
        return outcome(lambda: c.gather({"r": rank}, timeout=timeout, what="save test"))
    return outcome(lambda: c.exchange({"r": rank}, lambda got: got, timeout=timeout, what="save test"))


@pytest.mark.multiproc
@pytest.mark.parametrize("op", ["gather", "exchange"])
def test_a_slow_rank_is_not_blamed_for_a_dead_one(op: str) -> None:
    """The coordinator stops waiting as soon as one peer is lost; a peer that had not reported by then
    is said to be late, apart from the lost one, not named as at fault. In an exchange the late rank
    is then told that no reply will come (it reported after all), with the same words."""
    res = run_forked(3, _dead_and_slow, 20.0, op)
    assert res[1].get("crashed")
    assert_typed(res[0], 20.0, cls="CollectiveError", has=("rank(s) [1] did not report (connection lost",
                                                           "rank(s) [2] had not reported yet either"))
    assert res[0]["elapsed"] < 1.5, res[0]  # not the timeout, not the slow rank's delay
    if op == "exchange":
        assert_typed(res[2], 20.0, cls="CollectiveError", has=("rank(s) [1] did not report",))


def _dead_and_slow_payloads(rank: int, world: int, timeout: float) -> dict[str, Any]:
    """Ranks 1 and 2 send heads announcing payloads too big to go inline; then rank 1 dies before its
    payload and rank 2 sends its own late (healthy, only slow)."""
    import time

    c = Comm(None, fanin=0)

    class Slow:  # the group, with this rank's second send (the payload) held back
        def __init__(self, g: Any) -> None:
            self.g, self.n = g, 0

        def send(self, *args: Any) -> Any:
            self.n += 1
            if self.n == 2:
                time.sleep(0.3 if rank == 1 else 1.5)  # (rank 1: its head is on the wire first)
                if rank == 1:
                    os._exit(0)
            return self.g.send(*args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.g, name)

    if rank in (1, 2):
        c.cpu_group = Slow(c.cpu_group)
    return outcome(lambda: c.gather("x" * (comm_mod.INLINE + 100), timeout=timeout, what="save test"))


@pytest.mark.multiproc
def test_a_slow_payload_is_not_blamed_for_a_dead_one() -> None:
    res = run_forked(3, _dead_and_slow_payloads, 20.0)
    assert res[1].get("crashed")
    assert_typed(res[0], 20.0, cls="CollectiveError", has=("could not receive from rank 1 (connection lost",
                                                           "rank(s) [2] had not sent theirs in full yet either"))
    assert res[0]["elapsed"] < 1.5, res[0]


def _dead_and_slow_receivers(rank: int, world: int, timeout: float) -> dict[str, Any]:
    """The coordinator sends each rank a reply too big to go inline; rank 1 is gone before it takes
    its own, rank 2 takes its own late (healthy, only slow)."""
    import time

    c = Comm(None, fanin=0)
    if rank == 0:
        return outcome(lambda: c.send_each(["x" * (comm_mod.INLINE + 100)] * world, timeout=timeout,
                                           what="save test"))
    if rank == 1:
        os._exit(0)
    time.sleep(1.5)
    return outcome(lambda: c.recv_one(timeout=timeout, what="save test"))


@pytest.mark.multiproc
def test_a_slow_receiver_is_not_blamed_for_a_dead_one() -> None:
    """Sends as receives: once one peer is lost, one that had not taken its message yet is late, not lost."""
    res = run_forked(3, _dead_and_slow_receivers, 20.0)
    assert res[1].get("crashed")
    assert_typed(res[0], 20.0, cls="CollectiveError", has=("rank(s) [2] had not taken theirs yet either",))
    head = res[0]["msg"].split(" (rank(s) [2] had not taken")[0]
    assert names_rank(head, 1) and not names_rank(head, 2), res[0]
    assert res[0]["elapsed"] < 1.5, res[0]
    assert res[2]["type"] == "CollectiveError" and names_rank(res[2]["msg"], 1), res[2]


def _late_leaf_with_a_verdict(rank: int, world: int, timeout: float) -> dict[str, Any]:
    """Tree 0 -> 1, 2; 1 -> 3, 4; 2 -> 5. Rank 5 stalls. Rank 3 (a leaf below rank 1) never reports: it
    waits for bytes from rank 5 first (as a memory tier copy waits for a peer's), a little less long
    than rank 1 will wait for it; when that wait times out gloo closes its connections (rank 1 sees it
    lost), then it posts what it saw and raises, as the tier does."""
    import datetime

    from ckpt.errors import CollectiveError

    c = Comm(None, fanin=2)
    if rank == 5:
        stall(rank, world)
        return {}
    if rank == 3:
        def copy_from_5() -> None:
            try:
                c.cpu_group.recv([torch.zeros(8, dtype=torch.uint8)], 5, 7).wait(
                    datetime.timedelta(seconds=timeout - 0.5))
            except Exception:  # noqa: BLE001 - the copy's timeout: gloo closed this rank's connections
                seen = CollectiveError("tier copy: rank 3 could not receive from rank 5 within the timeout")
                raise c.post_or_heard(seen, timeout) or seen from None

        return outcome(copy_from_5)
    return outcome(lambda: c.gather({"r": rank}, timeout=timeout, what="save test"))


@pytest.mark.multiproc
def test_a_late_leaf_is_not_blamed_for_the_peer_it_waited_for() -> None:
    """A parent whose deadline for a leaf passes looks for a verdict (for a relay it waits a grace for
    one), and raises that: the rank the leaf waited for is named, not the leaf (rank 1 named rank 3
    before; rank 2, which waits for rank 5 itself, names it either way)."""
    res = run_forked(6, _late_leaf_with_a_verdict, 1.5)
    assert res[4]["type"] is None  # (a leaf's gather ends once its parent took its message)
    for r in (0, 1, 2, 3):
        assert_typed(res[r], 2 * 1.5 + SLACK, cls="CollectiveError")
        assert names_rank(res[r]["msg"], 5), (r, res[r])
    assert "could not receive from rank 5" in res[1]["msg"] and "gave up on rank(s) [3]" in res[1]["msg"], res[1]


# --- ckpt.save / ckpt.load over a tree ------------------------------------------------------------

def _save_load_on_tree(rank: int, world: int, path: str, bad: int | None) -> dict[str, Any]:
    comm_mod.FANIN = 2
    full = torch.arange(world * 4 * 6, dtype=torch.float32).reshape(world * 4, 6)
    rows = ckpt.Shard(full[rank * 4:(rank + 1) * 4].clone(), tuple(full.shape), (rank * 4, 0))
    if bad == rank:  # a region outside the tensor: a StateError/LayoutError on this rank only
        rows = ckpt.Shard(torch.zeros(4, 6), tuple(full.shape), (world * 4, 0))
    res = outcome(lambda: ckpt.save({"w": rows, "step": 3}, path, timeout=20.0))
    if bad is not None:
        return res
    assert res["type"] is None, res
    cols = torch.zeros(world * 4, 2)
    out = ckpt.load({"w": ckpt.Shard(cols, tuple(full.shape), (0, 2 * (rank % 3))), "step": 0}, path, timeout=20.0)
    assert torch.equal(cols, full[:, 2 * (rank % 3):2 * (rank % 3) + 2]) and out["step"] == 3
    return {"ok": True}


@pytest.mark.multiproc
def test_ckpt_save_and_resharded_load_over_a_tree(tmp_path) -> None:
    res = run_forked(5, _save_load_on_tree, str(tmp_path / "c"), None)
    assert all(x == {"ok": True} for x in res)
    assert ckpt.verify(str(tmp_path / "c"), deep=True).ok


@pytest.mark.multiproc
def test_a_bad_state_on_a_relayed_rank_fails_every_rank_typed(tmp_path) -> None:
    res = run_forked(5, _save_load_on_tree, str(tmp_path / "c"), 4)  # rank 4's parent is rank 1
    for x in res:
        assert_typed(x, 20.0, has=("rank 4",))
        assert x["typed"] and x["type"] != "CollectiveError", x
    assert not os.path.exists(tmp_path / "c" / "manifest.msgpack")


def _sizes(rank: int, world: int) -> dict[str, Any]:
    from ckpt._comm import INLINE

    c = Comm(None, fanin=2)
    got = []
    for n in (0, 1, INLINE - 1, INLINE, INLINE + 1, 3 * INLINE):  # around the head's inline capacity
        data = bytes((rank + i) % 251 for i in range(n))
        everyone = c.gather(data, timeout=10)
        back = c.broadcast_bytes(bytes(range(256)) * (n // 256) + bytes(n % 256) if rank == 0 else None, timeout=10)
        got.append([everyone == [bytes((r + i) % 251 for i in range(n)) for r in range(world)] if rank == 0
                    else everyone is None, back == bytes(range(256)) * (n // 256) + bytes(n % 256)])
    return {"ok": got}


@pytest.mark.multiproc
def test_messages_of_every_size_around_the_inline_head_arrive_whole() -> None:
    res = run_forked(5, _sizes)
    assert all(all(a and b for a, b in r["ok"]) for r in res), res


@pytest.mark.parametrize("timeout", [0, -5, float("nan"), True, "10"])
def test_a_timeout_no_wait_can_keep_is_a_state_error_before_anything_is_written(tmp_path, timeout: Any) -> None:
    """Zero, negative, NaN or non-numeric: every wait would give up at once (and a gloo wait that
    gives up closes the metadata group), so the one place timeouts become deadlines refuses it."""
    with pytest.raises(ckpt.StateError, match="timeout must be a positive number of seconds or None"):
        Comm(None, timeout=timeout)
    with pytest.raises(ckpt.StateError, match="timeout must be a positive number of seconds or None"):
        comm_mod._deadline(timeout)
    with pytest.raises(ckpt.StateError, match="timeout must be a positive"):
        ckpt.save({"w": torch.ones(2)}, str(tmp_path / "c"), timeout=timeout)
    assert not (tmp_path / "c").exists()
    assert comm_mod.check_timeout(None) is None and comm_mod.check_timeout(0.5) == 0.5
