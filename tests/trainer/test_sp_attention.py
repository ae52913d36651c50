"""LASP-2H attention without a quadratic term: zigzag chunk-pair blocks merged by log-sum-exp.

- the plan (a pure function of the positions) covers each (query, key) pair of the causal triangle
  exactly once, with blocks no larger than (run x keys before it) for kernels and chunk x chunk for
  the math formula, and refuses positions that are not a permutation of the sequence;
- every block backend (math, the CPU flash kernel; CUDA kernels where a GPU is present) gives the
  rows and gradients of dense causal attention, for random shapes (hypothesis, one process);
- on forked gloo ranks (sp=2, sp=4) ``lasp2h_attention`` forward and backward equal the unsplit
  dense reference within fp32 tolerance (rtol 1e-5), with and without re-gathering K/V in backward;
- no allocation during forward + backward reaches the size of a (local x global) score table, and
  with ``regather`` the tensors kept for backward are this rank's only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from ckpt.errors import LayoutError, MismatchError
from ckpt.layout import Layout
from ckpt.testing.ranks import gpu_count
from ckpt.trainer.model import causal_attention
from ckpt.trainer.parallel import Group, ParallelContext
from ckpt.trainer.sp import (
    _attend,
    _attend_backward,
    lasp2h_attention,
    plan_attention,
    zigzag_positions_all,
    zigzag_split,
)
from tests.dist_utils import run_ranks

RTOL = 1e-5


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, msg: str = "") -> None:
    """Within ``rtol`` of each value or of the tensor's largest magnitude (the gradients of one
    position are sums over the ranks in another order, so an element near zero gets the tensor's
    scale, not its own)."""
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()),
                               msg=lambda m: f"{msg}: {m}" if msg else m)
CPU_BACKENDS = ["math", "cpu_flash"]
GPU_BACKENDS = ["flash", "efficient"] if gpu_count() > 0 else []  # (no CUDA call at collection: forked ranks)


def _coverage(positions: torch.Tensor, index: int, tiles: bool) -> tuple[torch.Tensor, int]:
    plan = plan_attention(positions, index)
    local, total = positions.shape[1], positions.numel()
    seen = torch.zeros(local, total, dtype=torch.int64)
    biggest = 0
    for s in plan.tiles if tiles else plan.spans:
        assert s.q1 > s.q0 and s.k1 > s.k0
        rows = positions[index, s.q0:s.q1]
        if s.causal:  # a diagonal block: rows and keys are the same positions
            assert rows.tolist() == list(range(s.k0, s.k1))
            seen[s.q0:s.q1, s.k0:s.k1] += torch.ones(s.q1 - s.q0, s.k1 - s.k0, dtype=torch.int64).tril()
        else:  # a full block: every key before every row
            assert s.k1 <= int(rows.min())
            seen[s.q0:s.q1, s.k0:s.k1] += 1
        biggest = max(biggest, (s.q1 - s.q0) * (s.k1 - s.k0))
    return seen, biggest


@given(sp=st.integers(1, 6), chunk=st.integers(1, 5), data=st.data())
@settings(max_examples=30, deadline=None)
def test_plan_covers_the_causal_triangle_once(sp: int, chunk: int, data: st.DataObject) -> None:
    seq = 2 * sp * chunk
    pos = zigzag_positions_all(seq, sp)
    index = data.draw(st.integers(0, sp - 1))
    causal = (pos[index][:, None] >= torch.arange(seq)[None, :]).to(torch.int64)
    for tiles in (False, True):
        seen, biggest = _coverage(pos, index, tiles)
        assert torch.equal(seen, causal)  # every allowed pair once; no later key ever
        if tiles:  # chunk x chunk pairs (sp=1: the sequence is one run of two chunks)
            assert biggest <= (chunk * (2 if sp == 1 else 1)) ** 2
    # kernels: at most a full block and a causal square per run (zigzag: two runs)
    assert len(plan_attention(pos, index).spans) <= 4


def test_plan_refuses_positions_that_are_not_the_sequence() -> None:
    with pytest.raises(LayoutError, match="permutation"):
        plan_attention(torch.tensor([[0, 1], [1, 3]]), 0)
    with pytest.raises(LayoutError, match="member index"):
        plan_attention(zigzag_positions_all(8, 2), 2)
    group = Group([0], 0, None)
    q, k = torch.zeros(1, 3, 4, 2), torch.zeros(1, 2, 4, 2)
    with pytest.raises(MismatchError, match="heads a multiple"):
        lasp2h_attention(q, k, k, zigzag_positions_all(4, 1), group)
    with pytest.raises(LayoutError, match="backend"):
        lasp2h_attention(k, k, k, zigzag_positions_all(4, 1), group, backend="ring")


def _random_case(seed: int, batch: int, kv_heads: int, groups: int, seq: int, dim: int,
                 device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * groups, seq, dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq, dim, generator=gen)
    grad = torch.randn(batch, kv_heads * groups, seq, dim, generator=gen)
    return tuple(t.to(device) for t in (q, k, v, grad))


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The sp=1 reference: the model's own causal attention, its output and input gradients."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = causal_attention(q, k, v)
    (out * grad).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad  # type: ignore[return-value]


@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS)
@given(sp=st.integers(1, 4), chunk=st.integers(1, 6), batch=st.integers(1, 2), kv_heads=st.integers(1, 2),
       groups=st.integers(1, 3), dim=st.sampled_from([8, 16]), seed=st.integers(0, 2**16))
@settings(max_examples=15, deadline=None)
def test_blocks_equal_dense_attention(backend: str, sp: int, chunk: int, batch: int, kv_heads: int, groups: int,
                                      dim: int, seed: int) -> None:
    """One member's blocks against the whole sequence's K/V (no collective): rows and gradients of the
    dense reference; the K/V gradients of all members add up to the reference's."""
    device = "cuda" if backend in GPU_BACKENDS else "cpu"
    seq = 2 * sp * chunk
    q, k, v, grad = _random_case(seed, batch, kv_heads, groups, seq, dim, device)
    dtype = torch.bfloat16 if backend == "flash" else torch.float32  # flash takes half precision only
    q, k, v, grad = (t.to(dtype).float() for t in (q, k, v, grad))  # the fp32 reference sees the same values
    want, dq, dk, dv = (t.to(dtype) for t in _dense(q, k, v, grad))
    q, k, v, grad = (t.to(dtype) for t in (q, k, v, grad))
    rtol = RTOL if device == "cpu" else 2e-2 if backend == "flash" else 2e-3  # CUDA: other orders and tiles
    pos = zigzag_positions_all(seq, sp)
    dk_sum, dv_sum = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for index in range(sp):
        plan = plan_attention(pos, index)
        spans = plan.tiles if backend == "math" else plan.spans
        ql = zigzag_split(q, sp, index, dim=2)
        out, lse, metas = _attend(ql, k, v, spans, backend)
        assert_close(out, zigzag_split(want, sp, index, dim=2), rtol)
        gq, gk, gv = _attend_backward(zigzag_split(grad, sp, index, dim=2), ql, k, v, out, lse, spans, backend, metas)
        assert_close(gq, zigzag_split(dq, sp, index, dim=2), rtol)
        dk_sum += gk
        dv_sum += gv
    assert_close(dk_sum.to(dk.dtype), dk, rtol)
    assert_close(dv_sum.to(dv.dtype), dv, rtol)


def _sp_check(rank: int, world: int, examples: int) -> None:
    ctx = ParallelContext.create(Layout(sp=world))

    # derandomized and without shrinking: every rank draws the same examples in the same order, so
    # their collectives pair up; a failure on one rank fails the launch (the others are terminated)
    @given(chunk=st.integers(1, 6), batch=st.integers(1, 2), kv_heads=st.integers(1, 2), groups=st.integers(1, 3),
           dim=st.sampled_from([4, 8, 16]), backend=st.sampled_from(["auto", "math"]), regather=st.booleans(),
           seed=st.integers(0, 2**16))
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None, phases=[Phase.generate])
    def check(chunk: int, batch: int, kv_heads: int, groups: int, dim: int, backend: str, regather: bool,
              seed: int) -> None:
        seq = 2 * world * chunk
        q, k, v, grad = _random_case(seed, batch, kv_heads, groups, seq, dim)
        want, dq, dk, dv = _dense(q, k, v, grad)
        ql, kl, vl = (zigzag_split(t, world, rank, dim=2).requires_grad_() for t in (q, k, v))
        out = lasp2h_attention(ql, kl, vl, zigzag_positions_all(seq, world), ctx.sp, backend=backend,
                               regather=regather)
        (out * zigzag_split(grad, world, rank, dim=2)).sum().backward()
        assert_close(out, zigzag_split(want, world, rank, dim=2))
        for name, local, ref in (("q", ql, dq), ("k", kl, dk), ("v", vl, dv)):
            assert local.grad is not None
            assert_close(local.grad, zigzag_split(ref, world, rank, dim=2), msg=f"rank {rank} d{name}")

    check()


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_sp_attention_equals_dense_reference(world: int) -> None:
    run_ranks(world, _sp_check, 20)


def _memory_check(rank: int, world: int) -> None:
    from torch.autograd.graph import saved_tensors_hooks
    from torch.profiler import ProfilerActivity, profile

    ctx = ParallelContext.create(Layout(sp=world))
    batch, heads, kv_heads, seq, dim = 1, 4, 2, 256, 4
    local = seq // world
    q, k, v, grad = _random_case(rank, batch, kv_heads, heads // kv_heads, seq, dim)
    ql, kl, vl = (zigzag_split(t, world, rank, dim=2).requires_grad_() for t in (q, k, v))
    pos = zigzag_positions_all(seq, world)
    table = batch * heads * local * seq * 4  # a (local x global) fp32 score table over all heads
    for backend in CPU_BACKENDS:
        kept: list[int] = []

        def keep(t: torch.Tensor, kept: list[int] = kept) -> torch.Tensor:
            kept.append(t.numel())
            return t

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with saved_tensors_hooks(keep, lambda t: t):
                out = lasp2h_attention(ql, kl, vl, pos, ctx.sp, backend=backend, regather=True)
            (out * zigzag_split(grad, world, rank, dim=2)).sum().backward()
        largest = max(e.cpu_memory_usage for e in prof.events())
        # the math formula's tiles are chunk x chunk (1 / (4 sp) of the table), kernels' blocks smaller
        assert largest <= table // (4 * world), (backend, largest, table)
        # kept for backward: q, local k and v, out (local x heads x dim) and the log-sum-exp; nothing global
        assert sum(kept) == batch * local * (2 * heads * dim + 2 * kv_heads * dim + heads), (backend, kept)


@pytest.mark.multiproc
def test_no_allocation_of_local_by_global_size() -> None:
    run_ranks(2, _memory_check)


@pytest.mark.slow
@pytest.mark.multiproc
def test_longest_sequence_bench_grows_with_sp(tmp_path: Path) -> None:
    """``python -m bench sp --longest`` on CPU ranks: the record has the documented keys, and within a
    fixed activation budget per rank the whole trainer's longest sequence doubles from sp=1 to sp=2."""
    import argparse
    import json

    from bench import seqpar

    parser = argparse.ArgumentParser()
    seqpar.add_arguments(parser)
    out = tmp_path / "sp_longest_cpu.json"
    args = parser.parse_args(["--longest", "--sp", "1,2", "--budget-mib", "1", "--granule", "16", "--out", str(out)])
    assert seqpar.longest_main(args) == 0
    res = json.loads(out.read_text())
    assert {"device", "gib_per_gpu", "longest", "tokens_per_s"} <= set(res) and res["device"] == "cpu"
    assert set(res["longest"]) == set(res["tokens_per_s"]) == {"1", "2"}
    assert res["longest"]["1"] >= 32 and res["longest"]["2"] >= 1.8 * res["longest"]["1"]
    assert all(v > 0 for v in res["tokens_per_s"].values())
