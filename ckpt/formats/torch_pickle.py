"""Read pickles from other tools' checkpoints without running code from them.

DCP's ``.metadata``, DeepSpeed's ``*.pt`` and Megatron's ``common.pt`` are pickles; ``pickle.load``
of a hostile one runs whatever its ``__reduce__`` names (``os.system``...). Here every global a
pickle names goes through :class:`_Unpickler.find_class`, which returns only what an explicit
allowlist maps that exact name to, and raises :class:`~ckpt.errors.IntegrityError` naming the file
and the global for anything else, before anything is called. Tensors are never rebuilt by torch's
functions: ``torch._utils._rebuild_tensor_v2`` maps to a function that returns a :class:`TensorRef`
(dtype, shape, strides, and the absolute byte offset of the storage in the file), so a caller reads
exactly the bytes it needs (or :func:`materialize` builds the tensor from them).

``torch.save`` files (zip, the default format since torch 1.6) are parsed here too, from a byte
range of any file (DCP packs many into one ``.distcp`` file): only the zip directory, ``data.pkl``
and ``byteorder`` are read. The allowlists are documented in docs/RELIABILITY.md.

Every read runs under a :class:`~ckpt.formats.budget.Budget`: the pickle's and the zip directory's
sizes are capped before they are read, every storage a pickle names must fit its zip record, every
tensor must lie inside its storage (offset, sizes and strides non-negative, its extent within the
storage's elements), and the unpickled value must be a finite tree of bounded size and depth
(:func:`ckpt.formats.budget.check`: no cycles, no exponential sharing), so that no later walker
over it can hang. Over budget or malformed: :class:`~ckpt.errors.ForeignFormatError` (an
IntegrityError) naming the file and field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib
import io
import math
import pathlib
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.errors import ForeignFormatError, IntegrityError
from ckpt.formats import budget as _budget
from ckpt.formats.budget import Budget
from ckpt.formats.torch_zip import HEAD_BYTES, QUICK_TAIL, _directory, _entry, _scan_head  # noqa: F401 - API

Read = Callable[[int, int], bytes]

_DTYPE_NAMES = [n for n in ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
                            "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
                            "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                            "float4_e2m1fn_x2",
                            "qint8", "quint8", "qint32", "half", "float", "double", "long", "int", "short",
                            "cfloat", "cdouble", "chalf")
                if isinstance(getattr(torch, n, None), torch.dtype)]

# Legacy typed-storage class names torch.save writes into persistent ids, and their dtypes.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}

# DCP's metadata classes (torch.distributed.checkpoint): data-only dataclasses and one enum.
DCP_GLOBALS = (
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.filesystem._StoragePrefix",
    "torch.distributed.checkpoint.planner.WriteItemType",
    # Megatron-Core (0.16+) keeps every rank's local save plan in the metadata (``all_local_plans``):
    # frozen data-only dataclasses, rebuilt by NEWOBJ + BUILD (no __init__, no code of theirs runs)
    "torch.distributed.checkpoint.planner.SavePlan",
    "torch.distributed.checkpoint.planner.WriteItem",
    "torch.distributed.checkpoint.planner.TensorWriteData",
    "torch.distributed.checkpoint.planner.BytesIOWriteData",
)


class _Tampering(Exception):
    """A pickle's BUILD aimed at something the allowlist handed it (raised inside the unpickler)."""


class _Sealed:
    """What the allowlist hands a pickle in place of ckpt's own functions and markers.

    BUILD (fill in the object under it) runs no code, but aimed at a shared global it would change
    that object for the whole process: a later read of a good file could decode float32 as float64.
    A sealed object has no ``__dict__``, refuses ``setattr``, and its ``__setstate__`` (which BUILD
    calls first) refuses the change.
    """

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise _Tampering(repr(self))

    def __setattr__(self, name: str, value: Any) -> None:
        raise _Tampering(repr(self))

    def __delattr__(self, name: str) -> None:
        raise _Tampering(repr(self))


class _Fn(_Sealed):
    __slots__ = ("fn",)
    fn: Callable[..., Any]

    def __init__(self, fn: Callable[..., Any]) -> None:
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<allowed function {self.fn.__name__}>"


class _StorageType(_Sealed):
    __slots__ = ("dtype",)
    dtype: torch.dtype

    def __init__(self, dtype: torch.dtype) -> None:
        object.__setattr__(self, "dtype", dtype)

    def __repr__(self) -> str:
        return f"<storage type {self.dtype}>"


class _Marker(_Sealed):
    __slots__ = ()

    def __repr__(self) -> str:
        return "<torch.Tensor marker>"


class _Unbuildable:
    """ckpt's own records of a file's bytes: BUILD (which writes an object's ``__dict__`` directly,
    frozen dataclass or not) would let a pickle move a checked byte range anywhere, so it calls
    ``__setstate__`` here, which refuses (they are never copied or pickled; ``dataclasses.replace``
    works)."""

    __ckpt_leaf__ = True  # for budget.check: a record of a few ints, not a container

    def __setstate__(self, state: Any) -> None:
        raise _Tampering(f"a {type(self).__name__}")


@dataclass(frozen=True)
class _StorageRef(_Unbuildable):
    key: str
    dtype: torch.dtype
    data_offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class TensorRef(_Unbuildable):
    """A tensor inside a torch.save file, not read: where its elements are."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    data_offset: int  # absolute byte offset of the storage's first byte in the file
    storage_nbytes: int
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        """Row-major with no gaps (ignoring strides of size-1 dimensions)."""
        expected = 1
        for size, st in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and st != expected:
                return False
            expected *= size
        return True

    def byte_range(self) -> tuple[int, int]:
        """``(absolute offset, nbytes)`` of the elements (contiguous tensors only)."""
        if not self.contiguous:
            raise IntegrityError(f"tensor {list(self.shape)} stride {list(self.stride)} is not contiguous")
        size = self.dtype.itemsize
        return self.data_offset + self.storage_offset * size, self.numel * size


class _SealedClass(type):
    """Metaclass of the stand-in classes: setting an attribute on the class itself is refused."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise _Tampering(repr(cls))

    def __delattr__(cls, name: str) -> None:
        raise _Tampering(repr(cls))


class Stub(metaclass=_SealedClass):
    """Stands in for a class a checkpoint pickles but we do not import (e.g. DeepSpeed's enums and
    loss scaler): records the constructor arguments and state, runs nothing."""

    qualname = "?"
    args: tuple[Any, ...] = ()  # class defaults: NEWOBJ makes instances without calling __init__
    kwargs: dict[str, Any] = {}  # noqa: RUF012 - never mutated
    state: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Stub({self.qualname}, args={self.args!r}, state={self.state!r})"


def _stub(name: str) -> type:
    return _SealedClass("Stub", (Stub,), {"qualname": name})


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    # protocol-2 pickles (torch.save's default) spell bytes as _codecs.encode(text, "latin1")
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _bytearray(data: Any = b"", encoding: str = "latin1") -> bytearray:
    # bytearray(n) would allocate n bytes for a number the file chose: only build from given bytes
    if isinstance(data, str):
        return bytearray(_latin1(data, encoding))
    if isinstance(data, (bytes, bytearray)):
        return bytearray(data)
    raise pickle.UnpicklingError("bytearray from something other than bytes")


def _layout(name: str) -> torch.layout:
    # torch pickles a layout as torch.serialization._get_layout("torch.strided"); only names of layouts
    layouts = {f"torch.{n}": getattr(torch, n) for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc",
                                                          "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged")
               if isinstance(getattr(torch, n, None), torch.layout)}
    if name not in layouts:
        raise pickle.UnpicklingError(f"unknown layout {name!r}")
    return layouts[name]


_MAX_PATH = 65536


def _path(flavour: type[pathlib.PurePath]) -> _Fn:
    # DCP's StorageMeta.checkpoint_id may be a pathlib path, pickled as PosixPath("/", "tmp", "x"):
    # kept as its text, joined by the pure (string-only) class of the same flavour
    def join(*parts: str) -> str:
        if not all(isinstance(p, str) for p in parts):
            raise pickle.UnpicklingError("a path made of non-strings")
        # the result is a new string a pickle can join again: capped, or 60 joins make 2**60 characters
        if sum(len(p) for p in parts) > _MAX_PATH:
            raise ForeignFormatError(f"a pathlib path longer than {_MAX_PATH} characters, over ckpt's budget "
                                     "(a decompression bomb: each join can double it)")
        return str(flavour(*parts))

    return _Fn(join)


def _index(v: Any, field: str) -> int:
    """A non-negative int64 (not a bool) for ``field`` of a tensor record (ForeignFormatError)."""
    return _budget.integer(v, "a tensor record", field)


def _dims(v: Any, field: str) -> tuple[int, ...]:
    # sizes: the shared shape check, at most 64 int64 dimensions whose product fits an int64, as
    # torch.load requires (an empty dimension beside a 2**70 one reached torch as a raw TypeError later);
    # strides: as many int64 values, with no product rule (a size-1 dimension may have any stride)
    if field == "size":
        return _budget.dims(v, "a tensor record", field)
    if not isinstance(v, (tuple, list)) or len(v) > _budget.MAX_DIMS:
        raise pickle.UnpicklingError(f"tensor {field} is not a sequence of at most {_budget.MAX_DIMS} integers")
    return tuple(_index(x, field) for x in v)


def _rebuild_tensor(storage: _StorageRef, storage_offset: int, size: Any, stride: Any, requires_grad: bool = False,
                    backward_hooks: Any = None, metadata: Any = None) -> TensorRef:
    # every tensor is checked against its own storage record: offset, sizes and strides non-negative,
    # and its extent (the last element it can address) inside the storage, so no tensor is read from
    # a neighbouring record's bytes (torch.load refuses such a file too)
    if not isinstance(storage, _StorageRef):
        raise pickle.UnpicklingError("a tensor whose storage is not one of the file's records")
    shape, strides, offset = _dims(size, "size"), _dims(stride, "stride"), _index(storage_offset, "storage offset")
    if len(strides) != len(shape):
        raise pickle.UnpicklingError(f"tensor size {list(shape)} and stride {list(strides)} differ in length")
    numel = storage.nbytes // storage.dtype.itemsize
    end = offset if 0 in shape else offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    if end > numel:
        raise ForeignFormatError(f"tensor size {list(shape)} stride {list(strides)} at storage offset {offset} "
                                 f"reaches element {end}, past its storage data/{storage.key} of {numel} elements")
    return TensorRef(storage.dtype, shape, strides, offset, storage.data_offset, storage.nbytes, bool(requires_grad))


def _rebuild_tensor_v3(storage: _StorageRef, storage_offset: int, size: Any, stride: Any, requires_grad: bool = False,
                       backward_hooks: Any = None, dtype: Any = None, metadata: Any = None) -> TensorRef:
    # torch.save writes tensors of dtypes with no legacy storage class (float8, uint16/32/64,
    # complex32) over an untyped byte storage and names the dtype here; then the same checks as v2
    if not isinstance(storage, _StorageRef) or storage.dtype != torch.uint8 or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("_rebuild_tensor_v3 over something other than a byte storage and a dtype")
    if storage.nbytes % dtype.itemsize:
        raise ForeignFormatError(f"storage data/{storage.key} of {storage.nbytes} bytes does not hold whole {dtype} "
                                 "elements")
    return _rebuild_tensor(dataclasses.replace(storage, dtype=dtype), storage_offset, size, stride, requires_grad)


def _rebuild_parameter(data: TensorRef, requires_grad: bool = False, backward_hooks: Any = None,
                       state: Any = None) -> TensorRef:
    return data


_TENSOR_TYPE = _Marker()  # what "torch.Tensor" maps to: only a marker for _rebuild_from_type_v2
_REBUILD_TENSOR, _REBUILD_PARAMETER = _Fn(_rebuild_tensor), _Fn(_rebuild_parameter)


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any = None) -> TensorRef:
    # torch pickles some tensors as _rebuild_from_type_v2(_rebuild_tensor_v2, torch.Tensor, args, state);
    # only plain tensors rebuilt by our own functions are accepted
    if new_type is not _TENSOR_TYPE or (func is not _REBUILD_TENSOR and func is not _REBUILD_PARAMETER):
        raise pickle.UnpicklingError("a tensor subclass or an unexpected rebuild function")
    return func(*args)  # type: ignore[no-any-return]


def _base_globals() -> dict[str, Any]:
    allowed: dict[str, Any] = {
        "collections.OrderedDict": OrderedDict,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.slice": slice,
        "builtins.complex": complex, "builtins.bytearray": _Fn(_bytearray),
        "_codecs.encode": _Fn(_latin1),
        "torch.Size": torch.Size,
        "torch.device": torch.device,
        "torch.strided": torch.strided,
        "torch.serialization._get_layout": _Fn(_layout),
        "pathlib.PosixPath": _path(pathlib.PurePosixPath), "pathlib.PurePosixPath": _path(pathlib.PurePosixPath),
        "pathlib.WindowsPath": _path(pathlib.PureWindowsPath),
        "pathlib.PureWindowsPath": _path(pathlib.PureWindowsPath),
        "torch.contiguous_format": torch.contiguous_format,
        "torch.channels_last": torch.channels_last,
        "torch.preserve_format": torch.preserve_format,
        "torch._utils._rebuild_tensor": _REBUILD_TENSOR,
        "torch._utils._rebuild_tensor_v2": _REBUILD_TENSOR,
        "torch._utils._rebuild_tensor_v3": _Fn(_rebuild_tensor_v3),
        "torch._utils._rebuild_parameter": _REBUILD_PARAMETER,
        "torch._utils._rebuild_parameter_with_state": _REBUILD_PARAMETER,
        "torch.Tensor": _TENSOR_TYPE,
        "torch._tensor._rebuild_from_type_v2": _Fn(_rebuild_from_type),
    }
    for n in _DTYPE_NAMES:
        allowed[f"torch.{n}"] = getattr(torch, n)
    for n, dt in _STORAGE_DTYPES.items():
        allowed[f"torch.{n}"] = _StorageType(dt)
    allowed["torch.UntypedStorage"] = _StorageType(torch.uint8)
    allowed["torch.storage.UntypedStorage"] = _StorageType(torch.uint8)  # what _rebuild_tensor_v3's items name
    return allowed


def _resolve(name: str) -> Any:
    """The class ``name`` names, or a stand-in when this torch does not have it (an older version)."""
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return _stub(name)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, what: str, allowed: _Allowlist,
                 storages: dict[str, tuple[int, int | None]] | None = None, partial: bool = False, limit: int = 0):
        super().__init__(io.BytesIO(data))
        self.what, self.allowed, self.storages, self.partial = what, allowed, storages, partial
        self.limit = limit  # the item's end: no storage may reach past it

    def find_class(self, module: str, name: str) -> Any:
        # protocol-2 pickles (torch.save's default) use Python 2 module names for builtins
        module = {"__builtin__": "builtins", "copy_reg": "copyreg"}.get(module, module)
        full = f"{module}.{name}"
        if full not in self.allowed:
            raise IntegrityError(f"{self.what}: refusing to unpickle global {full!r}: it is not on ckpt's allowlist "
                                 "of checkpoint classes (nothing from the file was run); see docs/RELIABILITY.md")
        return self.allowed[full]

    def persistent_load(self, pid: Any) -> Any:
        if self.storages is None or not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, stype, key, _location, _numel = pid[:5]
        if not isinstance(stype, _StorageType):
            raise pickle.UnpicklingError(f"storage type {stype!r}")
        if str(key) not in self.storages:
            if self.partial:
                raise _MissingStorage
            raise pickle.UnpicklingError(f"storage record data/{key} is missing from the archive")
        offset, size = self.storages[str(key)]
        if isinstance(_numel, bool) or not isinstance(_numel, int) or _numel < 0:
            raise pickle.UnpicklingError(f"storage data/{key}: element count {_numel!r}")
        nbytes = _numel * stype.dtype.itemsize
        # exactly its record's size, as torch.load requires (torch.save writes whole storages)
        if (size is not None and size != nbytes) or offset + nbytes > self.limit:
            raise ForeignFormatError(f"{self.what}: storage data/{key} claims {_numel} elements ({nbytes} bytes) at "
                                     f"{offset}, but its zip record holds {size} bytes (hostile or damaged)")
        return _StorageRef(str(key), stype.dtype, offset, nbytes)


class _Allowlist(dict[str, Any]):
    """Global name -> what the unpickler returns for it; ``exposed``: the values a BUILD could change
    for the whole process (computed once per allowlist)."""

    exposed: tuple[Any, ...] = ()


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: builtin and C types refuse setattr


def _exposed(values: Iterable[Any]) -> tuple[Any, ...]:
    """Allowed values that BUILD could change: other libraries' Python classes (DCP's dataclasses
    and enums) and their enum members; ckpt's own functions and markers are sealed instead."""
    out: dict[int, Any] = {}
    for v in values:
        if isinstance(v, (_Sealed, _SealedClass)):
            continue
        if isinstance(v, type):
            if v.__flags__ & _IMMUTABLE_TYPE:
                continue
            out[id(v)] = v
            if issubclass(v, enum.Enum):
                out.update((id(m), m) for m in v.__members__.values())
        elif hasattr(v, "__dict__") or hasattr(v, "__defaults__"):
            out[id(v)] = v
    return tuple(out.values())


def _snapshot(obj: Any) -> tuple[Any, ...]:
    if isinstance(obj, type):
        return dict(vars(obj)), obj.__bases__, obj.__name__, obj.__qualname__
    d = getattr(obj, "__dict__", None)
    return (obj.__class__, dict(d) if d is not None else None, getattr(obj, "__defaults__", None),
            getattr(obj, "__kwdefaults__", None))


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys() or any(x[k] is not y[k] for k in x):
                return False
        elif x is not y:
            return False
    return True


def _restore(obj: Any, snap: tuple[Any, ...]) -> None:
    """Put back what a refused pickle changed (best effort; the read fails either way)."""
    if isinstance(obj, type):
        saved = snap[0]
        for k in set(vars(obj)) - set(saved):
            with contextlib.suppress(AttributeError, TypeError):
                delattr(obj, k)
        for k, v in saved.items():
            if vars(obj).get(k) is not v:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(obj, k, v)
        for attr, v in zip(("__bases__", "__name__", "__qualname__"), snap[1:], strict=True):
            if getattr(obj, attr) is not v:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(obj, attr, v)
        return
    cls, d, defaults, kwdefaults = snap
    if obj.__class__ is not cls:
        with contextlib.suppress(AttributeError, TypeError):
            obj.__class__ = cls
    if d is not None:
        obj.__dict__.clear()
        obj.__dict__.update(d)
    if hasattr(obj, "__defaults__"):
        obj.__defaults__, obj.__kwdefaults__ = defaults, kwdefaults


# Reads whose allowlist exposes other libraries' classes take turns, so that one read's check does
# not see another's (refused) change; reads of plain torch.save items (no such classes) never wait.
_GUARD = threading.Lock()


@functools.lru_cache(maxsize=64)
def _allowed_cached(extra: tuple[str, ...], stubs: tuple[str, ...]) -> _Allowlist:
    allowed = _Allowlist(_base_globals())
    for name in extra:
        allowed[name] = _resolve(name)
    for name in stubs:
        allowed[name] = _stub(name)
    allowed.exposed = _exposed(allowed.values())
    return allowed


def _allowed(extra: Iterable[str], stubs: Iterable[str]) -> _Allowlist:
    """The allowlist for one read (built once per (extra, stubs) and shared: nothing mutates it)."""
    return _allowed_cached(tuple(extra), tuple(stubs))


def _unpickle(data: bytes, what: str, allowed: _Allowlist,
              storages: dict[str, tuple[int, int | None]] | None, partial: bool = False, limit: int = 0,
              budget: Budget | None = None) -> Any:
    """Run the restricted unpickler; with exposed classes in the allowlist, check afterwards that
    none changed (BUILD on a class or enum member sets attributes without running code) and undo
    and refuse if one did. The value must then pass :func:`ckpt.formats.budget.check` (a finite
    tree within ``budget``), so nothing that walks it later can hang."""
    b = _budget.resolve(budget)
    b.check_bytes(len(data), what, "the pickle")
    obj = _run(data, what, allowed, storages, partial, limit)
    _budget.check(obj, what, len(data), b)
    return obj


def _run(data: bytes, what: str, allowed: _Allowlist, storages: dict[str, tuple[int, int | None]] | None,
         partial: bool, limit: int) -> Any:
    guard = contextlib.nullcontext() if not allowed.exposed else _GUARD
    try:
        with guard:
            before = [_snapshot(v) for v in allowed.exposed]
            try:
                return _Unpickler(data, what, allowed, storages, partial, limit).load()
            finally:
                changed = [(v, snap) for v, snap in zip(allowed.exposed, before, strict=True)
                           if not _same(snap, _snapshot(v))]
                for v, snap in changed:
                    _restore(v, snap)
                if changed:
                    raise _Tampering(", ".join(repr(v) for v, _ in changed))
    except _Tampering as e:
        raise IntegrityError(f"{what}: the pickle tries to change {e}, allowed by ckpt's allowlist only to be "
                             "built from (BUILD on a global); refused and undone, nothing from the file was run"
                             ) from None
    except ForeignFormatError as e:
        raise ForeignFormatError(str(e) if str(e).startswith(what) else f"{what}: {e}") from None
    except (IntegrityError, _MissingStorage):
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle is the file's problem, typed
        raise IntegrityError(f"{what}: cannot read the pickle ({type(e).__name__}: {e}); the file is damaged "
                             "or not what it claims to be") from None


def loads(data: bytes, *, what: str, extra: Iterable[str] = (), stubs: Iterable[str] = (),
          budget: Budget | None = None) -> Any:
    """Unpickle ``data`` allowing only plain data, torch's dtypes/sizes and the globals in ``extra``
    (fully qualified names, imported) and ``stubs`` (names replaced by :class:`Stub` records), under
    ``budget`` (default: :meth:`Budget.default`).

    Raises IntegrityError naming ``what`` and the refused global, or on a malformed pickle;
    ForeignFormatError when the value is over budget (cyclic, too deep, a decompression bomb).
    """
    return _unpickle(data, what, _allowed(extra, stubs), None, budget=budget)


# ---- torch.save zip files (the container: ckpt.formats.torch_zip) --------------------------------


@dataclass
class TorchZip:
    """A torch.save file read without running it: ``obj`` with tensors as :class:`TensorRef`."""

    obj: Any
    what: str

    def tensors(self) -> list[tuple[tuple[Any, ...], TensorRef]]:
        """Every TensorRef with its path (dict keys / sequence indices) from the root object."""
        return list(_budget.walk(self.obj, self.what, kind=TensorRef))


class _MissingStorage(Exception):
    """The pickle names a storage record the quick scan did not reach: read the zip directory."""


def load_torch(read: Read, start: int, length: int, *, what: str, extra: Iterable[str] = (),
               stubs: Iterable[str] = (), budget: Budget | None = None) -> TorchZip:
    """Index the torch.save file in bytes ``[start, start + length)`` (read through ``read(offset,
    nbytes)``) and unpickle its object with the allowlist (see :func:`loads`) under ``budget``;
    tensors come back as :class:`TensorRef`. Reads the item's first and last 4 KiB (local headers and
    zip directory of a small item), or, when the records it needs are not all there, the whole zip
    directory and each record's local header; then ``data.pkl`` and ``byteorder``. Every record's
    size comes from the zip directory: a storage the pickle claims larger than its record is refused.

    Raises IntegrityError: not a zip, truncated, a compressed entry, big-endian data, a global
    outside the allowlist, or a malformed pickle; ForeignFormatError (a subclass): over budget, or
    a tensor or storage that reaches past its own record.
    """
    allowed = _allowed(extra, stubs)
    b = _budget.resolve(budget)
    head = _scan_head(read, start, length)
    if head:
        directory = _directory(read, start, length, what, b, quick=True)
        if directory is not None:
            quick = {n: _entry(read, start, length, rec, n, what, head) for n, rec in directory.items()}
            found = {n: r for n, r in quick.items() if r is not None}
            try:
                return _from_records(read, found, what, allowed, partial=True, limit=start + length, budget=b)
            except _MissingStorage:
                pass
    directory = _directory(read, start, length, what, b)
    assert directory is not None
    records = {name: _entry(read, start, length, rec, name, what) for name, rec in directory.items()}
    return _from_records(read, {n: r for n, r in records.items() if r is not None}, what, allowed, partial=False,
                         limit=start + length, budget=b)


def _from_records(read: Read, records: dict[str, tuple[int, int]], what: str, allowed: _Allowlist,
                  *, partial: bool, limit: int, budget: Budget) -> TorchZip:
    pkl = [n for n in records if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        if partial:
            raise _MissingStorage
        raise IntegrityError(f"{what}: no data.pkl record in the torch.save archive")
    prefix = pkl[0][: -len("data.pkl")]
    if f"{prefix}byteorder" in records:
        off, size = records[f"{prefix}byteorder"]
        if size > 16 or read(off, size).strip() not in (b"little", b""):
            raise IntegrityError(f"{what}: big-endian torch.save data is not supported")
    storages: dict[str, tuple[int, int | None]] = {
        name[len(prefix) + 5:]: rec for name, rec in records.items() if name.startswith(f"{prefix}data/")}
    off, size = records[pkl[0]]
    budget.check_bytes(size, what, "data.pkl")
    obj = _unpickle(read(off, size), what, allowed, storages, partial, limit, budget)
    return TorchZip(obj, what)


def materialize(ref: TensorRef, read: Read) -> torch.Tensor:
    """The tensor ``ref`` describes, read from its file (any strides within its storage)."""
    if ref.numel == 0:
        return torch.empty(ref.shape, dtype=ref.dtype)
    size = ref.dtype.itemsize
    span = ref.storage_offset + 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))
    if span * size > ref.storage_nbytes or min(ref.stride, default=0) < 0:
        raise IntegrityError(f"tensor {list(ref.shape)} reaches past its storage of {ref.storage_nbytes} bytes")
    raw = bytearray(read(ref.data_offset, span * size))
    flat = torch.frombuffer(raw, dtype=ref.dtype) if raw else torch.empty(0, dtype=ref.dtype)
    return flat.as_strided(ref.shape, ref.stride, ref.storage_offset).clone()


__all__ = ["Read", "DCP_GLOBALS", "TensorRef", "Stub", "loads", "TorchZip", "load_torch", "materialize"]
