"""A pair's packed buckets of one round travel as one message (``Bucket.join``; the NCCL data path
plans so): on real forked gloo ranks, with the test hook that plans so over gloo too, rows -> columns
(strided: packed) and 1-D ranges across the others' pieces (contiguous runs: sent unpacked, never joined)
arrive bitwise, committed or in place, recorded and replayed, in one message per joined run; the
same plan without joining sends one message per bucket."""

from __future__ import annotations

import importlib

import pytest
import torch

import ckpt
from ckpt import _transfer_net as net
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.multiproc


def _joined(rank: int, world: int, join: bool) -> None:
    tr = importlib.import_module("ckpt.transfer")
    co = importlib.import_module("ckpt._transfer_coord")
    co.JOIN_ON_GLOO = join
    co.PLANS.clear()  # (plans of earlier tests in the parent process: this one's is the only one then)
    sent = [0]
    post = net.GlooTransport.post

    def counting(self: net.GlooTransport, sends: list, recvs: list) -> list:
        sent[0] += len(sends)
        return post(self, sends, recvs)

    net.GlooTransport.post = counting  # type: ignore[method-assign]
    rows = [30 * k // world for k in range(world + 1)]
    cols = [20 * k // world for k in range(world + 1)]
    flat = [90 * k // world for k in range(world + 1)]

    def whole(step: int) -> tuple[torch.Tensor, torch.Tensor]:  # the same on every rank
        g = torch.Generator().manual_seed(step)
        return torch.randn(30, 20, generator=g), torch.randn(90, generator=g).to(torch.bfloat16)

    for in_place in (False, True):
        w, e = whole(0)
        src = {"w": ckpt.Shard(w[rows[rank]: rows[rank + 1]].clone(), (30, 20), (rows[rank], 0)),
               "e": ckpt.Shard(e[flat[rank]: flat[rank + 1]].clone(), (90,), (flat[rank],))}
        lo, hi = 45 * rank // world + 10, 45 * (rank + 1) // world + 40  # ranges across the others' pieces
        dst = {"w": ckpt.Shard(torch.zeros(30, cols[rank + 1] - cols[rank]), (30, 20), (0, cols[rank])),
               "e": ckpt.Shard(torch.zeros(hi - lo, dtype=torch.bfloat16), (90,), (lo,))}
        for step in range(4):  # the first call records, the next ones replay
            w, e = whole(step)
            src["w"].local.copy_(w[rows[rank]: rows[rank + 1]])
            src["e"].local.copy_(e[flat[rank]: flat[rank + 1]])
            sent[0] = 0
            res = ckpt.transfer(src, dst, bucket_bytes=256, window=8, in_place=in_place, timeout=60)
            assert torch.equal(dst["w"].local, w[:, cols[rank]: cols[rank + 1]]), (in_place, step)
            assert torch.equal(dst["e"].local, e[lo: hi]), (in_place, step)
            assert res.replayed == (step > 0)
            sends = next(iter(co.PLANS.values())).sched.sends
            assert sent[0] == sum(not b.join for b in sends), (sent[0], len(sends))
            if join:  # the scenario joins some, and leaves the contiguous runs alone
                assert sent[0] < len(sends) and any(not b.join and len(b.copies) == 1 for b in sends)
            else:
                assert not any(b.join for b in sends)
        co.PLANS.clear()
        tr.release_buffers()


@pytest.mark.parametrize("join", [True, False])
def test_joined_buckets_travel_as_one_message_and_arrive_bitwise(join: bool) -> None:
    run_ranks(3, _joined, join)


def _joined_failure(rank: int, world: int) -> None:
    from ckpt import _transfer_exec as ex

    co = importlib.import_module("ckpt._transfer_coord")
    co.JOIN_ON_GLOO = True
    co.PLANS.clear()
    w = torch.randn(30, 20, generator=torch.Generator().manual_seed(1))
    rows = [30 * k // world for k in range(world + 1)]
    cols = [20 * k // world for k in range(world + 1)]
    src = {"w": ckpt.Shard(w[rows[rank]: rows[rank + 1]].clone(), (30, 20), (rows[rank], 0))}
    dst = {"w": ckpt.Shard(torch.full((30, cols[rank + 1] - cols[rank]), 5.0), (30, 20), (0, cols[rank]))}
    hit = [0]

    def fault(event: str, info: dict) -> None:
        if event == "pack" and rank == 1 and info["bucket"].join:  # inside a joined run: the message still goes
            hit[0] += 1
            raise RuntimeError("simulated sender failure")

    ex.FAULT = fault
    try:
        with pytest.raises(ckpt.CollectiveError, match=r"rank 1: RuntimeError: simulated sender failure"):
            ckpt.transfer(src, dst, bucket_bytes=256, window=8, timeout=60)
        assert torch.equal(dst["w"].local, torch.full_like(dst["w"].local, 5.0))  # nothing committed
    finally:
        ex.FAULT = None
    assert hit[0] == (1 if rank == 1 else 0)  # (the sender failed once, inside a joined run)
    ckpt.transfer(src, dst, bucket_bytes=256, window=8, timeout=60)  # the group still works
    assert torch.equal(dst["w"].local, w[:, cols[rank]: cols[rank + 1]])


def test_a_sender_failing_inside_a_joined_run_fails_every_rank_and_commits_nothing() -> None:
    run_ranks(3, _joined_failure)
