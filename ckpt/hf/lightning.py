"""MiniMax's lightning-attention decay, as transformers computes it (``MiniMaxLightningAttention``).

Per head ``h`` of linear layer ``i`` a decay rate ``s_h`` (:func:`slope_rates`), and the tables a
block of ``block_size`` tokens uses (:func:`decay_tables`). transformers stores rate and tables as
persistent buffers, so a Hugging Face MiniMax directory holds them: the ``minimax`` adapter computes
them on export (:meth:`ckpt.hf.adapters.MiniMax.derived`), and a model of this architecture (the
trainer's hybrid, :mod:`ckpt.trainer.hybrid`) computes its attention with the same functions, so the
two cannot drift apart.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["decay_tables", "slope_rates"]


def slope_rates(num_heads: int, layer_idx: int, num_layers: int) -> Tensor:
    """Per-head decay rates ``s_h`` (float32, shape (heads,)) of linear layer ``layer_idx``: token
    ``t`` contributes ``exp(-s_h * (i - t))`` to position ``i``. Same float operations, in the same
    order, as ``MiniMaxLightningAttention.get_slope_rate``."""
    base = 1 / (2 ** (8 / num_heads))
    exponent = torch.arange(num_heads) + 1
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (base**exponent) * factor


def decay_tables(rate: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(query_decay (h, B, 1), key_decay (h, B, 1), diagonal_decay (1, h, B, B))`` for rates
    ``rate`` (h, 1, 1): MiniMaxLightningAttention's ``decay_factors``, same operations (float32)."""
    steps = torch.arange(block_size, device=rate.device) + 1
    query_decay = torch.exp(-rate * steps[:, None])
    key_decay = torch.exp(-rate * (block_size - steps[:, None]))
    diagonal = rate * (steps[:, None] - steps[None, :])[None, None, :, :]
    diagonal_decay = torch.exp(torch.where(diagonal >= 0, -diagonal, float("-inf")))
    return query_decay, key_decay, diagonal_decay
