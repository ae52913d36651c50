"""The short agreement of ckpt.transfer (ckpt._transfer_agree): the plan's fingerprint and the commit
verdict as all-reduces. Pure: the encoding against the coordinator's rule over generated ranks.
Ranks: over a gloo side group (the test hook; production takes it over NCCL, see test_transfer_gpu):
repeated calls agree without the metadata exchange, and every way out of it (a changed structure,
a failing rank, versions that disagree, an absent rank, a random sequence of them) ends with every
rank doing the same thing: all commit bitwise, or all raise the same typed error."""

from __future__ import annotations

import importlib
import random
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt import _transfer_agree as AG  # noqa: N812
from ckpt import _transfer_exec as EX  # noqa: N812
from tests.dist_utils import run_ranks

PC = "0123456789abcdef0123456789abcdef"
OTHER = "0123456789abcdef0123456789abcdee"  # differs in the last hex digit only

rank_st = st.tuples(st.sampled_from([PC, OTHER, None]), st.booleans(), st.one_of(st.none(), st.integers(-3, 3)),
                    st.integers(0, 5))


@settings(max_examples=300, deadline=None)
@given(st.lists(rank_st, min_size=1, max_size=6))
def test_decode_of_the_maxima_is_the_coordinators_rule(ranks: list[tuple]) -> None:
    vecs = [AG.encode_plan(*r) for r in ranks]
    got = AG.decode_plan([max(col) for col in zip(*vecs, strict=True)])
    pcs = {r[0] for r in ranks}
    versions = {r[2] for r in ranks if r[2] is not None}
    if len(pcs) == 1 and None not in pcs and not any(r[1] for r in ranks) and len(versions) <= 1:
        assert got == (versions.pop() if versions else max(r[3] for r in ranks) + 1)
    else:
        assert got is None


def test_versions_that_cannot_be_encoded_take_the_exchange() -> None:
    assert AG.decode_plan(AG.encode_plan(PC, False, AG.BIG, 0)) is None
    assert AG.decode_plan(AG.encode_plan(PC, False, None, AG.BIG)) is None
    assert AG.decode_plan(AG.encode_plan(PC, False, -7, 0)) == -7


# --- ranks ---------------------------------------------------------------------------------

def _w(seed: int = 0, shape: tuple[int, int] = (8, 6)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _layout(rank: int, world: int, w: torch.Tensor) -> tuple[dict, dict]:
    rows = [w.shape[0] * k // world for k in range(world + 1)]
    cols = [w.shape[1] * k // world for k in range(world + 1)]
    src = {"w": ckpt.Shard(w[rows[rank]: rows[rank + 1]].clone(), tuple(w.shape), (rows[rank], 0))}
    dst = {"w": ckpt.Shard(torch.zeros(w.shape[0], cols[rank + 1] - cols[rank]), tuple(w.shape), (0, cols[rank]))}
    return src, dst


def _want(w: torch.Tensor, dst: dict) -> torch.Tensor:
    s = dst["w"]
    return w[:, s.offsets[1]: s.offsets[1] + s.local.shape[1]]


def _repeat(rank: int, world: int) -> None:
    AG.GLOO = True
    tr = importlib.import_module("ckpt.transfer")
    w = _w()
    src, dst = _layout(rank, world, w)
    for i in range(4):
        src["w"].local.add_(1)  # new values each call, the same structure
        w.add_(1)
        r = ckpt.transfer(src, dst, timeout=30)
        assert torch.equal(dst["w"].local, _want(w, dst)) and r.cached_plan == (i > 0)
    # the first call plans through the exchange; the next three agree by all-reduce; every verdict does
    assert AG.USED == {"plan": 3, "verdict": 4}
    if rank == 1:
        tr._PLANS.clear()  # one rank lost its cached plan: every rank takes the exchange
    r = ckpt.transfer(src, dst, timeout=30)
    assert torch.equal(dst["w"].local, _want(w, dst)) and AG.USED["plan"] == 3
    # every rank's structure changed: planned anew through the exchange
    w2 = _w(1, (8, 10))
    src2, dst2 = _layout(rank, world, w2)
    r = ckpt.transfer(src2, dst2, timeout=30)
    assert torch.equal(dst2["w"].local, _want(w2, dst2)) and not r.cached_plan and AG.USED["plan"] == 3
    w2.add_(1)
    src2["w"].local.add_(1)
    r = ckpt.transfer(src2, dst2, version=9, timeout=30)  # and agrees by all-reduce again afterwards
    assert r.cached_plan and r.version == 9 and AG.USED["plan"] == 4
    assert torch.equal(dst2["w"].local, _want(w2, dst2))


@pytest.mark.multiproc
def test_repeated_calls_agree_by_all_reduce_and_fall_back_when_a_structure_changes() -> None:
    run_ranks(3, _repeat)


def _failures(rank: int, world: int) -> None:
    AG.GLOO = True
    w = _w()
    src, dst = _layout(rank, world, w)
    ckpt.transfer(src, dst, timeout=30)
    keep = dst["w"].local.clone()
    src["w"].local.add_(1)

    def fault(event: str, info: dict) -> None:
        if event == "pack" and rank == 1:
            raise RuntimeError("simulated sender failure")

    EX.FAULT = fault
    try:  # a failing rank after an agreed call: the verdict's all-reduce says so, the exchange names it
        with pytest.raises(ckpt.CollectiveError, match=r"rank 1: RuntimeError: simulated sender failure") as ei:
            ckpt.transfer(src, dst, timeout=30)
        assert "no destination tensor was changed" in str(ei.value)
        assert torch.equal(dst["w"].local, keep)
    finally:
        EX.FAULT = None
    used = dict(AG.USED)
    ckpt.transfer(src, dst, timeout=30)  # after a failure: the exchange again (then all-reduces)
    assert AG.USED["plan"] == used["plan"]
    # versions that disagree: every rank raises the coordinator's error
    with pytest.raises(ckpt.StateError, match=r"different transfer versions"):
        ckpt.transfer(src, dst, version=7 + (rank == 2), timeout=30)
    # a rank that failed before declaring: its error on every rank
    ckpt.transfer(src, dst, timeout=30)
    with pytest.raises(ckpt.StateError, match=r"rank 0: transfer src must be a dict"):
        ckpt.transfer([1] if rank == 0 else src, dst, timeout=30)  # type: ignore[arg-type]
    w.add_(1)
    ckpt.transfer(src, dst, timeout=30)
    assert torch.equal(dst["w"].local, _want(w, dst))


@pytest.mark.multiproc
def test_failures_after_an_agreed_call_reach_every_rank_through_the_exchange() -> None:
    run_ranks(3, _failures)


def _absent(rank: int, world: int) -> None:
    AG.GLOO = True
    group = dist.new_group([0, 1, 2])
    w = _w()
    src, dst = _layout(rank, world, w)
    ckpt.transfer(src, dst, group=group, timeout=30)
    if rank == 2:
        time.sleep(6)  # never calls the second transfer
        return
    t0 = time.monotonic()
    with pytest.raises(ckpt.CollectiveError, match=r"transfer planning") as ei:
        ckpt.transfer(src, dst, group=group, timeout=1.5)
    if rank == 0:  # the all-reduce timed out; the exchange named the missing rank
        assert "rank(s) [2] did not report" in str(ei.value)
    assert time.monotonic() - t0 < 5.5  # twice the timeout, and some slack


@pytest.mark.multiproc
def test_an_absent_rank_after_an_agreed_call_is_named() -> None:
    run_ranks(3, _absent)


def _random(rank: int, world: int, seed: int) -> None:
    """A random sequence of calls on 3 ranks: same or changed structures, given versions (sometimes
    disagreeing), a rank that fails while packing. Every call: all commit bitwise or all raise."""
    AG.GLOO = True
    rng = random.Random(seed)  # the same sequence on every rank
    w = _w(seed)
    src, dst = _layout(rank, world, w)
    version = 0
    for _ in range(14):
        kind = rng.choice(["same", "same", "resize", "version", "bad-version", "fail"])
        if kind == "resize":
            w = _w(rng.randrange(100), (rng.randrange(3, 9), rng.randrange(3, 9)))
            src, dst = _layout(rank, world, w)
        w.add_(1)
        src["w"].local.add_(1)
        who = rng.randrange(world)
        ver = None if kind not in ("version", "bad-version") else version + 1 + (kind == "bad-version" and rank == who)
        before = dst["w"].local.clone()

        def fault(event: str, info: dict, who: int = who) -> None:
            if event == "pack" and rank == who:
                raise RuntimeError("simulated failure")

        EX.FAULT = fault if kind == "fail" else None
        try:
            r = ckpt.transfer(src, dst, version=ver, timeout=30)
        except ckpt.CheckpointError as e:
            # (every rank sends to every other here: a failing rank always fails the call)
            assert kind in ("fail", "bad-version"), e
            assert type(e) is (ckpt.CollectiveError if kind == "fail" else ckpt.StateError)
            assert torch.equal(dst["w"].local, before)
            w.sub_(1)
            src["w"].local.sub_(1)
            continue
        finally:
            EX.FAULT = None
        assert kind not in ("fail", "bad-version"), kind
        version = r.version
        assert torch.equal(dst["w"].local, _want(w, dst))
    assert AG.USED["plan"] > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_sequences_end_alike_on_every_rank(seed: int) -> None:
    run_ranks(3, _random, seed)
