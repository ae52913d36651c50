"""``ShardedTensor`` (``torch.distributed._shard``; FSDP1's ``SHARDED_STATE_DICT``) as pieces of a global tensor.

A ShardedTensor holds this rank's local shards (zero, one or several), each with its offsets in
the global tensor (``shard.metadata.shard_offsets``). Each local shard is one box of the global
tensor, exactly what a ``ckpt.Shard`` declares: saving writes the pieces, loading fills each local
shard in place from whatever layout was saved (resharding). :func:`ckpt._state.flatten_state` calls
:func:`sharded_tensor_pieces` for every ShardedTensor value, so ``ckpt.save`` / ``ckpt.load`` and
``ckpt.dcp`` take them alike.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ckpt.errors import StateError
from ckpt.shards import Box


def is_sharded_tensor(v: Any) -> bool:
    """True for a ``torch.distributed._shard.sharded_tensor.ShardedTensor`` (never imports it:
    if nobody imported the module, ``v`` cannot be one)."""
    mod = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    return mod is not None and isinstance(v, mod.ShardedTensorBase)


def sharded_tensor_pieces(v: Any, key: str) -> tuple[tuple[int, ...], list[tuple[Box, torch.Tensor]]]:
    """``(global_shape, [(box, local tensor), ...])`` for this rank's local shards of ``v``.

    The local tensors are the shards' own tensors (no copy), so a load fills them in place.
    Raises StateError naming ``key`` when a shard's offsets or sizes disagree with its tensor.
    """
    gshape = tuple(int(s) for s in v.size())
    out: list[tuple[Box, torch.Tensor]] = []
    for n, shard in enumerate(v.local_shards()):
        t, md = shard.tensor, shard.metadata
        offsets = tuple(int(o) for o in md.shard_offsets)
        sizes = tuple(int(s) for s in md.shard_sizes)
        if sizes != tuple(t.shape) or len(offsets) != len(gshape):
            raise StateError(f"ShardedTensor {key!r}: local shard {n} has metadata offsets {offsets} / sizes {sizes} "
                             f"but its tensor has shape {tuple(t.shape)} (global shape {gshape}); rebuild the "
                             "ShardedTensor so each shard's metadata matches its tensor")
        out.append((Box(offsets, sizes), t))
    return gshape, out


__all__ = ["is_sharded_tensor", "sharded_tensor_pieces"]
