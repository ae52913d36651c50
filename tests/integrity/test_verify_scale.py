"""``ckpt verify`` proves the coverage of a tensor stored as tens of thousands of shards that do not
form a grid in O(n log n) (issue 36: 42,000 such shards took 73 s: with three or more dims that
separate the shards, the overlap check compared each new shard with every shard active in a sweep),
and the coverage check stays exact: generated box / flat sets against a brute-force reference kept
here (gaps, overlaps, exact covers, pieces outside the tensor, zero-sized shards, flat ranges within
boxes, tilings that are not made by cutting blocks), through every path of the check.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt import _regions as regions
from ckpt._checksum import crc32
from ckpt._regions import check_disjoint, check_tiling, flat_boxes, separate
from ckpt.errors import LayoutError
from ckpt.formats.msgpack_codec import encode_manifest
from ckpt.formats.safetensors_header import build_header
from ckpt.manifest import MANIFEST_NAME, Manifest, ShardEntry, TensorEntry, entry_name
from ckpt.shards import Box, Flat

# --- layouts -----------------------------------------------------------------------------------


def _cuts(rng: random.Random, n: int, pieces: int) -> list[int]:
    return [0, *sorted(rng.sample(range(1, n), pieces - 1)), n]


def brick_wall(rng: random.Random, shape: tuple[int, ...], pieces: list[int]) -> list[Box]:
    """Dim 0 cut at random points into ``pieces[0]`` bands, each band's dim 1 cut at its own random
    points into ``pieces[1]``, and so on: no two bands share their cuts, so it is no grid."""
    out: list[Box] = []

    def rec(d: int, offs: tuple[int, ...], lens: tuple[int, ...]) -> None:
        if d == len(shape):
            out.append(Box(offs, lens))
            return
        c = _cuts(rng, shape[d], pieces[d])
        for a, b in itertools.pairwise(c):
            rec(d + 1, offs + (a,), lens + (b - a,))

    rec(0, (), ())
    return out


def _write_checkpoint(url: str, key: str, shape: tuple[int, ...], boxes: list[Box]) -> np.ndarray:
    """A real checkpoint of one uint8 tensor stored as ``boxes``: one safetensors file with an entry
    per shard, and a manifest with every checksum. Returns the tensor."""
    data = (np.arange(math.prod(shape), dtype=np.int64) * 7 % 251).astype(np.uint8).reshape(shape)
    blobs = [data[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))].tobytes()
             for b in boxes]
    header, offsets = build_header((entry_name(key, i), "U8", b.lengths, len(blob))
                                   for i, (b, blob) in enumerate(zip(boxes, blobs, strict=True)))
    name = "data/00000-0123456789ab.safetensors"
    os.makedirs(os.path.join(url, "data"))
    with open(os.path.join(url, name), "wb") as f:
        f.write(header)
        for blob in blobs:
            f.write(blob)
        size = f.tell()
    # format 2 (shards as columns), as ckpt.save writes it
    shards = [ShardEntry(b, name, off, len(blob), crc32(blob))
              for b, off, blob in zip(boxes, offsets, blobs, strict=True)]
    m = Manifest(tensors={key: TensorEntry("uint8", shape, shards)}, files={name: size}, step=1)
    with open(os.path.join(url, MANIFEST_NAME), "wb") as f:
        f.write(encode_manifest(m))
    return data


def _ranks(boxes: list[Box]) -> tuple[np.ndarray, np.ndarray]:
    lo = np.array([b.offsets for b in boxes], dtype=np.int64)
    return lo, lo + np.array([b.lengths for b in boxes], dtype=np.int64)


# --- 42,000 non-grid shards ----------------------------------------------------------------------

# 2 x 210 x 100 shards over three dims that each separate them (the 73 s case); 420 x 100 over two;
# and over four dims
SCALE = {"3d": ((4, 500, 1000), [2, 210, 100]), "2d": ((420, 1000), [420, 100]),
         "4d": ((3, 14, 20, 300), [3, 14, 10, 100])}


@pytest.mark.slow
def test_verify_proves_42000_non_grid_shards(tmp_path):
    shape, pieces = SCALE["3d"]
    boxes = brick_wall(random.Random(36), shape, pieces)
    url = str(tmp_path / "c")
    _write_checkpoint(url, "w", shape, boxes)
    report = ckpt.verify(url)
    assert report.ok, report.problems[:3]
    assert (report.tensors, report.shards) == (1, 42_000)


def test_verify_reports_an_overlap_among_42000_shards(tmp_path):
    shape, pieces = SCALE["3d"]
    boxes = brick_wall(random.Random(7), shape, pieces)
    i, wide = _widened(boxes, shape)
    url = str(tmp_path / "c")
    _write_checkpoint(url, "w", shape, boxes[:i] + [wide] + boxes[i + 1:])
    report = ckpt.verify(url)
    assert [(p.kind, p.tensor) for p in report.problems] == [("coverage", "w")], report.problems
    message = report.problems[0].message
    assert message.startswith("tensor 'w': shards overlap: ") and message.endswith(
        "; each element must be held by exactly one piece"), message
    assert any(_named(message, wide, o) for o in boxes if _meets(wide, o) and o != boxes[i]), message


def _widened(boxes: list[Box], shape: tuple[int, ...]) -> tuple[int, Box]:
    """A shard past the middle made one wider along the last dim: it overlaps its neighbour."""
    i = next(i for i, b in enumerate(boxes) if b.offsets[-1] + b.lengths[-1] < shape[-1] and i > len(boxes) // 2)
    b = boxes[i]
    return i, Box(b.offsets, b.lengths[:-1] + (b.lengths[-1] + 1,))


@pytest.mark.parametrize("dims", list(SCALE))
def test_coverage_of_42000_non_grid_shards_is_proven_by_sorting(dims):
    """Proven in O(n log n): the sorting passes split the wall down to single shards, no pairwise
    check is left; one overlap and one gap among them are still found and named exactly."""
    shape, pieces = SCALE[dims]
    boxes = brick_wall(random.Random(36), shape, pieces)
    assert len(boxes) == 42_000
    assert separate(*_ranks(boxes)) == []
    check_tiling("w", shape, boxes)
    i, wide = _widened(boxes, shape)
    with pytest.raises(LayoutError) as e:
        check_tiling("w", shape, boxes[:i] + [wide] + boxes[i + 1:])
    assert any(_named(str(e.value), wide, o) for o in boxes if _meets(wide, o) and o != boxes[i]), e.value
    total = math.prod(shape)
    with pytest.raises(LayoutError) as e:
        check_tiling("w", shape, boxes[:i] + boxes[i + 1:])
    assert str(e.value) == (f"tensor 'w': shards cover {total - boxes[i].numel} of {total} elements of shape "
                            f"{list(shape)}; some region is missing")


# --- brute-force reference -----------------------------------------------------------------------


def _paint(shape: tuple[int, ...], regs: list) -> np.ndarray:
    """How many pieces hold each element (pieces assumed inside the tensor)."""
    a = np.zeros(shape, dtype=np.int64)
    for r in regs:
        box = r if isinstance(r, Box) else (r.box or Box((0,) * len(shape), shape))
        sl = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))
        if isinstance(r, Box):
            a[sl] += 1
        else:
            sub = np.zeros(box.numel, dtype=np.int64)
            sub[r.start:r.stop] = 1
            a[sl] += sub.reshape(box.lengths)
    return a


def _inside(shape: tuple[int, ...], r) -> bool:
    box = r if isinstance(r, Box) else (r.box or Box((0,) * len(shape), shape))
    ok = all(o >= 0 and n >= 0 and o + n <= g for o, n, g in zip(box.offsets, box.lengths, shape, strict=True))
    return ok and (isinstance(r, Box) or (r.start >= 0 and r.stop <= box.numel))


def _meets(a: Box, b: Box) -> bool:
    return a.numel > 0 and b.numel > 0 and all(ao < bo + bl and bo < ao + al for ao, al, bo, bl in zip(
        a.offsets, a.lengths, b.offsets, b.lengths, strict=True))


def _pairs(boxes: list[Box]) -> list[tuple[Box, Box]]:
    return [(a, b) for a, b in itertools.combinations(boxes, 2) if _meets(a, b)]


def _named(message: str, a: Box, b: Box) -> bool:
    def s(x: Box) -> str:
        return f"offsets {list(x.offsets)} lengths {list(x.lengths)}"

    return f"{s(a)} and {s(b)}" in message or f"{s(b)} and {s(a)}" in message


@contextlib.contextmanager
def _path(path: str) -> Iterator[None]:
    """Route the check through one of its paths: pure Python for a few boxes ("small"), the sorting
    passes then the per-group grid ("grid"), or the per-group sweep ("sweep")."""
    saved = regions._SMALL, regions._CELLS
    regions._SMALL = 1 << 30 if path == "small" else 0
    regions._CELLS = 0 if path == "sweep" else saved[1]
    try:
        yield
    finally:
        regions._SMALL, regions._CELLS = saved


# --- generated cases -----------------------------------------------------------------------------


@st.composite
def _tiling(draw, shape: tuple[int, ...], pinwheels: bool = True) -> list[Box]:
    """An exact cover of ``shape`` made by cutting blocks into blocks, with (2-D and up, when
    ``pinwheels``) a pinwheel here and there: five boxes around a centre, which no cut separates."""
    out: list[Box] = []

    def rec(offs: tuple[int, ...], lens: tuple[int, ...], depth: int) -> None:
        if math.prod(lens) == 0:
            return
        if pinwheels and len(lens) >= 2 and lens[0] >= 3 and lens[1] >= 3 and draw(st.integers(0, 5)) == 0:
            o0, o1, r = offs[0], offs[1], lens[2:]
            a, b = draw(st.integers(1, lens[0] - 2)), draw(st.integers(1, lens[1] - 2))
            c, e = draw(st.integers(a + 1, lens[0] - 1)), draw(st.integers(b + 1, lens[1] - 1))
            rest = offs[2:]
            for (x0, x1, y0, y1) in [(0, c, 0, b), (c, lens[0], 0, e), (a, lens[0], e, lens[1]), (0, a, b, lens[1]),
                                     (a, c, b, e)]:
                out.append(Box((o0 + x0, o1 + y0) + rest, (x1 - x0, y1 - y0) + r))
            return
        splittable = [d for d, n in enumerate(lens) if n > 1]
        if depth >= 4 or not splittable or draw(st.integers(0, 3)) == 0:
            out.append(Box(offs, lens))
            return
        d = draw(st.sampled_from(splittable))
        cuts = sorted(set(draw(st.lists(st.integers(1, lens[d] - 1), min_size=1, max_size=3))))
        for a, b in itertools.pairwise([0, *cuts, lens[d]]):
            rec(offs[:d] + (offs[d] + a,) + offs[d + 1:], lens[:d] + (b - a,) + lens[d + 1:], depth + 1)

    rec((0,) * len(shape), shape, 0)
    return out


@st.composite
def _case(draw):
    """(shape, regions, flats?): an exact cover, then perhaps damaged; boxes only, or with some of its
    boxes cut into flat ranges (of themselves, or of the whole tensor) and zero-sized shards."""
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(nd))
    regs: list = list(draw(_tiling(shape)))
    flats = draw(st.booleans())
    if flats and regs:
        i = draw(st.integers(0, len(regs) - 1))
        box = regs.pop(i)
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, box.numel - 1)), max_size=3))))
        edges = [0, *[c for c in cuts if c < box.numel], box.numel]
        regs += [Flat(a, b, box) for a, b in itertools.pairwise(edges)]
        if draw(st.booleans()):  # a second box as a range of the whole tensor's flattening
            boxes = [r for r in regs if isinstance(r, Box) and r.numel]
            if boxes:
                b = draw(st.sampled_from(boxes))
                idx = np.arange(math.prod(shape)).reshape(shape)[
                    tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))].reshape(-1)
                if idx[-1] - idx[0] + 1 == b.numel:  # contiguous in the tensor: one flat range
                    regs.remove(b)
                    regs.append(Flat(int(idx[0]), int(idx[-1]) + 1))
    if draw(st.booleans()):
        regs.append(Box(tuple(draw(st.integers(0, n)) for n in shape), (0,) * nd))  # zero-sized, anywhere inside
    damage = draw(st.sampled_from(["none", "drop", "duplicate", "grow", "shrink", "random", "outside",
                                   "flat outside", "duplicate flat"]))
    boxes = [i for i, r in enumerate(regs) if isinstance(r, Box) and r.numel]
    if damage == "drop" and regs:
        regs.pop(draw(st.integers(0, len(regs) - 1)))
    elif damage == "duplicate" and regs:
        regs.append(draw(st.sampled_from(regs)))
    elif damage in ("grow", "shrink") and boxes:
        i = draw(st.sampled_from(boxes))
        b, d = regs[i], draw(st.integers(0, nd - 1))
        o, n = b.offsets[d], b.lengths[d]
        if damage == "shrink":
            n -= 1  # perhaps to a zero-sized box: a gap either way
        elif o + n < shape[d]:
            n += 1
        elif o > 0:
            o, n = o - 1, n + 1
        regs[i] = Box(b.offsets[:d] + (o,) + b.offsets[d + 1:], b.lengths[:d] + (n,) + b.lengths[d + 1:])
    elif damage == "random":
        offs = tuple(draw(st.integers(0, n - 1)) for n in shape)
        regs.append(Box(offs, tuple(draw(st.integers(0, n - o)) for o, n in zip(offs, shape, strict=True))))
    elif damage == "outside":
        d = draw(st.integers(0, nd - 1))
        offs = tuple(draw(st.integers(0, n)) for n in shape)
        lens = tuple(draw(st.integers(0, n - o)) for o, n in zip(offs, shape, strict=True))
        regs.append(Box(offs, lens[:d] + (shape[d] - offs[d] + 1,) + lens[d + 1:]))
    elif damage == "flat outside" and any(isinstance(r, Flat) for r in regs):
        i = draw(st.sampled_from([i for i, r in enumerate(regs) if isinstance(r, Flat)]))
        r = regs[i]
        regs[i] = Flat(r.start, (r.box.numel if r.box else math.prod(shape)) + 1, r.box)
    elif damage == "duplicate flat" and any(isinstance(r, Flat) for r in regs):
        regs.append(draw(st.sampled_from([r for r in regs if isinstance(r, Flat)])))
    order = draw(st.permutations(range(len(regs))))
    return shape, [regs[i] for i in order]


@pytest.mark.parametrize("path", ["small", "grid", "sweep"])
@settings(max_examples=50, deadline=None)
@given(case=_case())
def test_coverage_check_matches_brute_force(path, case):
    """Exact cover accepted, anything else refused with the message of its kind: a piece outside the
    tensor; for boxes alone, an overlap naming two boxes that do overlap, else the covered count."""
    shape, regs = case
    inside = all(_inside(shape, r) for r in regs)
    exact = inside and bool((_paint(shape, regs) == 1).all())
    with _path(path):
        try:
            check_tiling("t", shape, regs)
            err = None
        except LayoutError as e:
            err = str(e)
    assert (err is None) == exact, (shape, regs, err)
    if err is None:
        return
    assert err.startswith("tensor 't': "), err
    if not inside:
        assert "outside" in err, (shape, regs, err)
        return
    if all(isinstance(r, Box) for r in regs):
        pairs = _pairs(regs)
        if pairs:
            assert any(_named(err, a, b) for a, b in pairs), (regs, err)
        else:
            covered = sum(r.numel for r in regs)
            assert (f"shards cover {covered} of {math.prod(shape)} elements" in err
                    or (covered == 0 and "no shards cover" in err)), (regs, err)


@st.composite
def _boxes(draw):
    nd = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(nd))
    out = []
    for _ in range(draw(st.integers(0, 12))):
        offs = tuple(draw(st.integers(0, n)) for n in shape)
        out.append(Box(offs, tuple(draw(st.integers(0, n - o)) for o, n in zip(offs, shape, strict=True))))
    return out


@pytest.mark.parametrize("path", ["small", "grid", "sweep"])
@settings(max_examples=50, deadline=None)
@given(boxes=_boxes())
def test_disjointness_matches_pairwise(path, boxes):
    """check_disjoint (the load planner's check) refuses exactly the sets with an overlapping pair
    of non-empty boxes, and names such a pair."""
    pairs = _pairs(boxes)
    with _path(path):
        try:
            check_disjoint("k", boxes)
            err = None
        except LayoutError as e:
            err = str(e)
    assert (err is None) == (not pairs), (boxes, err)
    if err is not None:
        assert any(_named(err, a, b) for a, b in pairs), (boxes, err)


@settings(max_examples=50, deadline=None)
@given(boxes=_boxes())
def test_separated_groups_never_overlap_each_other(boxes):
    """:func:`separate`'s promise: two boxes that overlap are never put in different groups, nor
    left out as alone."""
    boxes = [b for b in boxes if b.numel]
    if not boxes:
        return
    group = {}
    for g, idx in enumerate(separate(*_ranks(boxes))):
        for i in idx:
            group[int(i)] = g
    for i, j in itertools.combinations(range(len(boxes)), 2):
        if _meets(boxes[i], boxes[j]):
            assert i in group and group.get(i) == group.get(j), (boxes, i, j)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_block_tilings_and_flat_cut_boxes_are_separated_completely(data):
    """The O(n log n) promise: a cover made by cutting blocks into blocks (no pinwheels), and the
    boxes of flat ranges of a tensor (what mixed flat/box layouts are checked as), are split down
    to single boxes by the sorting passes alone."""
    nd = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.integers(1, 6)) for _ in range(nd))
    boxes = [b for b in data.draw(_tiling(shape, pinwheels=False)) if b.numel]
    assert separate(*_ranks(boxes)) == [] if boxes else True
    check_tiling("t", shape, boxes)
    total = math.prod(shape)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, total - 1)), max_size=6))))
    edges = [0, *[c for c in cuts if c < total], total]
    flat = [b for a, e in itertools.pairwise(edges) for b in flat_boxes(a, e, Box((0,) * nd, shape))]
    assert separate(*_ranks(flat)) == []
    check_tiling("t", shape, flat)


@pytest.mark.parametrize("path", ["small", "grid"])
def test_coordinates_beyond_int64_sums_are_checked_exactly(path):
    """Offsets and lengths near 2**63 (a hostile or huge manifest): no overflow in the check."""
    big = 2**63 - 1
    cuts = [0, *[2**62 + k for k in range(40)], big]
    boxes = [Box((a, 0), (b - a, 2)) for a, b in itertools.pairwise(cuts)]
    with _path(path):
        check_tiling("h", (big, 2), boxes)
        bad = boxes[:5] + [Box((cuts[5], 1), (cuts[6] - cuts[5] + 1, 1))] + boxes[5:]
        with pytest.raises(LayoutError, match="shards overlap"):
            check_tiling("h", (big, 2), bad)
        with pytest.raises(LayoutError, match=r"shard offsets \[9223372036854775806, 0\] .* lie outside"):
            check_tiling("h", (big, 2), [*boxes, Box((big - 1, 0), (2, 2))])
