"""User-facing shard wrappers and the region descriptors the planners work on.

A *region* says which elements of a global tensor a piece holds:

- ``Box(offsets, lengths)``: an n-D block (TP, EP, PP, uneven splits, 2-D blocks);
- ``Flat(start, stop)``: a half-open range of the row-major flattening (ZeRO-1, FSDP1 flat params).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.errors import StateError


@dataclass(frozen=True, slots=True)
class Box:
    """An n-D block of a global tensor: ``offsets[d] <= i[d] < offsets[d] + lengths[d]``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def to_list(self) -> list[list[int]]:
        return [list(self.offsets), list(self.lengths)]


@dataclass(frozen=True, slots=True)
class Flat:
    """Elements ``[start, stop)`` of the row-major flattening of a global tensor, or, with ``box``,
    of that box's own row-major flattening (ZeRO-1 over a tensor-parallel piece: a flat range of
    a rank's local TP/EP block)."""

    start: int
    stop: int
    box: Box | None = None

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def to_list(self) -> list[int]:
        return [self.start, self.stop]

    def to_wire(self) -> list[Any]:
        return [self.start, self.stop] if self.box is None else [self.start, self.stop, *self.box.to_list()]


Region = Box | Flat


def full_box(shape: tuple[int, ...]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return Box(tuple(0 for _ in shape), tuple(shape))


def check_region(region: Region, global_shape: tuple[int, ...], key: str) -> None:
    """Raise LayoutError-like StateError when ``region`` is not inside ``global_shape``."""
    if isinstance(region, Box):
        if len(region.offsets) != len(global_shape) or len(region.lengths) != len(global_shape):
            raise StateError(
                f"tensor {key!r}: shard has {len(region.offsets)} dims but the global shape "
                f"{list(global_shape)} has {len(global_shape)}; pass one offset per dimension"
            )
        for d, (o, n, g) in enumerate(zip(region.offsets, region.lengths, global_shape, strict=True)):
            if o < 0 or n < 0 or o + n > g:
                raise StateError(
                    f"tensor {key!r}: shard offsets {list(region.offsets)} lengths {list(region.lengths)} "
                    f"fall outside the global shape {list(global_shape)} in dim {d}; fix the offsets"
                )
    else:
        total = math.prod(global_shape)
        if region.box is not None:
            check_region(region.box, global_shape, key)
            total = region.box.numel
        if region.start < 0 or region.stop < region.start or region.stop > total:
            where = f"box {region.box.to_list()}" if region.box is not None else f"global shape {list(global_shape)}"
            raise StateError(
                f"tensor {key!r}: flat shard [{region.start}, {region.stop}) falls outside the "
                f"{total} elements of the {where}; fix the start"
            )


class Shard:
    """A rank's n-D block of a global tensor.

    Args:
        local: the block's values; its shape gives the block's lengths.
        global_shape: shape of the whole (global) tensor.
        offsets: index of ``local[0, 0, ...]`` in the global tensor, one per dimension.

    Example::

        w = ckpt.Shard(local_rows, global_shape=(1024, 512), offsets=(rank * 256, 0))
    """

    __slots__ = ("local", "global_shape", "offsets")

    def __init__(self, local: torch.Tensor, global_shape: tuple[int, ...] | torch.Size, offsets: tuple[int, ...]):
        if not isinstance(local, torch.Tensor):
            raise StateError(f"Shard.local must be a torch.Tensor, got {type(local).__name__}")
        self.local = local
        self.global_shape = tuple(int(s) for s in global_shape)
        self.offsets = tuple(int(o) for o in offsets)

    @property
    def region(self) -> Box:
        return Box(self.offsets, tuple(self.local.shape))

    def __repr__(self) -> str:
        return f"Shard(local={tuple(self.local.shape)}, global_shape={self.global_shape}, offsets={self.offsets})"


class FlatShard:
    """A rank's range ``[start, start + local.numel())`` of the row-major flattening of a global tensor.

    This is how ZeRO-1 / distributed-optimizer state and FSDP1 flat parameters are held.

    With ``box=(offsets, lengths)`` the range is of that block's row-major flattening instead: this
    is ZeRO-1 state of a tensor-parallel parameter (DP ranks split the flattening of the local TP block).

    Example::

        exp_avg = ckpt.FlatShard(local_1d, global_shape=(1024, 512), start=rank * 131072)
        # TP rank t holds rows [t*512, (t+1)*512); its 2 DP ranks split that block's flattening
        exp_avg = ckpt.FlatShard(local_1d, (1024, 512), start=d * 131072, box=((t * 512, 0), (512, 512)))
    """

    __slots__ = ("local", "global_shape", "start", "box")

    def __init__(self, local: torch.Tensor, global_shape: tuple[int, ...] | torch.Size, start: int,
                 box: tuple[tuple[int, ...], tuple[int, ...]] | None = None):
        if not isinstance(local, torch.Tensor):
            raise StateError(f"FlatShard.local must be a torch.Tensor, got {type(local).__name__}")
        if local.dim() != 1:
            raise StateError(f"FlatShard.local must be 1-D, got shape {tuple(local.shape)}; pass local.view(-1)")
        self.local = local
        self.global_shape = tuple(int(s) for s in global_shape)
        self.start = int(start)
        self.box = (Box(tuple(int(o) for o in box[0]), tuple(int(n) for n in box[1])) if box is not None
                    else None)

    @property
    def region(self) -> Flat:
        return Flat(self.start, self.start + self.local.numel(), self.box)

    def __repr__(self) -> str:
        return f"FlatShard(numel={self.local.numel()}, global_shape={self.global_shape}, start={self.start})"


class PerRank:
    """Marks a non-tensor value as per-rank (e.g. an RNG state): every rank's value is stored.

    On load, each rank gets back the value saved by the rank with the same index.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any = None):
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


__all__ = ["Box", "Flat", "Region", "full_box", "check_region", "Shard", "FlatShard", "PerRank"]
