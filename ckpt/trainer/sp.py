"""Sequence parallelism: zigzag slices of every sequence, LASP-2H attention for softmax layers.

Each of the ``sp`` ranks of a sequence-parallel group holds a slice of every sample of its
data-parallel rank's batch (the samples themselves do not depend on ``sp``):

- **zigzag split**: the sequence is cut into ``2 * sp`` equal chunks and rank ``i`` holds chunks
  ``i`` and ``2 * sp - 1 - i``, so under a causal mask every rank has the same amount of work (an
  early chunk with little to attend to, paired with a late one with much);
- **global positions**: RoPE and the causal mask use the tokens' positions in the whole sequence;
- **LASP-2H** (Sun et al., 2025) for softmax attention: one all-gather of the local K/V over the
  ``sp`` group per layer (after RoPE, before the grouped-query repeat, so it carries key/value
  heads only), then each rank attends its queries to the whole sequence's keys, masked by global
  positions. The all-gather's gradient is a reduce-scatter: every rank's K/V gradient is the sum
  of what every rank's queries sent back to it. Communication per layer is one collective of
  ``2 * B * S * kv_heads * head_dim`` elements in all, no ring of ``sp - 1`` steps;
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

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ckpt.errors import LayoutError
from ckpt.trainer.model import IGNORE_INDEX, Attention, MoEForCausalLM
from ckpt.trainer.parallel import Group, all_gather_flat, all_reduce_, reduce_scatter_flat

if TYPE_CHECKING:
    from ckpt.trainer.hybrid import HybridForCausalLM

__all__ = ["all_gather_seq", "check_sp", "lasp2h_attention", "lasp2h_masks", "shard_sequence", "shift_labels",
           "sp_choices", "sp_loss_denominator", "split_batch", "zigzag_merge", "zigzag_positions",
           "zigzag_positions_all", "zigzag_split"]


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


Mask = Any  # an additive (run x keys) tensor, or a lower-right CausalBias that no kernel materializes


def lasp2h_masks(positions: Tensor, index: int, dtype: torch.dtype,
                 device: torch.device | None = None) -> list[tuple[int, int, int, Mask]]:
    """Member ``index``'s query runs and their causal masks: ``(start, stop, keys, mask)`` for each run
    of consecutive positions among its tokens (zigzag: two runs), ``keys`` the number of keys (in
    global order) up to the run's last position.

    A run attends only the keys it may see, so each zigzag member computes the same number of
    scores, half of a full (local seq x seq) product. When the keys up to a run are exactly the
    positions ``0 .. last`` (every layout this trainer makes), the run is the last rows of a causal
    square: ``mask`` is a lower-right :func:`~torch.nn.attention.bias.causal_lower_right` bias, which
    flash / memory-efficient kernels apply without building it (no ``run x keys`` table per layer,
    no quadratic memory). Otherwise ``mask`` is additive (stop - start, keys): 0 where the key's
    position is not after the query's, ``-inf`` elsewhere.
    """
    from torch.nn.attention.bias import causal_lower_right

    mine = positions[index].to(device)
    key_pos = positions.reshape(-1).sort().values.to(device)
    breaks = [0, *((torch.nonzero(mine[1:] - mine[:-1] != 1).flatten() + 1).tolist()), mine.numel()]
    out: list[tuple[int, int, int, Mask]] = []
    for start, stop in zip(breaks, breaks[1:], strict=False):
        run = mine[start:stop]
        keys = int((key_pos <= run.max()).sum())
        dense = bool(torch.equal(key_pos[:keys], torch.arange(keys, device=key_pos.device)))
        if dense and int(run[0]) == keys - (stop - start):
            out.append((start, stop, keys, causal_lower_right(stop - start, keys)))
            continue
        allowed = run[:, None] >= key_pos[None, :keys]
        out.append((start, stop, keys,
                    torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))))
    return out


def lasp2h_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, group: Group,
                     masks: list[tuple[int, int, int, Mask]] | None = None) -> Tensor:
    """LASP-2H softmax attention over a sequence split across ``group``: one all-gather of K/V.

    Args:
        q: (batch, heads, local seq, head_dim) this member's queries, RoPE applied.
        k, v: (batch, kv heads, local seq, head_dim) this member's keys / values, RoPE applied;
            ``heads`` is a multiple of ``kv heads`` (grouped-query attention).
        positions: int (group.size, local seq): the global position of every member's tokens (row
            ``group.index`` is this member's), e.g. :func:`zigzag_positions_all`.
        group: the sequence-parallel group.
        masks: :func:`lasp2h_masks` of ``positions`` (built here when None).

    Returns:
        (batch, heads, local seq, head_dim): causal attention by global position, equal (to fp32
        rounding) to this member's rows of attention over the unsplit sequence.
    """
    kv = all_gather_seq(torch.stack((k, v)), group)  # (size, 2, B, Hkv, Sl, D)
    size, _, b, h, sl, d = kv.shape
    kv = kv.permute(1, 2, 3, 0, 4, 5).reshape(2, b, h, size * sl, d)
    # Keys in global order: the unsplit model's summation order over keys.
    kv = kv.index_select(3, torch.argsort(positions.reshape(-1)).to(q.device))
    if masks is None:
        masks = lasp2h_masks(positions, group.index, q.dtype, q.device)
    groups = q.shape[1] // h
    outs = []
    for start, stop, keys, mask in masks:
        key, value = kv[0, :, :, :keys], kv[1, :, :, :keys]
        if isinstance(mask, Tensor):
            # enable_gqa: the key/value heads are not repeated (no full-sequence copy per query group)
            outs.append(F.scaled_dot_product_attention(q[:, :, start:stop], key, value, attn_mask=mask,
                                                       enable_gqa=True))
            continue
        if groups > 1:  # CausalBias's flash / efficient kernels take as many key heads as query heads
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        outs.append(F.scaled_dot_product_attention(q[:, :, start:stop], key, value, attn_mask=mask))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def shard_sequence(model: MoEForCausalLM | HybridForCausalLM, group: Group) -> None:
    """Make ``model`` (a pipeline stage or the whole model) compute on this member's zigzag slice of
    every sequence: global positions for RoPE, :func:`lasp2h_attention` in every softmax layer (the
    hybrid model's linear layers need LASP-2 besides: :func:`ckpt.trainer.hybrid_parallel.use_lasp2`)."""
    if group.trivial:
        return
    size, index = group.size, group.index

    def positions(local: int, device: torch.device) -> Tensor:
        return zigzag_positions(local * size, size, index, device).unsqueeze(0)

    cache: dict[tuple[int, torch.dtype, torch.device], tuple[Tensor, list[tuple[int, int, int, Mask]]]] = {}

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        key = (q.shape[2], q.dtype, q.device)
        if key not in cache:  # one set of masks for every layer and step (it depends on the shapes only)
            pos = zigzag_positions_all(q.shape[2] * size, size)
            cache.clear()
            cache[key] = (pos, lasp2h_masks(pos, index, q.dtype, q.device))
        pos, masks = cache[key]
        return lasp2h_attention(q, k, v, pos, group, masks)

    model.model.position_fn = positions
    for module in model.modules():
        if isinstance(module, Attention):
            module.attention_fn = attend


def sp_loss_denominator(labels: Tensor, group: Group, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Number of label tokens (not ``ignore_index``) of the whole batch: summed over ``group``."""
    count = (labels != ignore_index).sum().to(torch.float32).reshape(1)
    return all_reduce_(count, group).clamp(min=1)

