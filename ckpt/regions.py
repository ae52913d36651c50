"""Geometry of regions: intersections, contiguous runs, tiling checks. Pure functions, no I/O."""

from __future__ import annotations

import bisect
import math
from typing import NoReturn

import numpy as np

from ckpt.errors import LayoutError
from ckpt.shards import Box, Flat, Region


def strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return tuple(out)


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """The common block of two boxes, or None when they do not overlap (or the overlap is empty)."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return Box(tuple(offs), tuple(lens))


def split_dim(sub: Box, outer: Box) -> int:
    """Index of the outermost dim from which ``sub`` is one contiguous run inside ``outer``'s row-major data.

    ``sub`` (inside ``outer``) is made of ``prod(sub.lengths[:k])`` contiguous runs where k is returned.
    """
    n = len(outer.lengths)
    k = n - 1
    while k > 0 and sub.lengths[k] == outer.lengths[k]:
        k -= 1
    # dims after k are full; dim k may be partial; runs are indexed by dims < k
    # but if all dims >= 1 are full, k stays 0 and there is one run.
    return k if n else 0


def box_runs(sub: Box, outer: Box) -> tuple[np.ndarray, int]:
    """Start positions (elements, in ``outer``'s local row-major order) of ``sub``'s contiguous runs.

    Returns ``(starts, run_length)``; runs are in increasing order.
    """
    n = len(outer.lengths)
    if n == 0:
        return np.zeros(1, dtype=np.int64), 1
    st = strides(outer.lengths)
    k = split_dim(sub, outer)
    run = sub.lengths[k] * st[k]
    base = sum((sub.offsets[d] - outer.offsets[d]) * st[d] for d in range(n))
    starts = np.full(1, base, dtype=np.int64)
    for d in range(k - 1, -1, -1):  # dims before k, innermost first; outer dims vary slowest
        steps = np.arange(sub.lengths[d], dtype=np.int64) * st[d]
        starts = (steps[:, None] + starts[None, :]).reshape(-1)
    return starts, run


def global_runs(region: Region, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``region``'s elements, in its local order, as runs of the global row-major flattening:
    ``(starts, lengths)``. Runs are disjoint and increasing."""
    if isinstance(region, Flat) and region.box is None:
        return np.array([region.start], dtype=np.int64), np.array([region.numel], dtype=np.int64)
    box = region if isinstance(region, Box) else region.box
    assert box is not None
    starts, run = box_runs(box, Box(tuple(0 for _ in shape), tuple(shape)))
    lens = np.full(starts.shape, run, dtype=np.int64)
    if isinstance(region, Box):
        return starts, lens
    # A flat range of the box's own flattening: clip the box's runs to local positions [start, stop).
    local = np.arange(len(starts), dtype=np.int64) * run
    lo = np.clip(region.start - local, 0, run)
    hi = np.clip(region.stop - local, 0, run)
    keep = hi > lo
    return (starts + lo)[keep], (hi - lo)[keep]


def bounding_box(region: Region, shape: tuple[int, ...]) -> Box:
    """A box that contains ``region`` (a flat range: its box, or the whole tensor)."""
    if isinstance(region, Box):
        return region
    return region.box if region.box is not None else Box(tuple(0 for _ in shape), tuple(shape))


def flat_segments(src: Region, dst: Region, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Common elements of two regions as segments: ``(src_local_off, dst_local_off, length)``.

    Offsets are in each region's local row-major order (a flat region's local order is the flat
    order of its box, or of the tensor). Used whenever at least one side is flat.
    """
    e = np.zeros(0, dtype=np.int64)
    if isinstance(src, Flat) and isinstance(dst, Flat) and src.box == dst.box:
        # Same block split two ways (e.g. ZeRO over a different DP size): one range intersection.
        lo, hi = max(src.start, dst.start), min(src.stop, dst.stop)
        if hi <= lo:
            return e, e, e
        one = np.ones(1, dtype=np.int64)
        return one * (lo - src.start), one * (lo - dst.start), one * (hi - lo)
    if intersect_boxes(bounding_box(src, shape), bounding_box(dst, shape)) is None and len(shape):
        return e, e, e
    s_starts, s_lens = global_runs(src, shape)
    d_starts, d_lens = global_runs(dst, shape)
    if not len(s_starts) or not len(d_starts):
        return e, e, e
    # Local position of each run's first element = cumulative length of the previous runs.
    s_local = np.concatenate([[0], np.cumsum(s_lens)[:-1]]).astype(np.int64)
    d_local = np.concatenate([[0], np.cumsum(d_lens)[:-1]]).astype(np.int64)
    s_ends, d_ends = s_starts + s_lens, d_starts + d_lens
    # For every dst run, the src runs it overlaps are [a, b): all pairs, vectorized.
    a = np.searchsorted(s_ends, d_starts, side="right")
    b = np.searchsorted(s_starts, d_ends, side="left")
    cnt = np.maximum(b - a, 0)
    if not cnt.sum():
        return e, e, e
    di = np.repeat(np.arange(len(d_starts)), cnt)
    si = np.repeat(a, cnt) + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    lo = np.maximum(s_starts[si], d_starts[di])
    hi = np.minimum(s_ends[si], d_ends[di])
    keep = hi > lo
    lo, hi, si, di = lo[keep], hi[keep], si[keep], di[keep]
    return s_local[si] + (lo - s_starts[si]), d_local[di] + (lo - d_starts[di]), hi - lo


def check_tiling(key: str, shape: tuple[int, ...], regions: list[Region]) -> None:
    """Raise LayoutError unless ``regions`` cover every element of ``shape`` exactly once.

    O(n log n) for any set of pieces: flat pieces that tile the box they split (ZeRO) take a fast
    path; any other mix is checked exactly by cutting each flat range into at most ``2 * ndim``
    boxes, then boxes must be in bounds, disjoint (a sweep) and add up to the tensor.
    """
    try:
        _check_tiling(key, shape, regions)
    except LayoutError:
        if any(isinstance(r, Flat) for r in regions) and _tiles_exactly(shape, regions):
            return  # a valid tiling the grouped fast path cannot see (flat ranges mixed with boxes)
        raise


def _tiles_exactly(shape: tuple[int, ...], regions: list[Region]) -> bool:
    full = Box((0,) * len(shape), tuple(shape))
    boxes: list[Box] = []
    for r in regions:
        if isinstance(r, Flat):
            b = r.box or full
            if r.stop > b.numel or r.start < 0 or any(o + n > m for o, n, m in zip(b.offsets, b.lengths, shape,
                                                                                    strict=True)):
                return False
            boxes += flat_boxes(r.start, r.stop, b)
        elif r.numel:
            if any(o < 0 or o + n > m for o, n, m in zip(r.offsets, r.lengths, shape, strict=True)):
                return False
            boxes.append(r)
    if sum(b.numel for b in boxes) != math.prod(shape):
        return False
    try:
        _check_box_overlaps("", boxes)
    except LayoutError:
        return False
    return True


def flat_boxes(start: int, stop: int, box: Box) -> list[Box]:
    """Elements ``[start, stop)`` of ``box``'s row-major order as at most ``2 * ndim - 1`` boxes."""
    out: list[Box] = []

    def rec(a: int, b: int, dims: tuple[int, ...], prefix: tuple[int, ...]) -> None:
        if a >= b:
            return
        if len(dims) == 1:
            out.append(Box(prefix + (a,), (1,) * len(prefix) + (b - a,)))
            return
        inner = math.prod(dims[1:])
        ra, ca = divmod(a, inner)
        rb, cb = divmod(b, inner)
        if ra == rb:
            rec(ca, cb, dims[1:], prefix + (ra,))
            return
        if ca:
            rec(ca, inner, dims[1:], prefix + (ra,))
            ra += 1
        if rb > ra:
            out.append(Box(prefix + (ra,) + (0,) * (len(dims) - 1), (1,) * len(prefix) + (rb - ra,) + dims[1:]))
        if cb:
            rec(0, cb, dims[1:], prefix + (rb,))

    if not box.lengths:
        return [box] if stop > start else []
    rec(start, stop, tuple(box.lengths), ())
    return [Box(tuple(o + p for o, p in zip(b.offsets, box.offsets, strict=True)), b.lengths) for b in out]


def _check_tiling(key: str, shape: tuple[int, ...], regions: list[Region]) -> None:
    total = math.prod(shape)
    if not regions:
        if total == 0:
            return
        raise LayoutError(f"tensor {key!r}: no shards cover its {total} elements")
    full = Box(tuple(0 for _ in shape), tuple(shape))
    boxes = [r for r in regions if isinstance(r, Box) and r.numel > 0]
    if len(boxes) != len(regions):
        # Flat pieces are grouped by the box they split (none: the whole tensor). Within a box the
        # ranges must tile its flattening; the boxes themselves must then tile the tensor. Groups are
        # keyed by plain tuples: hashing a Box (a dataclass) costs a Python call per piece, and a
        # save at scale has a million flat pieces.
        groups: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Box, list[tuple[int, int]]]] = {}
        for r in regions:
            if isinstance(r, Flat) and r.stop > r.start:
                b = r.box or full
                g = groups.get((b.offsets, b.lengths))
                if g is None:
                    g = groups[(b.offsets, b.lengths)] = (b, [])
                g[1].append((r.start, r.stop))
        for box, ranges in groups.values():
            pos = 0
            for start, stop in sorted(ranges):
                if start < pos:
                    raise LayoutError(f"tensor {key!r}: flat shards{_where(box, full)} overlap at element {start}; "
                                      "each element must be held by exactly one piece (or identical replicas)")
                if start > pos:
                    raise LayoutError(f"tensor {key!r}: flat shards{_where(box, full)} leave elements "
                                      f"[{pos}, {start}) uncovered")
                pos = stop
            if pos != box.numel:
                raise LayoutError(f"tensor {key!r}: flat shards{_where(box, full)} leave elements "
                                  f"[{pos}, {box.numel}) uncovered")
        boxes += [box for box, _ in groups.values() if box.numel > 0]
    if _is_grid(shape, boxes):
        return
    covered = sum(b.numel for b in boxes)
    _check_box_overlaps(key, boxes)
    if covered != total:
        raise LayoutError(f"tensor {key!r}: shards cover {covered} of {total} elements of shape {list(shape)}; "
                          "some region is missing")


def _where(box: Box, full: Box) -> str:
    return "" if box == full else f" of box offsets {list(box.offsets)} lengths {list(box.lengths)}"


def _is_grid(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """True when ``boxes`` (non-empty) are distinct cells of a grid that tiles ``shape``: along every
    dim their intervals partition ``[0, shape[d])``, and there are as many boxes as cells.

    Then they tile the tensor exactly, with no pairwise overlap test: that test is O(n^2) per tensor
    (a few ms for the 512 expert blocks of one DeepSeek-V3 weight, seconds over a whole model), this
    is O(n log n). Tilings that are not grids (uneven, mixed) return False and take the general check.
    """
    n, nd = len(boxes), len(shape)
    if not nd or not n:
        return False
    offs = [b.offsets for b in boxes]
    lens = [b.lengths for b in boxes]
    if set(map(len, offs)) != {nd} or set(map(len, lens)) != {nd}:
        return False
    cells = 1
    for d, (o_d, l_d) in enumerate(zip(zip(*offs, strict=True), zip(*lens, strict=True), strict=True)):
        pos = 0
        ivs = sorted(set(zip(o_d, l_d, strict=True)))
        for o, length in ivs:
            if o != pos or length <= 0:
                return False
            pos = o + length
        if pos != shape[d]:
            return False
        cells *= len(ivs)
    return cells == n and len(set(zip(offs, lens, strict=True))) == n


def check_disjoint(key: str, boxes: list[Box]) -> None:
    """LayoutError naming two of ``boxes`` that overlap (O(n log n) for up to two separating dims)."""
    _check_box_overlaps(key, [b for b in boxes if b.numel])


def _check_box_overlaps(key: str, boxes: list[Box]) -> None:
    """LayoutError naming two overlapping boxes, if any; O(n log n) in the number of boxes for one
    or two separating dims (a sweep over one dim with the other's active intervals kept sorted),
    and a sweep with vectorized checks among the simultaneously active boxes beyond that. Dims in
    which every box has the same extent cannot separate boxes and are skipped."""
    n = len(boxes)
    if n < 2:
        return
    nd = len(boxes[0].offsets)
    dims = [d for d in range(nd) if len({(b.offsets[d], b.lengths[d]) for b in boxes}) > 1]
    if not dims:
        _overlap(key, boxes[0], boxes[1])
    x = dims[0]
    # ends sort before starts at the same coordinate: half-open intervals that touch do not overlap
    events = sorted([(b.offsets[x], 1, i) for i, b in enumerate(boxes)]
                    + [(b.offsets[x] + b.lengths[x], 0, i) for i, b in enumerate(boxes)])
    if len(dims) == 1:
        depth = 0
        for _pos, start, i in events:
            if start:
                if depth:
                    _overlap(key, boxes[i], next(boxes[j] for j in range(n) if j != i and _meets(boxes[i], boxes[j])))
                depth += 1
            else:
                depth -= 1
        return
    if len(dims) == 2:
        y = dims[1]
        los: list[int] = []  # active boxes' starts along y, sorted (they are disjoint along y)
        ids: list[int] = []
        for _pos, start, i in events:
            lo, hi = boxes[i].offsets[y], boxes[i].offsets[y] + boxes[i].lengths[y]
            k = bisect.bisect_left(los, lo)
            if not start:
                if k < len(los) and ids[k] == i:
                    del los[k], ids[k]
                continue
            if k < len(los) and los[k] < hi:
                _overlap(key, boxes[i], boxes[ids[k]])
            if k > 0 and _hi(boxes[ids[k - 1]], y) > lo:
                _overlap(key, boxes[i], boxes[ids[k - 1]])
            los.insert(k, lo)
            ids.insert(k, i)
        return
    rest = dims[1:]
    lo_all = np.array([[b.offsets[d] for d in rest] for b in boxes], dtype=np.int64)
    hi_all = lo_all + np.array([[b.lengths[d] for d in rest] for b in boxes], dtype=np.int64)
    active: list[int] = []
    for _pos, start, i in events:
        if not start:
            active.remove(i)
            continue
        if active:
            a = np.array(active)
            hit = np.all((lo_all[a] < hi_all[i]) & (lo_all[i] < hi_all[a]), axis=1)
            if hit.any():
                _overlap(key, boxes[i], boxes[int(a[int(np.argmax(hit))])])
        active.append(i)


def _hi(b: Box, d: int) -> int:
    return b.offsets[d] + b.lengths[d]


def _meets(a: Box, b: Box) -> bool:
    return all(ao < bo + bl and bo < ao + al
               for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True))


def _overlap(key: str, a: Box, b: Box) -> NoReturn:
    raise LayoutError(
        f"tensor {key!r}: shards overlap: offsets {list(a.offsets)} lengths {list(a.lengths)} and "
        f"offsets {list(b.offsets)} lengths {list(b.lengths)}; each element must be held by exactly one piece"
    )


def sub_region(region: Region, start: int, count: int) -> Region:
    """The part of ``region`` made of elements ``[start, start + count)`` of its local row-major data.

    A box's part must be whole rows (along dim 0): it is the sub-box of those rows. A flat range's
    part is the sub-range, of the same box. The save planner writes a large replicated piece in such
    parts, one per holder (``WriteEntry.count``), so that its writers stay balanced.
    """
    if isinstance(region, Flat):
        return Flat(region.start + start, region.start + start + count, region.box)
    row = math.prod(region.lengths[1:])
    if not region.lengths or row == 0 or start % row or count % row:
        raise ValueError(f"elements [{start}, {start + count}) are not whole rows of box {region.to_list()}")
    return Box((region.offsets[0] + start // row, *region.offsets[1:]), (count // row, *region.lengths[1:]))
