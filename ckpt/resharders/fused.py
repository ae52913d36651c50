"""Fused parameters: a rank's local tensor that concatenates slices of several logical tensors.

Trainers often fuse projections into one local matrix (QKV with grouped-query attention, gate and
up of a SwiGLU MLP) and split that matrix over tensor parallelism. The checkpoint never stores the
fused matrix: it stores the *logical* tensors (``q_proj``, ``k_proj``, ``v_proj``), each as pieces
of its own global tensor, so a checkpoint saved fused under TP=4 loads unfused, or fused under
TP=2, or into Hugging Face names.

A :class:`FusedSpec` describes the fusion: the parts (checkpoint key and global shape of each
logical tensor), the dim along which they are concatenated (which is also the dim TP splits), and
whether the concatenation is interleaved per group:

- ``groups=1`` (vLLM's ``QKVParallelLinear``, Megatron's fused ``linear_fc1`` gate/up): TP rank
  ``t`` holds ``cat([q_t, k_t, v_t])`` where ``x_t`` is the ``t``-th of ``tp`` equal slices of ``x``;
- ``groups=G`` (Megatron's QKV interleaved per query group, ``G = num_kv_heads``): the fused
  tensor is ``G`` repetitions of ``[q_g, k_g, v_g]``; TP rank ``t`` holds groups ``t*G/tp ..``.

Two functions go between the local fused tensor and ``ckpt.Shard`` pieces of the logical tensors:

- :func:`split_fused` (local fused -> shards; views of the fused tensor when the layout allows)
- :func:`join_fused` (shards -> local fused, into ``out`` in place or a new tensor)

Example::

    spec = FusedSpec.qkv("model.model.layers.0.self_attn", num_heads=32, num_kv_heads=8, head_dim=128,
                         hidden=4096)
    ckpt.save(split_fused(local_qkv, spec, tp=4, tp_rank=r), url)               # on each rank
    shards = split_fused(torch.empty_like(local_qkv), spec, tp=4, tp_rank=r)
    ckpt.load(shards, url)
    join_fused(shards, spec, out=local_qkv)                                       # back into the fused tensor
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ckpt.errors import StateError
from ckpt.shards import Shard


@dataclass(frozen=True, slots=True)
class FusedPart:
    """One logical tensor inside a fused parameter: its checkpoint key and global shape."""

    key: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FusedSpec:
    """How a fused local parameter is made of logical tensors (see the module docstring).

    Args:
        parts: the logical tensors, in fused order.
        dim: the dim along which they are concatenated and along which TP splits them.
        groups: 1 for plain concatenation of per-rank slices; ``G`` for interleaving per group
            (each part's ``dim`` is cut into ``G`` equal groups; the fused tensor repeats
            ``[part0_g, part1_g, ...]`` for every group ``g``).
    """

    parts: tuple[FusedPart, ...]
    dim: int = 0
    groups: int = 1

    def __post_init__(self) -> None:
        if not self.parts:
            raise StateError("FusedSpec: needs at least one part")
        nd = len(self.parts[0].shape)
        if not 0 <= self.dim < nd:
            raise StateError(f"FusedSpec: dim {self.dim} is outside the parts' {nd} dims")
        for p in self.parts:
            if len(p.shape) != nd:
                raise StateError(f"FusedSpec: part {p.key!r} has {len(p.shape)} dims, {self.parts[0].key!r} has {nd}")
            for d in range(nd):
                if d != self.dim and p.shape[d] != self.parts[0].shape[d]:
                    raise StateError(f"FusedSpec: part {p.key!r} has size {p.shape[d]} in dim {d}, "
                                     f"{self.parts[0].key!r} has {self.parts[0].shape[d]}; "
                                     f"only dim {self.dim} may differ")
            if self.groups < 1 or p.shape[self.dim] % self.groups:
                raise StateError(f"FusedSpec: part {p.key!r} size {p.shape[self.dim]} in dim {self.dim} does not "
                                 f"split into {self.groups} groups")

    @classmethod
    def qkv(cls, prefix: str, *, num_heads: int, num_kv_heads: int, head_dim: int, hidden: int,
            interleaved: bool = False) -> FusedSpec:
        """Fused QKV with grouped-query attention: parts ``{prefix}.{q,k,v}_proj.weight`` of shapes
        ``(num_heads*head_dim, hidden)``, ``(num_kv_heads*head_dim, hidden)`` twice; ``interleaved``
        for Megatron's per-query-group layout."""
        return cls((FusedPart(f"{prefix}.q_proj.weight", (num_heads * head_dim, hidden)),
                    FusedPart(f"{prefix}.k_proj.weight", (num_kv_heads * head_dim, hidden)),
                    FusedPart(f"{prefix}.v_proj.weight", (num_kv_heads * head_dim, hidden))),
                   dim=0, groups=num_kv_heads if interleaved else 1)

    @classmethod
    def gate_up(cls, prefix: str, *, intermediate: int, hidden: int, num_experts: int | None = None) -> FusedSpec:
        """Fused SwiGLU gate/up: ``{prefix}.gate_proj`` and ``{prefix}.up_proj`` of shape ``(I, H)``,
        or ``(E, I, H)`` for fused experts (concatenated along I, dim 1, as transformers'
        ``gate_up_proj``)."""
        lead = (num_experts,) if num_experts is not None else ()
        suffix = "" if num_experts is not None else ".weight"
        return cls((FusedPart(f"{prefix}.gate_proj{suffix}", (*lead, intermediate, hidden)),
                    FusedPart(f"{prefix}.up_proj{suffix}", (*lead, intermediate, hidden))),
                   dim=len(lead), groups=1)

    def local_sizes(self, tp: int) -> list[int]:
        """Each part's size along ``dim`` on one TP rank."""
        if tp < 1:
            raise StateError(f"fused {self._names()}: tp={tp} must be positive")
        if self.groups > 1 and self.groups % tp:
            raise StateError(f"fused {self._names()}: tp={tp} does not divide the {self.groups} groups (every TP "
                             "rank holds whole groups); choose tp dividing it")
        for p in self.parts:
            if p.shape[self.dim] % tp:
                raise StateError(f"fused {self._names()}: tp={tp} does not divide size {p.shape[self.dim]} of "
                                 f"{p.key!r} along dim {self.dim}; choose tp dividing it")
        return [p.shape[self.dim] // tp for p in self.parts]

    def _names(self) -> str:
        return "+".join(p.key.rsplit(".", 2)[-2] if p.key.endswith(".weight") else p.key.rsplit(".", 1)[-1]
                        for p in self.parts)


def _check_local(local: torch.Tensor, spec: FusedSpec, sizes: list[int], offsets: Sequence[int]) -> None:
    ref = spec.parts[0].shape
    if local.dim() != len(ref):
        raise StateError(f"fused {spec._names()}: local tensor has {local.dim()} dims, the parts have {len(ref)}")
    if local.shape[spec.dim] != sum(sizes):
        raise StateError(f"fused {spec._names()}: local size {local.shape[spec.dim]} along dim {spec.dim} is not "
                         f"the sum of the parts' local sizes {sizes}; check tp and tp_rank")
    for d in range(len(ref)):
        if d != spec.dim and offsets[d] + local.shape[d] > ref[d]:
            raise StateError(f"fused {spec._names()}: local dim {d} [{offsets[d]}, {offsets[d] + local.shape[d]}) "
                             f"exceeds the global size {ref[d]}; check offsets")


def _pieces(local: torch.Tensor, spec: FusedSpec, tp: int) -> list[torch.Tensor]:
    """Each part's local piece as a view (groups=1) or a strided view (groups>1) of ``local``."""
    sizes = spec.local_sizes(tp)
    if spec.groups == 1:
        out, pos = [], 0
        for n in sizes:
            out.append(local.narrow(spec.dim, pos, n))
            pos += n
        return out
    gl = spec.groups // tp
    per = [n // gl for n in sizes]  # each part's rows per group
    shape = list(local.shape)
    grouped = local.view(shape[:spec.dim] + [gl, sum(per)] + shape[spec.dim + 1:])  # needs a contiguous local
    out, pos = [], 0
    for n in per:
        out.append(grouped.narrow(spec.dim + 1, pos, n))  # (..., gl, n, ...): merge gl and n to get the piece
        pos += n
    return out


def split_fused(local: torch.Tensor, spec: FusedSpec, *, tp: int = 1, tp_rank: int = 0,
                offsets: Sequence[int] | None = None) -> dict[str, Shard]:
    """The ``ckpt.Shard`` of every logical tensor that TP rank ``tp_rank`` of ``tp`` holds inside
    its fused local tensor ``local``.

    ``offsets`` gives the global offset of ``local`` in the dims other than ``spec.dim`` (e.g. the
    first expert of an EP rank for fused experts); zeros by default. The shards' data are views of
    ``local`` where the layout allows it (``groups=1``), else copies; after loading into them, call
    :func:`join_fused` with ``out=local`` to write the values back (a no-op for views).

    Raises StateError when the local shape does not match the spec, ``tp`` and the offsets.
    """
    if not 0 <= tp_rank < tp:
        raise StateError(f"fused {spec._names()}: tp_rank {tp_rank} is outside tp={tp}")
    sizes = spec.local_sizes(tp)
    offs = list(offsets) if offsets is not None else [0] * local.dim()
    if len(offs) != local.dim():
        raise StateError(f"fused {spec._names()}: {len(offs)} offsets for a {local.dim()}-D tensor")
    _check_local(local, spec, sizes, offs)
    if spec.groups > 1 and not local.is_contiguous():
        local = local.contiguous()
    out: dict[str, Shard] = {}
    for part, n, piece in zip(spec.parts, sizes, _pieces(local, spec, tp), strict=True):
        if spec.groups > 1:
            shape = list(local.shape)
            shape[spec.dim] = n
            piece = piece.reshape(shape)  # merges (groups, rows): a copy, the rows are not adjacent
        o = list(offs)
        o[spec.dim] = tp_rank * n
        out[part.key] = Shard(piece, part.shape, tuple(o))
    return out


def join_fused(shards: Mapping[str, Shard | torch.Tensor], spec: FusedSpec, *, tp: int = 1,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The fused local tensor made of the logical tensors' local pieces (inverse of :func:`split_fused`).

    ``shards`` maps each part's key to its local piece (a ``ckpt.Shard`` or a tensor). With
    ``out`` the values are copied into it in place (the trainer's parameter); else a new tensor.

    Raises StateError naming a missing part or a piece of the wrong shape.
    """
    sizes = spec.local_sizes(tp)
    locals_: list[torch.Tensor] = []
    for part, n in zip(spec.parts, sizes, strict=True):
        if part.key not in shards:
            raise StateError(f"fused {spec._names()}: no piece for {part.key!r}")
        v = shards[part.key]
        t = v.local if isinstance(v, Shard) else v
        if t.shape[spec.dim] != n:
            raise StateError(f"fused {spec._names()}: piece {part.key!r} has {t.shape[spec.dim]} rows along dim "
                             f"{spec.dim}, tp={tp} needs {n}")
        locals_.append(t)
    shape = list(locals_[0].shape)
    shape[spec.dim] = sum(sizes)
    if out is None:
        out = torch.empty(shape, dtype=locals_[0].dtype, device=locals_[0].device)
    elif list(out.shape) != shape:
        raise StateError(f"fused {spec._names()}: out has shape {list(out.shape)}, the pieces make {shape}")
    elif spec.groups > 1 and not out.is_contiguous():
        raise StateError(f"fused {spec._names()}: out must be contiguous for an interleaved (groups > 1) fusion")
    for t, view in zip(locals_, _pieces(out, spec, tp), strict=True):
        if spec.groups > 1:
            t = t.reshape(view.shape)
        if t.data_ptr() != view.data_ptr() or t.stride() != view.stride():
            view.copy_(t)
    return out


__all__ = ["FusedPart", "FusedSpec", "split_fused", "join_fused"]
