"""Save and load planning. Pure functions of metadata: no process group, no I/O.

Save: every rank declares its pieces (``RankDecl``); ``plan_save`` deduplicates replicas, picks a
writer per piece balancing bytes across ranks, assigns files and byte offsets, and returns the
manifest skeleton plus one ``WriteAssignment`` per rank.

Load: ``plan_load(manifest, requests)`` intersects each requested region with the stored shards and
returns ``ReadOp``s: byte ranges per file (coalesced) plus the copies that move bytes into place.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckpt.dtypes import dtype_from_name, itemsize, safetensors_dtype
from ckpt.errors import LayoutError, MismatchError, StateError
from ckpt.formats.safetensors_header import build_header
from ckpt.manifest import DATA_DIR, Manifest, ObjectEntry, ShardEntry, TensorEntry, entry_name
from ckpt.regions import (
    box_runs,
    check_disjoint,
    check_tiling,
    flat_boxes,
    flat_segments,
    intersect_boxes,
    split_dim,
    strides,
    sub_region,
)
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
    aliases: dict[str, str] = field(default_factory=dict)  # key -> key whose memory it shares (ckpt.aliases)

    def to_wire(self) -> dict[str, Any]:
        w = {"t": [p.to_wire() for p in self.pieces], "o": self.objects, "p": self.per_rank_objects}
        if self.aliases:
            w["a"] = self.aliases
        return w

    @classmethod
    def from_wire(cls, w: dict[str, Any]) -> RankDecl:
        return cls([PieceDecl.from_wire(p) for p in w["t"]], dict(w["o"]), dict(w["p"]), dict(w.get("a", {})))


@dataclass(slots=True)
class WriteEntry:
    """One piece a rank writes, or a part of one: index into its own piece list, and where it goes.

    ``count`` None (the default) means the whole piece. Otherwise the entry is elements
    ``[start, start + count)`` of the piece's local row-major data: whole rows of a box or a
    sub-range of a flat range, so one contiguous run either way. ``plan_save(split_replicas=True)``
    writes a large replicated piece in such parts, one per holder; the part's region is
    ``ckpt.regions.sub_region(piece region, start, count)``.
    """

    piece: int  # index into the rank's RankDecl.pieces
    key: str
    shard: int  # index of the shard in the manifest's tensor entry
    offset: int  # absolute byte offset in the file
    length: int
    start: int = 0  # first element of the part within the piece (with count)
    count: int | None = None  # elements in the part; None: the whole piece


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
        # A part carries two more fields; whole pieces keep the 5-field form (no extra bytes per entry).
        return {"f": self.file, "h": self.header,
                "e": [[e.piece, e.key, e.shard, e.offset, e.length] if e.count is None
                      else [e.piece, e.key, e.shard, e.offset, e.length, e.start, e.count] for e in self.entries]}

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


# Splitting replicated pieces (plan_save(split_replicas=True)): a part is never smaller than this,
# nor than 1/SPLIT_PARTS_PER_LOAD of its replica group's mean writer load. Below 1 MiB a part's
# request and shard entry cost more than the imbalance it removes; 1/128 of the mean load bounds
# what one whole part can leave uneven at about 1% (the benchmark target is 5%).
SPLIT_MIN_PART_BYTES = 1 << 20
SPLIT_PARTS_PER_LOAD = 128


def plan_save(decls: list[RankDecl], *, save_id: str, step: int | None = None,
              user_metadata: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
              split_replicas: bool = False) -> SavePlan:
    """Build the global save plan from every rank's declaration.

    Each distinct piece (tensor key and region) is written once. A piece one rank declares is
    written by that rank; a replicated piece goes, largest first, to the least-loaded rank that
    holds it (LPT). With ``split_replicas`` a large replicated piece whose whole placement would
    leave its holders unbalanced is written in parts (whole rows) by several of them instead (see
    ``_place_split``); the manifest then has more shards, which still tile the tensor. Only callers
    whose writers handle ``WriteEntry.count`` may ask for it (``ckpt.save`` does, for safetensors).

    Pure and deterministic: the same declarations give the same plan.

    Raises StateError when ranks disagree on a tensor's dtype or shape, LayoutError when pieces
    overlap, leave gaps, or mix box and flat.
    """
    # The plan allocates a few objects per piece and frees nothing until it returns, so the cyclic
    # GC would rescan the ever-growing heap (the declarations included) over and over: two thirds of
    # the time at 16,384 ranks. Nothing here makes reference cycles; pause the collector.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _plan_save(decls, save_id, step, user_metadata, layout, split_replicas)
    finally:
        if paused:
            gc.enable()


def _plan_save(decls: list[RankDecl], save_id: str, step: int | None, user_metadata: dict[str, Any] | None,
               layout: dict[str, Any] | None, split_replicas: bool) -> SavePlan:
    world = len(decls)
    meta, regions, holders, ukey = _gather(decls)

    # Per tensor, in key order: its distinct non-empty pieces in region order (the manifest's shard
    # order), checked to tile the tensor. A piece one rank holds is that rank's to write, and counts
    # toward its load before any replica is placed: knowing every rank's mandatory bytes first
    # balances better than interleaving them with the replicas by size.
    size = [0] * len(regions)
    load = [0] * world
    writer = [0] * len(regions)  # holder code (rank << 32 | piece index) writing the whole piece
    replicated: list[int] = []
    kept: dict[str, list[int]] = {}
    for key in sorted(meta):
        dtype, shape, _, index = meta[key]
        isz = itemsize(dtype_from_name(dtype, key=key))
        uids = [index[k] for k in sorted(index)]
        meta[key][3] = None  # free the lookup early: what the plan allocates next reuses its memory
        regs = [regions[u] for u in uids]
        numels = [r.numel for r in regs]
        if 0 in numels:
            # Empty pieces (e.g. DTensor chunks past the end) carry nothing; keep one only for empty tensors.
            keep = [j for j, n in enumerate(numels) if n > 0] or [0]
            uids, regs, numels = [uids[j] for j in keep], [regs[j] for j in keep], [numels[j] for j in keep]
        check_tiling(key, shape, regs)
        for u, n in zip(uids, numels, strict=True):
            size[u] = nbytes = n * isz
            hs = holders[u]
            if isinstance(hs, int):
                writer[u] = hs
                load[hs >> 32] += nbytes
            else:
                replicated.append(u)
        kept[key] = uids

    # Replicas, largest first; the sort is stable, so ties keep the manifest order (deterministic).
    replicated.sort(key=size.__getitem__, reverse=True)
    parts: dict[int, list[tuple[int, int, int | None]]] = {}
    if split_replicas:
        parts = _place_split(replicated, holders, size, load, writer, regions, [meta[k][1] for k in ukey])
    else:
        for u in replicated:
            hs = holders[u]
            ranks = [h >> 32 for h in hs]
            r = min(ranks, key=load.__getitem__)  # the first minimum: ties go to the lowest rank
            writer[u] = hs[ranks.index(r)]
            load[r] += size[u]

    # Shards and each rank's entries. Tensors are visited by descending itemsize, then key: every
    # rank's entries come out in file order (descending itemsize keeps every entry aligned to its
    # element size), with no per-rank sort. Offsets are filled in once each rank's header is built.
    shards_of: dict[str, list[ShardEntry]] = {}
    went: list[list[WriteEntry]] = [[] for _ in range(world)]
    wshard: list[list[ShardEntry]] = [[] for _ in range(world)]
    isz_of = {key: itemsize(dtype_from_name(meta[key][0])) for key in kept}
    st_of = {key: safetensors_dtype(dtype_from_name(meta[key][0])) for key in kept}
    for key in sorted(kept, key=lambda k: (-isz_of[k], k)):
        isz = isz_of[key]
        shards: list[ShardEntry] = []
        for u in kept[key]:
            region = regions[u]
            for code, start, count in parts.get(u) or ((writer[u], 0, None),):
                if count is None:
                    reg, nbytes = region, size[u]
                else:
                    reg, nbytes = sub_region(region, start, count), count * isz
                rank, i = code >> 32, len(shards)
                s = ShardEntry(reg, "", 0, nbytes)
                shards.append(s)
                wshard[rank].append(s)
                went[rank].append(WriteEntry(code & 0xFFFFFFFF, key, i, 0, nbytes, start, count))
        shards_of[key] = shards

    files: dict[str, int] = {}
    assignments: list[WriteAssignment] = []
    for rank in range(world):
        mine = went[rank]
        if not mine:
            assignments.append(WriteAssignment(None, b"", []))
            continue
        fname = data_file_name(rank, save_id)
        header, offsets = build_header(_header_entries(mine, wshard[rank], st_of),
                                       {"format": "ckpt", "rank": str(rank)})
        for e, s, off in zip(mine, wshard[rank], offsets, strict=True):
            e.offset = s.offset = off
            s.file = fname
        files[fname] = offsets[-1] + mine[-1].length  # entries lie back to back after the header
        assignments.append(WriteAssignment(fname, header, mine))
    tensors = {key: TensorEntry(meta[key][0], meta[key][1], shards_of[key]) for key in kept}

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


def _header_entries(entries: list[WriteEntry], shards: list[ShardEntry],
                    st_of: dict[str, str | None]) -> Iterator[tuple[str, str, tuple[int, ...], int]]:
    """One rank's safetensors header entries, made while its header is built: held for every rank
    until the end, they were a million tuples and names more to allocate."""
    for e, s in zip(entries, shards, strict=True):
        st = st_of[e.key]
        if st is None:  # no safetensors dtype: raw bytes
            yield entry_name(e.key, e.shard), "U8", (e.length,), e.length
        else:
            shape = s.region.lengths if isinstance(s.region, Box) else (s.region.numel,)
            yield entry_name(e.key, e.shard), st, shape, e.length


def _gather(decls: list[RankDecl]) -> tuple[dict[str, list[Any]], list[Region], list[Any], list[str]]:
    """Deduplicate the declared pieces.

    Returns ``meta`` (key -> ``[dtype, shape, first rank, {region sort key: piece id}]``), and per
    distinct piece id its region, its holders (codes ``rank << 32 | piece index``, in rank order: the
    code itself while there is one, a list once there are more) and its key. Regions are looked up
    by a tuple of their fields, not by the Region object: a dataclass hash is a Python call, and a
    save at scale declares millions of pieces. The tuple is also the sort key of the manifest's
    shard order (boxes by offsets, flat ranges by box and start).
    """
    meta: dict[str, list[Any]] = {}
    regions: list[Region] = []
    holders: list[Any] = []  # int | list[int]: most pieces have one holder, and a million lists cost
    ukey: list[str] = []
    for rank, decl in enumerate(decls):
        base = rank << 32
        for i, p in enumerate(decl.pieces):
            key = p.key
            m = meta.get(key)
            if m is None:
                m = meta[key] = [p.dtype, p.shape, rank, {}]
            elif m[1] != p.shape or m[0] != p.dtype:
                raise StateError(
                    f"tensor {key!r}: rank {m[2]} declares {m[0]} {list(m[1])} but rank {rank} declares "
                    f"{p.dtype} {list(p.shape)}; every rank must agree on the global dtype and shape"
                )
            r = p.region
            sk: tuple[Any, ...]
            if isinstance(r, Box):
                sk = (0, r.offsets, r.lengths)
            elif r.box is None:
                sk = (1, (), r.start, r.stop, ())
            else:
                sk = (1, r.box.offsets, r.start, r.stop, r.box.lengths)
            u = m[3].get(sk)
            if u is None:
                m[3][sk] = len(regions)
                regions.append(r)
                holders.append(base | i)
                ukey.append(key)
            else:
                h = holders[u]
                if isinstance(h, int):
                    holders[u] = [h, base | i]
                else:
                    h.append(base | i)
    return meta, regions, holders, ukey


def _place_split(order: list[int], holders: list[Any], size: list[int], load: list[int], writer: list[int],
                 regions: list[Region], shapes: list[tuple[int, ...]]) -> dict[int, list[tuple[int, int, int | None]]]:
    """LPT over ``order`` (replicated piece ids, largest first), splitting a piece when placing it
    whole would unbalance its holders. Updates ``load`` and ``writer``; returns the split pieces'
    parts as ``(holder code, first element, element count)``.

    Why and when to split: a piece larger than what its holders can even out (the embedding and
    head of a large vocabulary on one pipeline stage, a dense block replicated over hundreds of
    ranks that each have only a few MB of room) leaves its writer above the others whatever the
    order. A piece is split when (1) it is at least two minimum parts, (2) its least-loaded holder
    would end above every other holder, and (3) the pieces still to come with exactly the same
    holders are too small to raise the others to that level (without (3), the experts of a
    ``dp=2`` pair would all be halved although alternating whole pieces balances the pair).
    It is then poured (water-filling) over the least-loaded holders, at most one part each, parts
    of at least the minimum size, cut at whole rows.
    """
    world = len(load)
    sigs = [tuple([h >> 32 for h in holders[u]]) for u in order]  # each piece's holder ranks
    remaining: dict[tuple[int, ...], int] = {}  # bytes still to place per holder set
    for u, rs in zip(order, sigs, strict=True):
        remaining[rs] = remaining.get(rs, 0) + size[u]
    # Replica groups (union-find over the distinct holder sets): ranks connected through pieces they
    # both hold. A group's mean final load (mandatory plus replicated bytes over its ranks) sets its
    # minimum part size.
    parent = list(range(world))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for rs in remaining:
        a = find(rs[0])
        for r in rs[1:]:
            b = find(r)
            if b != a:
                parent[b] = a
    root = [find(r) for r in range(world)]
    total: dict[int, int] = {}
    count: dict[int, int] = {}
    for r in range(world):
        total[root[r]] = total.get(root[r], 0) + load[r]
        count[root[r]] = count.get(root[r], 0) + 1
    for rs, nbytes in remaining.items():
        total[root[rs[0]]] += nbytes
    min_part = {g: max(SPLIT_MIN_PART_BYTES, total[g] // (count[g] * SPLIT_PARTS_PER_LOAD)) for g in total}

    parts: dict[int, list[tuple[int, int, int | None]]] = {}
    for u, rs in zip(order, sigs, strict=True):
        nbytes = size[u]
        remaining[rs] -= nbytes
        r = min(rs, key=load.__getitem__)
        mp = min_part[root[r]]
        if nbytes >= 2 * mp:
            over = load[r] + nbytes - max(map(load.__getitem__, rs))
            if over > 0 and over * (len(set(rs)) - 1) > remaining[rs]:
                got = _pour(regions[u], shapes[u], nbytes, holders[u], load, mp)
                if got:
                    parts[u] = got
                    continue
        writer[u] = holders[u][rs.index(r)]
        load[r] += nbytes
    return parts


def _pour(region: Region, shape: tuple[int, ...], nbytes: int, codes: list[int], load: list[int],
          min_part: int) -> list[tuple[int, int, int | None]]:
    """Split a piece over its least-loaded holders so that they end level (water-filling).

    Parts are whole rows of a box (sub-boxes along dim 0); a flat range is cut where the flattening
    it splits starts a row when possible, so that readers of row blocks get few partial runs.
    Returns ``[(holder code, first element, element count)]`` (two parts or more), or [] when the
    piece cannot be split usefully. Adds each part's bytes to ``load``.
    """
    numel = region.numel
    isz = nbytes // numel
    if isinstance(region, Box):
        if not region.lengths or region.lengths[0] < 2:
            return []
        unit, phase, strict = numel // region.lengths[0], 0, True
    else:
        dims = region.box.lengths if region.box is not None else shape
        unit = max(1, math.prod(dims[1:]))  # a row of the block (or tensor) whose flattening it splits
        phase, strict = -region.start % unit, False  # cut c is on a row start when (start + c) % unit == 0
    code_of: dict[int, int] = {}
    for h in codes:  # one candidate per rank (its first piece index), in rank order
        code_of.setdefault(h >> 32, h)
    m = min(len(code_of), nbytes // min_part)
    if m < 2:
        return []
    low = heapq.nsmallest(m, code_of, key=load.__getitem__)  # ascending load; ties keep rank order
    ls = [load[r] for r in low]
    # The level lam that the k lowest reach when the piece fills them: the smallest k whose next
    # holder is already at or above it.
    k, acc = m, 0
    for j in range(m):
        acc += ls[j]
        if j + 1 == m or (j + 1) * ls[j + 1] - acc >= nbytes:
            k = j + 1
            break
    lam = (nbytes + acc) / k
    while k > 1 and lam - ls[k - 1] < min_part / 2:  # no sliver parts: drop the fullest of the k
        k -= 1
        acc -= ls[k]
        lam = (nbytes + acc) / k
    if k < 2:
        return []
    cuts = [0]
    filled = 0.0
    for t in range(k - 1):
        filled += lam - ls[t]
        x = filled / isz
        c = phase + round((x - phase) / unit) * unit
        if not strict and not cuts[-1] < c < numel:
            c = round(x)  # a flat range too short for row-aligned cuts: any element will do
        cuts.append(c if cuts[-1] < c < numel else cuts[-1])
    cuts.append(numel)
    if sum(cuts[t + 1] > cuts[t] for t in range(k)) < 2:
        return []
    out: list[tuple[int, int, int | None]] = []
    for t in range(k):
        n = cuts[t + 1] - cuts[t]
        if n > 0:
            out.append((code_of[low[t]], cuts[t], n))
            load[low[t]] += n * isz
    return out


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


__all__ = [
    "PieceDecl", "RankDecl", "WriteAssignment", "WriteEntry", "SavePlan", "plan_save", "data_file_name",
    "LoadRequest", "ReadOp", "ReadPlan", "StridedCopy", "SegmentCopy", "plan_load", "split_dim",
]
