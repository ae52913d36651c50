"""ckpt.transfer_elastic.handoff on forked gloo ranks: a replaced rank and a shrunk world get the
new layout's tensors from the survivors' memory (bitwise) and the plain values; a layout the
survivors cannot cover fails on every rank with a LayoutError before any tensor changes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ckpt
from ckpt.transfer_elastic import handoff
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.multiproc

ROWS, COLS = 6, 12


def _w() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _old(rank: int, zero: bool = False) -> dict:
    """dp=2 x tp=2 (tp fastest): rank r holds column half r % 2; the moments of each tp shard are
    replicated over its dp pair, or with ``zero`` split flat over it (ZeRO-1: no replica)."""
    w, tp, dp = _w(), rank % 2, rank // 2
    half = w[:, tp * 6: tp * 6 + 6]
    n = half.numel() // 2
    m = (ckpt.FlatShard((half.reshape(-1)[dp * n: dp * n + n] * 10).clone(), (ROWS, COLS), dp * n,
                        box=((0, tp * 6), (ROWS, 6))) if zero
         else ckpt.Shard(half * 10, (ROWS, COLS), (0, tp * 6)))
    return {"model": {"w": ckpt.Shard(half.clone(), (ROWS, COLS), (0, tp * 6))}, "optim": {"m": m},
            "train": {"step": 7, "sched": {"lr": 0.5}}, "rng": ckpt.PerRank(b"r%d" % rank)}


def _new(i: int, n: int) -> dict:
    """tp=n: column block i of n, moments whole for that block."""
    c0, c1 = COLS * i // n, COLS * (i + 1) // n
    return {"model": {"w": ckpt.Shard(torch.zeros(ROWS, c1 - c0), (ROWS, COLS), (0, c0))},
            "optim": {"m": ckpt.Shard(torch.zeros(ROWS, c1 - c0), (ROWS, COLS), (0, c0))},
            "train": {"step": 0, "sched": {"lr": 0.0}}, "rng": ckpt.PerRank(b"")}


def _check(new: dict, out, i: int, n: int) -> None:
    c0, c1 = COLS * i // n, COLS * (i + 1) // n
    assert torch.equal(new["model"]["w"].local, _w()[:, c0:c1])
    assert torch.equal(new["optim"]["m"].local, _w()[:, c0:c1] * 10)
    assert out.state["train"] == {"step": 7, "sched": {"lr": 0.5}}
    assert out.skipped == ["rng"]


def _elastic(rank: int, world: int) -> None:
    # 1. rank 3 died and was replaced (it holds nothing); the job restarts as tp=4 on 4 ranks
    new = _new(rank, 4)
    out = handoff(None if rank == 3 else _old(rank), new, bucket_bytes=64, timeout=60)
    _check(new, out, rank, 4)
    assert out.result.bytes_sent > 0
    # ... but under ZeRO-1 rank 3's half of the moments of column half 1 had no replica
    new = _new(rank, 4)
    with pytest.raises(ckpt.LayoutError, match=r"elastic handoff: .*tensor 'optim.m'.*Restore from the newest"):
        handoff(None if rank == 3 else _old(rank, zero=True), new, timeout=60)
    assert torch.equal(new["model"]["w"].local, torch.zeros(ROWS, 3))  # nothing changed anywhere
    # 2. the world shrinks to ranks 0-2 (rank 3 leaves): tp=3 on them, from the old layout
    sub = dist.new_group([0, 1, 2])
    if rank < 3:
        new3 = _new(rank, 3)
        out3 = handoff(_old(rank), new3, group=sub, timeout=60)
        _check(new3, out3, rank, 3)
    # 3. ranks 1 and 3 both lost: column half 1 has no surviving replica; nothing changes anywhere
    pair = dist.new_group([0, 2])
    if rank in (0, 2):
        i = rank // 2
        new2 = _new(i, 2)
        with pytest.raises(ckpt.LayoutError, match=r"elastic handoff: .*tensor 'model.w'.*Restore from the newest"):
            handoff(_old(rank), new2, group=pair, timeout=60)
        assert torch.equal(new2["model"]["w"].local, torch.zeros(ROWS, 6))
    # 4. survivors disagreeing on a plain value is an error on every rank
    old = _old(rank)
    old["train"]["step"] = 7 + (rank == 2)
    with pytest.raises(ckpt.StateError, match=r"value 'train.step': surviving ranks 0 and 2 hold different"):
        handoff(old, _new(rank, 4), timeout=60)


def test_handoff_replaced_rank_shrunk_world_and_uncovered_layout() -> None:
    run_ranks(4, _elastic)
