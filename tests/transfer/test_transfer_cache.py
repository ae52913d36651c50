"""The plan cache and the unpacked paths of ckpt.transfer: a repeated transfer of the same structure
reuses its plan (one exchange of fingerprints), any change of structure on any rank plans anew;
pieces that are one contiguous run travel from the source / into the target as they are, bitwise."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt import _transfer_exec as ex
from ckpt._save_plan import PieceDecl
from ckpt._transfer_plan import plan_transfer, run_start
from ckpt.shards import Box
from ckpt.transfer import Options, structure_fingerprint
from tests.dist_utils import run_ranks
from tests.transfer.test_transfer_plan import _piece, _values, case, simulate


def _wire(pieces: list[tuple[str, str, tuple[int, ...], Box]], nccl: bool = False) -> dict:
    return {"s": [PieceDecl(*p).to_wire() for p in pieces], "d": [PieceDecl(*p).to_wire() for p in pieces[:1]],
            "nccl": nccl}


@st.composite
def _structure(draw: st.DrawFn) -> list[tuple[str, str, tuple[int, ...], Box]]:
    out = []
    for k in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        off = tuple(draw(st.integers(0, n - 1)) for n in shape)
        lengths = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, off, strict=True))
        out.append((f"t{k}", draw(st.sampled_from(["float32", "bfloat16", "int64"])), shape, Box(off, lengths)))
    return out


def _mutate(pieces: list, what: str) -> list:
    key, dtype, shape, box = pieces[0]
    if what == "key":
        return [(key + "x", dtype, shape, box), *pieces[1:]]
    if what == "dtype":
        return [(key, "float64" if dtype != "float64" else "float16", shape, box), *pieces[1:]]
    if what == "shape":
        return [(key, dtype, (*shape[:-1], shape[-1] + 1), box), *pieces[1:]]
    if what == "region":
        return [(key, dtype, shape, Box(box.offsets, (*box.lengths[:-1], box.lengths[-1] + 1))), *pieces[1:]]
    return pieces[1:] if len(pieces) > 1 else [*pieces, ("extra", dtype, shape, box)]  # a piece gone or added


@settings(max_examples=30, deadline=None)
@given(_structure(), st.sampled_from(["key", "dtype", "shape", "region", "pieces", "rank", "world", "nccl",
                                      "bucket_bytes", "window", "cast", "strict", "min_part"]))
def test_any_change_of_structure_changes_the_fingerprint(pieces: list, what: str) -> None:
    opts = Options()
    base = structure_fingerprint(_wire(pieces), 1, 4, opts)
    assert structure_fingerprint(_wire(list(pieces)), 1, 4, Options()) == base  # the same structure: reused
    wire, rank, world = _wire(pieces), 1, 4
    if what in ("key", "dtype", "shape", "region", "pieces"):
        wire = _wire(_mutate(pieces, what))
    elif what == "nccl":
        wire = _wire(pieces, nccl=True)
    elif what == "rank":
        rank = 2
    elif what == "world":
        world = 5
    else:
        changed = {"bucket_bytes": 1 << 20, "window": 2, "cast": True, "strict": False, "min_part": 64}[what]
        opts = Options(**{what: changed})  # type: ignore[arg-type]
    assert structure_fingerprint(wire, rank, world, opts) != base


def _ref(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _cache(rank: int, world: int) -> None:
    w = _ref((8, 6))
    src = {"w": ckpt.Shard(w[rank * 4: rank * 4 + 4].clone(), (8, 6), (rank * 4, 0))}

    def cols(i: int, n: int) -> dict:
        c0, c1 = 6 * i // n, 6 * (i + 1) // n
        return {"w": ckpt.Shard(torch.zeros(8, c1 - c0), (8, 6), (0, c0))}

    def check(dst: dict, step: str) -> None:
        s = dst["w"]
        assert torch.equal(s.local, w[:, s.offsets[1]: s.offsets[1] + s.local.shape[1]]), step
        s.local.zero_()

    dst = cols(rank, world)
    seen = []
    for _ in range(2):
        r = ckpt.transfer(src, dst, bucket_bytes=64, timeout=60)
        check(dst, "repeat")
        seen.append(r.cached_plan)
    assert seen == [False, True]
    # only rank 1 changes its layout (3 column blocks, it takes the last two): every rank plans anew
    dst2 = dst if rank == 0 else {"w": ckpt.Shard(torch.zeros(8, 4), (8, 6), (0, 2))}
    if rank == 0:
        dst2 = {"w": ckpt.Shard(torch.zeros(8, 2), (8, 6), (0, 0))}
    r = ckpt.transfer(src, dst2, bucket_bytes=64, timeout=60)
    check(dst2, "changed layout")
    assert not r.cached_plan
    r = ckpt.transfer(src, dst, bucket_bytes=64, timeout=60)  # back to the first layout: its plan is still kept
    check(dst, "first layout again")
    assert r.cached_plan
    r = ckpt.transfer(src, dst, bucket_bytes=128, timeout=60)  # an option that shapes the plan: planned anew
    check(dst, "other buckets")
    assert not r.cached_plan


@pytest.mark.multiproc
def test_a_repeated_transfer_reuses_its_plan_until_any_rank_changes() -> None:
    run_ranks(2, _cache)


def _direct(rank: int, world: int) -> None:
    """Rank 0 holds w whole; rank 1 wants rows 2..5 (one contiguous run of both pieces)."""
    w = _ref((8, 5), seed=3)
    src = {"w": w.clone()} if rank == 0 else None
    seen: list[int] = []

    def fault(event: str, info: dict) -> None:
        if event == "packed" and src is not None:
            base = src["w"].untyped_storage().data_ptr()
            seen.append(info["buf"].data_ptr() - base)  # sent from the source's own memory

    ex.FAULT = fault
    try:
        for in_place in (False, True):
            dst = {"w": ckpt.Shard(torch.full((4, 5), -1.0), (8, 5), (2, 0))} if rank == 1 else None
            ptr = dst["w"].local.data_ptr() if dst is not None else 0
            r = ckpt.transfer(src, dst, in_place=in_place, timeout=60)
            assert r.rank_packed == 0
            if rank == 0:
                assert r.rank_direct == 4 * 5 * 4 and seen[-1] == 2 * 5 * 4
            else:
                assert dst is not None and torch.equal(dst["w"].local, w[2:6]) and dst["w"].local.data_ptr() == ptr
                # received into the target itself only in place; else kept until the commit
                assert r.rank_direct == (4 * 5 * 4 if in_place else 0)
    finally:
        ex.FAULT = None


@pytest.mark.multiproc
def test_contiguous_runs_travel_without_packing_bitwise() -> None:
    run_ranks(2, _direct)


def test_a_local_copy_into_memory_its_source_shares_is_bitwise() -> None:
    """dst overlaps src in one storage, shifted (a layout change in place): the deferred local copy
    must read its source before the commit writes over it."""
    w = _ref((4, 4), seed=5)
    buf = torch.zeros(24)
    buf[:16] = w.reshape(-1)
    r = ckpt.transfer({"w": buf[:16].view(4, 4)}, {"w": ckpt.FlatShard(buf[8:24], (4, 4), 0)})
    assert torch.equal(buf[8:24], w.reshape(-1)) and r.bytes_local == 16 * 4


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case())
def test_large_runs_of_a_source_travel_alone_and_arrive_bitwise(c: tuple) -> None:
    """A copy of at least a quarter bucket that is a contiguous run of its source piece has a bucket
    of its own (sent from the source, unpacked), and the plan still delivers every element bitwise."""
    tensors, srcs, dsts, bucket, window = c
    plan = plan_transfer(srcs, dsts, bucket_bytes=bucket, window=window, min_part=4)
    for s in plan.schedules:
        for b in s.sends:
            for cp in b.copies:
                run = run_start(srcs[b.sender][cp.src].region, cp.geo, True) is not None
                if run and cp.nbytes * 4 >= bucket:
                    assert len(b.copies) == 1, (b, cp)
    globs = {k: _values(k, shape, dtype) for k, (shape, dtype) in tensors.items()}
    got = simulate(plan, srcs, dsts, globs)
    for r, ps in enumerate(dsts):
        for j, p in enumerate(ps):
            assert torch.equal(got[r][j], _piece(globs[p.key], p.region)), (r, p)


def _views(rank: int, world: int) -> None:
    """Repeated transfers of one plan reuse their views: values changed in place arrive, a tensor
    whose storage was replaced (``.data = ...``) is read / written at its new address, new tensor
    objects each call arrive, and only the last call's views stay kept."""
    from ckpt.transfer import _BUFFERS

    def rows(seed: int) -> torch.Tensor:
        return _ref((8, 6), seed)[rank * 4: rank * 4 + 4].clone()

    def cols() -> torch.Tensor:
        return torch.zeros(8, 3, dtype=torch.bfloat16)  # (cast on the way: bfloat16 targets)

    def want(seed: int) -> torch.Tensor:
        return _ref((8, 6), seed)[:, rank * 3: rank * 3 + 3].to(torch.bfloat16)

    src = {"w": ckpt.Shard(rows(0), (8, 6), (rank * 4, 0)), "v": ckpt.Shard(rows(7), (8, 6), (rank * 4, 0))}
    dst = {"w": ckpt.Shard(cols(), (8, 6), (0, rank * 3)), "v": ckpt.Shard(cols(), (8, 6), (0, rank * 3))}
    made = []
    for seed in (0, 1, 2):
        src["w"].local.copy_(rows(seed))  # the same tensors, new values
        r = ckpt.transfer(src, dst, bucket_bytes=64, timeout=60, cast=True)
        assert torch.equal(dst["w"].local, want(seed)) and torch.equal(dst["v"].local, want(7))
        keep = next(iter(_BUFFERS.values()))[1]
        made.append({k: id(v[1]) for k, v in keep.views._memo.items()})
    assert r.cached_plan
    assert made[0] and made[1] == made[2]  # kept from the first call; the third made none
    kept = len(keep.views._memo)
    assert kept > 0
    src["w"].local.data = rows(3)  # the same tensor object, a new storage
    old = dst["w"].local.data_ptr()
    dst["w"].local.data = cols()
    assert dst["w"].local.data_ptr() != old
    ckpt.transfer(src, dst, bucket_bytes=64, timeout=60, cast=True)
    assert torch.equal(dst["w"].local, want(3))
    for seed in (4, 5):  # new tensor objects every call
        src = {"w": ckpt.Shard(rows(seed), (8, 6), (rank * 4, 0)), "v": ckpt.Shard(rows(7), (8, 6), (rank * 4, 0))}
        dst = {"w": ckpt.Shard(cols(), (8, 6), (0, rank * 3)), "v": ckpt.Shard(cols(), (8, 6), (0, rank * 3))}
        ckpt.transfer(src, dst, bucket_bytes=64, timeout=60, cast=True)
        assert torch.equal(dst["w"].local, want(seed)) and torch.equal(dst["v"].local, want(7))
        assert len(keep.views._memo) <= kept and not keep.views._prev.keys() & keep.views._memo.keys()
    from ckpt.transfer import release_buffers

    release_buffers()
    assert not _BUFFERS


@pytest.mark.multiproc
def test_a_cached_plan_reuses_its_views_only_for_the_same_tensors_at_the_same_address() -> None:
    run_ranks(2, _views)


def _random_calls(rank: int, world: int, seed: int) -> None:
    """A generated sequence of repeated transfers (both ranks draw the same events): new values in the
    same tensors, a source or destination storage swapped under the same tensor object, new tensor
    objects, another column split (a new plan), other buckets, the other mode (in place or committed);
    every result bitwise, and the recorded run replayed exactly when nothing but values changed."""
    import random

    rng = random.Random(seed)
    n_rows, n_cols = 8, 12
    counter = [0]

    def full() -> torch.Tensor:
        counter[0] += 1
        return _ref((n_rows, n_cols), seed * 1000 + counter[0])

    def cut(n: int, parts: int, i: int) -> tuple[int, int]:
        return n * i // parts, n * (i + 1) // parts

    value = {"w": full(), "v": full()}
    splits = [0, 5, 12]

    def src_of(t: torch.Tensor) -> ckpt.Shard:
        a, b = cut(n_rows, world, rank)
        return ckpt.Shard(t[a:b].clone(), (n_rows, n_cols), (a, 0))

    def dst_of() -> ckpt.Shard:
        a, b = splits[rank], splits[rank + 1]
        return ckpt.Shard(torch.zeros(n_rows, b - a), (n_rows, n_cols), (0, a))

    src = {k: src_of(t) for k, t in value.items()}
    dst = {k: dst_of() for k in value}
    bucket = 64
    in_place = False
    for step in range(18):
        what = rng.choice(["values", "swap_src", "swap_dst", "objects", "relayout", "bucket", "same", "mode"])
        was = bucket
        if what == "values":
            value["w"] = full()
            a, b = cut(n_rows, world, rank)
            src["w"].local.copy_(value["w"][a:b])
        elif what == "swap_src":
            value["v"] = full()
            src["v"].local.data = src_of(value["v"]).local
        elif what == "swap_dst":
            dst["w"].local.data = torch.full_like(dst["w"].local, -1.0)
        elif what == "objects":
            value = {k: full() for k in value}
            src = {k: src_of(t) for k, t in value.items()}
            dst = {k: dst_of() for k in value}
        elif what == "relayout":
            splits = [0, rng.randint(1, n_cols - 1), n_cols]
            dst = {k: dst_of() for k in value}
        elif what == "bucket":
            bucket = rng.choice([64, 96, 4096])
        elif what == "mode":
            in_place = not in_place
        r = ckpt.transfer(src, dst, bucket_bytes=bucket, timeout=60, in_place=in_place)
        # the recorded run is replayed exactly when the plan and every tensor's address are as before
        assert r.replayed == (step > 0 and (what in ("values", "same") or (what == "bucket" and bucket == was))), (
            seed, step, what)
        for k, t in value.items():
            d = dst[k]
            want = t[:, d.offsets[1]: d.offsets[1] + d.local.shape[1]]
            assert torch.equal(d.local, want), (seed, step, what, k)
            d.local.fill_(-2.0)  # what the next transfer must overwrite


@pytest.mark.multiproc
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generated_sequences_of_repeated_transfers_stay_bitwise(seed: int) -> None:
    run_ranks(2, _random_calls, seed)


def test_the_plan_cache_is_bounded_by_count_and_by_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Least recently used plans go first once either bound passes; a plan heavier than the whole
    budget is not kept; a plan cached again under its key replaces itself (not counted twice)."""
    from ckpt import _transfer_coord as co
    from ckpt._transfer_plan import Schedule

    monkeypatch.setattr(co, "PLANS", type(co.PLANS)())
    monkeypatch.setattr(co, "PLAN_CACHE", 4)
    monkeypatch.setattr(co, "PLAN_CACHE_PIECES", 10)

    def plan(weight: int) -> co._Cached:
        return co._Cached("fp", {}, Schedule(), weight)

    for k in range(6):
        co._keep(("g", str(k)), plan(1))
    assert list(co.PLANS) == [("g", "2"), ("g", "3"), ("g", "4"), ("g", "5")]  # the count bound
    co._keep(("g", "3"), plan(2))  # again: replaces itself, now the most recent
    assert list(co.PLANS) == [("g", "2"), ("g", "4"), ("g", "5"), ("g", "3")]
    co._keep(("g", "big"), plan(7))  # 1 + 1 + 1 + 2 + 7 > 10: the oldest go until it fits
    assert list(co.PLANS) == [("g", "5"), ("g", "3"), ("g", "big")] and sum(c.weight for c in co.PLANS.values()) == 10
    co._keep(("g", "huge"), plan(11))  # heavier than the whole budget: not kept, nothing evicted for it
    assert list(co.PLANS) == [("g", "5"), ("g", "3"), ("g", "big")]
    assert co._weight(Schedule()) == 1


def _many_waves(rank: int, world: int) -> None:
    """A stream of 24 one-tensor waves (more than the 16 plans the cache once held), twice: the second
    refit reuses every wave's plan, also on rank 0, which sends the same pieces in every wave (it
    kept one plan for all of them: every wave was planned anew)."""
    from ckpt.transfer_stream import transfer_iter

    full = {f"t{i:02d}": _ref((4, 3), seed=i) for i in range(24)}
    src = {k: ckpt.Shard(v[rank * 2: rank * 2 + 2].clone(), (4, 3), (rank * 2, 0)) for k, v in full.items()}
    for refit in range(2):
        stream = transfer_iter(src, list(full) if rank == 1 else None, stream_bytes=48, timeout=60)
        got = dict(stream)
        assert stream.stats.waves == 24
        if rank == 1:
            assert list(got) == list(full) and all(torch.equal(got[k], full[k]) for k in full)
        cached = [r.cached_plan for r in stream.stats.results]
        assert cached == [refit == 1] * 24, (refit, cached)


@pytest.mark.multiproc
def test_a_stream_in_more_waves_than_sixteen_reuses_every_plan() -> None:
    run_ranks(2, _many_waves)
