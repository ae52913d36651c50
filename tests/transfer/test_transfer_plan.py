"""The pure transfer planner (ckpt._transfer_plan), executed in one process through the real pack /
unpack code of ckpt._transfer_exec: random source and destination layouts (boxes, flat ranges, flat
ranges of boxes, replicas on several ranks), every destination element filled exactly once from a
rank that holds it, bitwise."""

from __future__ import annotations

import itertools
import math

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

import ckpt
from ckpt import _transfer_exec as ex
from ckpt._regions import global_runs
from ckpt._save_plan import PieceDecl
from ckpt._transfer_plan import ALIGN, Schedule, TransferPlan, aligned, plan_transfer
from ckpt.errors import LayoutError, MismatchError, StateError
from ckpt.shards import Box, Flat, Region

DTYPES = {"float32": torch.float32, "int16": torch.int16, "float64": torch.float64}


def _grid(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    cuts = []
    for n in shape:
        inner = draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3)) if n > 1 else set()
        c = [0, *sorted(inner), n]
        cuts.append(list(zip(c[:-1], c[1:], strict=True)))
    return [Box(tuple(a for a, _ in combo), tuple(b - a for a, b in combo)) for combo in itertools.product(*cuts)]


def _flat_cut(draw: st.DrawFn, total: int, box: Box | None) -> list[Flat]:
    inner = draw(st.sets(st.integers(1, max(1, total - 1)), max_size=3)) if total > 1 else set()
    c = [0, *sorted(inner), total]
    return [Flat(a, b, box) for a, b in zip(c[:-1], c[1:], strict=True)]


@st.composite
def tiling(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Region]:
    kind = draw(st.sampled_from(["grid", "flat", "flatbox"]))
    if kind == "grid":
        return list(_grid(draw, shape))
    if kind == "flat":
        return list(_flat_cut(draw, math.prod(shape), None))
    return [f for b in _grid(draw, shape) for f in _flat_cut(draw, b.numel, b)]


@st.composite
def case(draw: st.DrawFn) -> tuple:
    world = draw(st.integers(1, 4)) if draw(st.booleans()) else 4
    tensors = {}
    for t in range(draw(st.integers(1, 2))):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        tensors[f"t{t}"] = (shape, draw(st.sampled_from(sorted(DTYPES))))
    srcs: list[list[PieceDecl]] = [[] for _ in range(world)]
    dsts: list[list[PieceDecl]] = [[] for _ in range(world)]
    for key, (shape, dtype) in tensors.items():
        for region in draw(tiling(shape)):
            for r in draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world)):  # replicas
                srcs[r].append(PieceDecl(key, dtype, shape, region))
        for region in draw(tiling(shape)):
            for r in draw(st.sets(st.integers(0, world - 1), max_size=world)):  # wanted by 0..world ranks
                dsts[r].append(PieceDecl(key, dtype, shape, region))
    bucket = draw(st.sampled_from([64, 96, 256, 4096]))
    window = draw(st.integers(1, 3))
    return tensors, srcs, dsts, bucket, window


def _values(key: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    n = math.prod(shape)
    seed = sum(map(ord, key))
    return (torch.arange(n, dtype=torch.float64) * 7 + seed).remainder(30000).to(DTYPES[dtype]).view(shape)


def _piece(glob: torch.Tensor, region: Region) -> torch.Tensor:
    starts, lens = global_runs(region, tuple(glob.shape))
    flat = glob.reshape(-1)
    out = torch.cat([flat[int(a): int(a + n)] for a, n in zip(starts, lens, strict=True)]) if len(lens) else flat[:0]
    return out.view(region.lengths) if isinstance(region, Box) else out


def simulate(plan: TransferPlan, srcs: list[list[PieceDecl]], dsts: list[list[PieceDecl]],
             globs: dict[str, torch.Tensor], fill: float = -1) -> list[list[torch.Tensor]]:
    """Run every rank's schedule in this process (through a msgpack round trip, as on the wire)."""
    scheds = [Schedule.from_wire(msgpack.unpackb(msgpack.packb(s.to_wire(), use_bin_type=True), raw=False))
              for s in plan.schedules]
    sources = [[_piece(globs[p.key], p.region) for p in ps] for ps in srcs]
    targets = [[torch.full(_piece(globs[p.key], p.region).shape, fill, dtype=DTYPES[p.dtype]) for p in ps]
               for ps in dsts]
    sregs = [[p.region for p in ps] for ps in srcs]
    dregs = [[p.region for p in ps] for ps in dsts]
    for r, s in enumerate(scheds):
        for c in s.local:
            ex.local_copy(c, sources[r], sregs[r], targets[r], dregs[r])
    recv_of = {(b.sender, b.receiver, b.tag): b for s in scheds for b in s.recvs}
    for r, s in enumerate(scheds):
        for b in s.sends:
            buf, head = torch.empty(b.nbytes, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
            rb = recv_of[(b.sender, b.receiver, b.tag)]
            # a one-copy bucket that is a contiguous run of both pieces travels without packing
            c, one = b.copies[0], len(b.copies) == 1
            sview = ex.direct_view(sources[r][c.src], sregs[r][c.src], c, True, buf.device) if one else None
            tgt = targets[b.receiver]
            rview = ex.direct_view(tgt[c.dst], dregs[b.receiver][c.dst], c, False, buf.device) if one else None
            ex.pack(b, sview if sview is not None else buf, head, sources[r], sregs[r], True, direct=sview is not None)
            if rview is not None:
                rview.copy_(sview if sview is not None else buf)
            ex.unpack(rb, rview if rview is not None else (sview if sview is not None else buf), head,
                      targets[b.receiver], dregs[b.receiver], True, b.receiver, direct=rview is not None)
    return targets


def _coverage(plan: TransferPlan, dsts: list[list[PieceDecl]]) -> list[list[np.ndarray]]:
    counts = [[np.zeros(p.region.numel, dtype=np.int64) for p in ps] for ps in dsts]
    copies = [(r, c) for r, s in enumerate(plan.schedules) for c in s.local]
    copies += [(b.receiver, c) for s in plan.schedules for b in s.sends for c in b.copies]
    for r, c in copies:
        region = dsts[r][c.dst].region
        if c.geo.box is not None:
            assert isinstance(region, Box)
            idx = np.arange(region.numel).reshape(region.lengths)
            sl = tuple(slice(o - ro, o - ro + n) for o, n, ro in zip(c.geo.box.offsets, c.geo.box.lengths,
                                                                   region.offsets, strict=True))
            np.add.at(counts[r][c.dst], idx[sl].reshape(-1), 1)
        else:
            for a, n in zip(c.geo.do, c.geo.ln, strict=True):
                counts[r][c.dst][int(a): int(a + n)] += 1
    return counts


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case(), st.booleans())
def test_every_wanted_element_arrives_once_from_a_holder(c: tuple, join: bool) -> None:
    tensors, srcs, dsts, bucket, window = c
    plan = plan_transfer(srcs, dsts, bucket_bytes=bucket, window=window, min_part=4, join=join)
    # joined buckets: the pair's bucket just before it, in the same round, on both sides; none sent unpacked
    for r, sch in enumerate(plan.schedules):
        for mine, other in ((sch.sends, "receiver"), (sch.recvs, "sender")):
            for prev, b in zip(mine, mine[1:], strict=False):
                pair = getattr(prev, other) == getattr(b, other) and prev.round == b.round
                assert b.join == (join and pair and not prev.solo and not b.solo), (r, b)
            assert not (mine and mine[0].join)
    globs = {k: _values(k, shape, dtype) for k, (shape, dtype) in tensors.items()}
    # exactly once: every element of every wanted piece is written by one copy
    for ps, cs in zip(dsts, _coverage(plan, dsts), strict=True):
        for p, cnt in zip(ps, cs, strict=True):
            assert (cnt == 1).all(), (p, cnt)
    # from a holder: the bytes that arrive are the global tensor's (bitwise)
    got = simulate(plan, srcs, dsts, globs)
    for ps, ts in zip(dsts, got, strict=True):
        for p, t in zip(ps, ts, strict=True):
            assert torch.equal(t, _piece(globs[p.key], p.region)), p
    # buckets: bounded, aligned, disjoint runs; rounds bounded by the window; no bucket to oneself
    per_round_s: dict[tuple[int, int], int] = {}
    per_round_r: dict[tuple[int, int], int] = {}
    for s, sch in enumerate(plan.schedules):
        for c_ in sch.local:
            assert srcs[s][c_.src].key == c_.key and dsts[s][c_.dst].key == c_.key
        for b in sch.sends:
            assert b.sender == s != b.receiver
            assert 0 < b.nbytes <= bucket
            end = 0
            for cp in b.copies:
                assert cp.offset % ALIGN == 0 and cp.offset >= end
                end = cp.offset + cp.nbytes
                assert srcs[s][cp.src].key == cp.key  # the sender holds the piece it reads
            assert end == b.nbytes
            per_round_s[(s, b.round)] = per_round_s.get((s, b.round), 0) + aligned(b.nbytes)
            per_round_r[(b.receiver, b.round)] = per_round_r.get((b.receiver, b.round), 0) + aligned(b.nbytes)
    # a round holds at most `window` buckets' worth of bytes per rank, each way
    assert max(per_round_s.values(), default=0) <= window * aligned(bucket)
    assert max(per_round_r.values(), default=0) <= window * aligned(bucket)
    assert plan.buckets == sum(len(s.sends) for s in plan.schedules) == sum(len(s.recvs) for s in plan.schedules)
    wanted = sum(p.region.numel * DTYPES[p.dtype].itemsize for ps in dsts for p in ps)
    assert plan.bytes_sent + plan.bytes_local == wanted


@settings(max_examples=25, deadline=None)
@given(holders=st.integers(2, 4), rows=st.integers(8, 40), receivers=st.integers(1, 3))
def test_replicas_share_the_sending(holders: int, rows: int, receivers: int) -> None:
    """A tensor every sender holds whole, wanted by disjoint ranks: each holder sends a fair share."""
    shape = (rows, 4)
    full = Box((0, 0), shape)
    srcs = [[PieceDecl("w", "float32", shape, full)] for _ in range(holders)] + [[] for _ in range(receivers)]
    dsts: list[list[PieceDecl]] = [[] for _ in range(holders)]
    cuts = [rows * i // receivers for i in range(receivers + 1)]
    dsts += [[PieceDecl("w", "float32", shape, Box((cuts[i], 0), (cuts[i + 1] - cuts[i], 4)))]
             for i in range(receivers)]
    plan = plan_transfer(srcs, dsts, bucket_bytes=1 << 20, min_part=4)
    sent = plan.sender_bytes[:holders]
    assert sum(sent) == rows * 4 * 4
    assert min(sent) > 0
    # no holder sends more than its share plus one row per receiver's piece (parts are whole rows)
    assert max(sent) - min(sent) <= receivers * 2 * 16, sent


@pytest.mark.parametrize(("window", "pieces", "rounds"), [(1, 8, 2), (1, 9, 3), (2, 8, 1), (1, 3, 1)])
def test_rounds_are_counted_in_bytes_not_buckets(window: int, pieces: int, rounds: int) -> None:
    """Whole pieces of a quarter bucket travel alone (one bucket each, unpacked); a round takes
    ``window`` buckets' worth of them (4 per bucket), not ``window`` buckets: fewer rounds, each a
    batch every peer enters and leaves together, at the same memory bound."""
    bucket = 1024  # 256 float32 per bucket; each piece 64 of them: a quarter bucket
    srcs = [[PieceDecl(f"w{i}", "float32", (64,), Box((0,), (64,))) for i in range(pieces)], []]
    dsts: list[list[PieceDecl]] = [[], [PieceDecl(f"w{i}", "float32", (64,), Box((0,), (64,))) for i in range(pieces)]]
    plan = plan_transfer(srcs, dsts, bucket_bytes=bucket, window=window)
    assert plan.buckets == pieces and all(b.solo for b in plan.schedules[0].sends)
    assert plan.rounds == rounds


def test_a_receiver_that_holds_its_piece_copies_locally() -> None:
    shape = (6, 4)
    full = Box((0, 0), shape)
    srcs = [[PieceDecl("w", "float32", shape, full)] for _ in range(3)]
    dsts = [[PieceDecl("w", "float32", shape, Flat(r * 8, r * 8 + 8))] for r in range(3)]  # ZeRO ranges
    plan = plan_transfer(srcs, dsts, bucket_bytes=64)
    assert plan.bytes_sent == 0 and plan.buckets == 0 and plan.bytes_local == 24 * 4


def test_delta_skips_unchanged_pieces_into_clean_targets() -> None:
    shape = (4, 4)
    srcs = [[PieceDecl("w", "float32", shape, Box((r * 2, 0), (2, 4)))] for r in range(2)]  # rows
    dsts = [[PieceDecl("w", "float32", shape, Box((0, r * 2), (4, 2)))] for r in range(2)]  # columns
    plan = plan_transfer(srcs, dsts, bucket_bytes=64, unchanged=[[True], [False]], clean=[[True], [True]])
    assert plan.bytes_skipped == 32 and plan.bytes_sent + plan.bytes_local == 32
    plan = plan_transfer(srcs, dsts, bucket_bytes=64, unchanged=[[True], [True]], clean=[[True], [False]])
    assert plan.bytes_skipped == 32  # rank 1's target was changed: everything into it goes again


def test_errors_name_the_tensor_and_rank() -> None:
    shape = (4, 4)
    half = [PieceDecl("w", "float32", shape, Box((0, 0), (2, 4)))]
    want_all = [PieceDecl("w", "float32", shape, Box((0, 0), (4, 4)))]
    with pytest.raises(LayoutError, match=r"'w'.*rank 1 wants 16 elements.*only 8"):
        plan_transfer([half, []], [[], want_all])
    with pytest.raises(MismatchError, match=r"'v'.*rank 0"):
        plan_transfer([half], [[PieceDecl("v", "float32", shape, Box((0, 0), (1, 1)))]])
    assert plan_transfer([half], [[PieceDecl("v", "float32", shape, Box((0, 0), (1, 1)))]], strict=False).buckets == 0
    with pytest.raises(MismatchError, match=r"cast=True"):
        plan_transfer([half], [[PieceDecl("w", "float64", shape, Box((0, 0), (1, 1)))]])
    with pytest.raises(MismatchError, match=r"global shape"):
        plan_transfer([half], [[PieceDecl("w", "float32", (4, 5), Box((0, 0), (1, 1)))]])
    with pytest.raises(StateError, match=r"rank 0 sends float32.*rank 1 sends int16"):
        plan_transfer([half, [PieceDecl("w", "int16", shape, Box((2, 0), (2, 4)))]], [[], []])
    overlap = [PieceDecl("w", "float32", shape, Box((1, 0), (2, 4)))]
    with pytest.raises(LayoutError, match=r"'w'.*overlap"):
        plan_transfer([half, overlap], [[], []])
    with pytest.raises(StateError, match=r"bucket_bytes"):
        plan_transfer([half, []], [[], want_all[:0] + [PieceDecl("w", "float32", shape, Box((0, 0), (2, 4)))]],
                      bucket_bytes=8)


# --- delta as a sequence of operations (one process: every copy is local, the bookkeeping is the same) ---


class DeltaMachine(RuleBasedStateMachine):
    """Random edits of sources and destinations between delta transfers: after each transfer the
    destinations hold exactly the sources' bytes, and only what changed was copied."""

    def __init__(self) -> None:
        super().__init__()
        self.src = {k: torch.arange(24, dtype=torch.float32).view(6, 4) + i * 100 for i, k in enumerate("abc")}
        # destinations: rows of "a", a flat range of "b", all of "c"
        self.dst = {"a": ckpt.Shard(torch.zeros(3, 4), (6, 4), (2, 0)),
                    "b": ckpt.FlatShard(torch.zeros(10), (6, 4), 7), "c": torch.zeros(6, 4)}
        self.state = ckpt.TransferState()
        self.dirty: set[str] = set(self.src)  # what the next transfer must copy
        self.sizes = {"a": 12 * 4, "b": 10 * 4, "c": 24 * 4}

    @rule(key=st.sampled_from("abc"), row=st.integers(0, 5))
    def edit_source(self, key: str, row: int) -> None:
        self.src[key][row, 1] += 1.0  # a real change of the bytes (small values: exact in float32)
        self.dirty.add(key)

    @rule(key=st.sampled_from("abc"))
    def edit_destination(self, key: str) -> None:
        d = self.dst[key]
        (d.local if not isinstance(d, torch.Tensor) else d).view(-1)[0] += 1
        self.dirty.add(key)

    @rule()
    def transfer(self) -> None:
        r = ckpt.transfer(self.src, self.dst, delta=True, state=self.state)
        assert r.bytes_sent == 0  # one process: nothing crosses a network
        assert r.bytes_local == sum(self.sizes[k] for k in self.dirty)
        assert r.bytes_skipped == sum(self.sizes.values()) - r.bytes_local
        self.dirty.clear()
        assert torch.equal(self.dst["a"].local, self.src["a"][2:5])
        assert torch.equal(self.dst["b"].local, self.src["b"].reshape(-1)[7:17])
        assert torch.equal(self.dst["c"], self.src["c"])


TestDelta = DeltaMachine.TestCase
TestDelta.settings = settings(max_examples=20, stateful_step_count=10, deadline=None)
