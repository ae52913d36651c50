"""Writer balance: replicated pieces split among their holders (plan_save(split_replicas=True)), the
writers that write such parts (sync and async saves, CPU and CUDA sources), and the benchmark's
replica-group balance metric."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import ckpt
from bench.scale import DSV3_RULES, dsv3_params, rank_pieces, replica_balance, replica_groups
from ckpt._io import entry_source, write_assignment
from ckpt._regions import check_tiling, sub_region
from ckpt._save_plan import SPLIT_MIN_PART_BYTES, PieceDecl, RankDecl, WriteAssignment, plan_save
from ckpt.formats.safetensors_header import parse_header
from ckpt.layout import Layout
from ckpt.shards import Box, Flat
from ckpt.storage import get_storage
from ckpt.testing.ranks import gpu_count
from tests.dist_utils import run_ranks

MiB = 1 << 20


def _spread(loads: list[int]) -> float:
    return (max(loads) - min(loads)) / (sum(loads) / len(loads))


def _embedding_layout(world: int) -> list[RankDecl]:
    """Every rank: a 2 MiB row block of ``w`` of its own, and the whole 16 MiB ``emb`` (replicated)."""
    decls = []
    for r in range(world):
        decls.append(RankDecl([PieceDecl("w", "float32", (256 * world, 2048), Box((256 * r, 0), (256, 2048))),
                               PieceDecl("emb", "float32", (4096, 1024), Box((0, 0), (4096, 1024)))]))
    return decls


def test_split_balances_what_whole_pieces_cannot():
    decls = _embedding_layout(4)
    whole = plan_save(decls, save_id="x")
    split = plan_save(decls, save_id="x", split_replicas=True)
    # Whole pieces: one rank writes the 16 MiB embedding on top of its 2 MiB (max/mean 3).
    assert _spread([a.nbytes for a in whole.assignments]) > 1.0
    loads = [a.nbytes for a in split.assignments]
    assert _spread(loads) <= 0.05, loads
    emb = split.manifest.tensors["emb"]
    assert len(emb.shards) == 4
    check_tiling("emb", emb.shape, [s.region for s in emb.shards])  # the parts tile the tensor
    writers = set()
    for rank, a in enumerate(split.assignments):
        for e in a.entries:
            s = split.manifest.tensors[e.key].shards[e.shard]
            piece = decls[rank].pieces[e.piece]
            assert (s.file, s.offset, s.length) == (a.file, e.offset, e.length)
            if e.key == "w":
                assert e.count is None and s.region == piece.region  # single-holder pieces stay whole
                continue
            writers.add(rank)
            assert e.count is not None and e.start % 1024 == 0 and e.count % 1024 == 0  # whole rows
            assert s.region == sub_region(piece.region, e.start, e.count)
            assert s.length == e.count * 4
    assert writers == {0, 1, 2, 3}
    # Deterministic: the same declarations give the same plan.
    again = plan_save(decls, save_id="x", split_replicas=True)
    assert [a.to_wire() for a in again.assignments] == [a.to_wire() for a in split.assignments]


def test_no_split_when_whole_pieces_balance_and_small_pieces_never_split():
    # A dp=2 pair holding six 4 MiB pieces: alternating whole pieces balances it exactly, so none is
    # split (the rule looks at the bytes still to come for the same holders).
    pair = [RankDecl([PieceDecl(f"e{i}", "float32", (1024, 1024), Box((0, 0), (1024, 1024))) for i in range(6)])
            for _ in range(2)]
    plan = plan_save(pair, save_id="x", split_replicas=True)
    assert all(e.count is None for a in plan.assignments for e in a.entries)
    assert [a.nbytes for a in plan.assignments] == [12 * MiB, 12 * MiB]
    # Below two minimum parts a piece is never split, however unbalanced that leaves its holders.
    n = (2 * SPLIT_MIN_PART_BYTES - 4) // 4
    small = [RankDecl([PieceDecl("s", "float32", (n,), Box((0,), (n,)))]) for _ in range(3)]
    plan = plan_save(small, save_id="x", split_replicas=True)
    assert sum(len(a.entries) for a in plan.assignments) == 1


def test_flat_replicas_split_into_flat_ranges_cut_at_rows():
    # A ZeRO chunk of an unsplit parameter is replicated over the TP ranks: a flat range of a box's
    # flattening. Its parts are flat ranges of the same box, cut where rows of the box start.
    box = Box((0, 0), (3000, 1000))
    region = Flat(1_000_500, 2_500_500, box)  # 6 MB of float32, not starting on a row
    decls = [RankDecl([PieceDecl("m", "float32", (3000, 1000), region)]) for _ in range(3)]
    for r in range(3):  # the rest of the box, one rank each, so that the tensor is tiled
        decls[r].pieces.append(PieceDecl("m", "float32", (3000, 1000),
                                         [Flat(0, 1_000_500, box), Flat(2_500_500, 2_800_000, box),
                                          Flat(2_800_000, 3_000_000, box)][r]))
    plan = plan_save(decls, save_id="x", split_replicas=True)
    m = plan.manifest.tensors["m"]
    check_tiling("m", m.shape, [s.region for s in m.shards])
    parts = [s.region for s in m.shards if isinstance(s.region, Flat) and region.start <= s.region.start
             and s.region.stop <= region.stop]
    assert len(parts) >= 2 and all(p.box == box for p in parts)
    assert sum(p.numel for p in parts) == region.numel
    assert all(p.start % 1000 == 0 for p in parts[1:])  # inner cuts on row starts of the box


def test_part_entries_survive_the_wire():
    plan = plan_save(_embedding_layout(2), save_id="x", split_replicas=True)
    a = plan.assignments[1]
    assert any(e.count is not None for e in a.entries)
    assert WriteAssignment.from_wire(a.to_wire()) == a


def test_replica_groups_union_find():
    d = "float32"
    decls = [
        RankDecl([PieceDecl("a", d, (8,), Box((0,), (4,)))]),
        RankDecl([PieceDecl("a", d, (8,), Box((0,), (4,))), PieceDecl("b", d, (8,), Flat(0, 4))]),
        RankDecl([PieceDecl("b", d, (8,), Flat(0, 4)), PieceDecl("a", d, (8,), Box((4,), (4,)))]),
        # same key, another region: shares nothing; an empty piece held twice joins nobody
        RankDecl([PieceDecl("b", d, (8,), Flat(4, 8)), PieceDecl("e", d, (0,), Box((0,), (0,)))]),
        RankDecl([PieceDecl("e", d, (0,), Box((0,), (0,)))]),
        RankDecl([PieceDecl("c", d, (4,), Box((0,), (4,)))]),
        RankDecl([PieceDecl("c", d, (4,), Box((0,), (4,)))]),
    ]
    groups, distinct = replica_groups(decls)
    assert sorted(groups) == [[0, 1, 2], [5, 6]]  # 0-1 through a, 1-2 through b: one group
    assert distinct == 5  # a[0:4], b[0:4], a[4:8], b[4:8], c
    got = replica_balance(groups, [10, 10, 12, 5, 0, 8, 8])
    assert got["replica_groups"] == 2 and got["replica_group_ranks_max"] == 3
    assert math.isclose(got["replica_group_imbalance_max"], 2 / (32 / 3))
    assert math.isclose(got["replica_group_max_over_mean"], 12 / (32 / 3))


def test_moe_layout_balanced_within_replica_groups():
    # The scale benchmark's model on 128 ranks: the vocabulary's embedding and head (one 900 MB
    # block per TP rank, replicated over 16 ranks) make whole-piece placement miss by far.
    layout = Layout.parse("tp=2,ep=8,pp=4,dp=2,zero=1")
    params = dsv3_params(8)
    decls = [RankDecl(pieces=rank_pieces(params, layout, r, 8, DSV3_RULES)) for r in range(layout.world_size)]
    groups, distinct = replica_groups(decls)
    assert len(groups) == 4  # one per pipeline stage
    whole = replica_balance(groups, [a.nbytes for a in plan_save(decls, save_id="x").assignments])
    plan = plan_save(decls, save_id="x", split_replicas=True)
    split = replica_balance(groups, [a.nbytes for a in plan.assignments])
    assert whole["replica_group_imbalance_max"] > 0.5
    assert split["replica_group_imbalance_max"] < 0.05 and split["replica_group_max_over_mean"] < 1.05
    shards = sum(len(t.shards) for t in plan.manifest.tensors.values())
    assert shards < 1.25 * distinct  # splits are few


# ---------------------------------------------------------------------------------------------
# Writers: real files, parts of local pieces
# ---------------------------------------------------------------------------------------------


def _devices() -> list[str]:
    return ["cpu", "cuda"] if gpu_count() > 0 else ["cpu"]  # (no CUDA call at collection: forked ranks)


@pytest.mark.parametrize("device", _devices())
def test_write_assignment_writes_parts_of_strided_pieces(tmp_path, device):
    g = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0))
    flat = torch.randn(1_500_000, generator=torch.Generator().manual_seed(1))
    decls = [RankDecl([PieceDecl("g", "float32", (2048, 1024), Box((0, 0), (2048, 1024))),
                       PieceDecl("f", "float32", (1_500_000,), Flat(0, 1_500_000))]) for _ in range(2)]
    plan = plan_save(decls, save_id="x", split_replicas=True)
    assert all(e.count is not None for a in plan.assignments for e in a.entries)
    # The writers' local tensors: g non-contiguous (a transpose's transpose view), flat contiguous.
    sources = [g.t().contiguous().t().to(device), flat.to(device)]
    assert not sources[0].is_contiguous()
    storage = get_storage(str(tmp_path))
    for a in plan.assignments:
        size, sums = write_assignment(storage, a, sources)
        data = (tmp_path / a.file).read_bytes()
        assert len(data) == size
        hdr = parse_header(data, size, path=a.file)
        for e in a.entries:
            s = plan.manifest.tensors[e.key].shards[e.shard]
            assert hdr[f"{e.key}@{e.shard}"].start == e.offset
            whole = g if e.key == "g" else flat
            if isinstance(s.region, Box):
                want = whole[s.region.offsets[0] : s.region.offsets[0] + s.region.lengths[0]]
            else:
                want = whole[s.region.start : s.region.stop]
            got = torch.frombuffer(bytearray(data[e.offset : e.offset + e.length]), dtype=torch.float32)
            assert torch.equal(got, want.reshape(-1))
    assert entry_source(sources[0], 0, None) is sources[0]


# ---------------------------------------------------------------------------------------------
# Save and load through real process groups
# ---------------------------------------------------------------------------------------------


def _replicated_state(rank: int, world: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(0)  # the same values on every rank: replicas
    emb = torch.randn(1024, 3072, generator=gen).t()  # (3072, 1024) fp32, 12 MiB, not contiguous
    head = torch.randn(3072, 1024, generator=gen).to(torch.bfloat16)  # 6 MiB
    chunk = torch.randn(786432, generator=gen)  # 3 MiB: a flat range (of a whole box) on every rank
    bias = torch.randn(256, generator=gen)  # small: never split
    mine = torch.full((16, 8), float(rank))
    return {
        "emb": emb.to(device), "head": head.to(device), "bias": bias.to(device),
        "chunk": ckpt.FlatShard(chunk.to(device), (768, 1024), start=0, box=((0, 0), (768, 1024))),
        "w": ckpt.Shard(mine.to(device), (16 * world, 8), (16 * rank, 0)),
    }


def _check_loaded(rank: int, world: int, url: str, m) -> None:
    ref = _replicated_state(rank, world, "cpu")
    if rank == 0:
        assert not m.partial
        for key, parts in (("emb", 3), ("head", 3), ("chunk", 3), ("bias", 1)):
            assert len(m.tensors[key].shards) == parts, (key, [s.region for s in m.tensors[key].shards])
        sizes = list(m.files.values())
        assert max(sizes) / min(sizes) < 1.05  # each rank writes a third of every replica
        assert ckpt.verify(url, deep=True).ok
    else:
        assert m.partial  # its own part of each split replica, with the part's region
        for t in m.tensors.values():
            for s in t.shards:
                assert s.region.numel * (2 if t.dtype == "bfloat16" else 4) == s.length
    out = ckpt.load({"emb": torch.zeros(3072, 1024), "head": torch.zeros(3072, 1024, dtype=torch.bfloat16),
                     "bias": torch.zeros(256),
                     "chunk": ckpt.FlatShard(torch.zeros(786432), (768, 1024), start=0, box=((0, 0), (768, 1024))),
                     "w": ckpt.Shard(torch.zeros(16, 8), (16 * world, 8), (16 * rank, 0))}, url)
    for key in ("emb", "head", "bias"):
        assert torch.equal(out[key], ref[key]), key
    assert torch.equal(out["chunk"].local, ref["chunk"].local) and torch.equal(out["w"].local, ref["w"].local)
    # rows across the cuts between parts (1024, 2048)
    rows = ckpt.load({"emb": ckpt.Shard(torch.zeros(1100, 1024), (3072, 1024), (1000, 0))}, url, strict=False)
    assert torch.equal(rows["emb"].local, ref["emb"][1000:2100])


def _save_and_load(rank: int, world: int, root: str, device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(0)
    state = _replicated_state(rank, world, device)
    m = ckpt.save(state, f"{root}/sync")
    _check_loaded(rank, world, f"{root}/sync", m)
    h = ckpt.async_save(state, f"{root}/async")
    h.staged()
    m = h.done()
    _check_loaded(rank, world, f"{root}/async", m)
    # Steady state: the second async save reuses the plan and the staging buffers (parts only).
    # (A forked rank may inherit the parent's saver from earlier tests: count from here.)
    pool = importlib.import_module("ckpt.async_save")._DEFAULT[id(None)].pool
    allocations = pool.allocations
    h = ckpt.async_save(state, f"{root}/async2")
    _check_loaded(rank, world, f"{root}/async2", h.done())
    assert pool.allocations == allocations


@pytest.mark.slow
@pytest.mark.multiproc
def test_split_replicas_round_trip_bitwise(tmp_path):
    run_ranks(3, _save_and_load, str(tmp_path), "cpu")


@pytest.mark.gpu
@pytest.mark.multiproc
def test_split_replicas_round_trip_from_cuda(tmp_path):
    # Spawned, not forked: CUDA cannot be used in a child forked after the parent touched it.
    run_ranks(3, _save_and_load, str(tmp_path), "cuda", start_method="spawn")
