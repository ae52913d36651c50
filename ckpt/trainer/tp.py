"""Tensor parallelism (Megatron style) on plain collectives.

Two conjugate operators keep every replicated activation and every replicated parameter's gradient
whole on each TP rank:

- :func:`copy_to_tp` ("f"): identity forward, all-reduce of the gradient backward; placed where a
  replicated activation enters a split computation (column-parallel input);
- :func:`reduce_from_tp` ("g"): all-reduce forward, identity backward; placed where partial results
  leave a split computation (row-parallel output).

Attention gets ``f`` before q/k/v and ``g`` after ``o_proj`` through forward hooks, so the model's
modules and parameter names stay as they are. The one exception to "replicated params get whole
gradients" is q/k RMSNorm: their weight is shared by all heads and each rank sees only its heads,
so their gradients are partial sums that :data:`TP_PARTIAL_GRAD` names for an all-reduce after
backward.

The vocabulary is split by rows (``torch.chunk``, padded to ``ceil(V / tp)`` rows per rank; the
rules table's ``pad``): :class:`VocabParallelEmbedding` and :class:`VocabParallelHead` hold the
padded rows, and :func:`vocab_parallel_cross_entropy` masks the padding out of the softmax, so it
never affects the loss, the gradients or a checkpoint.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ckpt.trainer.model import IGNORE_INDEX
from ckpt.trainer.parallel import Group, all_reduce_

# Replicated parameters used inside a head-split region: gradients are partial over TP.
TP_PARTIAL_GRAD = ("model.layers.*.self_attn.q_norm.weight", "model.layers.*.self_attn.k_norm.weight")


def is_tp_partial_grad(name: str) -> bool:
    """Whether ``name``'s gradient must be summed over the TP group after backward."""
    return any(fnmatch.fnmatchcase(name, p) for p in TP_PARTIAL_GRAD)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def copy_to_tp(x: Tensor, group: Group) -> Tensor:
    """Identity forward; gradient all-reduced over ``group`` backward ("f")."""
    return x if group.trivial else _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: Group) -> Tensor:
    """All-reduce over ``group`` forward; identity backward ("g")."""
    return x if group.trivial else _ReduceFromTP.apply(x, group)


def shard_attention(attn: nn.Module, group: Group) -> None:
    """Make a :class:`~ckpt.trainer.model.Attention` whose q/k/v rows and o_proj columns were sliced
    to whole heads compute its share: ``f`` on the input, ``g`` on the output (forward hooks)."""
    if group.trivial:
        return

    def pre(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (copy_to_tp(args[0], group), *args[1:])

    def post(_module: nn.Module, _args: tuple[Any, ...], out: Tensor) -> Tensor:
        return reduce_from_tp(out, group)

    attn.register_forward_pre_hook(pre)
    attn.register_forward_hook(post)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + real)`` of the embedding (``weight`` padded to a common row count).

    Tokens outside the slice look up zeros here; the all-reduce over TP sums the one rank that
    holds each token's row.
    """

    def __init__(self, weight: Tensor, start: int, real: int, group: Group):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.start, self.real, self.group = start, real, group

    def forward(self, ids: Tensor) -> Tensor:
        """Embed token ids (batch, seq) -> (batch, seq, hidden), replicated over TP."""
        inside = (ids >= self.start) & (ids < self.start + self.real)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight).masked_fill(~inside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class VocabParallelHead(nn.Module):
    """Column-parallel LM head: local logits for rows ``[start, start + real)`` of the vocabulary
    (padding columns included; :func:`vocab_parallel_cross_entropy` masks them)."""

    def __init__(self, weight: Tensor, start: int, real: int, group: Group):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.start, self.real, self.group = start, real, group

    def forward(self, h: Tensor) -> Tensor:
        """(batch, seq, hidden) -> local logits (batch, seq, padded local vocab)."""
        return F.linear(copy_to_tp(h, self.group), self.weight)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary rows (Megatron's algorithm): three all-reduces
    (max, target logit, sum of exponentials) forward, none backward."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, start: int, real: int, group: Group) -> Tensor:
        logits = logits.float()
        if real < logits.shape[-1]:  # padding rows: out of the softmax
            logits = logits.clone()
            logits[:, real:] = float("-inf")
        top = logits.max(dim=-1).values
        all_reduce_(top, group, dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        inside = (target >= start) & (target < start + real)
        local = torch.where(inside, target - start, torch.zeros_like(target))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        all_reduce_(picked, group)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        all_reduce_(total, group)
        loss = total.log() - picked
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, inside)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        softmax, local, inside = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, start: int, real: int, group: Group,
                                 ignore_index: int = IGNORE_INDEX, total: Tensor | None = None) -> Tensor:
    """Mean cross-entropy of ``logits`` (N, padded local vocab), rows ``[start, start + real)`` of
    the vocabulary on this rank, against global ``target`` ids (N,); ``ignore_index`` entries do not
    count. Equals ``F.cross_entropy`` on the gathered logits. ``total``: divide the sum by this
    count instead of the local number of targets (sequence parallelism: the whole batch's count)."""
    valid = target != ignore_index
    per_token = _VocabParallelCE.apply(logits, torch.where(valid, target, torch.zeros_like(target)), start, real,
                                       group)
    return (per_token * valid).sum() / (valid.sum().clamp(min=1) if total is None else total)


def parallel_causal_lm_loss(logits: Tensor, labels: Tensor, head: nn.Module) -> Tensor:
    """:func:`ckpt.trainer.model.causal_lm_loss` for a :class:`VocabParallelHead`'s local logits."""
    assert isinstance(head, VocabParallelHead)
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
    return vocab_parallel_cross_entropy(shifted, labels[:, 1:].reshape(-1), head.start, head.real, head.group)


__all__ = ["TP_PARTIAL_GRAD", "is_tp_partial_grad", "copy_to_tp", "reduce_from_tp", "shard_attention",
           "VocabParallelEmbedding", "VocabParallelHead", "vocab_parallel_cross_entropy", "parallel_causal_lm_loss"]
