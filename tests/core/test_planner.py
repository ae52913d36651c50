"""Property tests of the pure planners: random shapes, random box/flat shardings, no processes."""

from __future__ import annotations

import json
import math
import struct
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt._dtypes import dtype_name
from ckpt._io import byte_view, entry_source, run_read_plan
from ckpt._load_plan import LoadRequest, plan_load
from ckpt._regions import check_tiling, sub_region
from ckpt._save_plan import PieceDecl, RankDecl, plan_save
from ckpt.errors import LayoutError
from ckpt.formats.safetensors_header import build_header, parse_header
from ckpt.manifest import entry_name
from ckpt.shards import Box, Flat, Region
from ckpt.storage.base import Storage

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cuts(draw, n: int, max_parts: int) -> list[tuple[int, int]]:
    k = draw(st.integers(1, max_parts))
    pts = sorted(set(draw(st.lists(st.integers(0, n), min_size=k - 1, max_size=k - 1))))
    bounds = [0, *pts, n]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False) if b > a] or [(0, n)]


@st.composite
def sharding(draw, shape: tuple[int, ...]) -> list[Region]:
    """A random exact tiling of ``shape``: an n-D grid of boxes, or flat ranges."""
    kind = draw(st.sampled_from(["flat", "box", "flat-in-box"]))
    if kind == "flat" and math.prod(shape) > 0:
        return [Flat(s, s + n) for s, n in _cuts(draw, math.prod(shape), 5)]
    per_dim = [_cuts(draw, n, 3) if n else [(0, 0)] for n in shape]
    boxes: list[Box] = [Box((), ())]
    for cuts in per_dim:
        boxes = [Box(b.offsets + (o,), b.lengths + (n,)) for b in boxes for o, n in cuts]
    if kind == "flat-in-box":  # ZeRO-1 over TP blocks: each block's flattening split again
        out: list[Region] = []
        for b in boxes:
            if b.numel == 0:
                out.append(b)
                continue
            out += [Flat(s, s + n, b) for s, n in _cuts(draw, b.numel, 3)]
        return out
    return list(boxes)


@st.composite
def case(draw):
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    src = draw(sharding(shape))
    dst = draw(sharding(shape))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]))
    ranks = draw(st.integers(1, 4))
    replicas = draw(st.integers(1, 2))
    return shape, src, dst, dtype, ranks, replicas


class MemStorage(Storage):
    """Just enough of the Storage protocol to execute plans in memory."""

    url = "mem"

    def __init__(self, files: dict[str, bytearray]):
        self.files = files
        self.bytes_read = 0

    def read_into(self, path, offset, buf):
        data = self.files[path]
        assert offset + len(buf) <= len(data)
        buf[:] = data[offset : offset + len(buf)]
        self.bytes_read += len(buf)


def _local(g: torch.Tensor, r: Region) -> torch.Tensor:
    if isinstance(r, Flat):
        block = g if r.box is None else _local(g, r.box)
        return block.reshape(-1)[r.start : r.stop].clone()
    return g[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths, strict=True))].clone()


def _save_in_memory(g, src, ranks, replicas, split=False):
    key, dt = "t", dtype_name(g.dtype)
    decls = [RankDecl() for _ in range(ranks)]
    holders: dict[int, list[Region]] = {r: [] for r in range(ranks)}
    for i, region in enumerate(src):
        for k in range(replicas):
            holders[(i + k) % ranks].append(region)
    # one key per piece per rank is the API's rule; use distinct keys per piece slot
    sources: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    for r in range(ranks):
        for region in holders[r]:
            decls[r].pieces.append(PieceDecl(key, dt, tuple(g.shape), region))
            sources[r].append(_local(g, region))
    plan = plan_save(decls, save_id="x", split_replicas=split)
    files: dict[str, bytearray] = {}
    for r, a in enumerate(plan.assignments):
        if a.file is None:
            continue
        buf = bytearray(a.header)
        for e in a.entries:
            assert e.offset == len(buf)
            buf += bytes(byte_view(entry_source(sources[r][e.piece], e.start, e.count).contiguous()))
        files[a.file] = buf
        assert plan.manifest.files[a.file] == len(buf)
    return plan, files


@SETTINGS
@given(case())
def test_save_plan_writes_each_piece_once_balanced_and_consistent(c):
    shape, src, _dst, dtype, ranks, replicas = c
    g = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape).to(dtype)
    plan, files = _save_in_memory(g, src, ranks, replicas)
    t = plan.manifest.tensors["t"]
    nonempty = [r for r in src if r.numel > 0] or src[:1]
    assert sorted(map(repr, (s.region for s in t.shards))) == sorted(map(repr, nonempty))
    loads = [a.nbytes for a in plan.assignments]
    largest = max((s.length for s in t.shards), default=0)
    if replicas == 1 or ranks == 1:
        pass
    elif ranks == 2:  # every piece is held by both ranks: LPT bound
        assert max(loads) - min(loads) <= largest
    for f, data in files.items():
        hdr = parse_header(bytes(data), len(data), path=f)
        for i, s in enumerate(t.shards):
            if s.file == f:
                e = hdr[entry_name("t", i)]
                assert (e.start, e.length) == (s.offset, s.length)


@pytest.mark.slow
@SETTINGS
@given(case(), st.sampled_from([64, 1 << 20]))
def test_load_plan_reshards_bitwise(c, max_read):
    shape, src, dst, dtype, ranks, replicas = c
    g = torch.randn(shape, dtype=torch.float64).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 100, shape, dtype=dtype)
    plan, files = _save_in_memory(g, src, ranks, replicas)
    storage = MemStorage(files)
    needed = 0
    for region in dst:
        want = _local(g, region)
        target = torch.zeros_like(want)
        req = LoadRequest("t", dtype_name(dtype), tuple(shape), region)
        rp = plan_load(plan.manifest, [req], contiguous_targets=[True], max_read=max_read, max_gap=0)
        for op in rp.ops:
            assert op.length <= max_read + 8 or op.direct is not None  # + alignment of the buffer start
        run_read_plan(storage, rp, [target], [dtype_name(dtype)], workers=1)
        assert torch.equal(target.view(torch.uint8) if target.element_size() == 1 else target, want.view(
            torch.uint8) if want.element_size() == 1 else want)
        needed += want.numel() * want.element_size()
    # With max_gap=0 a rank reads exactly the bytes it needs, never more.
    assert storage.bytes_read == needed


@st.composite
def replicated_case(draw):
    """Like ``case``, with every piece held by 2 ranks or more (what splitting applies to)."""
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    src = draw(sharding(shape))
    dst = draw(sharding(shape))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]))
    ranks = draw(st.integers(2, 5))
    return shape, src, dst, dtype, ranks, draw(st.integers(2, ranks))


@pytest.mark.slow
@SETTINGS
@given(st.one_of(case(), replicated_case()), st.sampled_from([1, 8, 64]))
def test_split_replicas_tile_and_load_bitwise(c, min_part):
    # Parts of replicated pieces, with the minimum part size lowered to a few bytes so that these
    # tiny tensors split: they must still tile the tensor, sit where their entries say, and read
    # back bitwise under any other sharding.
    shape, src, dst, dtype, ranks, replicas = c
    g = torch.randn(shape, dtype=torch.float64).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 100, shape, dtype=dtype)
    with mock.patch("ckpt._save_plan.SPLIT_MIN_PART_BYTES", min_part):
        plan, files = _save_in_memory(g, src, ranks, replicas, split=True)
    t = plan.manifest.tensors["t"]
    check_tiling("t", tuple(shape), [s.region for s in t.shards])
    for a in plan.assignments:
        # at most one entry per local piece: the async stager keeps one buffer per piece
        assert len({e.piece for e in a.entries}) == len(a.entries)
        for e in a.entries:
            s = t.shards[e.shard]
            assert (s.file, s.offset, s.length) == (a.file, e.offset, e.length)
            if e.count is not None:
                assert e.count > 0 and s.region.numel == e.count
    storage = MemStorage(files)
    for region in dst:
        want = _local(g, region)
        target = torch.zeros_like(want)
        rp = plan_load(plan.manifest, [LoadRequest("t", dtype_name(dtype), tuple(shape), region)],
                       contiguous_targets=[True], max_gap=0)
        run_read_plan(storage, rp, [target], [dtype_name(dtype)], workers=1)
        assert torch.equal(target.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


@SETTINGS
@given(st.data())
def test_check_tiling_agrees_with_counting_elements(data):
    # The grid fast path and the general check against a brute-force count, on exact tilings and
    # on tilings with cells dropped, duplicated, or extra random boxes (a dropped cell and a duplicate
    # make as many boxes as cells).
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    boxes = [r for r in data.draw(sharding(shape)) if isinstance(r, Box)] or [Box((0,) * len(shape), shape)]
    for change in data.draw(st.lists(st.sampled_from(["drop", "dup", "extra"]), max_size=2)):
        if change == "drop" and len(boxes) > 1:
            boxes.pop(data.draw(st.integers(0, len(boxes) - 1)))
        elif change == "dup":
            boxes.append(boxes[data.draw(st.integers(0, len(boxes) - 1))])
        elif change == "extra":
            offs = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
            boxes.append(Box(offs, tuple(data.draw(st.integers(1, n - o)) for o, n in zip(offs, shape, strict=True))))
    count = torch.zeros(shape, dtype=torch.int64)
    for b in boxes:
        count[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))] += 1
    exact = bool((count == 1).all())
    try:
        check_tiling("t", shape, list(boxes))
    except LayoutError:
        assert not exact
    else:
        assert exact


def test_check_tiling_grid_with_a_cell_twice_and_one_missing():
    # As many boxes as grid cells, every row and column interval present: only the duplicate tells.
    a, b, c = Box((0, 0), (2, 2)), Box((0, 2), (2, 2)), Box((2, 0), (2, 2))
    try:
        check_tiling("t", (4, 4), [a, b, c, a])
    except LayoutError as e:
        assert "overlap" in str(e)
    else:
        raise AssertionError("a duplicated cell standing in for a missing one was accepted")


@SETTINGS
@given(st.lists(st.tuples(st.text(max_size=8), st.sampled_from(["BF16", "F32", "U8"]),
                          st.lists(st.integers(0, 10**12), max_size=3), st.integers(0, 10**12)), max_size=6),
       st.sampled_from([None, {}, {"format": "ckpt", "rank": "3"}, {"\u00fc": '"'}]))
def test_build_header_is_the_json_of_the_header_dict(entries, metadata):
    # build_header writes the JSON itself (speed); it must be byte for byte json.dumps of the dict.
    entries = [(f"{name}@{i}", dt, tuple(shape), n) for i, (name, dt, shape, n) in enumerate(entries)]
    header: dict = {"__metadata__": metadata} if metadata else {}
    pos, rel = 0, []
    for name, dt, shape, n in entries:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        rel.append(pos)
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    want = struct.pack("<Q", len(raw)) + raw
    assert build_header(entries, metadata) == (want, [len(want) + r for r in rel])


def test_sub_region():
    assert sub_region(Box((2, 3), (6, 4)), 8, 12) == Box((4, 3), (3, 4))
    assert sub_region(Flat(10, 50, Box((0, 0), (8, 8))), 5, 7) == Flat(15, 22, Box((0, 0), (8, 8)))
    try:
        sub_region(Box((0, 0), (6, 4)), 2, 4)
    except ValueError:
        pass
    else:
        raise AssertionError("a part that is not whole rows of a box was accepted")


def test_overlap_and_gap_are_refused():
    d = "float32"
    a = RankDecl([PieceDecl("w", d, (4, 4), Box((0, 0), (3, 4)))])
    b = RankDecl([PieceDecl("w", d, (4, 4), Box((2, 0), (2, 4)))])
    try:
        plan_save([a, b], save_id="x")
    except LayoutError as e:
        assert "overlap" in str(e) and "'w'" in str(e)
    else:
        raise AssertionError("overlap not detected")
    # Boxes and flat-split boxes may mix when they tile; a flat piece overlapping a box may not.
    c = RankDecl([PieceDecl("w", d, (4, 4), Box((3, 0), (1, 4)))])
    plan_save([a, c], save_id="x")
    f1 = RankDecl([PieceDecl("w", d, (4, 4), Flat(0, 2, Box((3, 0), (1, 4))))])
    f2 = RankDecl([PieceDecl("w", d, (4, 4), Flat(2, 4, Box((3, 0), (1, 4))))])
    plan_save([a, f1, f2], save_id="x")
    try:
        plan_save([a, c, f1, f2], save_id="x")
    except LayoutError as e:
        assert "overlap" in str(e)
    else:
        raise AssertionError("flat/box overlap not detected")
    try:
        plan_save([RankDecl([PieceDecl("w", d, (4, 4), Flat(0, 7, Box((0, 0), (2, 4))))]), c], save_id="x")
    except LayoutError as e:
        assert "uncovered" in str(e)
    else:
        raise AssertionError("gap not detected")


def test_column_read_of_row_major_shard_reads_only_needed_runs():
    # A (1000, 64) fp32 tensor stored whole, a rank wants columns [16, 32): 1000 runs of 64 bytes.
    g = torch.randn(1000, 64)
    plan, files = _save_in_memory(g, [Box((0, 0), (1000, 64))], 1, 1)
    storage = MemStorage(files)
    target = torch.zeros(1000, 16)
    rp = plan_load(plan.manifest, [LoadRequest("t", "float32", (1000, 64), Box((0, 16), (1000, 16)))],
                   contiguous_targets=[True], max_gap=0)
    run_read_plan(storage, rp, [target], ["float32"], workers=1)
    assert torch.equal(target, g[:, 16:32])
    assert rp.bytes_read == storage.bytes_read == 1000 * 16 * 4
    # Same-layout load: one direct read into the destination, no buffer.
    rp = plan_load(plan.manifest, [LoadRequest("t", "float32", (1000, 64), Box((0, 0), (1000, 64)))],
                   contiguous_targets=[True])
    assert len(rp.ops) == 1 and rp.ops[0].direct is not None


def test_object_store_merging_bounds_waste_and_shares_requests():
    # 64 small tensors stored back to back: one request for all of them when direct reads may merge.
    decl = RankDecl([PieceDecl(f"t{i:02d}", "float32", (16,), Box((0,), (16,))) for i in range(64)])
    plan = plan_save([decl], save_id="x")
    reqs = [LoadRequest(f"t{i:02d}", "float32", (16,), Box((0,), (16,))) for i in range(64)]
    local = plan_load(plan.manifest, reqs, contiguous_targets=[True] * 64, max_gap=1 << 20)
    s3 = plan_load(plan.manifest, reqs, contiguous_targets=[True] * 64, max_gap=1 << 20, max_waste=0.1,
                   merge_direct=True)
    assert len(local.ops) == 64 and all(op.direct for op in local.ops)
    assert len(s3.ops) == 1 and len(s3.ops[0].ranges) == 1 and s3.bytes_read == 64 * 16 * 4
    g = torch.randn(64)
    files = {}
    for a in plan.assignments:
        buf = bytearray(a.header)
        for _ in a.entries:
            buf += g.numpy().tobytes()[:64]
        files[a.file] = buf
    targets = [torch.zeros(16) for _ in range(64)]
    run_read_plan(MemStorage(files), s3, targets, ["float32"] * 64, workers=1)
    assert all(torch.equal(t, g[:16]) for t in targets)
    # A column quarter of a row-major tensor: the waste cap keeps bytes read == bytes needed.
    plan2, _ = _save_in_memory(torch.randn(256, 64), [Box((0, 0), (256, 64))], 1, 1)
    req = [LoadRequest("t", "float32", (256, 64), Box((0, 16), (256, 16)))]
    capped = plan_load(plan2.manifest, req, contiguous_targets=[True], max_gap=1 << 20, max_waste=0.1)
    uncapped = plan_load(plan2.manifest, req, contiguous_targets=[True], max_gap=1 << 20)
    assert capped.bytes_read == 256 * 16 * 4 and uncapped.bytes_read > 3 * capped.bytes_read
