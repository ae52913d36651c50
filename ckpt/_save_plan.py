"""Save planning. A pure function of metadata: no process group, no I/O.

Every rank declares its pieces (``RankDecl``); :func:`plan_save` deduplicates replicas, picks a
writer per piece balancing bytes across ranks, assigns files and byte offsets, and returns the
manifest skeleton plus one ``WriteAssignment`` per rank. Load planning is :mod:`ckpt._load_plan`.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckpt._dtypes import dtype_from_name, itemsize, safetensors_dtype
from ckpt._regions import (
    check_tiling,
    sub_region,
)
from ckpt.errors import StateError
from ckpt.formats.safetensors_header import build_header
from ckpt.manifest import DATA_DIR, Manifest, ObjectEntry, ShardEntry, TensorEntry, entry_name
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
    aliases: dict[str, str] = field(default_factory=dict)  # key -> key whose memory it shares (ckpt._aliases)

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
    ``ckpt._regions.sub_region(piece region, start, count)``.
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
    t = _tile(meta, regions, holders, world)
    # Replicas, largest first; the sort is stable, so ties keep the manifest order (deterministic).
    t.replicated.sort(key=t.size.__getitem__, reverse=True)
    parts: dict[int, list[tuple[int, int, int | None]]] = {}
    if split_replicas:
        parts = _place_split(t.replicated, holders, t.size, t.load, t.writer, regions, [meta[k][1] for k in ukey])
    else:
        for u in t.replicated:
            hs = holders[u]
            ranks = [h >> 32 for h in hs]
            r = min(ranks, key=t.load.__getitem__)  # the first minimum: ties go to the lowest rank
            t.writer[u] = hs[ranks.index(r)]
            t.load[r] += t.size[u]
    shards_of, went, wshard, st_of = _shard_entries(meta, regions, t, parts, world)
    files, assignments = _assign_files(went, wshard, st_of, save_id)
    tensors = {key: TensorEntry(meta[key][0], meta[key][1], shards_of[key]) for key in t.kept}
    manifest = Manifest(tensors=tensors, objects=_objects(decls, meta), files=files, step=step, world_size=world,
                        layout=layout, user_metadata=dict(user_metadata or {}))
    return SavePlan(manifest, assignments)


@dataclass(slots=True)
class _Tiling:
    """Per distinct piece (by uid): its bytes and the holder code writing it whole; per rank its bytes."""

    size: list[int]
    load: list[int]
    writer: list[int]  # holder code (rank << 32 | piece index) writing the whole piece
    replicated: list[int] = field(default_factory=list)  # pieces several ranks hold: placed later
    kept: dict[str, list[int]] = field(default_factory=dict)  # key -> its non-empty pieces, region order


def _tile(meta: dict[str, list[Any]], regions: list[Region], holders: list[Any], world: int) -> _Tiling:
    """Per tensor, in key order: its distinct non-empty pieces in region order (the manifest's shard
    order), checked to tile the tensor. A piece one rank holds is that rank's to write, and counts
    toward its load before any replica is placed: knowing every rank's mandatory bytes first
    balances better than interleaving them with the replicas by size."""
    t = _Tiling([0] * len(regions), [0] * world, [0] * len(regions))
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
            t.size[u] = nbytes = n * isz
            hs = holders[u]
            if isinstance(hs, int):
                t.writer[u] = hs
                t.load[hs >> 32] += nbytes
            else:
                t.replicated.append(u)
        t.kept[key] = uids
    return t


def _shard_entries(meta: dict[str, list[Any]], regions: list[Region], t: _Tiling,
                   parts: dict[int, list[tuple[int, int, int | None]]], world: int
                   ) -> tuple[dict[str, list[ShardEntry]], list[list[WriteEntry]], list[list[ShardEntry]],
                              dict[str, str | None]]:
    """Shards and each rank's entries. Tensors are visited by descending itemsize, then key: every
    rank's entries come out in file order (descending itemsize keeps every entry aligned to its
    element size), with no per-rank sort. Offsets are filled in once each rank's header is built."""
    shards_of: dict[str, list[ShardEntry]] = {}
    went: list[list[WriteEntry]] = [[] for _ in range(world)]
    wshard: list[list[ShardEntry]] = [[] for _ in range(world)]
    isz_of = {key: itemsize(dtype_from_name(meta[key][0])) for key in t.kept}
    st_of = {key: safetensors_dtype(dtype_from_name(meta[key][0])) for key in t.kept}
    for key in sorted(t.kept, key=lambda k: (-isz_of[k], k)):
        isz = isz_of[key]
        shards: list[ShardEntry] = []
        for u in t.kept[key]:
            region = regions[u]
            for code, start, count in parts.get(u) or ((t.writer[u], 0, None),):
                if count is None:
                    reg, nbytes = region, t.size[u]
                else:
                    reg, nbytes = sub_region(region, start, count), count * isz
                rank, i = code >> 32, len(shards)
                s = ShardEntry(reg, "", 0, nbytes)
                shards.append(s)
                wshard[rank].append(s)
                went[rank].append(WriteEntry(code & 0xFFFFFFFF, key, i, 0, nbytes, start, count))
        shards_of[key] = shards
    return shards_of, went, wshard, st_of


def _assign_files(went: list[list[WriteEntry]], wshard: list[list[ShardEntry]], st_of: dict[str, str | None],
                  save_id: str) -> tuple[dict[str, int], list[WriteAssignment]]:
    """Each writing rank's data file: its name, header and entry offsets (filled into the shards)."""
    files: dict[str, int] = {}
    assignments: list[WriteAssignment] = []
    for rank, mine in enumerate(went):
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
    return files, assignments


def _objects(decls: list[RankDecl], meta: dict[str, list[Any]]) -> dict[str, ObjectEntry]:
    """Global objects (rank 0's) and per-rank objects (every rank's that has one)."""
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
    return objects


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


__all__ = ["PieceDecl", "RankDecl", "WriteAssignment", "WriteEntry", "SavePlan", "plan_save", "data_file_name"]
