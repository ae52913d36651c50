"""Flatten a user state (nested dicts of tensors, shards, DTensors, objects) into keyed items."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from ckpt._dtypes import dtype_name
from ckpt._sharded_tensor import is_sharded_tensor, sharded_tensor_pieces
from ckpt.errors import StateError
from ckpt.shards import Box, FlatShard, PerRank, Region, Shard, check_region, full_box


@dataclass(slots=True)
class TensorItem:
    """One local piece of one global tensor, as a rank declares it."""

    key: str
    local: torch.Tensor  # holds exactly region.numel elements, shaped like the region (flat: 1-D)
    dtype: str
    global_shape: tuple[int, ...]
    region: Region


@dataclass(slots=True)
class ObjectItem:
    """A non-tensor value; ``per_rank`` when every rank's value must be kept."""

    key: str
    value: Any
    per_rank: bool


Item = TensorItem | ObjectItem


def _is_dtensor(v: Any) -> bool:
    # Importing torch.distributed.tensor is slow (measured in docs/BENCHMARKS.md, section "Figures that
    # code comments used to quote"): if nobody imported it, v cannot be a DTensor.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(v, mod.DTensor)


def _is_tensorish(v: Any) -> bool:
    return isinstance(v, torch.Tensor | Shard | FlatShard)


def _contains_tensor(v: Any) -> bool:
    if _is_tensorish(v):
        return True
    if isinstance(v, dict):
        return any(_contains_tensor(x) for x in v.values())
    if isinstance(v, list | tuple):
        return any(_contains_tensor(x) for x in v)
    return False


def check_tensor(key: str, t: torch.Tensor) -> None:
    """Refuse tensors whose bytes cannot be read or written in place, naming the key and the fix."""
    if t.device.type == "meta":
        raise StateError(f"tensor {key!r} is on the meta device (no data): materialize it first, e.g. "
                         "model.to_empty(device=...) and initialize, before saving or loading")
    if t.layout != torch.strided or t.is_quantized or getattr(t, "is_nested", False):
        raise StateError(f"tensor {key!r}: {t.layout} / quantized / nested tensors are not supported; convert "
                         "it to a dense tensor (e.g. t.to_dense() or t.dequantize())")


def check_key(key: str) -> None:
    """A flattened key must be non-empty UTF-8 text without NUL (it becomes a manifest key, a
    safetensors entry name and, for zarr, a directory)."""
    if not key:
        raise StateError("an empty key ('') cannot be stored: give the value a name")
    if "\x00" in key:
        raise StateError(f"key {key!r} contains a NUL character; rename it")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise StateError(f"key {key!r} is not valid UTF-8 text (a lone surrogate?); rename it") from None


def _tensor_item(key: str, v: Any) -> TensorItem:
    region: Region
    if isinstance(v, Shard | FlatShard):
        local, gshape, region = v.local, v.global_shape, v.region
    else:
        local, gshape, region = v, tuple(v.shape), full_box(tuple(v.shape))
    check_tensor(key, local)
    check_region(region, gshape, key)
    if isinstance(region, Box) and tuple(local.shape) != region.lengths:
        raise StateError(f"tensor {key!r}: local shape {tuple(local.shape)} differs from the region lengths")
    return TensorItem(key, local, dtype_name(local.dtype, key=key), gshape, region)


def _sharded_tensor_items(key: str, v: Any) -> list[TensorItem]:
    gshape, pieces = sharded_tensor_pieces(v, key)
    dtype = dtype_name(v.dtype, key=key)
    out = []
    for box, local in pieces:
        check_tensor(key, local)
        check_region(box, gshape, key)
        out.append(TensorItem(key, local, dtype, gshape, box))
    return out


def _dtensor_items(key: str, v: Any) -> list[TensorItem]:
    from ckpt._dtensor import dtensor_pieces

    gshape = tuple(v.shape)
    dtype = dtype_name(v.dtype, key=key)
    out = []
    check_tensor(key, v.to_local())
    for box, local in dtensor_pieces(v, key):
        check_region(box, gshape, key)
        out.append(TensorItem(key, local, dtype, gshape, box))
    return out


def flatten_state(state: dict[str, Any]) -> list[Item]:
    """Flatten nested dicts (and lists that hold tensors) into items with ``.``-joined keys.

    Raises StateError for non-string keys or duplicate flattened keys.
    """
    if not isinstance(state, dict):
        raise StateError(f"state must be a dict, got {type(state).__name__}")
    items: list[Item] = []
    seen: set[str] = set()

    def add(item: Item, again: bool = False) -> None:
        check_key(item.key)
        if item.key in seen and not again:
            raise StateError(f"key {item.key!r} appears twice after flattening nested keys with '.'; rename one")
        seen.add(item.key)
        items.append(item)

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict) and (v or not prefix):  # an empty state holds nothing
            for k, x in v.items():
                if not isinstance(k, str | int):
                    raise StateError(f"key {k!r} under {prefix or '<root>'!r} is not a string")
                if k == "":
                    raise StateError(f"an empty key ('') under {prefix or '<root>'!r} cannot be stored: name it")
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, list | tuple) and _contains_tensor(v):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}" if prefix else str(i), x)
        elif _is_dtensor(v):  # one item per box of its local tensor (several for strided placements)
            for n, item in enumerate(_dtensor_items(prefix, v)):
                add(item, again=n > 0)
        elif is_sharded_tensor(v):  # one item per local shard (none on a rank holding no shard)
            for n, item in enumerate(_sharded_tensor_items(prefix, v)):
                add(item, again=n > 0)
        elif _is_tensorish(v):
            add(_tensor_item(prefix, v))
        elif isinstance(v, PerRank):
            add(ObjectItem(prefix, v.value, True))
        else:
            add(ObjectItem(prefix, v, False))

    walk("", state)
    return items


def rebuild_state(state: Any, values: dict[str, Any], prefix: str = "") -> Any:
    """Return a copy of ``state``'s structure with each leaf replaced by ``values[key]``."""
    if isinstance(state, dict) and state:
        return {k: rebuild_state(x, values, f"{prefix}.{k}" if prefix else str(k)) for k, x in state.items()}
    if isinstance(state, list | tuple) and _contains_tensor(state):
        out = [rebuild_state(x, values, f"{prefix}.{i}" if prefix else str(i)) for i, x in enumerate(state)]
        return type(state)(out) if isinstance(state, tuple) else out
    return values.get(prefix, state)

