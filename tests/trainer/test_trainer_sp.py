"""Sequence parallelism (``sp``) on real gloo groups (forked ranks) against the single-process model.

- after one forward/backward, every rank's reduced gradient (its ZeRO range of its block, summed
  over ``dp x ep x sp``) equals the same range of the unsplit model's gradient on the whole batch,
  within fp32 tolerance (LASP-2H's masked attention and the split loss sum in another order, so not
  bitwise);
- the same with X-MoE's sequence-sharded MoE blocks under sp=2, tp=2;
- over 10 optimizer steps the losses equal the single-process run's within ``LOSS_TOL``;
- LASP-2H attention alone: equal to the rows of unsplit causal attention, gradients too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ckpt.layout import Layout
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.data import SampleSource, rank_batch
from ckpt.trainer.model import MoEForCausalLM, causal_attention
from ckpt.trainer.parallel import ParallelContext
from ckpt.trainer.pp import ForwardBackward
from ckpt.trainer.sp import lasp2h_attention, split_batch, zigzag_merge, zigzag_positions_all, zigzag_split
from ckpt.trainer.train import build
from tests.dist_utils import run_ranks
from tests.trainer.trainer_utils import assert_slots_match, losses_close, run_training

CFG = TrainConfig(steps=10)


def _grad_check(rank: int, world: int, cfg: TrainConfig, layout: Layout) -> None:
    ctx, pm, opt, _ = build(cfg, layout)
    src = SampleSource(cfg.seq_len, cfg.seed)
    ids = rank_batch(src, 0, cfg.global_batch, ctx.data_rank, ctx.data_world)
    ForwardBackward(pm, cfg.microbatches, cfg.schedule)(*split_batch(ids, ctx.sp))
    opt.reduce_tp_partial()
    grads = {kind: opt.reduce(kind) for kind in opt.slots}

    ref = MoEForCausalLM(cfg.model)
    ref.init_weights(cfg.seed)
    full = src.batch(0, cfg.global_batch)
    ref(full, labels=full)[1].backward()  # type: ignore[index]
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    seen = assert_slots_match(opt, grads, ref_grads)
    from ckpt.resharders.rules import MOE_RULES

    assert seen == {n for n in ref_grads
                    if MOE_RULES.stage_of(n, cfg.model.num_hidden_layers, layout.pp) == ctx.coord.pp}


@pytest.mark.parametrize("layout", [
    "sp=2", "sp=4", "sp=2,zero=1", "sp=4,zero=1", "sp=2,tp=2,zero=1", "sp=2,ep=2,zero=1", "sp=2,pp=2,zero=1",
    "sp=2,dp=2,zero=1", "sp=2,tp=2,ep=2,zero=1", "sp=2,dp=2,zero=0", "sp=4,tp=2,zero=1", "sp=4,ep=2,zero=1",
    "sp=4,pp=2,zero=1",
])
@pytest.mark.slow
@pytest.mark.multiproc
def test_gradients_equal_single_process_blocks(layout: str) -> None:
    lay = Layout.parse(layout)
    run_ranks(lay.world_size, _grad_check, CFG, lay)


@pytest.mark.multiproc
def test_sp_with_sequence_sharded_moe_under_tp() -> None:
    """The sp and X-MoE branches together: under sp=2, tp=2 each TP rank routes and dispatches 1/tp of
    its sp slice's tokens (``moe_sequence_shard``); the reduced gradients still equal one process's."""
    cfg = dataclasses.replace(CFG, moe_sequence_shard=True)
    run_ranks(4, _grad_check, cfg, Layout(sp=2, tp=2, zero=1))


@pytest.fixture(scope="module")
def single() -> dict[int, float]:
    return run_training(CFG, Layout())["losses"]


@pytest.mark.parametrize("layout", ["sp=2", "sp=4,zero=1", "sp=2,tp=2,zero=1", "sp=2,ep=2,zero=1",
                                    "sp=2,pp=2,dp=2,zero=1"])
@pytest.mark.slow
@pytest.mark.multiproc
def test_losses_match_single_process(layout: str, single: dict[int, float]) -> None:
    losses_close(run_training(CFG, Layout.parse(layout))["losses"], single)


def _attention_check(rank: int, world: int, seq: int) -> None:
    ctx = ParallelContext.create(Layout(sp=world))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, seq, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, seq, 8, generator=gen, requires_grad=True)
    grad_out = torch.randn(2, 4, seq, 8, generator=gen)
    want = causal_attention(q, k, v)
    (want * grad_out).sum().backward()

    def mine(t: torch.Tensor) -> torch.Tensor:
        return zigzag_split(t.detach(), world, rank, dim=2).requires_grad_()

    ql, kl, vl = mine(q), mine(k), mine(v)
    out = lasp2h_attention(ql, kl, vl, zigzag_positions_all(seq, world), ctx.sp)
    (out * zigzag_split(grad_out, world, rank, dim=2)).sum().backward()
    close = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out, zigzag_split(want, world, rank, dim=2), **close)
    for name, local, ref in (("q", ql, q), ("k", kl, k), ("v", vl, v)):
        assert local.grad is not None and ref.grad is not None
        torch.testing.assert_close(local.grad, zigzag_split(ref.grad, world, rank, dim=2), **close,
                                   msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_lasp2h_attention_equals_unsplit_causal_attention(world: int) -> None:
    run_ranks(world, _attention_check, 16)


def test_zigzag_split_merge_and_positions() -> None:
    x = torch.arange(2 * 16).view(2, 16)
    for size in (1, 2, 4, 8):
        parts = [zigzag_split(x, size, i) for i in range(size)]
        assert torch.equal(zigzag_merge(parts), x)
        pos = zigzag_positions_all(16, size)
        # every position exactly once, and each slice holds the tokens at its positions
        assert sorted(pos.reshape(-1).tolist()) == list(range(16))
        for i, p in enumerate(parts):
            assert torch.equal(p, x[:, pos[i]])
        # load balance under a causal mask: every member attends to the same number of keys
        work = {int((pos[i] + 1).sum()) for i in range(size)}
        assert len(work) == 1


def test_split_batch_labels_are_the_global_next_tokens() -> None:
    ids = torch.arange(3 * 8).view(3, 8)
    from ckpt.trainer.parallel import Group

    parts = [split_batch(ids, Group(list(range(4)), i, None)) for i in range(4)]
    labels = zigzag_merge([p[1] for p in parts])
    assert torch.equal(labels[:, :-1], ids[:, 1:]) and bool((labels[:, -1] == -100).all())
    # the summed per-rank losses over the global count are the unsplit mean
    logits = torch.randn(3, 8, 5)
    flat = F.cross_entropy(logits[:, :-1].reshape(-1, 5), (ids[:, 1:] % 5).reshape(-1))
    total = sum(F.cross_entropy(zigzag_split(logits, 4, i).reshape(-1, 5),
                                torch.where(p[1] >= 0, p[1] % 5, p[1]).reshape(-1), ignore_index=-100,
                                reduction="sum") for i, p in enumerate(parts))
    torch.testing.assert_close(total / (3 * 7), flat)
