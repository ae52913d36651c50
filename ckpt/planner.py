"""Save and load planning. Pure functions of metadata: no process group, no I/O.

Save: every rank declares its pieces (``RankDecl``); ``plan_save`` deduplicates replicas, picks a
writer per piece balancing bytes across ranks, assigns files and byte offsets, and returns the
manifest skeleton plus one ``WriteAssignment`` per rank.

Load: ``plan_load(manifest, requests)`` intersects each requested region with the stored shards and
returns ``ReadOp``s: byte ranges per file (coalesced) plus the copies that move bytes into place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckpt.dtypes import dtype_from_name, itemsize, safetensors_dtype
from ckpt.errors import LayoutError, MismatchError, StateError
from ckpt.formats.safetensors_header import build_header
from ckpt.manifest import DATA_DIR, Manifest, ObjectEntry, ShardEntry, TensorEntry, entry_name
from ckpt.regions import box_runs, check_tiling, flat_segments, intersect_boxes, split_dim, strides
from ckpt.shards import Box, Flat, Region

# ---------------------------------------------------------------------------------------------
# Save side
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PieceDecl:
    """What a rank holds of one tensor (metadata only)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    region: Region

    def to_wire(self) -> list[Any]:
        if isinstance(self.region, Box):
            return [self.key, self.dtype, list(self.shape), "b", self.region.to_list()]
        return [self.key, self.dtype, list(self.shape), "f", self.region.to_wire()]

    @classmethod
    def from_wire(cls, w: list[Any]) -> PieceDecl:
        key, dtype, shape, kind, reg = w
        region: Region
        if kind == "b":
            region = Box(tuple(reg[0]), tuple(reg[1]))
        else:
            region = Flat(reg[0], reg[1], Box(tuple(reg[2]), tuple(reg[3])) if len(reg) == 4 else None)
        return cls(key, dtype, tuple(shape), region)


@dataclass(slots=True)
class RankDecl:
    """One rank's declaration: its tensor pieces and its encoded objects."""

    pieces: list[PieceDecl] = field(default_factory=list)
    objects: dict[str, bytes] = field(default_factory=dict)  # global objects (used from rank 0 only)
    per_rank_objects: dict[str, bytes] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"t": [p.to_wire() for p in self.pieces], "o": self.objects, "p": self.per_rank_objects}

    @classmethod
    def from_wire(cls, w: dict[str, Any]) -> RankDecl:
        return cls([PieceDecl.from_wire(p) for p in w["t"]], dict(w["o"]), dict(w["p"]))


@dataclass(slots=True)
class WriteEntry:
    """One piece a rank writes: index into its own piece list, and where it goes."""

    piece: int  # index into the rank's RankDecl.pieces
    key: str
    shard: int  # index of the shard in the manifest's tensor entry
    offset: int  # absolute byte offset in the file
    length: int


@dataclass(slots=True)
class WriteAssignment:
    """Everything one rank needs to write its data file."""

    file: str | None
    header: bytes
    entries: list[WriteEntry]

    @property
    def nbytes(self) -> int:
        return sum(e.length for e in self.entries)

    def to_wire(self) -> dict[str, Any]:
        return {"f": self.file, "h": self.header,
                "e": [[e.piece, e.key, e.shard, e.offset, e.length] for e in self.entries]}

    @classmethod
    def from_wire(cls, w: dict[str, Any]) -> WriteAssignment:
        return cls(w["f"], w["h"], [WriteEntry(*e) for e in w["e"]])


@dataclass(slots=True)
class SavePlan:
    """The global save plan: a manifest without checksums, and each rank's assignment."""

    manifest: Manifest
    assignments: list[WriteAssignment]


def data_file_name(rank: int, save_id: str) -> str:
    """Data file written by ``rank`` in the save identified by ``save_id``."""
    return f"{DATA_DIR}/{rank:05d}-{save_id}.safetensors"


def plan_save(decls: list[RankDecl], *, save_id: str, step: int | None = None,
              user_metadata: dict[str, Any] | None = None, layout: dict[str, Any] | None = None) -> SavePlan:
    """Build the global save plan from every rank's declaration.

    Raises StateError when ranks disagree on a tensor's dtype or shape, LayoutError when pieces
    overlap, leave gaps, or mix box and flat.
    """
    world = len(decls)
    # key -> (dtype, shape, first rank); region -> holders
    meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
    holders: dict[str, dict[Region, list[tuple[int, int]]]] = {}
    for rank, decl in enumerate(decls):
        for i, p in enumerate(decl.pieces):
            m = meta.get(p.key)
            if m is None:
                meta[p.key] = (p.dtype, p.shape, rank)
                holders[p.key] = {}
            elif (m[0], m[1]) != (p.dtype, p.shape):
                raise StateError(
                    f"tensor {p.key!r}: rank {m[2]} declares {m[0]} {list(m[1])} but rank {rank} declares "
                    f"{p.dtype} {list(p.shape)}; every rank must agree on the global dtype and shape"
                )
            holders[p.key].setdefault(p.region, []).append((rank, i))

    # Writer choice: largest pieces first, each to the least-loaded rank that holds it (LPT greedy).
    pieces: list[tuple[int, str, Region, list[tuple[int, int]]]] = []
    tensors: dict[str, TensorEntry] = {}
    for key in sorted(meta):
        dtype, shape, _ = meta[key]
        regions = sorted(holders[key], key=_region_sort_key)
        # Empty pieces (e.g. DTensor chunks past the end) carry nothing; keep one only for empty tensors.
        regions = [r for r in regions if r.numel > 0] or regions[:1]
        check_tiling(key, shape, regions)
        isz = itemsize(dtype_from_name(dtype, key=key))
        tensors[key] = TensorEntry(dtype, shape, [])
        for r in regions:
            pieces.append((r.numel * isz, key, r, holders[key][r]))
    load = [0] * world
    per_rank: list[list[tuple[str, int, Region, int, int]]] = [[] for _ in range(world)]
    order = sorted(range(len(pieces)), key=lambda j: (-pieces[j][0], pieces[j][1]))
    chosen: dict[int, tuple[int, int]] = {}
    for j in order:
        nbytes, _key, _region, hs = pieces[j]
        rank, idx = min(hs, key=lambda h: (load[h[0]], h[0]))
        load[rank] += nbytes
        chosen[j] = (rank, idx)
    for j, (nbytes, key, region, _hs) in enumerate(pieces):
        rank, idx = chosen[j]
        shard_index = len(tensors[key].shards)
        tensors[key].shards.append(ShardEntry(region, "", 0, nbytes))
        per_rank[rank].append((key, shard_index, region, idx, nbytes))

    files: dict[str, int] = {}
    assignments: list[WriteAssignment] = []
    for rank in range(world):
        mine = per_rank[rank]
        if not mine:
            assignments.append(WriteAssignment(None, b"", []))
            continue
        # Descending itemsize keeps every entry aligned to its element size.
        mine.sort(key=lambda e: (-itemsize(dtype_from_name(tensors[e[0]].dtype)), e[0], e[1]))
        hdr_entries = []
        for key, shard_index, region, _idx, nbytes in mine:
            t = tensors[key]
            st = safetensors_dtype(dtype_from_name(t.dtype))
            shape = region.lengths if isinstance(region, Box) else (region.numel,)
            if st is None:
                st, shape = "U8", (nbytes,)
            hdr_entries.append((entry_name(key, shard_index), st, tuple(shape), nbytes))
        fname = data_file_name(rank, save_id)
        header, offsets = build_header(hdr_entries, {"format": "ckpt", "rank": str(rank)})
        entries = []
        for (key, shard_index, _region, idx, nbytes), off in zip(mine, offsets, strict=True):
            s = tensors[key].shards[shard_index]
            s.file, s.offset = fname, off
            entries.append(WriteEntry(idx, key, shard_index, off, nbytes))
        files[fname] = len(header) + sum(e[4] for e in mine)
        assignments.append(WriteAssignment(fname, header, entries))

    objects: dict[str, ObjectEntry] = {}
    if decls:
        for key, data in decls[0].objects.items():
            if key in meta:
                raise StateError(f"key {key!r} is a tensor on some ranks and an object on rank 0")
            objects[key] = ObjectEntry(data=data)
        pr_keys = set().union(*(d.per_rank_objects.keys() for d in decls))
        for key in sorted(pr_keys):
            objects[key] = ObjectEntry(per_rank={r: d.per_rank_objects[key] for r, d in enumerate(decls)
                                                 if key in d.per_rank_objects})
    manifest = Manifest(tensors=tensors, objects=objects, files=files, step=step, world_size=world,
                        layout=layout, user_metadata=dict(user_metadata or {}))
    return SavePlan(manifest, assignments)


def _region_sort_key(r: Region) -> tuple[Any, ...]:
    if isinstance(r, Box):
        return (0, r.offsets, r.lengths)
    return (1, r.box.offsets if r.box else (), r.start, r.stop)


# ---------------------------------------------------------------------------------------------
# Load side
# ---------------------------------------------------------------------------------------------


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
        for s in t.shards_overlapping(req.region):
            covered += _plan_pair(frags, ti, req, s, tuple(t.shape), isz, direct_ok, max_read)
        if covered != req.region.numel:
            raise LayoutError(f"tensor {req.key!r}: stored shards cover {covered} of the {req.region.numel} "
                              "requested elements; the checkpoint is incomplete (run `ckpt verify`)")
    return ReadPlan(_coalesce(frags, max_read, max_gap, max_waste, merge_direct))


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


__all__ = [
    "PieceDecl", "RankDecl", "WriteAssignment", "WriteEntry", "SavePlan", "plan_save", "data_file_name",
    "LoadRequest", "ReadOp", "ReadPlan", "StridedCopy", "SegmentCopy", "plan_load", "split_dim",
]
