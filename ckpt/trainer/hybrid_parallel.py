"""Parallelism for the hybrid family's lightning-attention layers, applied from outside the model.

- :func:`check_hybrid_layout`: which ``tp`` / ``ep`` / ``sp`` / sequence lengths a
  :class:`~ckpt.trainer.hybrid.HybridConfig` can run, checked before any process starts
  (``LayoutError`` naming the values that work);
- :func:`shard_linear_attention`: tensor parallelism of a :class:`~ckpt.trainer.hybrid.LightningAttention`
  whose ``qkv_proj`` / ``output_gate`` rows, ``norm`` weight and ``out_proj`` columns were sliced to
  whole heads as the ``hf-decoder`` rules say (Megatron's ``f`` before, ``g`` after, and the output
  norm's sum of squares reduced over the TP group);
- :func:`use_lasp2`: sequence parallelism of every linear layer of a model (LASP-2 on the sp group).

The full-attention layers are the trainer's :class:`~ckpt.trainer.model.Attention` and take the
trainer's own TP (``tp.shard_attention``) and sequence parallelism (LASP-2H) unchanged.

Example::

    check_hybrid_layout(cfg, tp=2, ep=2, sp=2, seq_len=512)
    for layer in model.model.layers:
        if layer.layer_type == "linear_attention":
            shard_linear_attention(layer.self_attn, ctx.tp)
    use_lasp2(model, ctx.groups["sp"], layout="zigzag")
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ckpt.errors import LayoutError
from ckpt.trainer.hybrid import HybridConfig, LightningAttention
from ckpt.trainer.lasp import CommStats, SequenceGroup, check_sequence, lasp2_linear_attention
from ckpt.trainer.parallel import Group, all_reduce_
from ckpt.trainer.tp import shard_attention

__all__ = ["check_hybrid_layout", "shard_linear_attention", "use_lasp2"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_hybrid_layout(cfg: HybridConfig, *, tp: int = 1, ep: int = 1, sp: int = 1, seq_len: int | None = None,
                        sequence_layout: str = "zigzag") -> None:
    """Raise LayoutError when ``cfg`` cannot run under this layout; pure, call it before launching.

    TP splits whole heads: it must divide the linear layers' heads and the softmax layers' key/value
    heads; EP must divide the experts; under sp > 1 the sequence must split into chunks of whole
    lightning blocks (:func:`ckpt.trainer.lasp.check_sequence`).
    """
    linear = "linear_attention" in cfg.layer_types
    full = "full_attention" in cfg.layer_types
    ok_tp = [d for d in _divisors(cfg.num_attention_heads) if (not full or cfg.num_key_value_heads % d == 0)]
    if tp not in ok_tp:
        raise LayoutError(f"tp={tp} does not split the hybrid model's heads (num_attention_heads="
                          f"{cfg.num_attention_heads}, num_key_value_heads={cfg.num_key_value_heads}) into whole "
                          f"heads per rank; tp can be {ok_tp}")
    if cfg.num_local_experts % ep:
        raise LayoutError(f"ep={ep} does not divide num_local_experts={cfg.num_local_experts}; ep can be "
                          f"{_divisors(cfg.num_local_experts)}")
    if sp > 1 and seq_len is not None and linear:
        check_sequence(seq_len, sp, cfg.block_size, sequence_layout)


class _SumOverTP(torch.autograd.Function):
    """All-reduce forward and backward: a statistic each rank uses with its own heads."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


def shard_linear_attention(attn: LightningAttention, group: Group) -> None:
    """Make a lightning-attention layer whose weights hold this TP rank's heads compute its share.

    The caller slices ``qkv_proj.weight``, ``output_gate.weight`` and ``norm.weight`` by rows and
    ``out_proj.weight`` by columns into ``group.size`` equal blocks (the rules' ``tp_dim``); this sets
    ``head_offset`` (the decay rates of the local heads), the input/output operators and the
    norm's reduction. Raises LayoutError when the weights do not hold whole heads.
    """
    if group.trivial:
        return
    local = attn.qkv_proj.weight.shape[0] // (3 * attn.head_dim)
    if local * group.size != attn.num_heads or attn.qkv_proj.weight.shape[0] % (3 * attn.head_dim):
        raise LayoutError(f"lightning attention layer {attn.layer_idx}: qkv_proj holds "
                          f"{attn.qkv_proj.weight.shape[0]} rows on each of tp={group.size} ranks, not "
                          f"{attn.num_heads // group.size} whole heads of 3 x {attn.head_dim} rows; tp must divide "
                          f"{attn.num_heads}")
    attn.head_offset = group.index * local
    attn.sum_over_heads = lambda t: t if group.trivial else _SumOverTP.apply(t, group)
    shard_attention(attn, group)


def use_lasp2(model: nn.Module, group: SequenceGroup, *, layout: str = "zigzag",
              stats: CommStats | None = None) -> int:
    """Run every :class:`LightningAttention` of ``model`` with LASP-2 over ``group``; returns how many.

    The model's input then holds this rank's chunks of each sequence (:func:`ckpt.trainer.lasp.shard_sequence`),
    and its full-attention layers need sequence parallelism of their own (LASP-2H) and the tokens'
    global positions.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, LightningAttention):
            module.core = (lambda q, k, v, s, b: lasp2_linear_attention(q, k, v, s, group, block_size=b,
                                                                        layout=layout, stats=stats))
            count += 1
    return count

