"""The front of :func:`ckpt.transfer`: this rank's declared pieces, kept between calls over the same inputs.

Why: on GPUs a transfer of a few hundred tensors is bound by the host, and flattening the state
(checking every tensor and region) and declaring its pieces were ~2-3 ms of Python a call for ~170
tensors (docs/TRANSFER.md). A call whose ``src``, ``dst`` and ``rename`` are the objects of the
group's last call, holding the same leaves (the same objects, with the same shapes, dtypes,
devices, offsets and ranges), reuses that call's pieces, their wire form and fingerprints. Checking
that costs a walk over the dicts and a few attribute reads per leaf.

Never kept (flattened every call, as before): states with lists, Stateful values, DTensors,
ShardedTensors or other objects (their pieces come from their own metadata, which this walk does
not see). A ``rename`` dict is compared by value, a callable by identity (it must be pure).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt._state import TensorItem
from ckpt.shards import FlatShard, Shard

_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types: a subclass (DTensor, ...) is never kept
_PLAIN = (int, float, bool, str, bytes, type(None))  # values transfer ignores


@dataclass(slots=True)
class _Memo:
    src: Any
    dst: Any
    rename: Any  # the callable itself, or a copy of the dict
    sig: list[Any]
    held: list[Any]  # the objects whose ids ``sig`` holds (so no id is reused while kept)
    srcs: list[TensorItem]
    dsts: list[TensorItem]
    wire: tuple[list[Any], list[Any], bool] | None = None
    fps: dict[Any, str] = field(default_factory=dict)


_LAST: dict[Any, _Memo] = {}  # per group key: the last call's inputs and pieces


def _leaves(state: Any, out: list[Any], held: list[Any]) -> bool:
    """Append what identifies ``state``'s structure and pieces to ``out``; False when it holds
    something not kept (see the module)."""
    if state is None:
        out.append(None)
        return True
    if type(state) is not dict:
        return False
    stack = [state]
    while stack:
        d = stack.pop()
        held.append(d)
        out += (id(d), len(d))
        for k, v in d.items():
            t = type(v)
            out.append(k)
            if t is dict:
                stack.append(v)
            elif t is Shard or t is FlatShard:
                loc = v.local
                if type(loc) not in _TENSORS:
                    return False
                where = (v.offsets,) if t is Shard else (v.start, v.box)
                out += (id(v), id(loc), loc.shape, loc.dtype, loc.device, v.global_shape, *where)
                held += (v, loc)
            elif t in _TENSORS:
                out += (id(v), v.shape, v.dtype, v.device)
                held.append(v)
            elif t in _PLAIN:
                out.append(t)
            else:
                return False
    return True


def declared(key: Any, src: Any, dst: Any, rename: Any,
             declare: Callable[[Any, Any, Any], tuple[list[TensorItem], list[TensorItem]]]
             ) -> tuple[list[TensorItem], list[TensorItem]]:
    """``declare(src, dst, rename)``, or the group's last result when the inputs are the same."""
    sig: list[Any] = []
    held: list[Any] = []
    keep = (callable(rename) or rename is None or type(rename) is dict) and _leaves(src, sig, held) and \
        _leaves(dst, sig, held)
    memo = _LAST.get(key)
    if keep and memo is not None and memo.src is src and memo.dst is dst and memo.sig == sig and (
            memo.rename is rename if not isinstance(rename, dict) else memo.rename == rename):
        return memo.srcs, memo.dsts
    _LAST.pop(key, None)
    srcs, dsts = declare(src, dst, rename)
    if keep:
        _LAST[key] = _Memo(src, dst, dict(rename) if isinstance(rename, dict) else rename, sig, held, srcs, dsts)
    return srcs, dsts


def _memo_of(srcs: list[TensorItem], dsts: list[TensorItem]) -> _Memo | None:
    for m in _LAST.values():
        if m.srcs is srcs and m.dsts is dsts:
            return m
    return None


def wire_of(srcs: list[TensorItem], dsts: list[TensorItem],
            fn: Callable[[list[TensorItem]], list[Any]]) -> tuple[list[Any], list[Any], bool]:
    """The wire form of the pieces (``fn`` of each list) and whether one is on a GPU; kept with the
    pieces when they are kept."""
    memo = _memo_of(srcs, dsts)
    if memo is not None and memo.wire is not None:
        return memo.wire
    wire = (fn(srcs), fn(dsts), any(i.local.device.type == "cuda" for i in srcs + dsts))
    if memo is not None:
        memo.wire = wire
    return wire


def fingerprint_of(srcs: list[TensorItem], dsts: list[TensorItem], what: Any, fn: Callable[[], str]) -> str:
    """``fn()``, the fingerprint of the pieces under ``what`` (the options and place that shape the
    plan), kept with the pieces when they are kept."""
    memo = _memo_of(srcs, dsts)
    if memo is None:
        return fn()
    if what not in memo.fps:
        memo.fps[what] = fn()
    return memo.fps[what]


def forget(key: Any) -> None:
    """Drop what is kept for group ``key`` (its tensors are referenced until then)."""
    _LAST.pop(key, None)


__all__ = ["declared", "wire_of", "fingerprint_of", "forget"]
