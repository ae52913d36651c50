"""The front of :func:`ckpt.transfer`: this rank's declared pieces, kept between calls over the same inputs.

Why: on GPUs a transfer of a few hundred tensors is bound by the host, and flattening the state
(checking every tensor and region) and declaring its pieces were ~2-3 ms of Python a call for ~170
tensors (docs/TRANSFER.md). A call whose ``src``, ``dst`` and ``rename`` are the objects of the
group's last call, holding the same leaves (the same objects, with the same shapes, dtypes,
devices, offsets, ranges, addresses and strides), reuses that call's pieces, their wire form,
fingerprints and the signature of their tensors (:func:`signature_of`). Checking that costs, per
dict, a comparison of its keys and values (by identity) with the last call's, per piece its
geometry, and per tensor its address and torch's own C++ check of its metadata (:func:`_guard`; in
Python where this torch lacks it), each list made in C (``map``): for the ~340 leaves of the MoE in
docs/BENCHMARKS.md, 0.16 ms in a loop on a CPU of this project's CI (0.6 ms as a walk in Python),
0.55-0.6 ms inside calls, where every tensor is read cold after the call's other work; before, a
replay also took the signature of the same tensors again (0.2-0.3 ms on a 4 x H100 host).

Never kept (flattened every call, as before): states with lists, Stateful values, DTensors,
ShardedTensors or other objects (their pieces come from their own metadata, which this walk does
not see). A ``rename`` dict is compared by value, a callable by identity (it must be pure).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter, is_, methodcaller
from typing import Any

import torch

from ckpt._state import TensorItem
from ckpt.shards import FlatShard, Shard

_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types: a subclass (DTensor, ...) is never kept
_PLAIN = (int, float, bool, str, bytes, type(None))  # values transfer ignores


_GEOMETRY = attrgetter("global_shape", "offsets")
_FLAT_GEOMETRY = attrgetter("global_shape", "start", "box")
_LOCAL = attrgetter("local")
_META = attrgetter("shape", "dtype", "device")
_PTR = methodcaller("data_ptr")
_STRIDE = methodcaller("stride")


GUARD = True  # use torch's own metadata check where this torch has it (tests turn it off to check the other way)


def _guard(tensors: list[Any]) -> Any:
    """torch's C++ check that tensors still have the dtype, device, sizes, strides (and autograd and
    dispatch state) they have now (the guard ``torch.compile`` puts on its inputs), or None where this
    torch has none of the shape relied on (then the metadata is compared in Python). Why: reading
    those in Python for ~340 tensors took ~0.3 ms of a replayed call's ~2 ms of host time on a
    4 x H100 host (24 GB MoE: ~1,000 tensors, 2.2 ms); the guard takes ~0.03 ms."""
    if not GUARD:
        return None
    try:
        from torch._C._dynamo.guards import TensorGuards

        # (one list of sizes and one of strides per tensor, as torch.compile passes them; the stub says otherwise)
        guard = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],  # type: ignore[misc]
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])  # type: ignore[misc]
        return guard if guard.check(*tensors) else None
    except Exception:  # noqa: BLE001 - another torch: compared in Python
        return None


@dataclass(slots=True)
class _Leaves:
    """What a kept call's inputs held, to compare a later call's with (:meth:`same`): every dict (its
    keys, and its values by identity), the geometry of every Shard and FlatShard and the identity of
    its tensor, and where every tensor is (shape, dtype, device, address, strides)."""

    dicts: list[tuple[dict[Any, Any], list[Any], list[Any]]] = field(default_factory=list)
    shards: list[Any] = field(default_factory=list)
    flats: list[Any] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)  # every leaf's tensor (a Shard's local too), in order
    geometry: list[Any] = field(default_factory=list)
    flat_geometry: list[Any] = field(default_factory=list)
    locals: list[Any] = field(default_factory=list)  # the tensors of ``shards`` then ``flats``
    meta: list[Any] = field(default_factory=list)
    ptrs: list[int] = field(default_factory=list)
    strides: list[Any] = field(default_factory=list)
    guard: Any = None  # torch's own check of the tensors' metadata (_guard), or None: ``meta`` and ``strides``

    def seal(self) -> _Leaves | None:
        """Take the geometry and places as they are now; None where a tensor has no address or
        strides to take (a sparse tensor: such inputs are not kept)."""
        try:
            self._take()
        except Exception:  # noqa: BLE001 - not kept: flattened every call, as before
            return None
        return self

    def _take(self) -> None:
        self.geometry = list(map(_GEOMETRY, self.shards))
        self.flat_geometry = list(map(_FLAT_GEOMETRY, self.flats))
        self.locals = list(map(_LOCAL, self.shards + self.flats))
        self.meta = list(map(_META, self.tensors))
        self.ptrs = list(map(_PTR, self.tensors))
        self.strides = list(map(_STRIDE, self.tensors))
        self.guard = _guard(self.tensors)

    def same(self) -> bool:
        """Whether the inputs hold what they held when sealed (the dicts are the same objects)."""
        try:
            return self._same()
        except Exception:  # noqa: BLE001 - e.g. an attribute of a piece deleted: not the same, declared anew
            return False

    def _same(self) -> bool:
        for d, keys, values in self.dicts:
            if len(d) != len(keys) or not all(map(is_, d.values(), values)) or list(d) != keys:
                return False
        # (identity before equality: a tensor compared with == would compare its elements)
        if not (all(map(is_, map(_LOCAL, self.shards + self.flats), self.locals))
                and list(map(_GEOMETRY, self.shards)) == self.geometry
                and list(map(_FLAT_GEOMETRY, self.flats)) == self.flat_geometry
                and list(map(_PTR, self.tensors)) == self.ptrs):
            return False
        # (the leaves are the sealed objects: the dicts hold the same values, the pieces the same tensors)
        if self.guard is not None:
            return bool(self.guard.check(*self.tensors))
        return list(map(_STRIDE, self.tensors)) == self.strides and list(map(_META, self.tensors)) == self.meta


@dataclass(slots=True)
class _Memo:
    src: Any
    dst: Any
    rename: Any  # the callable itself, or a copy of the dict
    leaves: _Leaves  # (it holds the dicts, pieces and tensors: no id is reused while kept)
    srcs: list[TensorItem]
    dsts: list[TensorItem]
    derived: dict[Any, Any] = field(default_factory=dict)  # kept()'s: wire form, fingerprints, signature...


_LAST: dict[Any, _Memo] = {}  # per group key: the last call's inputs and pieces


def _leaves(state: Any, out: _Leaves) -> bool:
    """Add what ``state`` holds to ``out``; False when it holds something not kept (see the module)."""
    if state is None:
        return True
    if type(state) is not dict:
        return False
    stack = [state]
    while stack:
        d = stack.pop()
        out.dicts.append((d, list(d), list(d.values())))
        for v in d.values():
            t = type(v)
            if t is dict:
                stack.append(v)
            elif t is Shard or t is FlatShard:
                if type(v.local) not in _TENSORS:
                    return False
                (out.shards if t is Shard else out.flats).append(v)
                out.tensors.append(v.local)
            elif t in _TENSORS:
                out.tensors.append(v)
            elif t not in _PLAIN:
                return False
    return True


def declared(key: Any, src: Any, dst: Any, rename: Any,
             declare: Callable[[Any, Any, Any], tuple[list[TensorItem], list[TensorItem]]]
             ) -> tuple[list[TensorItem], list[TensorItem]]:
    """``declare(src, dst, rename)``, or the group's last result when the inputs are the same."""
    memo = _LAST.pop(key, None)
    if memo is not None and memo.src is src and memo.dst is dst and (
            memo.rename is rename if not isinstance(rename, dict) else memo.rename == rename) and memo.leaves.same():
        _LAST[key] = memo
        return memo.srcs, memo.dsts
    leaves = _Leaves()
    keep = (callable(rename) or rename is None or type(rename) is dict) and _leaves(src, leaves) and \
        _leaves(dst, leaves)
    srcs, dsts = declare(src, dst, rename)
    # (sealed after declaring: a declaration that fails leaves nothing kept)
    sealed = leaves.seal() if keep else None
    if sealed is not None:
        _LAST[key] = _Memo(src, dst, dict(rename) if isinstance(rename, dict) else rename, sealed, srcs, dsts)
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
    out: tuple[list[Any], list[Any], bool] = kept(srcs, dsts, "wire", lambda: (
        fn(srcs), fn(dsts), any(i.local.device.type == "cuda" for i in srcs + dsts)))
    return out


def kept(srcs: list[TensorItem], dsts: list[TensorItem], what: Any, fn: Callable[[], Any]) -> Any:
    """``fn()``, something derived from the pieces alone (named ``what``), kept with the pieces when
    they are kept: computed once per kept declaration, the same object on every call that reuses it."""
    memo = _memo_of(srcs, dsts)
    if memo is None:
        return fn()
    if what not in memo.derived:
        memo.derived[what] = fn()
    return memo.derived[what]


def fingerprint_of(srcs: list[TensorItem], dsts: list[TensorItem], what: Any, fn: Callable[[], str]) -> str:
    """``fn()``, the fingerprint of the pieces under ``what`` (the options and place that shape the
    plan), kept with the pieces when they are kept."""
    out: str = kept(srcs, dsts, ("fingerprint", what), fn)
    return out


def signature_of(srcs: list[TensorItem], dsts: list[TensorItem], fn: Callable[[], Any]) -> Any:
    """``fn()``, the signature of the pieces' tensors (where their bytes are,
    :func:`ckpt._transfer_net.signature`), kept with the pieces when they are kept: the same object
    on every call that reuses them, which a recorded run compares by identity first. Valid while they
    are kept: the check of the inputs (:meth:`_Leaves.same`) compares every tensor's address,
    strides, shape, dtype and device, and the pieces' tensors are those or views of them that keep
    their storage alive (no other can come to live at those addresses)."""
    return kept(srcs, dsts, "signature", fn)


def strided(srcs: list[TensorItem], dsts: list[TensorItem]) -> list[int]:
    """The destination pieces whose tensors are not contiguous (an in-place transfer stages them), kept
    with the pieces when they are kept (the check of the inputs compares every tensor's strides)."""
    out: list[int] = kept(srcs, dsts, "strided", lambda: [j for j, i in enumerate(dsts)
                                                         if not i.local.is_contiguous()])
    return out


def forget(key: Any) -> None:
    """Drop what is kept for group ``key`` (its tensors are referenced until then)."""
    _LAST.pop(key, None)


__all__ = ["declared", "wire_of", "kept", "fingerprint_of", "signature_of", "strided", "forget"]
