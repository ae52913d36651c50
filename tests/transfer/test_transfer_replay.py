"""Replays of a recorded transfer (ckpt._transfer_net.Program): a repeated transfer over the same
tensors runs its recorded copies and messages; it stays bitwise over many rounds, with the rounds
pipelined as on NCCL, fails like any transfer (named rank, dst unchanged), and is never used where
a copy is not a view (gathered segments) or buckets carry a checksum."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import ckpt
from ckpt import _transfer_net as net
from tests.dist_utils import run_ranks


def _ref(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _rows(t: torch.Tensor, rank: int, world: int) -> ckpt.Shard:
    n = t.shape[0]
    a, b = n * rank // world, n * (rank + 1) // world
    return ckpt.Shard(t[a:b].clone(), tuple(t.shape), (a, 0))


def _cols(t: torch.Tensor, rank: int, world: int) -> ckpt.Shard:
    n = t.shape[1]
    a, b = n * rank // world, n * (rank + 1) // world
    return ckpt.Shard(torch.zeros(t.shape[0], b - a, dtype=t.dtype), tuple(t.shape), (0, a))


def _want(t: torch.Tensor, s: ckpt.Shard) -> torch.Tensor:
    return t[:, s.offsets[1]: s.offsets[1] + s.local.shape[1]]


def _pipelined(rank: int, world: int, eager: bool, in_place: bool) -> None:
    """Many rounds (tiny buckets, window 1), values changed between calls; ``eager=False`` runs the
    replay as on NCCL (every round posted before the host waits; round k's buffers reused by round
    k + 2 after a fence); ``in_place``: received copies written out after each round. ``t*`` go
    rows -> columns (each received run is contiguous in its target), ``u*`` columns -> rows (strided:
    unpacked from the buffers)."""
    net.GlooTransport.eager = eager
    try:
        ws = {f"t{i}": _ref((12, 10), seed=i) for i in range(3)} | {f"u{i}": _ref((10, 12), seed=i) for i in range(3)}

        def held(k: str, t: torch.Tensor, fill: bool) -> ckpt.Shard:
            rows = k.startswith("t") == fill
            s = _rows(t, rank, world) if rows else _cols(t, rank, world)
            if fill and not rows:
                s.local.copy_(_want(t, s))
            if not fill:
                s.local.zero_()
            return s

        src = {k: held(k, t, True) for k, t in ws.items()}
        dst = {k: held(k, t, False) for k, t in ws.items()}
        seen = []
        for step in range(6):
            for i, (k, t) in enumerate(ws.items()):
                t.copy_(_ref(tuple(t.shape), seed=100 * step + i))
                src[k].local.copy_(held(k, t, True).local)
            r = ckpt.transfer(src, dst, bucket_bytes=64, window=1, timeout=60, in_place=in_place)
            seen.append(r.replayed)
            for k, t in ws.items():
                d = dst[k]
                want = t[tuple(slice(o, o + n) for o, n in zip(d.offsets, d.local.shape, strict=True))]
                assert torch.equal(d.local, want), (step, k)
                d.local.fill_(-1.0)
        assert r.rounds > 4  # (the pool of round k is reused by round k + 2)
        assert seen == [False] + [True] * 5
    finally:
        net.GlooTransport.eager = True


@pytest.mark.multiproc
@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_replayed_transfer_of_many_rounds_stays_bitwise(eager: bool, in_place: bool) -> None:
    run_ranks(3, _pipelined, eager, in_place)


def _stall(rank: int, world: int, recorded_in_place: bool) -> None:
    """A sender stalls inside a replayed transfer: its receiver names it within the timeout, no dst
    changed, and the next transfer records anew and replays again. ``recorded_in_place``: the run
    was recorded in place (its copies write dst as they go); the failing call is not in place, so it
    must not replay that recording (it would write dst before the verdict)."""
    w = _ref((8, 6))
    src = {"w": _rows(w, rank, world)}
    dst = {"w": _cols(w, rank, world)}
    for _ in range(2):
        r = ckpt.transfer(src, dst, bucket_bytes=64, timeout=30, in_place=recorded_in_place)
    assert r.replayed
    dst["w"].local.fill_(7.0)
    post = net.GlooTransport.post

    def slow(self: net.GlooTransport, sends: list, recvs: list) -> list:
        time.sleep(2.0)  # past the others' deadline
        return post(self, sends, recvs)

    if rank == 0:
        net.GlooTransport.post = slow  # type: ignore[method-assign]
    try:
        with pytest.raises(ckpt.CollectiveError, match=r"rank 0 within 1.5 s.*no destination tensor was changed"):
            ckpt.transfer(src, dst, bucket_bytes=64, timeout=1.5)
    finally:
        net.GlooTransport.post = post  # type: ignore[method-assign]
    assert torch.equal(dst["w"].local, torch.full_like(dst["w"].local, 7.0))
    seen = [ckpt.transfer(src, dst, bucket_bytes=64, timeout=30).replayed for _ in range(2)]
    assert seen == [False, True] and torch.equal(dst["w"].local, _want(w, dst["w"]))


@pytest.mark.multiproc
@pytest.mark.parametrize("recorded_in_place", [False, True])
def test_a_sender_stalled_in_a_replay_is_named_and_nothing_is_committed(recorded_in_place: bool) -> None:
    run_ranks(2, _stall, recorded_in_place)


def _not_replayed(rank: int, world: int) -> None:
    """Runs that are not views are never replayed, and stay bitwise: a FlatShard source whose part
    of a column block is several segments (gathered anew each call), and buckets with checksum."""
    w = _ref((6, 8))
    flat = w.reshape(-1)
    a, b = 48 * rank // world, 48 * (rank + 1) // world
    src = {"w": ckpt.FlatShard(flat[a:b].clone(), (6, 8), a)}
    dst = {"w": _cols(w, rank, world)}
    for step in range(3):
        r = ckpt.transfer(src, dst, bucket_bytes=64, timeout=30)
        assert not r.replayed and (step == 0 or r.cached_plan)
        assert torch.equal(dst["w"].local, _want(w, dst["w"]))
        dst["w"].local.zero_()
    src = {"w": _rows(w, rank, world)}
    for _ in range(3):
        r = ckpt.transfer(src, dst, bucket_bytes=64, checksum=True, timeout=30)
        assert not r.replayed and torch.equal(dst["w"].local, _want(w, dst["w"]))
        dst["w"].local.zero_()


@pytest.mark.multiproc
def test_gathered_segments_and_checksums_are_never_replayed() -> None:
    run_ranks(2, _not_replayed)


def _checksum_disagrees(rank: int, world: int) -> None:
    w = _ref((4, 4))
    with pytest.raises(ckpt.StateError, match=r"ranks disagree on checksum: \[1\] pass checksum=True"):
        ckpt.transfer({"w": _rows(w, rank, world)}, {"w": _cols(w, rank, world)}, checksum=rank == 1, timeout=30)


@pytest.mark.multiproc
def test_ranks_that_disagree_on_checksum_get_a_typed_error_on_every_rank() -> None:
    run_ranks(2, _checksum_disagrees)


def _same_memory(rank: int, world: int) -> None:
    """New tensor objects over the same memory each call (as ``model.state_dict()`` gives) replay; a
    source whose storage was freed (FSDP resizes unsharded parameters to 0) never replays the old
    views, even when a new tensor lands at its address; every result bitwise."""
    w = _ref((8, 6))
    held = _rows(w, rank, world).local
    dst = {"w": _cols(w, rank, world)}
    seen = []
    for step in range(3):
        held.copy_(_rows(w * step, rank, world).local)
        src = {"w": ckpt.Shard(held.detach(), (8, 6), (held.shape[0] * rank, 0))}  # a new object each call
        seen.append(ckpt.transfer(src, dst, bucket_bytes=64, timeout=30).replayed)
        assert torch.equal(dst["w"].local, _want(w * step, dst["w"]))
    assert seen == [False, True, True]
    was, shape = held.data_ptr(), held.shape
    held.untyped_storage().resize_(0)  # freed: the recorded views now view nothing
    fresh = torch.empty(shape)  # (often where the freed memory was)
    fresh.copy_(_rows(w * 5, rank, world).local)
    r = ckpt.transfer({"w": ckpt.Shard(fresh, (8, 6), (fresh.shape[0] * rank, 0))}, dst, bucket_bytes=64,
                      timeout=30)
    assert not r.replayed and torch.equal(dst["w"].local, _want(w * 5, dst["w"])), fresh.data_ptr() == was


@pytest.mark.multiproc
def test_new_objects_over_the_same_memory_replay_and_reallocated_memory_is_followed() -> None:
    run_ranks(2, _same_memory)


def test_a_recording_does_not_hold_for_a_tensor_whose_storage_was_freed() -> None:
    """The same signature (a new tensor landing where a freed one was) does not make a recording
    replayable: its views would read freed memory."""
    t = torch.randn(4, 6)
    prog = net.Program(net.signature([t]), [t], defer=True)
    assert prog.holds([t], net.signature([t]), defer=True)
    assert not prog.holds([t], net.signature([t]), defer=False)  # (a run in place never replays a deferred one)
    other = torch.randn(4, 6)
    assert not prog.holds([other], net.signature([other]), defer=True)  # elsewhere
    sig = prog.sig
    t.untyped_storage().resize_(0)
    assert not prog.holds([other], sig, defer=True)  # (what a new tensor at the old address would show)


def _packed_ahead(rank: int, world: int, eager: bool, in_place: bool) -> None:
    """A replayed call packs its first round before the plan exchange (``_replay.prepack``) and its
    replay does not pack it again: every result bitwise with values that change between calls; a
    call whose plan fails after rank 0 packed ahead (rank 1's dst is out of bounds) raises on every
    rank, and the next call sends its own new values; where one rank's structure changed (a new
    plan) the rank that packed ahead does not use it."""
    from ckpt import _transfer_replay as rp

    net.GlooTransport.eager = eager
    step = 0
    ahead: list[int] = []  # the steps this rank packed ahead
    packed: list[int] = []  # the steps whose replay skipped its first packing
    prepack, replay = rp.prepack, rp.replay

    def spy_prepack(*a: Any, **k: Any) -> rp.Early | None:
        out = prepack(*a, **k)
        if out is not None:
            ahead.append(step)
        return out

    def spy_replay(*a: Any, **k: Any) -> Any:
        if k.get("packed"):
            packed.append(step)
        return replay(*a, **k)

    rp.prepack, rp.replay = spy_prepack, spy_replay  # type: ignore[assignment]
    try:
        w = _ref((12, 10))
        src = {"w": _rows(w, rank, world)}
        dst = {"w": _cols(w, rank, world)}
        for step in range(7):
            w = _ref((12, 10), seed=step + 1)
            src["w"].local.copy_(_rows(w, rank, world).local)
            if step == 3:
                bad = {"w": ckpt.Shard(torch.zeros(12, 5), (12, 10), (0, 9))} if rank == 1 else dst
                with pytest.raises(ckpt.CheckpointError, match="rank 1"):
                    ckpt.transfer(src, bad, bucket_bytes=64, window=1, timeout=30, in_place=in_place)
                continue
            mine = dst
            if step == 5 and rank == 0:  # a new plan (rank 0 wants fewer columns): rank 1 packed ahead
                mine = {"w": ckpt.Shard(torch.zeros(12, 3), (12, 10), dst["w"].offsets)}
            r = ckpt.transfer(src, mine, bucket_bytes=64, window=1, timeout=30, in_place=in_place)
            assert torch.equal(mine["w"].local, _want(w, mine["w"])), step
            # (step 6: the first plan again, but the kept buffers and recording are step 5's)
            assert r.rounds > 1 and r.replayed == (step not in (0, 5, 6)), step
            mine["w"].local.fill_(-1.0)
        # rank 1 fails before planning at step 3; at steps 5 and 6 it packs ahead for the plan it last
        # ran, which rank 0 no longer has (its structure changed, then changed back)
        assert ahead == ([1, 2, 3, 4] if rank == 0 else [1, 2, 4, 5, 6]), ahead
        assert packed == [1, 2, 4], packed
    finally:
        rp.prepack, rp.replay = prepack, replay  # type: ignore[assignment]
        net.GlooTransport.eager = True


@pytest.mark.multiproc
@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_replay_packs_its_first_round_ahead_of_the_plan_exchange(eager: bool, in_place: bool) -> None:
    run_ranks(2, _packed_ahead, eager, in_place)


def _calls_with_failures(rank: int, world: int, seed: int) -> None:
    """A generated sequence of repeated transfers, both ranks drawing the same events: new values,
    the other mode (committed or in place), another column split, and a rank whose posting of the
    data fails mid-call (in any round of a recorded, replayed or fresh run). After every call: a
    committed call that raised left dst as it was; one that returned is bitwise; none took much
    longer than its timeout (the commit exchange waits for the data's deadline, not past it); the
    group keeps working (later calls record and replay again)."""
    import random

    rng = random.Random(seed)
    post = net.GlooTransport.post
    w = _ref((8, 12), seed=seed)
    src = {"w": _rows(w, rank, world)}
    splits = [0, 6, 12]

    def dst_of() -> ckpt.Shard:
        a, b = splits[rank], splits[rank + 1]
        return ckpt.Shard(torch.zeros(8, b - a), (8, 12), (0, a))

    dst = {"w": dst_of()}
    in_place = False
    replays = 0
    for step in range(12):
        what = rng.choice(["values", "values", "mode", "relayout", "fail"])
        failing, at = rng.randrange(world), rng.randrange(1, 4)  # (the rank, and which of its posts fails)
        if what == "values":
            w = _ref((8, 12), seed=1000 * seed + step)
            src["w"].local.copy_(_rows(w, rank, world).local)
        elif what == "mode":
            in_place = not in_place
        elif what == "relayout":
            splits = [0, rng.randint(1, 11), 12]
            dst = {"w": dst_of()}
        before = dst["w"].local.clone()
        calls = [0]

        def failing_post(self: net.GlooTransport, sends: list, recvs: list, calls: list[int] = calls,
                         at: int = at) -> list:
            calls[0] += 1
            if calls[0] == at:
                raise RuntimeError("injected: the data group broke")
            return post(self, sends, recvs)

        if what == "fail" and rank == failing:
            net.GlooTransport.post = failing_post  # type: ignore[method-assign]
        t0 = time.monotonic()
        try:
            r = ckpt.transfer(src, dst, bucket_bytes=64, window=1, timeout=1.5, in_place=in_place)
        except ckpt.CollectiveError as e:
            assert what == "fail", (seed, step, what, e)
            assert time.monotonic() - t0 < 1.5 + 10, (seed, step, "a failed call took too long")
            assert in_place or torch.equal(dst["w"].local, before), (seed, step, "dst changed by a failed call")
            continue
        finally:
            net.GlooTransport.post = post  # type: ignore[method-assign]
        # (a failure armed for a post the call never made: it succeeded)
        assert what != "fail" or calls[0] < at, (seed, step)
        replays += r.replayed
        d = dst["w"]
        assert torch.equal(d.local, _want(w, d)), (seed, step, what, in_place, r.replayed)
        d.local.fill_(-3.0)
    assert replays > 0, seed


@pytest.mark.multiproc
@pytest.mark.parametrize("seed", [0, 1])
def test_generated_calls_with_failures_never_change_dst_when_they_raise(seed: int) -> None:
    run_ranks(2, _calls_with_failures, seed)
