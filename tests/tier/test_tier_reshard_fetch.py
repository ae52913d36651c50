"""A layout change across hosts restores from the memory tier by fetching the copies a host lacks
from the ranks that reach them (no storage): the planner over generated reach sets and hosts, and 4
forked gloo ranks' memory tier split over two simulated hosts (each host's shared memory holding
only its own node's copies) restored on 2 ranks, one per host, bitwise; a damaged copy falls back to
storage on every rank, and nothing fetched is left behind."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.tier.nodes import run_id_for
from ckpt.tier.reshard import _rounds, plan_fetches
from tests.dist_utils import run_ranks
from tests.tier.kill_harness import state_of
from tests.tier.test_tier_reshard import _global, _target


@st.composite
def _reach(draw: Any) -> tuple[list[dict[str, list[int]]], list[Any]]:
    n = draw(st.integers(1, 6))
    hosts = [draw(st.sampled_from(["a", "b", "c"])) for _ in range(n)]
    keys = draw(st.lists(st.tuples(st.integers(1, 9), st.sampled_from(["e1", "e2"]), st.integers(1, 5)),
                         min_size=0, max_size=4, unique=True))
    reach: list[dict[str, list[int]]] = [{} for _ in range(n)]
    for s, e, w in keys:
        for r in range(n):
            owners = draw(st.lists(st.integers(0, w - 1), unique=True, max_size=w))
            if owners:
                reach[r][f"{s}|{e}|{w}"] = sorted(owners)
    return reach, hosts


@settings(max_examples=300, deadline=None)
@given(_reach())
def test_the_plan_restores_the_newest_covered_step_and_fetches_each_missing_copy_once_per_host(
        case: tuple[list[dict[str, list[int]]], list[Any]]) -> None:
    reach, hosts = case
    n = len(reach)

    def covered(key: str) -> bool:
        w = int(key.split("|")[2])
        return set().union(*(set(r.get(key, [])) for r in reach)) == set(range(w))

    keys = set().union(*reach)
    want = max((k for k in keys if covered(k)), key=lambda k: (int(k.split("|")[0]), k.split("|")[1],
                                                                 int(k.split("|")[2])), default=None)
    plan = plan_fetches(reach, hosts, "tok")
    if want is None:
        assert plan is None
        return
    assert plan is not None and plan["key"] == want and plan["token"] == "tok"
    w = int(want.split("|")[2])
    fetched = {(f[0], f[1]) for f in plan["fetch"]}
    assert len(fetched) == len(plan["fetch"])  # each copy fetched once per fetcher
    for fetcher, owner, sender in plan["fetch"]:
        assert owner in reach[sender].get(want, [])  # from a rank that has it
        same = [r for r in range(n) if hosts[r] == hosts[fetcher]]
        assert fetcher == min(same)  # the host's lowest rank
        assert all(owner not in reach[r].get(want, []) for r in same)  # nobody on that host had it
    for r in range(n):
        same = [q for q in range(n) if hosts[q] == hosts[r]]
        here = set().union(*(set(reach[q].get(want, [])) for q in same))
        at = {o: f for o, f in plan["at"].get(str(r), [])}
        assert set(at) == set(range(w)) - here  # every copy the host lacks, from its fetcher
        assert all((f, o) in fetched for o, f in at.items())


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 9), st.integers(0, 4)), max_size=30))
def test_rounds_carry_each_pair_at_most_once(fetch: list[tuple[int, int, int]]) -> None:
    rounds = _rounds([list(f) for f in fetch])
    assert sorted(tuple(f) for r in rounds for f in r) == sorted(fetch)
    for r in rounds:
        pairs = [(f[2], f[0]) for f in r]
        assert len(pairs) == len(set(pairs))


def _split(shm: str, root: str, hosts: list[str]) -> None:
    """The 2-node tier in ``shm`` as if each node were its own host: node i's own copies (not the
    replicas it keeps for the other node) in ``hosts[i]``."""
    name = f"ckpt-{run_id_for(root)}"
    src = Path(shm) / name
    for i, h in enumerate(hosts):
        dst = Path(h) / name
        dst.mkdir(mode=0o700)
        for p in src.iterdir():
            if p.is_file():
                shutil.copy2(p, dst / p.name)
        shutil.copytree(src / f"node-{i}", dst / f"node-{i}", ignore=shutil.ignore_patterns("replicas", ".slots"),
                        copy_function=shutil.copy2)


def _two_hosts(shm: str, root: str, save_memory: Callable[..., None]) -> list[str]:
    """Steps 1-3 of 4 ranks in the memory tier (step 1 also in storage), split over two simulated
    hosts' shared memory (see :func:`_split`); their base directories."""
    run_ranks(4, save_memory, shm, root, (1, 2, 3), (1,))
    hosts = [os.path.join(shm, "host-a"), os.path.join(shm, "host-b")]
    for h in hosts:
        os.mkdir(h, 0o700)
    _split(shm, root, hosts)
    return hosts


def _restore(rank: int, world: int, hosts: list[str], root: str, out: str) -> None:
    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=hosts[rank], nodes=2,
                                 memory_timeout=30)
    target = _target(rank, world)
    step = mgr.restore(target)
    assert step is not None
    got = mgr.last_restore
    g = _global(step)
    w, m = target["model"]["w"], target["optim"]["m"]
    assert torch.equal(w.local, g["w"][w.offsets[0]:w.offsets[0] + w.local.shape[0]])  # bitwise
    assert torch.equal(m.local, g["m"][m.start:m.start + m.local.numel()])
    assert target["train"] == state_of(0, step)["train"]
    rec = {"rank": rank, "step": step, "tier": got.tier if got is not None else "storage",
           "fetched": got.fetched_bytes if got is not None else 0,
           "peers": got.peer_ranks if got is not None else [],
           "left": sorted(p.name for p in Path(hosts[rank]).rglob("view-*"))}
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _run(hosts: list[str], root: str, tmp: Path) -> list[dict[str, Any]]:
    out = tmp / f"out-{len(list(tmp.glob('out-*')))}.jsonl"
    run_ranks(2, _restore, hosts, root, str(out))
    return sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["rank"])


@pytest.mark.multiproc
def test_a_layout_change_across_hosts_fetches_what_each_host_lacks(shm: str, tmp_path: Path,
                                                                   save_memory: Callable[..., None]) -> None:
    root = str(tmp_path / "ckpts")
    hosts = _two_hosts(shm, root, save_memory)
    # what a fetcher killed mid-fetch would leave behind: removed at the next restore of that rank
    left = Path(hosts[0]) / f"ckpt-{run_id_for(root)}" / "view-0-dead0000-fetched" / "rank-3"
    left.mkdir(parents=True, mode=0o700)
    (left / "part").write_bytes(b"x" * 100)
    got = _run(hosts, root, tmp_path)
    # step 3 from memory (storage has step 1): each rank fetched the other host's two copies
    assert [(r["step"], r["tier"]) for r in got] == [(3, "memory-reshard")] * 2
    assert [r["peers"] for r in got] == [[1], [0]] and all(r["fetched"] > 0 for r in got)
    assert all(r["left"] == [] for r in got)  # views and fetched copies removed


@pytest.mark.multiproc
def test_a_damaged_copy_on_the_sending_host_falls_back_to_storage_everywhere(
        shm: str, tmp_path: Path, save_memory: Callable[..., None]) -> None:
    root = str(tmp_path / "ckpts")
    hosts = _two_hosts(shm, root, save_memory)
    copy = Path(hosts[1]) / f"ckpt-{run_id_for(root)}" / "node-1" / "rank-2" / "step-0000000003"
    m = ckpt.inspect(str(copy))
    s = m.tensors["model.w"].shards[0]
    with open(copy / s.file, "r+b") as f:  # one flipped byte in rank 2's piece, the only copy of it
        f.seek(s.offset + 7)
        b = f.read(1)
        f.seek(s.offset + 7)
        f.write(bytes([b[0] ^ 1]))
    got = _run(hosts, root, tmp_path)
    assert [(r["step"], r["tier"]) for r in got] == [(1, "storage")] * 2
    assert all(r["left"] == [] for r in got)
