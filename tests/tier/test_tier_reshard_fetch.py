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
from ckpt._state import TensorItem
from ckpt.shards import Box, Flat
from ckpt.tier.nodes import run_id_for
from ckpt.tier.reshard import _rounds, plan_fetches
from ckpt.tier.reshard_fetch import StoredShard, _to_all, needed
from tests.dist.forked import SLACK, assert_typed, outcome, run_forked
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


def _cross_target(rank: int, world: int) -> dict[str, Any]:
    """``w`` split by columns (every rank wants half of every old rank's rows: half of it lies on the
    other host), ``m`` as :func:`_target` splits it (all on this rank's host)."""
    t = _target(rank, world)
    rows, c0 = t["model"]["w"].global_shape[0], rank * 256 // world
    t["model"]["w"] = ckpt.Shard(torch.zeros(rows, 256 // world), (rows, 256), (0, c0))
    return t


def _restore(rank: int, world: int, hosts: list[str], root: str, out: str, how: str) -> None:
    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=hosts[rank], nodes=2,
                                 memory_timeout=30)
    target = _target(rank, world) if how == "rows" else _cross_target(rank, world)
    if how in ("whole", "mixed"):  # no wanted pieces named (by one rank, with mixed): whole copies cross
        assert mgr.memory is not None
        want = target if how == "mixed" and rank == 0 else None
        got = mgr.memory.restore_resharded_with(lambda url: mgr.memory.load_view(target, url, verify=True),
                                                want=want)
        assert got is not None
        step = got.step
        mgr.memory.reset(None)  # as the manager does after a resharded restore (removes dead fetchers' copies)
    else:
        step = mgr.restore(target)
        got = mgr.last_restore
    assert step is not None
    g = _global(step)
    w, m = target["model"]["w"], target["optim"]["m"]
    (r0, c0), (nr, nc) = w.offsets, w.local.shape
    assert torch.equal(w.local, g["w"][r0:r0 + nr, c0:c0 + nc])  # bitwise
    assert torch.equal(m.local, g["m"][m.start:m.start + m.local.numel()])
    if how not in ("whole", "mixed"):
        assert target["train"] == state_of(0, step)["train"]
    rec = {"rank": rank, "step": step, "tier": got.tier if got is not None else "storage",
           "fetched": got.fetched_bytes if got is not None else 0,
           "peers": got.peer_ranks if got is not None else [],
           "left": sorted(p.name for p in Path(hosts[rank]).rglob("view-*"))}
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _run(hosts: list[str], root: str, tmp: Path, how: str = "cross") -> list[dict[str, Any]]:
    out = tmp / f"out-{len(list(tmp.glob('out-*')))}.jsonl"
    run_ranks(len(hosts), _restore, hosts, root, str(out), how)
    return sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["rank"])


WHOLE_SHARD = 256 * 256 * 4  # bytes of one old rank's piece of w


@pytest.mark.multiproc
@pytest.mark.parametrize("how,fetched", [
    ("cross", 2 * WHOLE_SHARD),  # w by columns: the other host's two shards of w, whole; nothing of m
    ("rows", 0),  # split as saved: each host holds everything its rank wants, nothing crosses
    ("whole", None),  # no wanted pieces named (restore_resharded_with without ``want``): whole copies
    ("mixed", None),  # named by one rank only: whole copies on both (one path on every rank)
])
def test_a_layout_change_across_hosts_fetches_what_each_host_lacks(
        shm: str, tmp_path: Path, save_memory: Callable[..., None], how: str, fetched: int | None) -> None:
    root = str(tmp_path / "ckpts")
    hosts = _two_hosts(shm, root, save_memory)
    # what a fetcher killed mid-fetch would leave behind: removed at the next restore of that rank
    left = Path(hosts[0]) / f"ckpt-{run_id_for(root)}" / "view-0-dead0000-fetched" / "rank-3"
    left.mkdir(parents=True, mode=0o700)
    (left / "part").write_bytes(b"x" * 100)
    got = _run(hosts, root, tmp_path, how)
    # step 3 from memory (storage has step 1), bitwise (checked in every rank)
    assert [(r["step"], r["tier"]) for r in got] == [(3, "memory-reshard")] * 2
    assert [r["peers"] for r in got] == ([[], []] if fetched == 0 else [[1], [0]])
    if fetched is not None:
        assert [r["fetched"] for r in got] == [fetched] * 2  # exactly the shards wanted, whole
    else:  # every file of the other host's two copies: both pieces of w and m and the manifests' objects
        assert got[0]["fetched"] == got[1]["fetched"] > 2 * (WHOLE_SHARD + 8192 * 4)
    assert all(r["left"] == [] for r in got)  # views and fetched copies removed


def _rank2_w(hosts: list[str], root: str) -> tuple[Path, Any]:
    """Old rank 2's copy of step 3 on the second host (its only copy there), and its shard of ``w``."""
    copy = Path(hosts[1]) / f"ckpt-{run_id_for(root)}" / "node-1" / "rank-2" / "step-0000000003"
    return copy, ckpt.inspect(str(copy)).tensors["model.w"].shards[0]


@pytest.mark.multiproc
def test_a_damaged_copy_on_the_sending_host_falls_back_to_storage_everywhere(
        shm: str, tmp_path: Path, save_memory: Callable[..., None]) -> None:
    root = str(tmp_path / "ckpts")
    hosts = _two_hosts(shm, root, save_memory)
    copy, s = _rank2_w(hosts, root)
    with open(copy / s.file, "r+b") as f:  # one flipped byte in rank 2's piece, the only copy of it
        f.seek(s.offset + 7)
        b = f.read(1)
        f.seek(s.offset + 7)
        f.write(bytes([b[0] ^ 1]))
    got = _run(hosts, root, tmp_path)
    assert [(r["step"], r["tier"]) for r in got] == [(1, "storage")] * 2
    assert all(r["left"] == [] for r in got)


@pytest.mark.multiproc
def test_a_copy_its_sender_cannot_send_falls_back_to_storage_everywhere(
        shm: str, tmp_path: Path, save_memory: Callable[..., None]) -> None:
    root = str(tmp_path / "ckpts")
    hosts = _two_hosts(shm, root, save_memory)
    copy, s = _rank2_w(hosts, root)
    (copy / s.file).unlink()  # its manifest lists a file that is gone
    got = _run(hosts, root, tmp_path)
    assert [(r["step"], r["tier"]) for r in got] == [(1, "storage")] * 2
    assert all(r["left"] == [] for r in got)


def _tiles(draw: Any, length: int) -> list[tuple[int, int]]:
    cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=4)))
    bounds = [0, *cuts, length]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@st.composite
def _layouts(draw: Any) -> tuple[list[StoredShard], set[int], list[TensorItem]]:
    """Old owners' shards of two tensors (a 2-D one cut in row blocks, some owners replicas of others;
    a 1-D one cut flat), the owners this host reaches, and a rank's wanted pieces (column blocks of
    the first, flat ranges of the second)."""
    rows, cols, n = draw(st.integers(2, 9)), draw(st.integers(1, 5)), draw(st.integers(2, 24))
    shards: list[StoredShard] = []
    owner = 0
    for r0, r1 in _tiles(draw, rows):
        for _ in range(draw(st.integers(1, 2))):  # a replica: the same region in another owner's copy
            shards.append(StoredShard(owner, "data/0", 0, 4 * (r1 - r0) * cols, "w", "float32", (rows, cols),
                                      Box((r0, 0), (r1 - r0, cols))))
            owner += 1
    for f0, f1 in _tiles(draw, n):
        shards.append(StoredShard(owner, "data/0", 0, 4 * (f1 - f0), "m", "float32", (n,), Flat(f0, f1)))
        owner += 1
    local = set(draw(st.sets(st.integers(0, owner - 1))))
    want = [TensorItem("w", torch.empty(0), "float32", (rows, cols), Box((0, c0), (rows, c1 - c0)))
            for c0, c1 in draw(st.lists(st.sampled_from(_tiles(draw, cols) if cols > 1 else [(0, 1)]), max_size=2,
                                        unique=True))]
    want += [TensorItem("m", torch.empty(0), "float32", (n,), Flat(f0, f1))
             for f0, f1 in draw(st.lists(st.sampled_from(_tiles(draw, n)), max_size=3, unique=True))]
    return shards, local, want


def _cells(region: Box | Flat, shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    if isinstance(region, Flat):
        return {(i,) for i in range(region.start, region.stop)}
    (r0, c0), (nr, nc) = region.offsets, region.lengths
    return {(r, c) for r in range(r0, r0 + nr) for c in range(c0, c0 + nc)}


@settings(max_examples=200, deadline=None)
@given(_layouts())
def test_the_shards_fetched_with_the_local_ones_cover_every_wanted_element_once(
        case: tuple[list[StoredShard], set[int], list[TensorItem]]) -> None:
    shards, local_owners, want = case
    local = [s for s in shards if s.owner in local_owners]
    remote = [s for s in shards if s.owner not in local_owners]
    got = needed(local, remote, want)
    held = {(s.key, s.region) for s in local}
    assert len({(s.key, s.region) for s in got}) == len(got)  # one owner's shard per region
    assert all((s.key, s.region) not in held for s in got)  # never what this host reaches
    for s in got:  # only shards a wanted piece overlaps
        assert any(w.key == s.key and _cells(w.region, s.shape) & _cells(s.region, s.shape) for w in want)
    for w in want:  # every wanted element is in a local shard or a fetched one
        have = set().union(*(_cells(s.region, s.shape) for s in local + got if s.key == w.key))
        assert _cells(w.region, w.global_shape) <= have
    # of replicas none of which is here, the lowest owner's (the one the view takes)
    for s in got:
        assert s.owner == min(r.owner for r in remote if (r.key, r.region) == (s.key, s.region))


def test_a_coordinator_failure_in_the_fetch_reaches_every_rank_as_an_error() -> None:
    """Raised on the coordinator alone, it would leave the other ranks waiting until the timeout."""
    def broken(got: list[Any]) -> list[Any]:
        return [min(set())]  # e.g. a rank listed shards but has no fetcher

    got = _to_all(broken)([{}, {}, {}])
    assert len(got) == 3 and all(g == got[0] for g in got)
    assert got[0]["err"].startswith("rank 0 (coordinating the fetch): ValueError: min()")
    assert _to_all(lambda got: [len(got)] * len(got))([{}, {}]) == [2, 2]


def _killed_mid_fetch(rank: int, world: int, hosts: list[str], root: str, point: str) -> dict[str, Any]:
    """Rank 0 (its host's fetcher, and the other host's sender) dies at ``point`` of the fetch."""
    from ckpt._comm import Comm
    from ckpt.tier import reshard_fetch

    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=hosts[rank], nodes=2,
                                 memory_timeout=3)

    def die(*a: Any, **k: Any) -> Any:
        os._exit(9)

    if rank == 0 and point == "transfer":  # its sparse copies exist, the shards are about to move
        reshard_fetch.run_items = die  # type: ignore[assignment]
    elif rank == 0 and point == "commit":  # every shard arrived, no manifest committed yet
        reshard_fetch.commit_manifest = die  # type: ignore[assignment]
    elif rank == 0:  # entering one of the fetch's two exchanges
        exchange = Comm.exchange

        def maybe_die(self: Comm, obj: Any, reply: Any, **kw: Any) -> Any:
            if point in str(kw.get("what", "")):
                os._exit(9)
            return exchange(self, obj, reply, **kw)

        Comm.exchange = maybe_die  # type: ignore[method-assign]
    return outcome(lambda: mgr.restore(_cross_target(rank, world)))


@pytest.mark.multiproc
@pytest.mark.parametrize("point", ["(manifests)", "(shards wanted)", "transfer", "commit"])
def test_a_rank_killed_anywhere_in_the_fetch_is_named_in_time_and_the_next_restore_is_clean(
        shm: str, tmp_path: Path, save_memory: Callable[..., None], point: str) -> None:
    root = str(tmp_path / "ckpts")
    hosts = _two_hosts(shm, root, save_memory)
    res = run_forked(2, _killed_mid_fetch, hosts, root, point)
    assert res[0].get("crashed")
    assert_typed(res[1], 2 * 3 + SLACK, cls="CollectiveError", has=("rank 0",))
    # what it left holds no manifest: never read as a copy
    assert not list(Path(hosts[0]).rglob("view-0-*-fetched/rank-*/manifest.msgpack"))
    got = _run(hosts, root, tmp_path)  # the job restarts: restored from memory, the dead fetcher's files gone
    assert [(r["step"], r["tier"], r["fetched"]) for r in got] == [(3, "memory-reshard", 2 * WHOLE_SHARD)] * 2
    assert all(r["left"] == [] for r in got)


@pytest.mark.multiproc
def test_two_ranks_per_host_fetch_their_union_once_through_the_hosts_fetcher(
        shm: str, tmp_path: Path, save_memory: Callable[..., None]) -> None:
    """4 ranks, two per host, each wanting a quarter of w's columns: the host's lowest rank receives
    the other host's two shards of w once for both; its neighbour receives nothing and reads the
    same files."""
    root = str(tmp_path / "ckpts")
    a, b = _two_hosts(shm, root, save_memory)
    got = _run([a, a, b, b], root, tmp_path)
    assert [(r["step"], r["tier"]) for r in got] == [(3, "memory-reshard")] * 4
    assert [r["fetched"] for r in got] == [2 * WHOLE_SHARD, 0, 2 * WHOLE_SHARD, 0]
    assert got[1]["peers"] == got[3]["peers"] == []
    assert got[0]["peers"] and set(got[0]["peers"]) <= {2, 3} and got[2]["peers"] and set(got[2]["peers"]) <= {0, 1}
    assert all(r["left"] == [] for r in got)


def _full_shm(rank: int, world: int, hosts: list[str], root: str, out: str) -> None:
    import errno

    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rank == 0:  # the fetcher's shared memory is full
        os.posix_fallocate = full  # type: ignore[assignment]
    try:
        _restore(rank, world, hosts, root, out, "cross")
    finally:
        os.posix_fallocate = real


@pytest.mark.multiproc
def test_a_fetcher_whose_shared_memory_is_full_falls_back_to_storage_everywhere(
        shm: str, tmp_path: Path, save_memory: Callable[..., None]) -> None:
    """The received ranges are allocated before any byte is written through the mapping: a full
    shared memory is an error every rank hears of (storage restores), never a SIGBUS mid-transfer."""
    root = str(tmp_path / "ckpts")
    hosts = _two_hosts(shm, root, save_memory)
    out = tmp_path / "full.jsonl"
    run_ranks(2, _full_shm, hosts, root, str(out))
    got = sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["rank"])
    assert [(r["step"], r["tier"]) for r in got] == [(1, "storage")] * 2
    assert all(r["left"] == [] for r in got)
