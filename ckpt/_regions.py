"""Geometry of regions: intersections, contiguous runs, tiling checks. Pure functions, no I/O."""

from __future__ import annotations

import itertools
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


def flat_span(region: Region, shape: tuple[int, ...]) -> tuple[int, int]:
    """``[first, last + 1)`` of the global flat indices ``region`` touches (a superset for boxes)."""
    if isinstance(region, Flat) and region.box is None:
        return region.start, region.stop
    box = region if isinstance(region, Box) else region.box
    assert box is not None
    if box.numel == 0:
        return 0, 0
    st = strides(shape)
    first = sum(o * s for o, s in zip(box.offsets, st, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(box.offsets, box.lengths, st, strict=True))
    return first, last + 1


def bounding_box(region: Region, shape: tuple[int, ...]) -> Box:
    """A box containing every element of ``region`` (the region itself for a box; for a flat range,
    the rows of its box, or of the whole tensor, that the range spans)."""
    if isinstance(region, Box):
        return region
    box = region.box if region.box is not None else Box(tuple(0 for _ in shape), tuple(shape))
    if not box.lengths or region.numel == 0:
        return box
    row = strides(box.lengths)[0]
    lo, hi = region.start // row, (region.stop - 1) // row + 1
    return Box((box.offsets[0] + lo, *box.offsets[1:]), (hi - lo, *box.lengths[1:]))


def may_overlap(a: Region, b: Region, shape: tuple[int, ...]) -> bool:
    """False when ``a`` and ``b`` certainly share no element (exact for two boxes)."""
    if len(shape) == 0:
        return True
    if intersect_boxes(bounding_box(a, shape), bounding_box(b, shape)) is None:
        return False
    if isinstance(a, Box) and isinstance(b, Box):
        return True
    (a0, a1), (b0, b1) = flat_span(a, shape), flat_span(b, shape)
    return a0 < b1 and b0 < a1


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
    boxes, then boxes must be in bounds, disjoint (:func:`separate`) and add up to the tensor.
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
        b = r if isinstance(r, Box) else (r.box or full)
        if any(o < 0 or n < 0 or o + n > m for o, n, m in zip(b.offsets, b.lengths, shape, strict=True)):
            return False  # (the error raised is _check_tiling's, which names the piece)
        if isinstance(r, Flat):
            if r.start < 0 or r.stop > b.numel:
                return False
            boxes += flat_boxes(r.start, r.stop, b)
        elif r.numel:
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
    # every piece inside the tensor first: the counts below assume it
    _check_bounds(key, shape, [r for r in regions if isinstance(r, Box)])
    boxes = [r for r in regions if isinstance(r, Box) and r.numel > 0]
    if len(boxes) != len(regions):
        # Flat pieces are grouped by the box they split (none: the whole tensor). Within a box the
        # ranges must tile its flattening; the boxes themselves must then tile the tensor. Groups are
        # keyed by plain tuples: hashing a Box (a dataclass) costs a Python call per piece, and a
        # save at scale has a million flat pieces.
        groups: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Box, list[tuple[int, int]]]] = {}
        for r in regions:
            if isinstance(r, Flat) and r.stop >= r.start:
                b = r.box or full
                g = groups.get((b.offsets, b.lengths))
                if g is None:
                    g = groups[(b.offsets, b.lengths)] = (b, [])
                g[1].append((r.start, r.stop))
        for box, ranges in groups.values():
            _check_bounds(key, shape, [box])
            ranges.sort()
            lo, hi = ranges[0][0], max(stop for _, stop in ranges)
            if lo < 0 or hi > box.numel:
                bad = ranges[0] if lo < 0 else next(r for r in ranges if r[1] == hi)
                raise LayoutError(f"tensor {key!r}: flat shard [{bad[0]}, {bad[1]}) lies outside the {box.numel} "
                                  f"elements{_where(box, full) or f' of shape {list(shape)}'}; every piece must lie "
                                  "inside its tensor")
        for box, ranges in groups.values():
            pos = 0
            held = [r for r in ranges if r[1] > r[0]]
            for start, stop in held:
                if start < pos:
                    raise LayoutError(f"tensor {key!r}: flat shards{_where(box, full)} overlap at element {start}; "
                                      "each element must be held by exactly one piece (or identical replicas)")
                if start > pos:
                    raise LayoutError(f"tensor {key!r}: flat shards{_where(box, full)} leave elements "
                                      f"[{pos}, {start}) uncovered")
                pos = stop
            if held and pos != box.numel:
                raise LayoutError(f"tensor {key!r}: flat shards{_where(box, full)} leave elements "
                                  f"[{pos}, {box.numel}) uncovered")
        boxes += [box for box, ranges in groups.values() if box.numel > 0 and any(b > a for a, b in ranges)]
    # a few boxes: the pure-Python grid test is cheaper than numpy's set-up in the general check
    if len(boxes) <= _SMALL and _is_grid(shape, boxes):
        return
    covered = sum(b.numel for b in boxes)
    _check_box_overlaps(key, boxes)
    if covered != total:
        raise LayoutError(f"tensor {key!r}: shards cover {covered} of {total} elements of shape {list(shape)}; "
                          "some region is missing")


def _check_bounds(key: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """LayoutError naming the first of ``boxes`` not inside ``shape``. Manifests and states are
    checked when read; this keeps the tiling check exact for any caller (pieces outside the tensor
    could otherwise add up to its size)."""
    nd = len(shape)
    if len(boxes) > _SMALL and max(shape, default=0) < 2**62:
        try:
            lo = np.array([b.offsets for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
            n = np.array([b.lengths for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
        except (ValueError, OverflowError):  # a box of another rank, or beyond int64: found below
            pass
        else:
            bad = np.flatnonzero(((lo < 0) | (n < 0) | (lo > np.array(shape)) | (n > np.array(shape) - lo)).any(axis=1))
            if not len(bad):
                return
            boxes = [boxes[int(bad[0])]]
    for b in boxes:
        if len(b.offsets) != nd or len(b.lengths) != nd or any(
                o < 0 or n < 0 or o + n > g for o, n, g in zip(b.offsets, b.lengths, shape, strict=True)):
            raise LayoutError(f"tensor {key!r}: shard offsets {list(b.offsets)} lengths {list(b.lengths)} lie outside "
                              f"the shape {list(shape)}; every piece must lie inside its tensor")


def _where(box: Box, full: Box) -> str:
    return "" if box == full else f" of box offsets {list(box.offsets)} lengths {list(box.lengths)}"


def _is_grid(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """True when ``boxes`` (non-empty) are distinct cells of a grid that tiles ``shape``: along every
    dim their intervals partition ``[0, shape[d])``, and there are as many boxes as cells.

    Then they tile the tensor exactly, with no overlap test: for the few boxes it is used on (the
    shards of one tensor over TP / EP ranks) this pure-Python test costs less than setting up the
    general check. Tilings that are not grids (uneven, mixed) return False and take the general check.
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
    """LayoutError naming two of ``boxes`` that overlap (O(n log n) per pass of :func:`separate`)."""
    _check_box_overlaps(key, [b for b in boxes if b.numel])


_SMALL = 32  # up to this many boxes, pure Python beats numpy's set-up
_PASSES = 64  # separation passes before the groups still entangled go to the per-group checks
_CELLS = 1 << 22  # an entangled group is counted cell by cell when its own grid has at most this many cells


def _check_box_overlaps(key: str, boxes: list[Box]) -> None:
    """LayoutError naming two overlapping boxes (non-empty, one rank each), if any.

    O(n log n) per pass for any layout built by cutting blocks into blocks (grids, brick walls, uneven
    and nested splits, flat ranges cut into boxes): :func:`separate` splits the boxes into groups
    that provably cannot overlap each other, down to single boxes. The groups it cannot split (an
    overlap, or a pinwheel of boxes) are checked on their own by :func:`_entangled`.
    """
    if len(boxes) < 2:
        return
    if len(boxes) <= _SMALL:
        _sweep_small(key, boxes)
        return
    lo, hi = _coordinate_ranks(boxes)
    for idx in separate(lo, hi):
        _entangled(key, boxes, lo[idx], hi[idx], idx)


def _sweep_small(key: str, boxes: list[Box]) -> None:
    """Overlap check of a few boxes in pure Python (no numpy set-up): a sweep along the dim with
    the most distinct starts, each box compared with the boxes still active there."""
    nd = len(boxes[0].offsets)
    x = max(range(nd), key=lambda d: len({b.offsets[d] for b in boxes}), default=0)
    active: list[Box] = []
    for b in sorted(boxes, key=lambda b: b.offsets[x] if nd else 0):
        if nd:
            active = [a for a in active if a.offsets[x] + a.lengths[x] > b.offsets[x]]
        for a in active:
            if all(ao < bo + bl and bo < ao + al
                   for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True)):
                _overlap(key, a, b)
        active.append(b)


def _coordinate_ranks(boxes: list[Box]) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``: each box's start and end along every dim as its rank among that dim's distinct
    coordinates, ``(n, ndim)`` int64. Ranks keep order and ties, so the boxes overlap exactly when
    the originals do, and every rank is below ``2 n`` (no overflow in the sort keys below)."""
    n, nd = len(boxes), len(boxes[0].offsets)
    lo, hi = np.empty((n, nd), dtype=np.int64), np.empty((n, nd), dtype=np.int64)
    for d in range(nd):
        starts = [b.offsets[d] for b in boxes]
        ends = [b.offsets[d] + b.lengths[d] for b in boxes]
        if max(ends) < 2**62 and min(starts) > -(2**62):
            _, inv = np.unique(np.array(starts + ends, dtype=np.int64), return_inverse=True)
        else:  # coordinates beyond int64 (a hostile manifest): rank them as Python ints
            rank = {v: i for i, v in enumerate(sorted(set(starts) | set(ends)))}
            inv = np.array([rank[v] for v in starts + ends], dtype=np.int64)
        lo[:, d], hi[:, d] = inv[:n], inv[n:]
    return lo, hi


def separate(lo: np.ndarray, hi: np.ndarray, passes: int = _PASSES) -> list[np.ndarray]:
    """Groups (row indices) of the boxes ``[lo, hi)`` (``(n, ndim)`` int arrays) that could not be
    separated; boxes of different groups, and boxes left out (alone in their group), are disjoint.

    Each pass takes one dim in turn and, inside every group, cuts at each coordinate that no box of
    the group crosses (sorted by start, a cut lies wherever the running maximum of the ends reaches
    the next start): the two sides are disjoint along that dim. Passes stop when a whole round of
    dims cuts nothing, or after ``passes``. A pass is one sort: O(n log n). A tiling made by cutting
    blocks into blocks, recursively (grids, brick walls, nested and uneven splits, flat ranges as
    boxes), is separated into single boxes in (nesting depth x ndim) passes, so nothing is left.
    """
    n, nd = lo.shape
    dims = [d for d in range(nd) if (lo[:, d] != lo[0, d]).any() or (hi[:, d] != hi[0, d]).any()]
    idx = np.arange(n)
    label = np.zeros(n, dtype=np.int64)  # group of each row of idx, non-decreasing
    if not dims:
        return [idx] if n > 1 else []
    clean = done = 0
    while len(idx) and clean < len(dims) and done < passes:
        d = dims[done % len(dims)]
        done += 1
        start, end = lo[idx, d], hi[idx, d]
        span = int(end.max()) + 1
        keys = label * span + start  # sorts by group, then start
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        reach = np.maximum.accumulate(label[order] * span + end[order])  # running max end, per group
        first = np.empty(len(idx), dtype=bool)
        first[0] = True
        first[1:] = reach[:-1] <= keys[1:]  # a new group starts: nothing before it reaches it
        if int(first.sum()) == int(label[-1]) + 1:
            clean += 1  # no cut along d
            continue
        clean = 1
        grp = np.cumsum(first) - 1
        keep = np.bincount(grp)[grp] > 1  # a box alone in its group is disjoint from all others
        idx, grp = idx[order][keep], grp[keep]
        if not len(idx):
            break
        label = np.cumsum(np.concatenate([[True], grp[1:] != grp[:-1]])) - 1
    if not len(idx):
        return []
    return np.split(idx, np.flatnonzero(np.diff(label)) + 1)


def _entangled(key: str, boxes: list[Box], lo: np.ndarray, hi: np.ndarray, idx: np.ndarray) -> None:
    """Overlap check of one group :func:`separate` could not split (rows ``idx`` of ``boxes``):
    counted on the grid of the group's own coordinates when it is small (cells + 2^ndim boxes),
    else a sweep over the first dim that compares each box with the boxes active there."""
    dims = [d for d in range(lo.shape[1]) if (lo[:, d] != lo[0, d]).any() or (hi[:, d] != hi[0, d]).any()]
    if not dims:  # the same block, twice
        _overlap(key, boxes[int(idx[0])], boxes[int(idx[1])])
    lo, hi = lo[:, dims], hi[:, dims]
    axes = [np.unique(np.concatenate([lo[:, j], hi[:, j]])) for j in range(len(dims))]
    if len(dims) <= 8 and math.prod(len(a) for a in axes) <= _CELLS:
        li = [np.searchsorted(a, lo[:, j]) for j, a in enumerate(axes)]
        hj = [np.searchsorted(a, hi[:, j]) for j, a in enumerate(axes)]
        count = np.zeros(tuple(len(a) for a in axes), dtype=np.int64)
        for corner in itertools.product((0, 1), repeat=len(dims)):  # difference array: +-1 at 2^d corners
            at = tuple(hj[j] if c else li[j] for j, c in enumerate(corner))
            np.add.at(count, at, -1 if sum(corner) % 2 else 1)
        for j in range(len(dims)):
            np.cumsum(count, axis=j, out=count)
        cell = np.unravel_index(int(np.argmax(count)), count.shape)
        if count[cell] > 1:
            inside = np.logical_and.reduce([(li[j] <= c) & (c < hj[j]) for j, c in enumerate(cell)])
            a, b = np.flatnonzero(inside)[:2]
            _overlap(key, boxes[int(idx[a])], boxes[int(idx[b])])
        return
    # Bounded fallback (O(n x active boxes), vectorized): large groups that are neither cut into
    # blocks nor on a small grid; no sharding layout we know produces them.
    active = np.empty(0, dtype=np.int64)
    for i in np.argsort(lo[:, 0], kind="stable"):
        active = active[hi[active, 0] > lo[i, 0]]  # boxes ending at or before this start are done
        hit = np.all((lo[active] < hi[i]) & (lo[i] < hi[active]), axis=1)
        if hit.any():
            _overlap(key, boxes[int(idx[i])], boxes[int(idx[active[int(np.argmax(hit))]])])
        active = np.append(active, i)


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
