"""Expert parallelism: a MoE block whose experts are split over the EP group (and over TP along the
expert width), tokens dispatched and combined with all-to-all, as in X-MoE.

Per layer and micro-step, on each rank:

1. route the tokens this rank dispatches (router replicated);
2. plan the dispatch (:func:`plan_dispatch`, a pure function of the routing): expert ``e`` lives
   on EP rank ``e // experts_per_rank``. Two plans:

   - ``"dedup"`` (X-MoE's redundancy-bypassing dispatch, the default): one row per distinct
     (token, destination rank) pair, carrying the token's ``k`` routing slots with the expert ids
     of that rank's experts and ``-1`` for the others;
   - ``"per-expert"``: one row per (token, slot) pair, sorted by expert;

3. exchange counts, then one autograd-aware all-to-all carries ``[hidden | slot weights]`` rows (a
   plain ``all_to_all_single`` carries the expert ids);
4. run the local experts (:func:`ckpt.trainer.model.experts_forward`) on the received rows: each
   row's result is the weighted sum over its slots held here, in increasing expert id;
5. send one row back per row received (autograd all-to-all) and ``index_add`` them per token.

**Summation order.** The unsplit model sums each token's experts in increasing expert id, one at a
time. ``"per-expert"`` keeps exactly that order (rows come back in expert order). ``"dedup"`` sums
the experts of one destination rank first (on that rank) and then the per-rank partial sums in
rank order, i.e. ``(y_a + y_b) + (y_c + y_d)`` instead of ``((y_a + y_b) + y_c) + y_d``. The two
agree bitwise for every token whose experts fall on distinct ranks, except possibly the first rank
it visits (in particular always when ``ep == num_experts``, and always when ``ep == 1``); otherwise
they agree within fp32 rounding (~1e-7 relative). Neither mode promises bitwise equality with the
unsplit model across layouts (the expert GEMMs run on other row counts; the trainer's layout tests
use tolerances), but each mode is deterministic: the same layout and mode replay bitwise.

**Sequence-sharded MoE blocks under TP** (``sequence_shard=True``; off by default; X-MoE's hybrid
parallelism). The block's input is replicated over TP. Instead of every TP rank routing and
dispatching every token, TP rank ``j`` takes the ``j``-th of ``tp`` near-equal contiguous slices of
the tokens (backward: the slices' gradients are all-gathered), routes them (the router weight's
gradient is summed over TP, since each rank saw only its slice) and dispatches them over its EP
group. The experts stay split over TP along their width, so the checkpoint layout of expert tensors
is unchanged: EP rank ``d``'s TP ranks all-gather the rows they received (each holds only a width
slice of the experts, so each needs every row), compute their width partials, and reduce-scatter the
partials back to the TP rank that received each row; that rank sends one row per (token, rank) back
over EP. Finally the outputs of the ``tp`` slices are all-gathered over TP (backward: the rank's
slice). The EP all-to-all then moves each (token, rank) pair once per TP group instead of once per
TP rank: ``tp`` times fewer bytes; the TP group pays an all-gather and a reduce-scatter of the
received rows plus the all-gather of the outputs, instead of the all-reduce of all outputs, which
is more TP bytes than it saves EP bytes (``python -m bench xmoe``). It pays off where the EP
all-to-all crosses nodes and TP stays on a node's fast links, hence off by default. Whole experts
per TP rank (X-MoE's own pairing, TP ranks acting as extra EP ranks) would need no TP traffic in the
block but would change the checkpoint layout of every expert tensor; this variant keeps it.

With ``ep == 1`` and no sequence sharding, the dispatch vanishes and this is the plain
:class:`~ckpt.trainer.model.MoEBlock`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ckpt.errors import LayoutError
from ckpt.trainer.model import Experts, Router, experts_forward, route
from ckpt.trainer.parallel import Group, all_gather_flat, all_to_all
from ckpt.trainer.tp import copy_to_tp, reduce_from_tp

DISPATCH_MODES = ("dedup", "per-expert")
ID_BYTES = 8  # expert ids travel as int64 (the router's dtype)


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """Which rows one rank sends to its EP peers, and what each row carries.

    Rows are grouped by destination rank (rank 0's rows first); ``send_counts[r]`` rows go to rank
    ``r``. Row ``i`` carries the hidden state of token ``token[i]`` and ``slots`` routing slots:
    ``experts[i, j]`` the global expert id (``-1``: the slot's expert is on another rank, weight 0)
    and ``slot_index[i, j]`` the index of the slot's weight in the flattened (tokens, k) routing
    weights.
    """

    token: Tensor  # (rows,) int64
    experts: Tensor  # (rows, slots) int64, -1 where masked
    slot_index: Tensor  # (rows, slots) int64
    send_counts: list[int]

    @property
    def rows(self) -> int:
        """Rows this rank sends (its own rank's included)."""
        return int(self.token.numel())

    def slot_weights(self, weights: Tensor) -> Tensor:
        """The (rows, slots) weights to send, from the (tokens, k) routing weights (autograd flows)."""
        picked = weights.reshape(-1)[self.slot_index]
        return torch.where(self.experts >= 0, picked, torch.zeros_like(picked))


def plan_dispatch(selected: Tensor, experts_per_rank: int, ranks: int, mode: str = "dedup") -> DispatchPlan:
    """Plan one rank's dispatch for routing ``selected`` (tokens, k) of global expert ids.

    A pure function (no process group): expert ``e`` lives on rank ``e // experts_per_rank``.
    ``"dedup"`` sends one row per distinct (token, rank) pair, rows of a rank in token order;
    ``"per-expert"`` one row per (token, slot), sorted by expert id then token (stable).

    Raises:
        LayoutError: for an unknown ``mode`` or an expert id outside ``ranks * experts_per_rank``.

    Example::

        plan = plan_dispatch(torch.tensor([[0, 1], [3, 0]]), 2, 2)  # experts 0-1 on rank 0, 2-3 on 1
        plan.send_counts  # [2, 1]: token 0 once to rank 0 (experts 0 and 1), token 1 to both ranks
    """
    if mode not in DISPATCH_MODES:
        raise LayoutError(f"unknown MoE dispatch {mode!r}; choose one of {', '.join(DISPATCH_MODES)}")
    tokens, k = selected.shape
    if selected.numel() and not 0 <= int(selected.min()) <= int(selected.max()) < ranks * experts_per_rank:
        raise LayoutError(f"expert ids {int(selected.min())}..{int(selected.max())} fall outside the "
                          f"{ranks} x {experts_per_rank} experts of the EP group")
    rank_of = torch.div(selected, experts_per_rank, rounding_mode="floor")
    if mode == "per-expert":
        flat = selected.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, then by token: the unsplit sum order
        counts = torch.bincount(rank_of.reshape(-1), minlength=ranks)
        return DispatchPlan(torch.div(order, k, rounding_mode="floor"), flat[order].unsqueeze(-1),
                            order.unsqueeze(-1), counts.tolist())
    present = torch.zeros(ranks, tokens, dtype=torch.bool, device=selected.device)
    present[rank_of, torch.arange(tokens, device=selected.device).unsqueeze(-1)] = True
    dest, token = present.nonzero(as_tuple=True)  # row-major: by rank, then by token
    on_dest = rank_of[token] == dest.unsqueeze(-1)
    experts = torch.where(on_dest, selected[token], torch.full_like(selected[token], -1))
    slot_index = token.unsqueeze(-1) * k + torch.arange(k, device=selected.device)
    return DispatchPlan(token, experts, slot_index, present.sum(dim=1).tolist())


@dataclass(slots=True)
class DispatchStats:
    """Bytes and rows this rank moved, accumulated over forward calls (reset by assigning anew).

    ``rows``: rows dispatched over EP (to every EP rank, itself included); ``remote_rows``: those
    to other ranks. ``ep_bytes``: payload bytes this rank sends through the EP all-to-alls in the
    forward (rows, ids, results back) and in the backward those calls cause (gradients, no ids);
    ``remote_ep_bytes`` the same without the rows to itself (which never leave the process).
    ``tp_bytes``: bytes sent to other TP ranks by the sequence-sharded path (row all-gather,
    partial reduce-scatter, output all-gather, forward and backward). ``tp_allreduce_bytes``: what
    a ring all-reduce would send per rank (``2 (tp - 1) / tp`` of the tensor) for the block's TP
    all-reduces: the output and the input/weight gradients without sequence sharding, the router
    weight's gradient with it. The count exchanges (one int per peer) are not counted.
    """

    calls: int = 0
    rows: int = 0
    remote_rows: int = 0
    ep_bytes: int = 0
    remote_ep_bytes: int = 0
    tp_bytes: int = 0
    tp_allreduce_bytes: int = 0


def _gather_v(x: Tensor, counts: list[int], group: Group) -> Tensor:
    """Concatenate every member's ``x`` (``counts[r]`` rows from member ``r``) in group order."""
    out = x.new_empty((sum(counts), *x.shape[1:]))
    dist.all_to_all_single(out, torch.cat([x] * group.size).contiguous(), counts, [x.shape[0]] * group.size,
                           group=group.pg)
    return out


def _shard_bounds(sizes: list[int], index: int) -> tuple[int, int]:
    start = sum(sizes[:index])
    return start, start + sizes[index]


class _ShardTokens(torch.autograd.Function):
    """This TP rank's slice of TP-replicated tokens; backward all-gathers the slices' gradients (each
    rank's slice gradient is whole, and the replicated input needs the whole gradient everywhere)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sizes: list[int], group: Group) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        lo, hi = _shard_bounds(sizes, group.index)
        return x[lo:hi].clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather_v(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _GatherTokens(torch.autograd.Function):
    """All-gather the TP ranks' token slices; backward keeps this rank's slice of the (replicated,
    whole) output gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sizes: list[int], group: Group) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _gather_v(x.contiguous(), sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        lo, hi = _shard_bounds(ctx.sizes, ctx.group.index)
        return grad[lo:hi].contiguous(), None, None


def shard_sizes(tokens: int, parts: int) -> list[int]:
    """Near-equal contiguous split of ``tokens`` rows over ``parts`` ranks (the first get one more)."""
    return [tokens // parts + (1 if i < tokens % parts else 0) for i in range(parts)]


class ParallelMoEBlock(nn.Module):
    """Drop-in for :class:`~ckpt.trainer.model.MoEBlock` (same ``gate`` / ``experts`` submodules and
    parameter names) holding experts ``[expert_offset, expert_offset + local)`` and a TP slice of
    their width.

    Args:
        gate: the router (replicated).
        experts: this rank's experts (``expert_offset`` set) and TP width slice.
        num_experts: experts in the layer (all EP ranks together).
        ep / tp: this rank's groups.
        dispatch: ``"dedup"`` or ``"per-expert"`` (see the module docstring).
        sequence_shard: under TP, each TP rank routes and dispatches ``1/tp`` of the tokens.

    Raises:
        LayoutError: for an unknown ``dispatch`` or an EP size that does not divide ``num_experts``.
    """

    def __init__(self, gate: Router, experts: Experts, num_experts: int, ep: Group, tp: Group,
                 dispatch: str = "dedup", sequence_shard: bool = False):
        super().__init__()
        if dispatch not in DISPATCH_MODES:
            raise LayoutError(f"unknown MoE dispatch {dispatch!r}; choose one of {', '.join(DISPATCH_MODES)}")
        if num_experts % ep.size:
            raise LayoutError(f"ep={ep.size} must divide num_experts={num_experts}")
        self.gate = gate
        self.experts = experts
        self.num_experts = num_experts
        self.ep, self.tp = ep, tp
        self.dispatch = dispatch
        self.sequence_shard = sequence_shard
        self.stats = DispatchStats()

    def forward(self, x: Tensor) -> Tensor:
        """Apply to ``x`` (batch, seq, hidden), replicated over TP; returns the same shape."""
        flat = x.reshape(-1, x.shape[-1])
        if self.sequence_shard and not self.tp.trivial:
            sizes = shard_sizes(flat.shape[0], self.tp.size)
            mine = _ShardTokens.apply(flat, sizes, self.tp)
            g = self.gate
            # Each TP rank routes only its slice, so the router weight's gradient is a partial sum
            # over TP: "f" on the weight all-reduces it and every TP rank keeps the whole gradient.
            _, weights, selected = route(mine, copy_to_tp(g.weight, self.tp), g.top_k, g.norm_topk_prob)
            out = self._dispatch_combine(mine, weights, selected, gather_tp=True)
            self._count_allreduce(g.weight.numel() * g.weight.element_size())
            self.stats.tp_bytes += 2 * (self.tp.size - 1) * out.shape[0] * out.shape[1] * out.element_size()
            return _GatherTokens.apply(out, sizes, self.tp).view_as(x)
        _, weights, selected = self.gate(flat)
        flat, weights = copy_to_tp(flat, self.tp), copy_to_tp(weights, self.tp)
        if not self.tp.trivial:  # output forward, input and weight gradients backward
            self._count_allreduce((2 * flat.numel() + weights.numel()) * flat.element_size())
        if self.ep.trivial:
            e = self.experts
            out = experts_forward(flat, weights, selected, e.gate_proj, e.up_proj, e.down_proj, e.expert_offset)
        else:
            out = self._dispatch_combine(flat, weights, selected, gather_tp=False)
        return reduce_from_tp(out, self.tp).view_as(x)

    def _dispatch_combine(self, flat: Tensor, weights: Tensor, selected: Tensor, gather_tp: bool) -> Tensor:
        """Send ``flat``'s rows to the ranks holding their experts, run the experts there, and sum the
        returned rows per token. With ``gather_tp`` the destination's TP ranks pool their received
        rows (each holds a width slice of the experts) and reduce-scatter the partials."""
        ep, tp, e = self.ep, self.tp, self.experts
        plan = plan_dispatch(selected, self.num_experts // ep.size, ep.size, self.dispatch)
        send = plan.send_counts
        if ep.trivial:
            recv = send
        else:
            recv_t = torch.empty(ep.size, dtype=torch.int64, device=flat.device)
            dist.all_to_all_single(recv_t, torch.tensor(send, dtype=torch.int64, device=flat.device), group=ep.pg)
            recv = recv_t.tolist()
        slots = plan.experts.shape[1]
        payload = torch.cat([flat[plan.token], plan.slot_weights(weights).to(flat.dtype)], dim=1)
        ids = plan.experts
        if not ep.trivial:
            payload = all_to_all(payload, send, recv, ep)
            ids_out = ids.new_empty((sum(recv), slots))
            dist.all_to_all_single(ids_out, ids.contiguous(), recv, send, group=ep.pg)
            ids = ids_out
        self._count(send, recv, flat.shape[1], slots, flat.element_size())

        received = payload.shape[0]
        if gather_tp:
            # Each TP rank holds a width slice of these experts, so each needs every received row.
            counts = all_gather_flat(torch.tensor([received], dtype=torch.int64, device=flat.device), tp).tolist()
            mine = [received] * tp.size
            payload = all_to_all(torch.cat([payload] * tp.size), mine, counts, tp)
            ids_all = ids.new_empty((sum(counts), slots))
            dist.all_to_all_single(ids_all, torch.cat([ids] * tp.size).contiguous(), counts, mine, group=tp.pg)
            ids = ids_all
            # Sent by this rank: its rows to every peer (forward) and the partials' gradients for them
            # (reduce-scatter backward); the peers' rows' gradients (gather backward) and partials.
            row, out_row = (flat.shape[1] + slots) * flat.element_size(), flat.shape[1] * flat.element_size()
            self.stats.tp_bytes += (tp.size - 1) * received * (row + slots * ID_BYTES + out_row)
            self.stats.tp_bytes += (sum(counts) - received) * (row + out_row)
        hidden = flat.shape[1]
        y = experts_forward(payload[:, :hidden], payload[:, hidden:], ids, e.gate_proj, e.up_proj, e.down_proj,
                            e.expert_offset)
        if gather_tp:
            # Sum the width partials over TP, each row landing on the TP rank that received it.
            y = all_to_all(y, counts, mine, tp).view(tp.size, received, hidden).sum(dim=0)
        back = y if ep.trivial else all_to_all(y, recv, send, ep)
        return torch.zeros_like(flat).index_add(0, plan.token, back)

    def _count_allreduce(self, nbytes: int) -> None:
        self.stats.tp_allreduce_bytes += 2 * (self.tp.size - 1) * nbytes // self.tp.size

    def _count(self, send: list[int], recv: list[int], hidden: int, slots: int, elt: int) -> None:
        s = self.stats
        s.calls += 1
        me = self.ep.index
        remote_send, remote_recv = sum(send) - send[me], sum(recv) - recv[me]
        s.rows += sum(send)
        s.remote_rows += remote_send

        def sent(out_rows: int, back_rows: int) -> int:
            forward = out_rows * ((hidden + slots) * elt + slots * ID_BYTES) + back_rows * hidden * elt
            backward = back_rows * (hidden + slots) * elt + out_rows * hidden * elt  # gradients, no ids
            return forward + backward

        if not self.ep.trivial:
            s.ep_bytes += sent(sum(send), sum(recv))
            s.remote_ep_bytes += sent(remote_send, remote_recv)


__all__ = ["DISPATCH_MODES", "ID_BYTES", "DispatchPlan", "plan_dispatch", "DispatchStats", "shard_sizes",
           "ParallelMoEBlock"]
