"""X-MoE dispatch (issue 19): redundancy-bypassing all-to-all and sequence-sharded MoE blocks.

- :func:`plan_dispatch` is a pure function: a hypothesis test over random routings checks its row
  counts and that combining per destination, then per token, reproduces the reference sum (in the
  unsplit order for ``per-expert``; bitwise for ``dedup`` wherever its order coincides);
- on forked gloo ranks, one forward/backward of :class:`ParallelMoEBlock` under every dispatch mode
  equals the unsplit :class:`MoEBlock` on the whole batch (outputs, input gradients, expert and
  router gradients), and the rows and bytes it reports equal the distinct (token, rank) pairs of
  its routing and the bytes the all-to-alls were actually handed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.errors import LayoutError
from ckpt.layout import Layout
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.ep import DISPATCH_MODES, ParallelMoEBlock, plan_dispatch, shard_sizes
from ckpt.trainer.model import CONFIGS, Experts, MoEBlock, Router, route
from ckpt.trainer.parallel import ParallelContext, all_reduce_
from tests.dist_utils import run_ranks

# Tiny experts: 8 of them so that top-8 and ep=4 exist; width 16 splits over tp=2.
SMALL = dataclasses.replace(CONFIGS["tiny"], hidden_size=32, moe_intermediate_size=16, num_experts=8)


# ---------------------------------------------------------------------------------------------
# The plan, no processes


@st.composite
def routings(draw: st.DrawFn) -> tuple[torch.Tensor, int, int]:
    ranks = draw(st.sampled_from([1, 2, 3, 4]))
    per_rank = draw(st.integers(1, 3))
    k = draw(st.integers(1, ranks * per_rank))
    tokens = draw(st.integers(0, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    # top-k picks distinct experts per token, in no particular id order
    selected = torch.stack([torch.randperm(ranks * per_rank, generator=g)[:k] for _ in range(tokens)]) \
        if tokens else torch.empty(0, k, dtype=torch.int64)
    return selected, per_rank, ranks


def _combine(plan: Any, values: torch.Tensor, weights: torch.Tensor, tokens: int) -> torch.Tensor:
    """What the ranks compute, by plain additions: each row sums ``w * value`` over its unmasked
    slots in increasing expert id (the destination), then rows are added per token in row order."""
    out = torch.zeros(tokens, values.shape[-1])
    w = plan.slot_weights(weights)
    for i in range(plan.rows):
        t = int(plan.token[i])
        row = torch.zeros(values.shape[-1])
        for j in sorted(range(plan.experts.shape[1]), key=lambda j: int(plan.experts[i, j])):
            e = int(plan.experts[i, j])
            if e >= 0:
                row = row + w[i, j] * values[t, e]
        out[t] = out[t] + row
    return out


@settings(max_examples=60, deadline=None)
@given(routings())
def test_plan_rows_and_combine_reproduce_the_reference_sum(routing: tuple[torch.Tensor, int, int]) -> None:
    selected, per_rank, ranks = routing
    tokens, k = selected.shape
    g = torch.Generator().manual_seed(tokens * 31 + k)
    values = torch.randn(tokens, ranks * per_rank, 3, generator=g)  # expert e's output for token t
    weights = torch.rand(tokens, k, generator=g)
    # The unsplit model: each token's experts one at a time, in increasing expert id.
    reference = torch.zeros(tokens, 3)
    for t in range(tokens):
        for j in sorted(range(k), key=lambda j: int(selected[t, j])):
            reference[t] = reference[t] + weights[t, j] * values[t, selected[t, j]]
    rank_of = selected // per_rank
    pairs = {(t, int(r)) for t in range(tokens) for r in rank_of[t]}

    dedup = plan_dispatch(selected, per_rank, ranks, "dedup")
    assert dedup.rows == len(pairs) == sum(dedup.send_counts)
    assert dedup.send_counts == [sum(1 for _, r in pairs if r == d) for d in range(ranks)]
    dest = torch.repeat_interleave(torch.arange(ranks), torch.tensor(dedup.send_counts, dtype=torch.int64))
    assert {(int(t), int(d)) for t, d in zip(dedup.token, dest, strict=True)} == pairs  # each pair once
    valid = dedup.experts >= 0
    assert torch.equal((dedup.experts // per_rank)[valid], dest.unsqueeze(-1).expand_as(valid)[valid])
    assert int(valid.sum()) == tokens * k  # every (token, slot) travels exactly once, unmasked

    per_expert = plan_dispatch(selected, per_rank, ranks, "per-expert")
    assert per_expert.rows == tokens * k == sum(per_expert.send_counts)

    # per-expert keeps the unsplit order: bitwise. dedup regroups by rank: equal within rounding,
    # and bitwise for tokens whose experts after their first rank sit one per rank.
    assert torch.equal(_combine(per_expert, values, weights, tokens), reference)
    got = _combine(dedup, values, weights, tokens)
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
    for t in range(tokens):
        ranks_hit = sorted(int(r) for r in rank_of[t])
        if all(ranks_hit.count(r) == 1 for r in set(ranks_hit) if r != ranks_hit[0]):
            assert torch.equal(got[t], reference[t]), t


def test_plan_rejects_unknown_mode_and_out_of_range_experts() -> None:
    with pytest.raises(LayoutError, match="choose one of dedup, per-expert"):
        plan_dispatch(torch.zeros(2, 1, dtype=torch.int64), 1, 2, "bogus")
    with pytest.raises(LayoutError, match="outside the 2 x 1 experts"):
        plan_dispatch(torch.tensor([[2]]), 1, 2)
    with pytest.raises(ValueError, match="moe_dispatch='bogus'"):
        TrainConfig(moe_dispatch="bogus")


def test_shard_sizes_cover_every_token_once() -> None:
    assert shard_sizes(15, 2) == [8, 7]
    assert shard_sizes(3, 4) == [1, 1, 1, 0]
    assert sum(shard_sizes(1001, 8)) == 1001


# ---------------------------------------------------------------------------------------------
# Forked gloo ranks


def _record_collectives(log: list[tuple[Any, int, list[int]]]) -> None:
    """Wrap ``dist.all_to_all_single`` (this forked process only) to log every uneven call: its
    group, its row size in bytes and its input splits (the count exchanges, even splits, are not
    payload and are left out); and ``dist.all_reduce``: its group and minus its bytes."""
    inner = dist.all_to_all_single

    def recording(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                  input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
        if input_split_sizes is not None:
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            log.append((group, row, list(input_split_sizes)))
        return inner(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = recording  # type: ignore[assignment]
    reduce = dist.all_reduce

    def recording_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                         async_op: bool = False) -> Any:
        log.append((group, -tensor.numel() * tensor.element_size(), []))  # negative: an all-reduce
        return reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = recording_reduce  # type: ignore[assignment]


def _close(got: torch.Tensor | None, want: torch.Tensor, what: str) -> None:
    """Equal within fp32 summation-order noise: ~1e-7 of the tensor's scale (the layout tests'
    gradient tolerance), since partial sums over ranks and slices regroup the additions."""
    assert got is not None, what
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(scale, 1.0), msg=lambda m: f"{what}: {m}")


def _sent(calls: list[tuple[Any, int, list[int]]], pg: Any, me: int, remote: bool) -> int:
    """Bytes handed to the logged all-to-alls of group ``pg`` (without member ``me``'s share if
    ``remote``)."""
    return sum(row * n for g, row, splits in calls if g is pg and row >= 0 for i, n in enumerate(splits)
               if not (remote and i == me))


def _slice_block(ref: MoEBlock, ctx: ParallelContext, num_experts: int, dispatch: str, shard: bool
                 ) -> ParallelMoEBlock:
    lay, coord = ctx.layout, ctx.coord
    per, width = num_experts // lay.ep, ref.experts.gate_proj.shape[1] // lay.tp
    e0, i0 = coord.ep * per, coord.tp * width
    gate = Router(SMALL)
    gate.weight = torch.nn.Parameter(ref.gate.weight.detach().clone())
    gate.top_k = ref.gate.top_k
    experts = Experts(SMALL)
    w = ref.experts
    experts.gate_proj = torch.nn.Parameter(w.gate_proj.detach()[e0:e0 + per, i0:i0 + width].clone())
    experts.up_proj = torch.nn.Parameter(w.up_proj.detach()[e0:e0 + per, i0:i0 + width].clone())
    experts.down_proj = torch.nn.Parameter(w.down_proj.detach()[e0:e0 + per, :, i0:i0 + width].clone())
    experts.expert_offset = e0
    return ParallelMoEBlock(gate, experts, num_experts, ctx.ep, ctx.tp, dispatch, shard)


def _block_check(rank: int, world: int, layout: str, top_k: int, num_experts: int) -> None:
    log: list[tuple[Any, int, list[int]]] = []
    _record_collectives(log)
    ctx = ParallelContext.create(Layout.parse(layout))
    lay, coord = ctx.layout, ctx.coord
    cfg = dataclasses.replace(SMALL, num_experts=num_experts, num_experts_per_tok=top_k)
    torch.manual_seed(0)  # the same reference block and data on every rank
    ref = MoEBlock(cfg)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x_all = torch.randn(ctx.data_world, 3, 5, cfg.hidden_size)  # 15 tokens per data rank: uneven over tp=2
    grad_all = torch.randn_like(x_all)
    x_ref = x_all.clone().requires_grad_()
    out_ref = ref(x_ref)
    out_ref.backward(grad_all)
    per, width = num_experts // lay.ep, cfg.moe_intermediate_size // lay.tp
    e0, i0 = coord.ep * per, coord.tp * width

    results = {}
    shards = (True, False) if lay.tp > 1 else (True,)
    for dispatch in DISPATCH_MODES:
        for shard in shards:
            block = _slice_block(ref, ctx, num_experts, dispatch, shard)
            x = x_all[ctx.data_rank].clone().requires_grad_()
            start = len(log)
            out = block(x)
            out.backward(grad_all[ctx.data_rank])
            what = f"{dispatch}, shard={shard}, rank {rank}"
            _close(out, out_ref[ctx.data_rank], f"{what}: output")
            assert x.grad is not None and x_ref.grad is not None and ref.experts.gate_proj.grad is not None
            _close(x.grad, x_ref.grad[ctx.data_rank], f"{what}: input grad")
            e, r = block.experts, ref.experts
            _close(e.gate_proj.grad, r.gate_proj.grad[e0:e0 + per, i0:i0 + width], f"{what}: gate_proj grad")
            _close(e.up_proj.grad, r.up_proj.grad[e0:e0 + per, i0:i0 + width], f"{what}: up_proj grad")  # type: ignore[index]
            _close(e.down_proj.grad, r.down_proj.grad[e0:e0 + per, :, i0:i0 + width], f"{what}: down_proj grad")  # type: ignore[index]
            # The router is replicated: whole over TP on every rank; summed over the data ranks.
            router_grad = block.gate.weight.grad
            assert router_grad is not None
            _close(all_reduce_(router_grad.clone(), ctx.ep), ref.gate.weight.grad, f"{what}: router grad")
            results[dispatch, shard] = (out.detach(), x.grad, e.down_proj.grad, router_grad)

            # Rows: the distinct (token, EP rank) pairs of what this rank routed (dedup), or every slot.
            flat = x.detach().reshape(-1, cfg.hidden_size)
            if shard and lay.tp > 1:
                sizes = shard_sizes(flat.shape[0], lay.tp)
                flat = flat[sum(sizes[:coord.tp]):sum(sizes[:coord.tp + 1])]
            selected = route(flat, block.gate.weight.detach(), top_k, cfg.norm_topk_prob)[2]
            dest = selected // per
            pairs = {(t, int(d)) for t in range(flat.shape[0]) for d in dest[t]}
            s = block.stats
            if lay.ep > 1 or (shard and lay.tp > 1):
                assert s.rows == (len(pairs) if dispatch == "dedup" else selected.numel()), what
                assert s.remote_rows == (sum(1 for _, d in pairs if d != coord.ep) if dispatch == "dedup"
                                         else int((dest != coord.ep).sum())), what
            # Bytes: what the all-to-alls were handed, forward and backward, by group.
            calls = log[start:]
            if lay.ep > 1:
                assert s.ep_bytes == _sent(calls, ctx.ep.pg, ctx.ep.index, False), what
                assert s.remote_ep_bytes == _sent(calls, ctx.ep.pg, ctx.ep.index, True), what
            else:
                assert s.ep_bytes == s.remote_ep_bytes == 0
            if lay.tp > 1:
                assert s.tp_bytes == _sent(calls, ctx.tp.pg, ctx.tp.index, True), what
                reduced = sum(-row for g, row, _ in calls if g is ctx.tp.pg and row < 0)
                assert s.tp_allreduce_bytes == 2 * (lay.tp - 1) * reduced // lay.tp, what
    # The modes agree with each other; bitwise where dedup keeps the unsplit order (one expert per
    # EP rank, so every rank's partial sum is one term).
    for shard in shards:
        a, b = results["dedup", shard], results["per-expert", shard]
        for u, v in zip(a, b, strict=True):
            if lay.ep == num_experts:
                assert torch.equal(u, v), f"shard={shard}: dedup and per-expert differ with one expert per rank"
            else:
                _close(u, v, f"shard={shard}: dedup vs per-expert")


@pytest.mark.parametrize("layout,top_k,num_experts", [
    ("ep=2", 2, 8),
    ("ep=2", 8, 8),
    ("ep=4", 4, 8),
    ("ep=4", 8, 8),
    ("ep=4", 2, 4),  # one expert per rank: dedup == per-expert bitwise
    ("tp=2", 4, 8),  # sequence sharding without EP
    ("tp=2,ep=2", 2, 8),
    ("tp=2,ep=2", 4, 8),
    ("tp=2,ep=2", 8, 8),
    ("tp=2,ep=4", 8, 8),
])
@pytest.mark.slow
@pytest.mark.multiproc
def test_block_equals_unsplit_and_counts_are_exact(layout: str, top_k: int, num_experts: int) -> None:
    run_ranks(Layout.parse(layout).world_size, _block_check, layout, top_k, num_experts)


def test_block_rejects_unknown_dispatch() -> None:
    ctx = ParallelContext.create(Layout())
    ref = MoEBlock(SMALL)
    with pytest.raises(LayoutError, match="unknown MoE dispatch 'fast'"):
        ParallelMoEBlock(ref.gate, ref.experts, SMALL.num_experts, ctx.ep, ctx.tp, "fast")


# ---------------------------------------------------------------------------------------------
# The trainer's switches


@pytest.mark.parametrize("dispatch,shard", [("per-expert", False), ("dedup", True), ("per-expert", True)],
                         ids=["per-expert", "dedup-shard", "per-expert-shard"])
@pytest.mark.slow
@pytest.mark.multiproc
def test_trainer_gradients_with_each_dispatch(dispatch: str, shard: bool) -> None:
    """The whole model's reduced gradients after one step equal the unsplit model's under tp=2, ep=2
    for the non-default switches (the defaults run in test_trainer_parallel)."""
    from tests.trainer.test_trainer_parallel import _grad_check

    cfg = TrainConfig(steps=10, moe_dispatch=dispatch, moe_sequence_shard=shard)
    run_ranks(4, _grad_check, cfg, Layout(tp=2, ep=2))


@pytest.mark.slow
@pytest.mark.multiproc
def test_sequence_sharded_losses_match_single_process() -> None:
    """Ten steps under tp=2, ep=2 with sequence-sharded MoE blocks: losses within fp32 tolerance of
    one process (the router's TP-summed gradient and the sharded experts' updates are right)."""
    from tests.trainer.trainer_utils import losses_close, run_training

    cfg = TrainConfig(steps=10, moe_sequence_shard=True)
    losses_close(run_training(cfg, Layout(tp=2, ep=2))["losses"], run_training(cfg, Layout())["losses"])


def test_cli_refuses_unknown_dispatch() -> None:
    from typer.testing import CliRunner

    from ckpt.cli.app import app

    r = CliRunner().invoke(app, ["train", "--moe-dispatch", "fast", "--steps", "2"])
    # the error names the flag, not the Python argument (issue 30)
    assert r.exit_code == 5 and "--moe-dispatch 'fast'" in r.output and "moe_dispatch=" not in r.output
