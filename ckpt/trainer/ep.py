"""Expert parallelism: a MoE block whose experts are split over the EP group (and over TP along the
expert width), tokens dispatched and combined with all-to-all.

Per layer and micro-step, on each rank:

1. route the local tokens (router replicated; ``f`` over TP on its inputs so its gradient is whole);
2. sort the (token, slot) pairs by expert id; expert ``e`` lives on EP rank ``e // experts_per_rank``;
3. exchange counts, then one autograd-aware all-to-all carries ``[hidden | weight]`` rows (a plain
   ``all_to_all_single`` carries the expert ids);
4. run the local experts (:func:`ckpt.trainer.model.experts_forward`) on the received rows;
5. send the weighted outputs back (autograd all-to-all) and ``index_add`` them per token; the pairs
   are in expert order, so each token sums its experts in the same order as the unsplit model;
6. ``g`` over TP sums the expert-width partial results.

With ``ep == 1`` steps 2-3 and 5 vanish and this is the plain :class:`~ckpt.trainer.model.MoEBlock`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ckpt.trainer.model import Experts, Router, experts_forward
from ckpt.trainer.parallel import Group, all_to_all
from ckpt.trainer.tp import copy_to_tp, reduce_from_tp


class ParallelMoEBlock(nn.Module):
    """Drop-in for :class:`~ckpt.trainer.model.MoEBlock` (same ``gate`` / ``experts`` submodules and
    parameter names) holding experts ``[expert_offset, expert_offset + local)`` and a TP slice of
    their width."""

    def __init__(self, gate: Router, experts: Experts, num_experts: int, ep: Group, tp: Group):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_experts = num_experts
        self.ep, self.tp = ep, tp

    def forward(self, x: Tensor) -> Tensor:
        """Apply to ``x`` (batch, seq, hidden), replicated over TP; returns the same shape."""
        flat = x.reshape(-1, x.shape[-1])
        _, weights, selected = self.gate(flat)
        flat, weights = copy_to_tp(flat, self.tp), copy_to_tp(weights, self.tp)
        e = self.experts
        if self.ep.trivial:
            out = experts_forward(flat, weights, selected, e.gate_proj, e.up_proj, e.down_proj, e.expert_offset)
        else:
            out = self._dispatch_combine(flat, weights, selected)
        return reduce_from_tp(out, self.tp).view_as(x)

    def _dispatch_combine(self, flat: Tensor, weights: Tensor, selected: Tensor) -> Tensor:
        tokens, k = selected.shape
        per_rank = self.num_experts // self.ep.size
        expert = selected.reshape(-1)
        order = torch.argsort(expert, stable=True)  # by expert, then by token: the unsplit sum order
        expert = expert[order]
        token = torch.div(order, k, rounding_mode="floor")
        send_counts = torch.bincount(torch.div(expert, per_rank, rounding_mode="floor"), minlength=self.ep.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep.pg)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        received = sum(recv_splits)

        payload = torch.cat([flat[token], weights.reshape(-1)[order].unsqueeze(-1).to(flat.dtype)], dim=1)
        recv = all_to_all(payload, send_splits, recv_splits, self.ep)
        recv_expert = expert.new_empty(received)
        dist.all_to_all_single(recv_expert, expert, recv_splits, send_splits, group=self.ep.pg)

        e = self.experts
        y = experts_forward(recv[:, :-1], recv[:, -1:], recv_expert.unsqueeze(-1), e.gate_proj, e.up_proj,
                            e.down_proj, e.expert_offset)
        back = all_to_all(y, recv_splits, send_splits, self.ep)
        return torch.zeros_like(flat).index_add(0, token, back)
