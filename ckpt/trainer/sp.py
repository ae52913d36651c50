"""Sequence parallelism: zigzag slices of every sequence, LASP-2H attention for softmax layers.

Each of the ``sp`` ranks of a sequence-parallel group holds a slice of every sample of its
data-parallel rank's batch (the samples themselves do not depend on ``sp``):

- **zigzag split**: the sequence is cut into ``2 * sp`` equal chunks and rank ``i`` holds chunks
  ``i`` and ``2 * sp - 1 - i``, so under a causal mask every rank has the same amount of work (an
  early chunk with little to attend to, paired with a late one with much);
- **global positions**: RoPE and the causal mask use the tokens' positions in the whole sequence;
- **LASP-2H** (Sun et al., 2025) for softmax attention: one all-gather of the local K/V over the
  ``sp`` group per layer (after RoPE, with key/value heads only: grouped-query heads are never
  repeated over the sequence), then each rank attends its queries to the whole sequence's keys by
  global position, in blocks: a run of consecutive positions ``[g, g + n)`` sees keys ``[0, g)``
  in full and ``[g, g + n)`` under a causal square; later keys are skipped. Each block is one
  flash / memory-efficient kernel call returning its log-sum-exp, the blocks are merged by
  log-sum-exp, and the backward gives each block the merged output and log-sum-exp (the flash
  backward), so no mask, bias or score table of (local x global) size exists on any device. The
  all-gather's gradient is a reduce-scatter: every rank's K/V gradient is the sum of what every
  rank's queries sent back to it. By default a layer keeps only its local K/V for the backward and
  gathers them again there (``regather``), so the memory a rank holds falls as 1 / sp;
  communication per layer is then two all-gathers and one reduce-scatter of ``2 * B * S *
  kv_heads * head_dim`` elements in all, no ring of ``sp - 1`` steps;
- **loss**: labels are shifted on the whole sequence before the split (the next token of a
  chunk's last position may live on another rank); each rank returns the sum of its tokens'
  losses over the number of label tokens of the whole batch, so the sum over ``sp`` is the mean.

The functions here take a :class:`~ckpt.trainer.parallel.Group`, so another model (a hybrid with
linear-attention layers) can reuse :func:`lasp2h_attention` and the split helpers.

Example::

    ids_local, labels_local = split_batch(ids, ctx.sp)          # (B, S / sp) each
    out = lasp2h_attention(q, k, v, zigzag_positions_all(S, sp), ctx.sp)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ckpt.errors import LayoutError, MismatchError
from ckpt.trainer.model import IGNORE_INDEX, Attention, MoEForCausalLM
from ckpt.trainer.parallel import Group, all_gather_flat, all_reduce_, reduce_scatter_flat

if TYPE_CHECKING:
    from ckpt.trainer.hybrid import HybridForCausalLM

__all__ = ["BACKENDS", "AttentionPlan", "Span", "all_gather_seq", "attention_backend", "check_sp", "lasp2h_attention",
           "plan_attention", "shard_sequence", "shift_labels", "sp_choices", "sp_loss_denominator", "split_batch",
           "zigzag_merge", "zigzag_positions", "zigzag_positions_all", "zigzag_split"]


def sp_choices(seq_len: int, limit: int = 64) -> list[int]:
    """The values of ``sp`` (up to ``limit``) that cut ``seq_len`` into ``2 * sp`` equal chunks (and 1)."""
    return [1] + [d for d in range(2, limit + 1) if seq_len % (2 * d) == 0]


def check_sp(seq_len: int, sp: int) -> None:
    """Raise LayoutError unless ``sp`` is 1 or splits ``seq_len`` into ``2 * sp`` equal zigzag chunks."""
    if sp > 1 and seq_len % (2 * sp):
        raise LayoutError(f"sp={sp} does not cut seq_len={seq_len} into 2*sp={2 * sp} equal zigzag chunks; "
                          f"choose sp in {sp_choices(seq_len)} or a seq_len that is a multiple of {2 * sp}")


def zigzag_positions(seq_len: int, size: int, index: int, device: torch.device | None = None) -> Tensor:
    """Global positions (int64, ``seq_len // size``) of the tokens member ``index`` of ``size`` holds:
    chunks ``index`` and ``2 * size - 1 - index`` of ``2 * size``."""
    check_sp(seq_len, size)
    if size == 1:
        return torch.arange(seq_len, device=device)
    c = seq_len // (2 * size)
    lo, hi = index * c, (2 * size - 1 - index) * c
    return torch.cat([torch.arange(lo, lo + c, device=device), torch.arange(hi, hi + c, device=device)])


def zigzag_positions_all(seq_len: int, size: int, device: torch.device | None = None) -> Tensor:
    """(size, seq_len // size): row ``i`` is :func:`zigzag_positions` of member ``i``."""
    return torch.stack([zigzag_positions(seq_len, size, i, device) for i in range(size)])


def zigzag_split(x: Tensor, size: int, index: int, dim: int = 1) -> Tensor:
    """Member ``index``'s zigzag slice of ``x`` along ``dim`` (the sequence dim)."""
    if size == 1:
        return x
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat([chunks[index], chunks[2 * size - 1 - index]], dim=dim)


def zigzag_merge(parts: list[Tensor], dim: int = 1) -> Tensor:
    """Inverse of :func:`zigzag_split`: the whole sequence from every member's slice (in member order)."""
    size = len(parts)
    if size == 1:
        return parts[0]
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def shift_labels(ids: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Next-token labels of ``ids`` (batch, seq) on the whole sequence: ``labels[:, t] = ids[:, t + 1]``,
    the last position ``ignore_index`` (what :func:`~ckpt.trainer.model.causal_lm_loss` computes by
    shifting, done before the split because a slice's next token may be on another rank)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], ignore_index)], dim=1)


def split_batch(ids: Tensor, group: Group) -> tuple[Tensor, Tensor]:
    """This member's ``(input ids, shifted labels)`` zigzag slices of the batch ``ids`` (batch, seq)."""
    return (zigzag_split(ids, group.size, group.index), zigzag_split(shift_labels(ids), group.size, group.index))


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        ctx.group, ctx.shape = group, x.shape
        return all_gather_flat(x.contiguous().view(-1), group).view(group.size, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # Every member's copy of x got gradient from its own queries: sum them, keep this member's.
        return reduce_scatter_flat(grad.contiguous().view(-1), ctx.group).view(ctx.shape), None


def all_gather_seq(x: Tensor, group: Group) -> Tensor:
    """Autograd-aware all-gather: ``(group.size, *x.shape)``, row ``i`` member ``i``'s ``x``; the
    backward reduce-scatters (sums every member's gradient of this member's row)."""
    if group.trivial:
        return x.unsqueeze(0)
    return _AllGatherSeq.apply(x, group)


# ----------------------------------------------------------------------------- LASP-2H attention
#
# Each member's queries attend to the whole sequence's keys in blocks that never need a mask table:
# a run of consecutive positions [g, g + n) sees every key before g in full and itself under a
# causal square, and every later key not at all. Each block is one kernel call (flash or
# memory-efficient on CUDA, the CPU flash kernel, or the math formula in chunk x chunk tiles) that
# returns its output and log-sum-exp; the blocks of a row are merged by log-sum-exp. The backward
# hands each block the merged output and log-sum-exp, which gives exactly that block's share of the
# gradients (the flash-attention backward), so nothing of size (local x global) exists at any time.

BACKENDS = ("auto", "flash", "efficient", "cpu_flash", "math")


@dataclass(frozen=True, slots=True)
class Span:
    """One block of :func:`lasp2h_attention`: this member's query rows ``[q0, q1)`` against the keys
    ``[k0, k1)`` of the whole sequence in global order; ``causal`` for a diagonal block (rows and keys
    the same positions), otherwise every key precedes every row (no mask)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """What :func:`lasp2h_attention` computes on one member, a pure function of the positions.

    ``spans``: one full block (keys before the run) and one causal square per run of consecutive
    positions, for the kernels; ``tiles``: the same area cut into chunk x chunk pairs (full,
    causal-diagonal; later pairs skipped), for the math formula; ``runs``: ``(member, local start,
    local stop, global start)`` of every member's runs in global order, which place the gathered keys.
    """

    spans: tuple[Span, ...]
    tiles: tuple[Span, ...]
    runs: tuple[tuple[int, int, int, int], ...]
    seq_len: int


def _runs(row: list[int]) -> list[tuple[int, int]]:
    bounds = [0, *(i for i in range(1, len(row)) if row[i] != row[i - 1] + 1), len(row)]
    return list(zip(bounds, bounds[1:], strict=False))


def _run_spans(a: int, b: int, g: int, tile: int | None) -> list[Span]:
    if tile is None:
        return ([Span(a, b, 0, g, False)] if g else []) + [Span(a, b, g, g + b - a, True)]
    out = []
    for r0 in range(0, b - a, tile):
        r1 = min(r0 + tile, b - a)
        out += [Span(a + r0, a + r1, k0, min(k0 + tile, g + r0), False) for k0 in range(0, g + r0, tile)]
        out.append(Span(a + r0, a + r1, g + r0, g + r1, True))
    return out


def plan_attention(positions: Tensor, index: int) -> AttentionPlan:
    """The blocks member ``index`` computes, from every member's global positions ``positions`` (int,
    ``(members, local seq)``, e.g. :func:`zigzag_positions_all`).

    Raises LayoutError unless the positions are a permutation of ``0 .. members * local - 1`` (each
    token of the sequence held by exactly one member) and ``index`` is a member.
    """
    if positions.dim() != 2 or not 0 <= index < positions.shape[0]:
        raise LayoutError(f"LASP-2H positions of shape {list(positions.shape)} and member index {index}: pass "
                          "(members, local seq) positions and an index below the number of members")
    total = positions.numel()
    if not torch.equal(positions.reshape(-1).sort().values.cpu(), torch.arange(total)):
        raise LayoutError(f"LASP-2H positions are not a permutation of 0..{total - 1}: every position of the "
                          "sequence must be held by exactly one member (use zigzag_positions_all)")
    rows = positions.tolist()
    runs = sorted(((m, a, b, row[a]) for m, row in enumerate(rows) for a, b in _runs(row)), key=lambda r: r[3])
    chunk = min(b - a for _, a, b, _ in runs)  # the zigzag chunk: the tiles of the math formula
    mine = [r for r in runs if r[0] == index]
    return AttentionPlan(spans=tuple(s for _, a, b, g in mine for s in _run_spans(a, b, g, None)),
                         tiles=tuple(s for _, a, b, g in mine for s in _run_spans(a, b, g, chunk)),
                         runs=tuple(runs), seq_len=total)


def attention_backend(q: Tensor) -> str:
    """The kernel :func:`lasp2h_attention` uses for ``q`` with ``backend="auto"``: ``flash`` (CUDA,
    fp16/bf16), ``efficient`` (CUDA, other dtypes), ``cpu_flash`` (CPU), else ``math``."""
    d = q.shape[-1]
    if q.device.type == "cuda" and d % 8 == 0:
        return "flash" if q.dtype in (torch.float16, torch.bfloat16) and d <= 256 else "efficient"
    if q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "cpu_flash"
    return "math"


@dataclass(slots=True)
class _Meta:
    """What a kernel's backward needs from its forward: the log-sum-exp's layout, RNG and varlen state."""

    lse_shape: tuple[int, ...]
    lse_stride: tuple[int, ...]
    lse_dtype: torch.dtype
    extra: tuple[Any, ...] = ()


def _block_forward(backend: str, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor, _Meta]:
    """``(out, lse (batch, heads, rows), meta)`` of softmax attention of q over k/v (same heads)."""
    aten = torch.ops.aten
    if backend == "math":
        acc = torch.promote_types(q.dtype, torch.float32)
        s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * q.shape[-1] ** -0.5
        if causal:
            s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse[..., None]), v.to(acc)).to(q.dtype)
        return out, lse, _Meta(tuple(lse.shape), lse.stride(), lse.dtype)
    extra: tuple[Any, ...] = ()
    if backend == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal)
        extra = (cum_q, cum_k, max_q, max_k, seed, offset)
    elif backend == "efficient":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        extra = (seed, offset)
    elif backend == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    else:
        raise LayoutError(f"LASP-2H attention backend {backend!r} is unknown; use one of {list(BACKENDS)}")
    meta = _Meta(tuple(lse.shape), lse.stride(), lse.dtype, extra)
    return out, lse[..., :q.shape[2]], meta  # the memory-efficient kernel pads the rows of its lse


def _block_backward(backend: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    causal: bool, meta: _Meta) -> tuple[Tensor, Tensor, Tensor]:
    """This block's ``(dq, dk, dv)`` given the *merged* output and log-sum-exp of its rows."""
    aten = torch.ops.aten
    if backend == "math":
        acc = lse.dtype
        scale = q.shape[-1] ** -0.5
        q32, k32, v32, do32 = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
        s = torch.matmul(q32, k32.transpose(-1, -2)) * scale
        if causal:
            s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        p = torch.exp(s - lse[..., None])
        dp = torch.matmul(do32, v32.transpose(-1, -2))
        ds = p * (dp - (do32 * out.to(acc)).sum(-1, keepdim=True)) * scale
        return torch.matmul(ds, k32), torch.matmul(ds.transpose(-1, -2), q32), torch.matmul(p.transpose(-1, -2), do32)
    # the kernels read the log-sum-exp in the layout (and padding) their forward wrote
    full = torch.empty_strided(meta.lse_shape, meta.lse_stride, dtype=meta.lse_dtype, device=lse.device).zero_()
    full[..., :lse.shape[-1]].copy_(lse)
    if backend == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = meta.extra
        grads = aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, full, cum_q, cum_k, max_q,
                                                                  max_k, 0.0, causal, seed, offset)
    elif backend == "efficient":
        seed, offset = meta.extra
        grads = aten._scaled_dot_product_efficient_attention_backward(dout, q, k, v, None, out, full, seed, offset,
                                                                      0.0, [True, True, True, False], causal)
    else:
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, full, 0.0, causal)
    return grads[0], grads[1], grads[2]


def _fold(x: Tensor, groups: int) -> Tensor:
    """(B, H, rows, ...) -> (B, H / groups, groups * rows, ...): the query heads of one key/value head
    stacked along the rows, so a block without a mask runs on the key/value heads as they are."""
    return x.reshape(x.shape[0], x.shape[1] // groups, groups * x.shape[2], *x.shape[3:])


def _unfold(x: Tensor, groups: int) -> Tensor:
    return x.reshape(x.shape[0], x.shape[1] * groups, x.shape[2] // groups, *x.shape[3:])


def _block_inputs(span: Span, q: Tensor, k: Tensor, v: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor, bool]:
    """The block's q, k, v with equal heads, and whether q's heads were folded into its rows."""
    qs, ks, vs = q[:, :, span.q0:span.q1], k[:, :, span.k0:span.k1], v[:, :, span.k0:span.k1]
    if groups == 1:
        return qs.contiguous(), ks.contiguous(), vs.contiguous(), False
    if span.causal:  # a chunk of keys, repeated per query head: the causal mask needs the rows as they are
        return qs.contiguous(), ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1), False
    return _fold(qs, groups).contiguous(), ks.contiguous(), vs.contiguous(), True


def _attend(q: Tensor, k: Tensor, v: Tensor, spans: tuple[Span, ...],
            backend: str) -> tuple[Tensor, Tensor, list[_Meta]]:
    """Forward over the blocks: ``(out, lse, metas)``; ``k``/``v`` hold the whole sequence in global order."""
    b, h, rows, d = q.shape
    groups = h // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros((b, h, rows, d), dtype=acc)
    lse = q.new_full((b, h, rows), float("-inf"), dtype=acc)
    metas = []
    for span in spans:
        qs, ks, vs, folded = _block_inputs(span, q, k, v, groups)
        o, part_lse, meta = _block_forward(backend, qs, ks, vs, span.causal)
        metas.append(meta)
        if folded:
            o, part_lse = _unfold(o, groups), _unfold(part_lse, groups)
        o, part_lse = o.to(acc), part_lse.to(acc)
        old_o, old_lse = out[:, :, span.q0:span.q1], lse[:, :, span.q0:span.q1]
        new_lse = torch.logaddexp(old_lse, part_lse)
        out[:, :, span.q0:span.q1] = (old_o * torch.exp(old_lse - new_lse)[..., None]
                                      + o * torch.exp(part_lse - new_lse)[..., None])
        lse[:, :, span.q0:span.q1] = new_lse
    return out.to(q.dtype), lse, metas


def _attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     spans: tuple[Span, ...], backend: str, metas: list[_Meta]) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`_attend`, dk/dv over the whole sequence in global order."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    groups = h // hkv
    acc = lse.dtype
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for span, meta in zip(spans, metas, strict=True):
        qs, ks, vs, folded = _block_inputs(span, q, k, v, groups)
        rows = slice(span.q0, span.q1)
        do, o, part_lse = dout[:, :, rows], out[:, :, rows], lse[:, :, rows]
        if folded:
            do, o, part_lse = _fold(do, groups), _fold(o, groups), _fold(part_lse, groups)
        gq, gk, gv = _block_backward(backend, do.contiguous(), qs, ks, vs, o.contiguous(), part_lse.contiguous(),
                                     span.causal, meta)
        if folded:
            gq = _unfold(gq, groups)
        elif groups > 1:  # the repeated key/value heads: sum each head's copies
            gk = gk.reshape(b, hkv, groups, -1, d).sum(2)
            gv = gv.reshape(b, hkv, groups, -1, d).sum(2)
        dq[:, :, rows] += gq
        dk[:, :, span.k0:span.k1] += gk
        dv[:, :, span.k0:span.k1] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gather_keys(k: Tensor, v: Tensor, plan: AttentionPlan, group: Group) -> tuple[Tensor, Tensor]:
    """Every member's k/v (batch, kv heads, local seq, d): the whole sequence's, in global order."""
    kv = torch.stack((k, v))
    gathered = kv.unsqueeze(0) if group.trivial else all_gather_flat(kv.reshape(-1), group).view(-1, *kv.shape)
    whole = kv.new_empty((*kv.shape[:3], plan.seq_len, kv.shape[4]))
    for member, a, b, g in plan.runs:
        whole[:, :, :, g:g + b - a].copy_(gathered[member, :, :, :, a:b])
    return whole[0], whole[1]


def _scatter_key_grads(dk: Tensor, dv: Tensor, plan: AttentionPlan, group: Group,
                       local: int) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`_gather_keys` for gradients: every member's share of ``dk``/``dv`` (global
    order), summed over the group's members (a reduce-scatter); this member's part."""
    members = 1 if group.trivial else group.size
    parts = dk.new_empty((members, 2, *dk.shape[:2], local, dk.shape[3]))
    for member, a, b, g in plan.runs:
        parts[member, 0, :, :, a:b].copy_(dk[:, :, g:g + b - a])
        parts[member, 1, :, :, a:b].copy_(dv[:, :, g:g + b - a])
    mine = parts[0] if group.trivial else reduce_scatter_flat(parts.reshape(-1), group).view(parts.shape[1:])
    return mine[0], mine[1]


class _ChunkPairAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, group: Group,  # type: ignore[override]
                backend: str, regather: bool) -> Tensor:
        spans = plan.tiles if backend == "math" else plan.spans
        k_all, v_all = _gather_keys(k, v, plan, group)
        out, lse, metas = _attend(q, k_all, v_all, spans, backend)
        ctx.plan, ctx.group, ctx.backend, ctx.spans, ctx.metas = plan, group, backend, spans, metas
        ctx.regather = regather
        # regather: keep only this member's K/V and gather again in the backward, so that what a
        # layer keeps for its backward is local (1 / sp of the sequence), at one more all-gather
        ctx.save_for_backward(q, *((k, v) if regather else (k_all, v_all)), out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.regather:
            k, v = _gather_keys(k, v, ctx.plan, ctx.group)
        dq, dk, dv = _attend_backward(grad, q, k, v, out, lse, ctx.spans, ctx.backend, ctx.metas)
        del k, v
        dk, dv = _scatter_key_grads(dk, dv, ctx.plan, ctx.group, q.shape[2])
        return dq, dk, dv, None, None, None, None


def lasp2h_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, group: Group,
                     plan: AttentionPlan | None = None, *, backend: str = "auto", regather: bool = True) -> Tensor:
    """LASP-2H softmax attention over a sequence split across ``group``: one all-gather of K/V, then
    blocks of (run, keys) pairs through flash / memory-efficient kernels merged by log-sum-exp.

    Args:
        q: (batch, heads, local seq, head_dim) this member's queries, RoPE applied.
        k, v: (batch, kv heads, local seq, head_dim) this member's keys / values, RoPE applied;
            ``heads`` is a multiple of ``kv heads`` (grouped-query attention, never repeated over
            the whole sequence).
        positions: int (group.size, local seq): the global position of every member's tokens (row
            ``group.index`` is this member's), e.g. :func:`zigzag_positions_all`.
        group: the sequence-parallel group.
        plan: :func:`plan_attention` of ``positions`` (built here when None).
        backend: ``auto`` (:func:`attention_backend`), ``flash``, ``efficient``, ``cpu_flash`` or
            ``math`` (the formula, in chunk x chunk tiles).
        regather: keep only the local K/V for the backward and all-gather them again there (memory
            per rank falls as 1/sp); False keeps the gathered K/V (one collective fewer).

    Returns:
        (batch, heads, local seq, head_dim): causal attention by global position, equal (to fp32
        rounding) to this member's rows of attention over the unsplit sequence.

    Raises:
        MismatchError: shapes that do not fit together; LayoutError: positions that are not a
        permutation of the sequence, or an unknown backend.
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[::2] != k.shape[::2] \
            or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise MismatchError(f"LASP-2H: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must be (batch, "
                            "heads, local seq, head_dim) with k and v alike and heads a multiple of kv heads")
    if backend not in BACKENDS:
        raise LayoutError(f"LASP-2H attention backend {backend!r} is unknown; use one of {list(BACKENDS)}")
    if plan is None:
        plan = plan_attention(positions, group.index)
    if plan.seq_len != q.shape[2] * (1 if group.trivial else group.size):
        raise MismatchError(f"LASP-2H: the plan covers {plan.seq_len} tokens but {q.shape[2]} local tokens on each of "
                            f"{group.size} members make {q.shape[2] * group.size}; plan with this shape's positions")
    return _ChunkPairAttention.apply(q, k, v, plan, group, attention_backend(q) if backend == "auto" else backend,
                                     regather)


def shard_sequence(model: MoEForCausalLM | HybridForCausalLM, group: Group, *, backend: str = "auto",
                   regather: bool = True) -> None:
    """Make ``model`` (a pipeline stage or the whole model) compute on this member's zigzag slice of
    every sequence: global positions for RoPE, :func:`lasp2h_attention` (with ``backend`` and
    ``regather``) in every softmax layer (the hybrid model's linear layers need LASP-2 besides:
    :func:`ckpt.trainer.hybrid_parallel.use_lasp2`)."""
    if group.trivial:
        return
    size, index = group.size, group.index

    def positions(local: int, device: torch.device) -> Tensor:
        return zigzag_positions(local * size, size, index, device).unsqueeze(0)

    cache: dict[int, tuple[Tensor, AttentionPlan]] = {}

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if q.shape[2] not in cache:  # one plan for every layer and step (it depends on the length only)
            pos = zigzag_positions_all(q.shape[2] * size, size)
            cache.clear()
            cache[q.shape[2]] = (pos, plan_attention(pos, index))
        pos, plan = cache[q.shape[2]]
        return lasp2h_attention(q, k, v, pos, group, plan, backend=backend, regather=regather)

    model.model.position_fn = positions
    for module in model.modules():
        if isinstance(module, Attention):
            module.attention_fn = attend


def sp_loss_denominator(labels: Tensor, group: Group, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Number of label tokens (not ``ignore_index``) of the whole batch: summed over ``group``."""
    count = (labels != ignore_index).sum().to(torch.float32).reshape(1)
    return all_reduce_(count, group).clamp(min=1)

