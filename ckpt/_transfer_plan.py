"""The pure planner of :func:`ckpt.transfer`: every rank's pieces in, point-to-point buckets out.

No process group, no I/O: a function of metadata, the same on every rank, tested without processes.

Input: per rank, the pieces it holds (``PieceDecl``s, as ``ckpt.save`` declares them: boxes, flat
ranges, flat ranges of a box) and the pieces it wants (as ``ckpt.load`` requests them), keys in
one name space. Output, per rank: the copies it makes locally (it holds what it wants), the
buckets it sends and the buckets it receives.

Rules the plan keeps (tests/transfer/test_transfer_plan.py checks them over random layouts):

- every element of every requested piece comes from exactly one holder of it;
- a receiver that holds what it wants copies it locally (nothing crosses the network);
- a piece several ranks hold (replicas) is sent by its least-loaded holders, largest first, a
  large one cut into parts over several of them (byte balance, as the save planner's writers);
- a bucket holds at most ``bucket_bytes`` of payload (copies packed at 16-byte offsets); a copy of
  at least a quarter bucket that is one contiguous run of its source piece gets a bucket of its own
  (the executor sends it from the source's memory, no packing);
- buckets carry a round: in one round a rank sends at most ``window`` buckets' worth of bytes
  (``window * bucket_bytes``, each bucket counted from a 16-byte boundary) and receives at most as
  much; each rank posts all its sends and receives of a round before waiting for any of them
  and rounds run in order, so the schedule cannot deadlock and memory stays bounded;
- with ``join`` (the NCCL data path), a pair's packed buckets of one round are marked to travel as one
  message (``Bucket.join``: the same runs on the sender's and the receiver's side).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckpt._dtypes import dtype_from_name, itemsize
from ckpt._regions import check_disjoint, flat_boxes, flat_segments, intersect_boxes
from ckpt._save_plan import PieceDecl
from ckpt.errors import LayoutError, MismatchError, StateError
from ckpt.shards import Box, Flat, Region

ALIGN = 16  # byte alignment of each copy inside a bucket (complex128 is 16 bytes)
MIN_PART = 1 << 20  # a replicated piece is split over several holders only in parts of at least this


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN` (where the next copy or buffer may start)."""
    return -(-nbytes // ALIGN) * ALIGN


@functools.cache
def isz(dtype: str) -> int:
    """Bytes per element of the dtype named ``dtype`` (cached: the plan asks once per copy)."""
    return itemsize(dtype_from_name(dtype))


@dataclass(slots=True)
class Geo:
    """Which elements a copy moves: a box (global coordinates; both sides are boxes) or segments
    ``(src_local_offset, dst_local_offset, length)`` in each piece's local row-major order."""

    box: Box | None = None
    so: np.ndarray | None = None
    do: np.ndarray | None = None
    ln: np.ndarray | None = None

    @property
    def numel(self) -> int:
        if self.box is not None:
            return self.box.numel
        assert self.ln is not None
        return int(self.ln.sum())

    def to_wire(self) -> list[Any]:
        if self.box is not None:
            return ["b", self.box.to_list()]
        assert self.so is not None and self.do is not None and self.ln is not None
        return ["s", self.so.astype("<i8").tobytes(), self.do.astype("<i8").tobytes(), self.ln.astype("<i8").tobytes()]

    @classmethod
    def from_wire(cls, w: list[Any]) -> Geo:
        if w[0] == "b":
            return cls(box=Box(tuple(w[1][0]), tuple(w[1][1])))
        return cls(so=np.frombuffer(w[1], "<i8"), do=np.frombuffer(w[2], "<i8"), ln=np.frombuffer(w[3], "<i8"))


@dataclass(slots=True)
class Copy:
    """One run of a bucket (or a local copy): elements ``geo`` of the sender's piece ``src`` into the
    receiver's piece ``dst``, ``offset`` bytes into the bucket's payload, in the sender's dtype."""

    key: str
    src: int  # index of the piece in the sender's declaration
    dst: int  # index of the piece in the receiver's declaration
    dtype: str  # the sender's dtype (the bytes on the wire)
    geo: Geo
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.geo.numel * isz(self.dtype)

    def to_wire(self) -> list[Any]:
        return [self.key, self.src, self.dst, self.dtype, self.offset, self.geo.to_wire()]

    @classmethod
    def from_wire(cls, w: list[Any]) -> Copy:
        return cls(w[0], w[1], w[2], w[3], Geo.from_wire(w[5]), w[4])


@dataclass(slots=True)
class Bucket:
    """Bytes one sender sends one receiver in one message: ``copies`` packed into ``nbytes``."""

    sender: int
    receiver: int
    tag: int  # this bucket's number among the pair's buckets
    round: int = 0
    nbytes: int = 0
    copies: list[Copy] = field(default_factory=list)
    solo: bool = False  # planning only: a contiguous run of its source, sent as it is (never on the wire)
    # travels in one message with the pair's previous bucket (same round, both packed; see plan_transfer's
    # ``join``): on both sides it is carved right after it, 16-byte aligned, and never sent from or received
    # into a tensor itself
    join: bool = False

    def to_wire(self) -> list[Any]:
        return [self.sender, self.receiver, self.tag, self.round, self.nbytes, [c.to_wire() for c in self.copies],
                int(self.join)]

    @classmethod
    def from_wire(cls, w: list[Any]) -> Bucket:
        return cls(w[0], w[1], w[2], w[3], w[4], [Copy.from_wire(c) for c in w[5]], join=bool(w[6]))


@dataclass(slots=True)
class Schedule:
    """One rank's part of a transfer plan."""

    local: list[Copy] = field(default_factory=list)  # held and wanted by this rank: copied in place
    sends: list[Bucket] = field(default_factory=list)
    recvs: list[Bucket] = field(default_factory=list)
    # what a runner derives from the schedule, kept with it (a cached plan runs again and again)
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def to_wire(self) -> dict[str, Any]:
        return {"l": [c.to_wire() for c in self.local], "s": [b.to_wire() for b in self.sends],
                "r": [b.to_wire() for b in self.recvs]}

    @classmethod
    def from_wire(cls, w: dict[str, Any]) -> Schedule:
        return cls([Copy.from_wire(c) for c in w["l"]], [Bucket.from_wire(b) for b in w["s"]],
                   [Bucket.from_wire(b) for b in w["r"]])


@dataclass(slots=True)
class TransferPlan:
    """Every rank's schedule, and the totals (bytes over the network, skipped by delta, copied locally)."""

    schedules: list[Schedule]
    rounds: int = 0
    bytes_sent: int = 0
    bytes_skipped: int = 0
    bytes_local: int = 0
    buckets: int = 0
    sender_bytes: list[int] = field(default_factory=list)  # network bytes each rank sends


def plan_transfer(srcs: list[list[PieceDecl]], dsts: list[list[PieceDecl]], *, bucket_bytes: int = 64 << 20,
                  window: int = 4, strict: bool = True, cast: bool = False, min_part: int = MIN_PART,
                  unchanged: list[list[bool]] | None = None, clean: list[list[bool]] | None = None,
                  join: bool = False) -> TransferPlan:
    """Plan the transfer of ``srcs[r]`` (what rank r holds) into ``dsts[r]`` (what rank r wants).

    ``unchanged[r][i]`` (delta): rank r's source piece i holds the bytes it held at the previous
    transfer of the same plan; ``clean[r][j]``: rank r's destination piece j still holds what that
    transfer put there. A copy from an unchanged piece into a clean one is skipped. ``join``: a pair's
    packed buckets of one round travel as one message (``Bucket.join``; NCCL: on 2 x H200 one message
    of 1 GiB each way took 3.2 ms, four of 256 MiB 3.8 ms).

    Raises StateError (ranks disagree on a tensor's dtype or shape, ``bucket_bytes`` too small),
    LayoutError (held pieces overlap without being replicas; a requested element nobody holds),
    MismatchError (a requested key nobody holds, with ``strict``; a dtype or shape mismatch).
    """
    if len(srcs) != len(dsts):
        raise StateError(f"plan_transfer: {len(srcs)} source declarations but {len(dsts)} destination ones")
    if window < 1:
        raise StateError(f"window must be at least 1 bucket in flight, got {window}")
    world = len(srcs)
    groups = _source_groups(srcs)  # key -> (dtype, shape, [(region, [(rank, piece)])])
    sched = [Schedule() for _ in range(world)]
    plan = TransferPlan(sched, sender_bytes=[0] * world)
    mandatory: list[Assigned] = []
    shared: list[Shared] = []
    for rank, wants in enumerate(dsts):
        for j, want in enumerate(wants):
            _intersect_want(groups, rank, j, want, strict, cast, sched[rank], mandatory, shared)
    assigned = _assign(mandatory, shared, world, min_part)
    skip = unchanged is not None and clean is not None
    for s, r, c in assigned:
        if skip and unchanged[s][c.src] and clean[r][c.dst]:  # type: ignore[index]
            plan.bytes_skipped += c.nbytes
            continue
        sched[s].sends.append(Bucket(s, r, -1, copies=[c]))  # regrouped into buckets below
    for rank in range(world):
        local = []
        for c in sched[rank].local:
            if skip and unchanged[rank][c.src] and clean[rank][c.dst]:  # type: ignore[index]
                plan.bytes_skipped += c.nbytes
            else:
                plan.bytes_local += c.nbytes
                local.append(c)
        sched[rank].local = local
    _bucket(plan, bucket_bytes, window, srcs)
    if join:
        _join(plan)
    return plan


def _join(plan: TransferPlan) -> None:
    """Mark the buckets that travel with the pair's previous one: same round, neither sent unpacked.
    The sender's sends and the receiver's receives list a pair's buckets of a round consecutively in
    the same order (by tag), so both sides see the same runs."""
    for sch in plan.schedules:
        prev: Bucket | None = None
        for b in sch.sends:
            b.join = (prev is not None and prev.receiver == b.receiver and prev.round == b.round and not prev.solo
                      and not b.solo)
            prev = b


Assigned = tuple[int, int, Copy]  # (sender, receiver, copy)
Shared = tuple[list[int], int, Copy, list[tuple[int, int]]]  # (holder ranks, receiver, copy, holders)


def _intersect_want(groups: dict[str, tuple[str, tuple[int, ...], Held]], rank: int, j: int, want: PieceDecl,
                    strict: bool, cast: bool, sched: Schedule, mandatory: list[Assigned],
                    shared: list[Shared]) -> None:
    """Intersect rank ``rank``'s wanted piece ``j`` with every distinct held region of its key: local
    copies into ``sched``, single-holder copies into ``mandatory``, replicated ones into ``shared``.

    Raises MismatchError (nobody holds the key, with ``strict``; shape or dtype differ) and
    LayoutError (some wanted element is held by nobody)."""
    if want.region.numel == 0:
        return
    g = groups.get(want.key)
    if g is None:
        if strict:
            raise MismatchError(f"tensor {want.key!r}: rank {rank} wants it but no sender holds it; check the "
                                "name mapping, or pass strict=False to skip keys nobody sends")
        return
    dtype, shape, pieces = g
    if tuple(want.shape) != tuple(shape):
        raise MismatchError(f"tensor {want.key!r}: rank {rank} wants global shape {list(want.shape)} but the "
                            f"senders hold {list(shape)}; the shapes must match")
    if want.dtype != dtype and not cast:
        raise MismatchError(f"tensor {want.key!r}: rank {rank} wants {want.dtype} but the senders hold "
                            f"{dtype}; pass cast=True to convert on receive")
    covered = 0
    for region, holders in pieces:
        geo = _intersect(region, want.region, shape)
        if geo is None:
            continue
        covered += geo.numel
        here = [h for h in holders if h[0] == rank]
        if here:  # the receiver holds these elements itself
            sched.local.append(Copy(want.key, here[0][1], j, dtype, geo))
        elif len(holders) == 1:
            mandatory.append((holders[0][0], rank, Copy(want.key, holders[0][1], j, dtype, geo)))
        else:
            shared.append(([h[0] for h in holders], rank, Copy(want.key, -1, j, dtype, geo), holders))
    if covered != want.region.numel:
        raise LayoutError(f"tensor {want.key!r}: rank {rank} wants {want.region.numel} elements "
                          f"({_describe(want.region)}) but the senders hold only {covered} of them; every "
                          "requested element must be held by some sender")


def _assign(mandatory: list[Assigned], shared: list[Shared], world: int, min_part: int) -> list[Assigned]:
    """Choose a sender for every copy: single-holder copies count first; then replicas, largest first
    (stable: ties keep the plan order), each to its least-loaded holder, or cut over several when it
    is large enough to be worth it."""
    load = [0] * world
    for s, _r, c in mandatory:
        load[s] += c.nbytes
    assigned = list(mandatory)
    shared.sort(key=lambda t: -t[2].nbytes)
    for ranks, recv, c, holders in shared:
        n = c.nbytes
        k = min(len(ranks), max(1, n // max(1, min_part)))
        parts = _divide(c.geo, k) if k > 1 else [c.geo]
        for geo in sorted(parts, key=lambda g: -g.numel):
            h = min(holders, key=lambda h: (load[h[0]], h[0]))
            part = Copy(c.key, h[1], c.dst, c.dtype, geo)
            load[h[0]] += part.nbytes
            assigned.append((h[0], recv, part))
    return assigned


Held = list[tuple[Region, list[tuple[int, int]]]]  # distinct regions of a key, each with its holders (rank, piece)


def _source_groups(srcs: list[list[PieceDecl]]) -> dict[str, tuple[str, tuple[int, ...], Held]]:
    """Per key: dtype, shape and its distinct held regions, each with its holders ``(rank, piece)``.

    Identical regions are replicas; distinct regions must not overlap (LayoutError naming two)."""
    out: dict[str, tuple[str, tuple[int, ...], Held]] = {}
    index: dict[str, dict[Region, int]] = {}
    first: dict[str, int] = {}
    for rank, pieces in enumerate(srcs):
        for i, p in enumerate(pieces):
            g = out.get(p.key)
            if g is None:
                g = out[p.key] = (p.dtype, tuple(p.shape), [])
                index[p.key] = {}
                first[p.key] = rank
            elif g[0] != p.dtype or g[1] != tuple(p.shape):
                raise StateError(f"tensor {p.key!r}: rank {first[p.key]} sends {g[0]} {list(g[1])} but rank {rank} "
                                 f"sends {p.dtype} {list(p.shape)}; every sender must agree on dtype and global shape")
            if p.region.numel == 0:
                continue
            u = index[p.key].get(p.region)
            if u is None:
                index[p.key][p.region] = len(g[2])
                g[2].append((p.region, [(rank, i)]))
            else:
                g[2][u][1].append((rank, i))
    for key, (_dtype, shape, held) in out.items():
        if len(held) > 1:
            full = Box((0,) * len(shape), tuple(shape))
            boxes: list[Box] = []
            for region, _ in held:
                if isinstance(region, Box):
                    boxes.append(region)
                else:
                    boxes += flat_boxes(region.start, region.stop, region.box or full)
            check_disjoint(key, boxes)  # replicas share a region exactly; anything else must not overlap
    return out


def _intersect(src: Region, dst: Region, shape: tuple[int, ...]) -> Geo | None:
    if isinstance(src, Box) and isinstance(dst, Box):
        box = intersect_boxes(src, dst) if shape else Box((), ())
        return Geo(box=box) if box is not None and box.numel else None
    so, do, ln = flat_segments(src, dst, shape)
    if not len(ln) or not int(ln.sum()):
        return None
    return Geo(so=so, do=do, ln=ln)


def _describe(region: Region) -> str:
    if isinstance(region, Flat):
        return f"flat [{region.start}, {region.stop})" + (f" of box {region.box.to_list()}" if region.box else "")
    return f"offsets {list(region.offsets)} lengths {list(region.lengths)}"


def _divide(geo: Geo, k: int) -> list[Geo]:
    """``geo`` cut into at most ``k`` parts of near-equal size (boxes along their first dim longer than 1)."""
    if geo.box is not None:
        b = geo.box
        d = next((i for i, n in enumerate(b.lengths) if n > 1), None)
        if d is None:
            return [geo]
        k = min(k, b.lengths[d])
        cuts = [b.lengths[d] * t // k for t in range(k + 1)]
        return [Geo(box=_slab(b, d, cuts[t], cuts[t + 1] - cuts[t])) for t in range(k) if cuts[t + 1] > cuts[t]]
    n = geo.numel
    cuts = [n * t // k for t in range(k + 1)]
    return [_seg_range(geo, cuts[t], cuts[t + 1]) for t in range(k) if cuts[t + 1] > cuts[t]]


def _slab(b: Box, d: int, off: int, length: int) -> Box:
    return Box(b.offsets[:d] + (b.offsets[d] + off,) + b.offsets[d + 1:], b.lengths[:d] + (length,) + b.lengths[d + 1:])


def _seg_range(geo: Geo, lo: int, hi: int) -> Geo:
    """Elements ``[lo, hi)`` of a segment geometry, in its own order."""
    assert geo.so is not None and geo.do is not None and geo.ln is not None
    ends = np.cumsum(geo.ln)
    starts = ends - geo.ln
    keep = (ends > lo) & (starts < hi)
    s, e = starts[keep], ends[keep]
    cut_lo = np.maximum(lo - s, 0)
    cut_hi = np.maximum(e - hi, 0)
    return Geo(so=geo.so[keep] + cut_lo, do=geo.do[keep] + cut_lo, ln=geo.ln[keep] - cut_lo - cut_hi)


def split_geo(geo: Geo, max_elems: int) -> list[Geo]:
    """``geo`` cut into parts of at most ``max_elems`` elements, in order (a box into sub-boxes whose
    row-major concatenation is the box's own row-major order)."""
    if geo.numel <= max_elems:
        return [geo]
    if geo.box is None:
        n = geo.numel
        return [_seg_range(geo, a, min(a + max_elems, n)) for a in range(0, n, max_elems)]
    out: list[Geo] = []

    def rec(b: Box) -> None:
        if b.numel <= max_elems:
            out.append(Geo(box=b))
            return
        d = next(i for i, n in enumerate(b.lengths) if n > 1)
        row = math.prod(b.lengths[d + 1:])
        step = max(1, max_elems // row)
        for a in range(0, b.lengths[d], step):
            rec(_slab(b, d, a, min(step, b.lengths[d] - a)))

    rec(geo.box)
    return out


def run_start(region: Region, geo: Any, src: bool) -> int | None:
    """Where a copy's elements start in a piece's local row-major data when they are one contiguous
    run of it, in the copy's order (the bytes can then travel without packing); else None."""
    if geo.box is None:
        offs = geo.so if src else geo.do
        return int(offs[0]) if len(offs) == 1 else None
    assert isinstance(region, Box)
    sub, n = geo.box, len(geo.box.lengths)
    k = 0
    while k < n and sub.lengths[k] == 1:
        k += 1
    if any(sub.lengths[d] != region.lengths[d] for d in range(k + 1, n)):
        return None
    start, stride = 0, 1
    for d in range(n - 1, -1, -1):
        start += (sub.offsets[d] - region.offsets[d]) * stride
        stride *= region.lengths[d]
    return start


def _bucket(plan: TransferPlan, bucket_bytes: int, window: int, srcs: list[list[PieceDecl]]) -> None:
    """Pack each (sender, receiver) pair's copies into buckets and give every bucket a round."""
    if bucket_bytes < 4 * ALIGN:
        raise StateError(f"bucket_bytes must be at least {4 * ALIGN} bytes, got {bucket_bytes}")
    pairs: dict[tuple[int, int], list[Bucket]] = {}
    for s, sch in enumerate(plan.schedules):
        singles, sch.sends = sch.sends, []
        for one in singles:
            c = one.copies[0]
            out = pairs.setdefault((s, one.receiver), [])
            region = srcs[s][c.src].region
            for geo in split_geo(c.geo, max(1, bucket_bytes // isz(c.dtype))):
                part = Copy(c.key, c.src, c.dst, c.dtype, geo)
                nb = part.nbytes
                # a run of the source's memory of a quarter bucket or more travels alone, unpacked
                solo = nb * 4 >= bucket_bytes and run_start(region, geo, True) is not None
                cur = out[-1] if out else None
                start = aligned(cur.nbytes) if cur is not None else 0
                if cur is None or start + nb > bucket_bytes or solo or cur.solo:
                    cur = Bucket(s, one.receiver, len(out))
                    out.append(cur)
                    start = 0
                part.offset = start
                cur.solo = solo
                cur.copies.append(part)
                cur.nbytes = start + nb
                plan.bytes_sent += nb
                plan.sender_bytes[s] += nb
    # Rounds: the pairs' first buckets, then their second ones, ...; each bucket in the first round,
    # from its pair's previous bucket's on, where neither its sender nor its receiver would pass
    # `window` buckets' worth of bytes (`window * bucket_bytes`). Bytes, not buckets: a plan of many
    # small buckets (whole pieces of a few MB sent unpacked) would otherwise take many rounds, each a
    # batch that every peer of it enters and leaves together (on NCCL a round costs ~0.1 ms beside its
    # bytes; 52 rounds of 22 MB buckets were most of a MoE's gap to NCCL's own send/recv).
    cap = window * aligned(bucket_bytes)  # (an empty round takes any bucket)
    sends: dict[tuple[int, int], int] = {}
    recvs: dict[tuple[int, int], int] = {}
    order = sorted(((b.tag, s, r, b) for (s, r), bs in pairs.items() for b in bs), key=lambda t: t[:3])
    last: dict[tuple[int, int], int] = {}
    for _tag, s, r, b in order:
        k = last.get((s, r), 0)
        size = aligned(b.nbytes)
        while sends.get((s, k), 0) + size > cap or recvs.get((r, k), 0) + size > cap:
            k += 1
        b.round = k
        last[(s, r)] = k
        sends[(s, k)] = sends.get((s, k), 0) + size
        recvs[(r, k)] = recvs.get((r, k), 0) + size
        plan.rounds = max(plan.rounds, k + 1)
        plan.schedules[s].sends.append(b)
        plan.schedules[r].recvs.append(b)
        plan.buckets += 1
    for sch in plan.schedules:
        sch.sends.sort(key=lambda b: (b.round, b.receiver, b.tag))
        sch.recvs.sort(key=lambda b: (b.round, b.sender, b.tag))
