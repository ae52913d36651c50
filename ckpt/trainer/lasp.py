"""LASP-2: sequence parallelism for lightning-attention layers (one AllGather of memory states per layer).

Each rank of the sequence-parallel group holds some chunks of every sequence. For a linear layer,
``out_i = sum_{t <= i} lambda^{i - t} (q_i . k_t) v_t`` with ``lambda = exp(-s_h)`` per head, so a
chunk's output is its own (intra-chunk) part plus its queries against the decayed sum of everything
before it, and that sum is a ``d_k x d_v`` matrix per head whatever the sequence length:

1. each rank runs the blocked single-process algorithm on each of its chunks from a zero state,
   giving the intra-chunk output and the chunk's memory state ``M_c = sum_t lambda^{L-1-t} k_t^T v_t``;
2. ONE AllGather of the memory states over the group (``ranks x chunks-per-rank`` states of
   ``batch x heads x d_k x d_v``: independent of the sequence length);
3. each rank combines the states of the chunks before each of its own, in global order:
   ``S_g = sum_{j < g} lambda^{L (g-1-j)} M_j`` (a weighted sum of at most ``2 x sp`` matrices), and adds
   ``(q_i lambda^{i}) @ S_g`` (``i`` = 1-based position in the chunk) to the intra-chunk output.

The backward is autograd through the same steps; the AllGather's backward is a reduce-scatter (sum)
of the states' gradients: one collective of the same size. Step 1 does not depend on step 2, so an
implementation with async collectives can overlap them.

Sequence layouts (:data:`SEQUENCE_LAYOUTS`): ``contiguous`` (rank r holds chunk r of sp) and
``zigzag`` (2 x sp chunks; rank r holds chunks r and 2sp-1-r, the load-balanced layout causal
softmax attention wants). Linear attention costs the same per token wherever it sits, so it gains
nothing from zigzag, but the hybrid model's softmax layers do; because the prefix combine takes
chunks in any global order, a linear layer runs on the zigzag layout as it is, and the model never
re-arranges activations between its two kinds of layers. The price is two states per rank in the
AllGather instead of one (still independent of the sequence length).

``group`` is anything with ``.pg``, ``.size``, ``.index``, ``.trivial``, like
:class:`ckpt.trainer.parallel.Group`.

Example::

    attn.core = lambda q, k, v, s, b: lasp2_linear_attention(q, k, v, s, ctx.groups["sp"], block_size=b,
                                                              layout="zigzag")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ckpt.errors import LayoutError, MismatchError
from ckpt.trainer.hybrid import lightning_attention

__all__ = ["SEQUENCE_LAYOUTS", "CommStats", "SequenceGroup", "chunk_ids", "check_sequence", "gather_sequence",
           "lasp2_linear_attention", "shard_sequence"]

SEQUENCE_LAYOUTS = ("contiguous", "zigzag")


class SequenceGroup(Protocol):
    """The process-group view LASP-2 needs (:class:`ckpt.trainer.parallel.Group` has it)."""

    @property
    def pg(self) -> Any: ...
    @property
    def size(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def trivial(self) -> bool: ...


@dataclass(slots=True)
class CommStats:
    """Bytes LASP-2 moved on this rank, summed over calls (tensor sizes, not wire bytes)."""

    all_gather_calls: int = 0
    all_gather_sent: int = 0  # this rank's input to the AllGathers
    all_gather_received: int = 0  # the gathered tensors (every rank's states, this one's included)
    reduce_scatter_calls: int = 0
    reduce_scatter_bytes: int = 0  # the backward's input (the gathered states' gradients)


def chunk_ids(layout: str, rank: int, size: int) -> list[int]:
    """Global chunk indices rank ``rank`` of ``size`` holds, in the order it holds them.

    ``contiguous``: ``[rank]`` of ``size`` chunks; ``zigzag``: ``[rank, 2 size - 1 - rank]`` of
    ``2 size`` chunks. Raises LayoutError for another layout name.
    """
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * size - 1 - rank]
    raise LayoutError(f"sequence layout {layout!r} is unknown; use one of {list(SEQUENCE_LAYOUTS)}")


def check_sequence(seq_len: int, sp: int, block_size: int, layout: str = "zigzag") -> int:
    """The chunk length of a ``seq_len``-token sequence over ``sp`` ranks, or LayoutError.

    Every chunk must hold whole lightning-attention blocks, so that each rank's blocks are the
    blocks of the unsplit computation: ``seq_len`` must be a multiple of ``chunks x block_size``
    (``chunks`` = sp, or 2 sp for zigzag). The message names the nearest lengths that work.
    Pure: call it before starting any process.
    """
    if sp < 1 or block_size < 1:
        raise LayoutError(f"sp={sp} and block_size={block_size} must be positive")
    chunks = len(chunk_ids(layout, 0, sp)) * sp
    unit = chunks * block_size
    if seq_len < unit or seq_len % unit:
        lower = max(unit, seq_len // unit * unit)
        raise LayoutError(
            f"sequence length {seq_len} does not split into {chunks} {layout} chunks of whole "
            f"{block_size}-token blocks (sp={sp}); use a multiple of {unit} (e.g. {lower} or {lower + unit}), "
            f"a smaller sp, or a block_size dividing {seq_len // chunks if seq_len >= chunks else seq_len}")
    return seq_len // chunks


def shard_sequence(x: Tensor, dim: int, rank: int, size: int, layout: str) -> Tensor:
    """This rank's tokens of ``x`` along ``dim`` (its chunks concatenated in :func:`chunk_ids` order)."""
    ids = chunk_ids(layout, rank, size)
    parts = x.chunk(len(ids) * size, dim=dim)
    return torch.cat([parts[i] for i in ids], dim=dim)


def gather_sequence(pieces: list[Tensor], dim: int, layout: str) -> Tensor:
    """Inverse of :func:`shard_sequence`: every rank's piece (in rank order) -> the whole sequence."""
    size = len(pieces)
    per = len(chunk_ids(layout, 0, size))
    chunks: dict[int, Tensor] = {}
    for rank, piece in enumerate(pieces):
        for i, part in zip(chunk_ids(layout, rank, size), piece.chunk(per, dim=dim), strict=True):
            chunks[i] = part
    return torch.cat([chunks[i] for i in range(per * size)], dim=dim)


class _AllGather(torch.autograd.Function):
    """All-gather along a new leading dim; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: SequenceGroup, stats: CommStats | None) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.stats = group, stats
        x = x.contiguous()
        # gloo takes only the concatenated form (ranks x dim 0), not a new leading dim
        out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
        # all_gather_single is the 2.13 name; older torch (2.11 on the GPU box) has only the old one
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x, group=group.pg)
        if stats is not None:
            stats.all_gather_calls += 1
            stats.all_gather_sent += x.numel() * x.element_size()
            stats.all_gather_received += out.numel() * out.element_size()
        return out.view(group.size, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        grad = grad.reshape(-1, *grad.shape[2:]).contiguous()
        out = grad.new_empty((grad.shape[0] // ctx.group.size, *grad.shape[1:]))
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, grad, op=dist.ReduceOp.SUM, group=ctx.group.pg)
        if ctx.stats is not None:
            ctx.stats.reduce_scatter_calls += 1
            ctx.stats.reduce_scatter_bytes += grad.numel() * grad.element_size()
        return out, None, None


def _check(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, group: SequenceGroup, block_size: int,
           layout: str) -> int:
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise MismatchError(f"lasp2: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must be "
                            "(batch, heads, local tokens, d) with the same batch, heads and tokens")
    if tuple(slopes.shape) != (q.shape[1],):
        raise MismatchError(f"lasp2: slopes has shape {list(slopes.shape)}; it needs one rate per local head "
                            f"({q.shape[1]},)")
    per = len(chunk_ids(layout, 0, group.size))
    local = q.shape[2]
    if local % (per * block_size):
        raise LayoutError(
            f"lasp2: {local} local tokens on each of sp={group.size} ranks do not make {per} {layout} chunk(s) of "
            f"whole {block_size}-token blocks; the sequence length must be a multiple of "
            f"{per * group.size * block_size} (sp x {per} chunks x block_size)")
    return local // per


def lasp2_linear_attention(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, group: SequenceGroup, *,
                           block_size: int = 256, layout: str = "contiguous",
                           stats: CommStats | None = None) -> Tensor:
    """Lightning attention over a sequence split across ``group`` (module docstring), differentiable.

    Args:
        q, k: (batch, heads, local tokens, d_k); v: (batch, heads, local tokens, d_v): this rank's
            tokens, its chunks concatenated in :func:`chunk_ids` order.
        slopes: (heads,) decay rates of these heads.
        group: the sequence-parallel group (``.pg``, ``.size``, ``.index``, ``.trivial``).
        block_size: lightning attention's block length; every chunk holds whole blocks.
        layout: ``contiguous`` or ``zigzag`` (:data:`SEQUENCE_LAYOUTS`).
        stats: bytes of the collectives are added to it when given.

    Returns:
        (batch, heads, local tokens, d_v): this rank's rows of the unsplit result (equal within
        float rounding: only the order of the inter-chunk sums differs).

    Raises:
        LayoutError: unknown layout, or local tokens that are not whole blocks per chunk.
        MismatchError: shapes that do not fit together.
    """
    chunk = _check(q, k, v, slopes, group, block_size, layout)
    ids = chunk_ids(layout, group.index, group.size)
    parts = [lightning_attention(q[:, :, i * chunk:(i + 1) * chunk], k[:, :, i * chunk:(i + 1) * chunk],
                                 v[:, :, i * chunk:(i + 1) * chunk], slopes, block_size) for i in range(len(ids))]
    states = torch.stack([state for _, state in parts])  # (chunks here, batch, heads, d_k, d_v)
    gathered = states[None] if group.trivial else _AllGather.apply(states, group, stats)
    order = {c: (r, j) for r in range(group.size) for j, c in enumerate(chunk_ids(layout, r, group.size))}
    everything = torch.stack([gathered[order[c]] for c in range(len(order))])  # global chunk order
    rate = slopes.to(device=q.device, dtype=torch.float32)  # (heads,)
    # prefix[i] = sum_{j < ids[i]} lambda^{L (ids[i]-1-j)} M_j, as one weighted sum over ALL chunks
    # (zero weights for j >= ids[i]) rather than a scan over the earlier ones: then every rank's
    # output depends on the gathered tensor, so every rank runs the backward's reduce-scatter (rank 0
    # of a contiguous layout needs no earlier state, and would otherwise skip its part of it).
    distance = torch.tensor(ids, device=q.device)[:, None] - 1 - torch.arange(len(order), device=q.device)[None, :]
    weights = torch.exp(-rate * chunk * distance.clamp(min=0)[..., None].to(torch.float32))
    weights = torch.where((distance >= 0)[..., None], weights, 0.0).to(q.dtype)  # (mine, all chunks, heads)
    prefix = torch.einsum("mch,cbhkv->mbhkv", weights, everything)
    query_decay = torch.exp(-rate[:, None, None] * (torch.arange(chunk, device=q.device) + 1)[:, None]).to(q.dtype)
    outs = [intra + torch.matmul(q[:, :, i * chunk:(i + 1) * chunk] * query_decay, prefix[i])
            for i, (intra, _) in enumerate(parts)]
    return torch.cat(outs, dim=2)
