"""Pure parts of the memory tier: node identity, who keeps whose copies, restore planning."""

from __future__ import annotations

import itertools

import pytest

from ckpt.errors import StateError
from ckpt.tier import TierConfig, node_identity, plan_restore, replica_holders, run_id_for, senders_to


def test_node_identity_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPT_NODE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert node_identity(3, 4) == 0  # one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert [node_identity(r, 4) for r in range(4)] == [0, 0, 1, 1]  # torchrun's contiguous ranks
    monkeypatch.setenv("CKPT_NODE", "5")
    assert node_identity(0, 4) == 5
    assert [node_identity(r, 8, nodes=4) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert node_identity(0, 4, node=2, nodes=4) == 2
    monkeypatch.setenv("CKPT_NODE", "x")
    with pytest.raises(StateError, match="CKPT_NODE='x'"):
        node_identity(0, 4)
    with pytest.raises(StateError, match="must divide the 4 ranks"):
        node_identity(0, 4, nodes=3)


@pytest.mark.parametrize("nodes", [[0, 0, 1, 1], [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2], [0, 0, 0, 1],
                                   [3, 3, 7, 7, 9, 9, 9, 9]])
@pytest.mark.parametrize("replicas", [1, 2])
def test_losing_any_one_node_loses_no_piece(nodes: list[int], replicas: int) -> None:
    holders = replica_holders(nodes, replicas)
    n_other = len(set(nodes)) - 1
    for r, hs in enumerate(holders):
        assert len(hs) == min(replicas, n_other)
        assert all(nodes[h] != nodes[r] for h in hs)  # never on the owner's node
        assert len({nodes[h] for h in hs}) == len(hs)  # each copy on a different node
    for lost in set(nodes):
        for r in range(len(nodes)):
            assert nodes[r] != lost or any(nodes[h] != lost for h in holders[r]), (lost, r)
    senders = senders_to(holders)
    assert sorted((s, h) for h, ss in enumerate(senders) for s in ss) == sorted(
        (r, h) for r, hs in enumerate(holders) for h in hs)


def test_copies_spread_over_the_next_node() -> None:
    assert replica_holders([0, 0, 1, 1], 1) == [[2], [3], [0], [1]]
    assert replica_holders([0, 0, 0, 0], 1) == [[], [], [], []]  # one node: no peer copies
    assert replica_holders([0, 0, 1, 1], 0) == [[], [], [], []]


def test_run_id() -> None:
    assert run_id_for("/a/b") == run_id_for("/a/b/") != run_id_for("/a/c")
    assert run_id_for("/a/b", "job-7") == "job-7"
    with pytest.raises(StateError, match="run id '../x'"):
        run_id_for("/a", "../x")
    with pytest.raises(StateError, match="keep at least 1"):
        TierConfig("/a", keep=0)


def _rep(digest: str, own: list[tuple[int, str]] = (), held: list[tuple[int, int, str]] = (),  # type: ignore[assignment]
         d: str | None = None) -> dict[str, object]:
    return {"digest": digest, "own": [[s, e, d or digest] for s, e in own],
            "held": [[o, s, e, dd] for o, s, e, dd in held]}


def test_plan_prefers_own_copies_then_peers_newest_first() -> None:
    reports = [
        _rep("a0", own=[(4, "e"), (5, "e")], held=[(2, 5, "e", "a2"), (2, 4, "e", "a2")]),
        _rep("a1", own=[(4, "e"), (5, "e")], held=[(3, 4, "e", "a3")]),  # rank 3's step 5 copy was not kept
        _rep("a2"),  # node 1 lost: no own copies
        _rep("a3"),
    ]
    cands, notes = plan_restore(reports)
    assert [c.step for c in cands] == [4]
    assert cands[0].sources == [[0], [1], [0], [1]]
    assert any("step 5: no copy of rank(s) [3]" in n for n in notes)
    reports[3] = _rep("a3", own=[(5, "e"), (4, "e")])
    cands, _ = plan_restore(reports)
    assert [c.step for c in cands] == [5, 4] and cands[0].sources == [[0], [1], [0], [3]]
    assert [c.step for c in plan_restore(reports, min_step=5)[0]] == [5]
    assert plan_restore(reports, min_step=6)[0] == []


def test_plan_refuses_other_layouts_and_mixed_epochs() -> None:
    # rank 1's copy holds other pieces (another layout): step 3 is not complete
    reports = [_rep("a0", own=[(3, "e")]), _rep("a1", own=[(3, "e")], d="other")]
    cands, notes = plan_restore(reports)
    assert cands == [] and any("other pieces" in n for n in notes)
    # the same step written by two attempts (a step redone after a fallback) never mixes
    reports = [_rep("a0", own=[(3, "e1")]), _rep("a1", own=[(3, "e2")])]
    assert plan_restore(reports)[0] == []
    reports = [_rep("a0", own=[(3, "e1")], held=[(1, 3, "e1", "a1")]), _rep("a1", own=[(3, "e2")])]
    cands, _ = plan_restore(reports)
    assert [(c.step, c.epoch, c.sources) for c in cands] == [(3, "e1", [[0], [0]])]


def test_plan_is_deterministic() -> None:
    reports = [_rep(f"a{r}", own=[(s, "e") for s in (1, 2)], held=[((r + 2) % 4, s, "e", f"a{(r + 2) % 4}")
                                                                    for s in (1, 2)]) for r in range(4)]
    for perm in itertools.islice(itertools.permutations(range(4)), 6):
        shuffled = [dict(reports[r]) for r in range(4)]
        for r in perm:
            shuffled[r]["held"] = list(reversed(shuffled[r]["held"]))  # type: ignore[call-overload]
        assert [c.to_wire() for c in plan_restore(shuffled)[0]] == [c.to_wire() for c in plan_restore(reports)[0]]
