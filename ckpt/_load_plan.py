"""Load planning. A pure function of metadata: no process group, no I/O.

``plan_load(manifest, requests)`` intersects each requested region with the stored shards and
returns ``ReadOp``s: byte ranges per file (coalesced) plus the copies that move bytes into place.
Save planning is :mod:`ckpt._save_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ckpt._dtypes import dtype_from_name, itemsize
from ckpt._regions import (
    box_runs,
    check_disjoint,
    flat_boxes,
    flat_segments,
    intersect_boxes,
    split_dim,
    strides,
)
from ckpt.errors import LayoutError, MismatchError
from ckpt.manifest import Manifest, ShardEntry
from ckpt.shards import Box, Flat, Region


@dataclass(slots=True)
class LoadRequest:
    """A region of a global tensor that a rank wants, with the dtype/shape it expects."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    region: Region


@dataclass(slots=True)
class StridedCopy:
    """Copy a block: source is a strided view of the read buffer, destination a block of the target."""

    target: int
    buf_offset: int  # bytes into the ReadOp buffer where the view's first element sits
    lengths: tuple[int, ...]
    src_strides: tuple[int, ...]  # in elements
    dst_offsets: tuple[int, ...]  # within the target's local region (box targets only)


@dataclass(slots=True)
class SegmentCopy:
    """Copy 1-D segments: buffer element offsets -> target local (row-major) element offsets."""

    target: int
    buf_offsets: np.ndarray  # bytes
    dst_offsets: np.ndarray  # elements
    lengths: np.ndarray  # elements


Copy = StridedCopy | SegmentCopy


@dataclass(slots=True)
class ReadOp:
    """One buffer's worth of reading from one file, and the copies that consume it.

    ``direct`` set means the bytes go straight into the target's memory (no buffer, no copy):
    ``(target, byte offset in the target's local data)``.
    """

    file: str
    start: int
    length: int
    ranges: list[tuple[int, int]]  # (file offset, length) to actually read, within [start, start+length)
    copies: list[Copy] = field(default_factory=list)
    direct: tuple[int, int] | None = None

    @property
    def bytes_read(self) -> int:
        return sum(n for _, n in self.ranges)


@dataclass(slots=True)
class ReadPlan:
    """All reads one rank performs for a load."""

    ops: list[ReadOp]

    @property
    def bytes_read(self) -> int:
        return sum(op.bytes_read for op in self.ops)

    @property
    def files(self) -> set[str]:
        return {op.file for op in self.ops}


@dataclass(slots=True)
class _Frag:
    file: str
    start: int
    end: int
    offs: np.ndarray  # byte ranges to read: file offsets (sorted) ...
    lens: np.ndarray  # ... and lengths
    copy: Copy | None
    direct: tuple[int, int] | None
    isz: int = 1


DEFAULT_MAX_READ = 64 * 1024 * 1024


def plan_load(manifest: Manifest, requests: list[LoadRequest], *, contiguous_targets: list[bool] | None = None,
              max_read: int = DEFAULT_MAX_READ, max_gap: int = 4096, max_waste: float | None = None,
              merge_direct: bool = False) -> ReadPlan:
    """Plan the reads that fill ``requests`` from ``manifest``'s stored shards.

    Args:
        contiguous_targets: per request, whether its destination memory is one contiguous CPU block
            that bytes may be read straight into (zero-copy). Defaults to False for all.
        max_read: upper bound in bytes of one buffered read (the buffer budget per reader).
        max_gap: byte ranges of one file closer than this are merged into one read.
        max_waste: also require a merged gap to be at most this fraction of the range it joins
            (object stores: bounds bytes requested / bytes needed, e.g. 0.1 -> at most ~1.1x).
        merge_direct: merge reads that could go straight into a destination with their neighbours
            into one buffered read (object stores: fewer requests beat the saved copy).

    Raises MismatchError when a request's key is missing or its dtype/shape differ from the
    checkpoint; LayoutError when the stored shards do not cover the requested region.
    """
    frags: list[_Frag] = []
    for ti, req in enumerate(requests):
        t = manifest.tensors.get(req.key)
        if t is None:
            raise MismatchError(f"tensor {req.key!r}: not in the checkpoint (load with strict=False to skip it)")
        if t.dtype != req.dtype:
            raise MismatchError(f"tensor {req.key!r}: checkpoint has dtype {t.dtype}, the target is {req.dtype}; "
                                "load into a tensor of the stored dtype and cast afterwards")
        if tuple(t.shape) != tuple(req.shape):
            raise MismatchError(f"tensor {req.key!r}: checkpoint has global shape {list(t.shape)}, the target "
                                f"expects {list(req.shape)}")
        isz = itemsize(dtype_from_name(t.dtype))
        direct_ok = bool(contiguous_targets and contiguous_targets[ti])
        covered = 0
        # Decoded manifests keep shards as columns: only the candidates that can overlap are built.
        cands = t.shards_overlapping(req.region)
        for s in cands:
            covered += _plan_pair(frags, ti, req, s, tuple(t.shape), isz, direct_ok, max_read)
        if covered != req.region.numel:
            raise LayoutError(f"tensor {req.key!r}: stored shards cover {covered} of the {req.region.numel} "
                              "requested elements; the checkpoint is incomplete (run `ckpt verify`)")
        # An element count can hide an overlap that makes up for a gap: with the count right, the
        # cover is exact iff the candidates do not overlap inside the request (O(k log k)).
        _check_disjoint(req, [s.region for s in cands], tuple(t.shape))
    return ReadPlan(_coalesce(frags, max_read, max_gap, max_waste, merge_direct))


def _check_disjoint(req: LoadRequest, regions: list[Region], shape: tuple[int, ...]) -> None:
    """LayoutError when two stored pieces overlap (inside the requested box, when it is one). Flat
    pieces are cut into at most ``2 * ndim - 1`` boxes each, so any mix is checked exactly."""
    if len(regions) < 2 or not len(shape):
        return
    full = Box((0,) * len(shape), shape)
    boxes: list[Box] = []
    for r in regions:
        boxes += flat_boxes(r.start, r.stop, r.box or full) if isinstance(r, Flat) else [r]
    if isinstance(req.region, Box):
        boxes = [c for c in (intersect_boxes(b, req.region) for b in boxes) if c is not None]
    try:
        check_disjoint(req.key, boxes)
    except LayoutError as e:
        raise LayoutError(f"{e}; the manifest is corrupted, nothing was loaded (run `ckpt verify`)") from None


def _plan_pair(frags: list[_Frag], ti: int, req: LoadRequest, s: ShardEntry, shape: tuple[int, ...],
               isz: int, direct_ok: bool, max_read: int) -> int:
    src, dst = s.region, req.region
    if isinstance(src, Box) and isinstance(dst, Box):
        inter = intersect_boxes(src, dst) if len(shape) else src
        if inter is None or inter.numel == 0:
            return 0
        for sub in _split_box(inter, src, isz, max_read):
            _box_frag(frags, ti, s, src, dst, sub, isz, direct_ok)
        return inter.numel
    s_off, d_off, lens = flat_segments(src, dst, shape)
    if lens.size == 0:
        return 0
    order = np.argsort(s_off, kind="stable")
    s_off, d_off, lens = s_off[order], d_off[order], lens[order]
    # Split segments longer than max_read, then group consecutive segments into fragments.
    max_el = max(1, max_read // isz)
    if (lens > max_el).any():
        ss, dd, nn = [], [], []
        for a, b, n in zip(s_off.tolist(), d_off.tolist(), lens.tolist(), strict=True):
            for k in range(0, n, max_el):
                ss.append(a + k)
                dd.append(b + k)
                nn.append(min(max_el, n - k))
        s_off, d_off, lens = (np.array(x, dtype=np.int64) for x in (ss, dd, nn))
    i = 0
    total = int(lens.sum())
    s_end = s_off + lens  # increasing: the segments of one stored piece are disjoint and sorted
    while i < len(lens):
        span_start = int(s_off[i])
        # the longest run of segments from i whose span fits in one read
        j = max(i, int(np.searchsorted(s_end, span_start + max_el, side="right")) - 1)
        sl = slice(i, j + 1)
        fstart = s.offset + span_start * isz
        fend = s.offset + int(s_off[j] + lens[j]) * isz
        offs, nbytes = s.offset + s_off[sl] * isz, lens[sl] * isz
        if direct_ok and j == i:
            frags.append(_Frag(s.file, fstart, fend, offs, nbytes, None, (ti, int(d_off[i]) * isz), isz))
        else:
            seg = SegmentCopy(ti, (s_off[sl] - span_start) * isz, d_off[sl].copy(), lens[sl].copy())
            frags.append(_Frag(s.file, fstart, fend, offs, nbytes, seg, None))
        i = j + 1
    return total


def _split_box(inter: Box, src: Box, isz: int, max_read: int) -> list[Box]:
    """Split ``inter`` (inside ``src``) so that each part's byte span in ``src``'s data fits ``max_read``."""
    st = strides(src.lengths)
    n = len(inter.lengths)

    def span(b: Box) -> int:
        if b.numel == 0:
            return 0
        first = sum((b.offsets[d] - src.offsets[d]) * st[d] for d in range(n))
        last = sum((b.offsets[d] + b.lengths[d] - 1 - src.offsets[d]) * st[d] for d in range(n))
        return (last - first + 1) * isz

    out: list[Box] = []

    def rec(b: Box, d: int) -> None:
        if d >= n or span(b) <= max_read:
            out.append(b)
            return
        # A chunk of `per` indices along d spans at most per * stride bytes.
        per = max(1, max_read // (st[d] * isz))
        for i in range(0, b.lengths[d], per):
            c = _slice_box(b, d, b.offsets[d] + i, min(per, b.lengths[d] - i))
            if span(c) <= max_read:
                out.append(c)
            else:  # only when per == 1: a single index along d is still too large
                rec(c, d + 1)

    rec(inter, 0)
    return out


def _slice_box(b: Box, d: int, off: int, length: int) -> Box:
    return Box(b.offsets[:d] + (off,) + b.offsets[d + 1:], b.lengths[:d] + (length,) + b.lengths[d + 1:])


def _box_frag(frags: list[_Frag], ti: int, s: ShardEntry, src: Box, dst: Box, sub: Box, isz: int,
              direct_ok: bool) -> None:
    st = strides(src.lengths)
    starts, run = box_runs(sub, src)
    first = int(starts[0])
    fstart = s.offset + first * isz
    fend = s.offset + (int(starts[-1]) + run) * isz
    offs = s.offset + starts * isz
    nbytes = np.full(offs.shape, run * isz, dtype=np.int64)
    dst_offsets = tuple(o - d for o, d in zip(sub.offsets, dst.offsets, strict=True))
    if direct_ok and len(starts) == 1:
        # One run in the file; is it one run in the destination too?
        dstarts, drun = box_runs(sub, dst)
        if len(dstarts) == 1 and drun == run:
            frags.append(_Frag(s.file, fstart, fend, offs, nbytes, None, (ti, int(dstarts[0]) * isz), isz))
            return
    frags.append(_Frag(s.file, fstart, fend, offs, nbytes, StridedCopy(ti, 0, sub.lengths, st, dst_offsets), None))


def _merge(offs: np.ndarray, lens: np.ndarray, max_gap: int, max_waste: float | None = None) -> list[tuple[int, int]]:
    """Sort byte ranges and merge those that overlap or lie within ``max_gap`` of each other (and,
    with ``max_waste``, whose gap is at most that fraction of the range it joins)."""
    if len(offs) == 0:
        return []
    order = np.argsort(offs, kind="stable")
    o, e = offs[order], offs[order] + lens[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(o), dtype=bool)
    gap = o[1:] - reach[:-1]
    new[1:] = gap > max_gap
    if max_waste is not None:
        new[1:] |= gap > max_waste * lens[order][1:]
    idx = np.nonzero(new)[0]
    starts = o[idx]
    ends = np.maximum.reduceat(e, idx)
    return list(zip(starts.tolist(), (ends - starts).tolist(), strict=True))


def _coalesce(frags: list[_Frag], max_read: int, max_gap: int, max_waste: float | None = None,
              merge_direct: bool = False) -> list[ReadOp]:
    """Merge fragments of the same file whose spans are near each other into one buffered read.

    A buffered op starts at an 8-byte aligned file offset so that every fragment's first element
    sits at a buffer offset divisible by its item size (entries are aligned in the data files).
    """
    ops: list[ReadOp] = []
    by_file: dict[str, list[_Frag]] = {}
    for f in frags:
        if f.direct is not None and merge_direct and f.end - f.start < max_read:
            # As a one-segment copy it can share a request with its neighbours.
            ti, off = f.direct
            n = (f.end - f.start) // f.isz
            seg = SegmentCopy(ti, np.zeros(1, dtype=np.int64), np.array([off // f.isz]), np.array([n]))
            f = _Frag(f.file, f.start, f.end, f.offs, f.lens, seg, None, f.isz)
        by_file.setdefault(f.file, []).append(f)
    for file in sorted(by_file):
        groups: list[tuple[int, int, list[_Frag]]] = []  # (aligned start, end, members)
        for f in sorted(by_file[file], key=lambda f: f.start):
            if f.direct is not None:
                ops.append(ReadOp(file, f.start, f.end - f.start, _merge(f.offs, f.lens, 0), [], f.direct))
                continue
            joinable = groups and f.start <= groups[-1][1] + max_gap and f.end - groups[-1][0] <= max_read
            if joinable and max_waste is not None:
                joinable = f.start - groups[-1][1] <= max_waste * int(f.lens.sum())
            if joinable:
                start, end, members = groups[-1]
                members.append(f)
                groups[-1] = (start, max(end, f.end), members)
            else:
                groups.append((f.start - f.start % 8, f.end, [f]))
        for start, end, members in groups:
            ranges = _merge(np.concatenate([m.offs for m in members]), np.concatenate([m.lens for m in members]),
                            max_gap, max_waste)
            copies = [_shift(m.copy, m.start - start) for m in members if m.copy is not None]
            ops.append(ReadOp(file, start, end - start, ranges, copies, None))
    return ops


def _shift(c: Copy, by: int) -> Copy:
    if isinstance(c, StridedCopy):
        return StridedCopy(c.target, c.buf_offset + by, c.lengths, c.src_strides, c.dst_offsets)
    return SegmentCopy(c.target, c.buf_offsets + by, c.dst_offsets, c.lengths)


__all__ = ["LoadRequest", "ReadOp", "ReadPlan", "StridedCopy", "SegmentCopy", "Copy", "plan_load", "split_dim",
           "DEFAULT_MAX_READ"]
