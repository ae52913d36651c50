"""Knobs no transfer can use are a typed ``StateError`` naming the value, before any byte moves and
without costing the group: a ``timeout`` of zero, a negative or NaN made every wait give up at once,
and a gloo wait that gives up closes the metadata group (the job had to restart); a ``version`` that
is not a non-negative int failed with a bare ``ValueError`` after planning."""

from __future__ import annotations

import math

import pytest
import torch

import ckpt
from ckpt.transfer_stream import ALL, transfer_iter
from tests.dist_utils import run_ranks

BAD = [({"timeout": 0}, "timeout must be a positive"), ({"timeout": -1.0}, "timeout must be a positive"),
       ({"timeout": math.nan}, "timeout must be a positive"), ({"timeout": True}, "timeout must be a positive"),
       ({"version": -1}, "version must be a non-negative int"), ({"version": "3"}, "version must be a non-negative"),
       ({"version": 2.0}, "version must be a non-negative int"), ({"bucket_bytes": 63}, "bucket_bytes must be"),
       ({"bucket_bytes": 1e6}, "bucket_bytes must be an int"), ({"window": 0}, "window must be at least 1"),
       ({"window": 1.5}, "window must be at least 1"), ({"min_part": "1"}, "min_part must be an int")]


@pytest.mark.parametrize(("kw", "says"), BAD)
def test_a_bad_knob_is_a_state_error_naming_it(kw: dict, says: str) -> None:
    w = torch.randn(4, 4)
    dst = {"w": torch.zeros(4, 4)}
    with pytest.raises(ckpt.StateError, match=says):
        ckpt.transfer({"w": w}, dst, **kw)
    assert torch.equal(dst["w"], torch.zeros(4, 4))
    with pytest.raises(ckpt.StateError, match=says):
        list(transfer_iter({"w": w}, ALL, **kw))


def test_good_knobs_pass() -> None:
    w = torch.randn(4, 4)
    dst = {"w": torch.zeros(4, 4)}
    r = ckpt.transfer({"w": w}, dst, timeout=None, version=0, bucket_bytes=64, window=1, min_part=1)
    assert r.version == 0 and torch.equal(dst["w"], w)


def _ranks(rank: int, world: int) -> None:
    """Every rank passes timeout=0, then only rank 1 a bad version: every rank raises a StateError
    (the second naming rank 1) at once, and the group still works."""
    w = torch.arange(16.0).reshape(4, 4)
    src = {"w": ckpt.Shard(w[rank * 2: rank * 2 + 2].clone(), (4, 4), (rank * 2, 0))}
    dst = {"w": ckpt.Shard(torch.zeros(4, 2), (4, 4), (0, rank * 2))}
    with pytest.raises(ckpt.StateError, match="timeout must be a positive"):
        ckpt.transfer(src, dst, timeout=0)
    with pytest.raises(ckpt.StateError, match=r"rank 1: version must be a non-negative int or None, got -2"):
        ckpt.transfer(src, dst, version=-2 if rank == 1 else None, timeout=30)
    assert torch.equal(dst["w"].local, torch.zeros(4, 2))
    r = ckpt.transfer(src, dst, timeout=30)
    assert torch.equal(dst["w"].local, w[:, rank * 2: rank * 2 + 2]) and r.version == 1


@pytest.mark.multiproc
def test_a_bad_knob_on_one_rank_fails_every_rank_at_once_and_keeps_the_group() -> None:
    run_ranks(2, _ranks, timeout=60)
