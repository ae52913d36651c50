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
"""

from __future__ import annotations

import functools
import importlib
import io
import math
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.errors import IntegrityError

Read = Callable[[int, int], bytes]

_DTYPE_NAMES = [n for n in ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
                            "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
                            "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
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
    "torch.distributed.checkpoint.planner.WriteItemType",
)


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    data_offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class TensorRef:
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


class Stub:
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
    return type("Stub", (Stub,), {"qualname": name})


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


def _path(*parts: str) -> str:
    # DCP's StorageMeta.checkpoint_id may be a pathlib path: kept as its text, no pathlib object made
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path made of non-strings")
    return "/".join(parts)


def _rebuild_tensor(storage: _StorageRef, storage_offset: int, size: Any, stride: Any, requires_grad: bool = False,
                    backward_hooks: Any = None, metadata: Any = None) -> TensorRef:
    if not isinstance(storage, _StorageRef):
        raise pickle.UnpicklingError("a tensor whose storage is not one of the file's records")
    return TensorRef(storage.dtype, tuple(int(s) for s in size), tuple(int(s) for s in stride), int(storage_offset),
                     storage.data_offset, storage.nbytes, bool(requires_grad))


def _rebuild_parameter(data: TensorRef, requires_grad: bool = False, backward_hooks: Any = None,
                       state: Any = None) -> TensorRef:
    return data


_TENSOR_TYPE = object()  # what "torch.Tensor" maps to: only a marker for _rebuild_from_type_v2


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any = None) -> TensorRef:
    # torch pickles some tensors as _rebuild_from_type_v2(_rebuild_tensor_v2, torch.Tensor, args, state);
    # only plain tensors rebuilt by our own functions are accepted
    if new_type is not _TENSOR_TYPE or func not in (_rebuild_tensor, _rebuild_parameter):
        raise pickle.UnpicklingError("a tensor subclass or an unexpected rebuild function")
    return func(*args)  # type: ignore[no-any-return]


def _base_globals() -> dict[str, Any]:
    allowed: dict[str, Any] = {
        "collections.OrderedDict": OrderedDict,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.slice": slice,
        "builtins.complex": complex, "builtins.bytearray": _bytearray,
        "_codecs.encode": _latin1,
        "torch.Size": torch.Size,
        "torch.device": torch.device,
        "torch.strided": torch.strided,
        "torch.serialization._get_layout": _layout,
        "pathlib.PosixPath": _path, "pathlib.PurePosixPath": _path,
        "pathlib.WindowsPath": _path, "pathlib.PureWindowsPath": _path,
        "torch.contiguous_format": torch.contiguous_format,
        "torch.channels_last": torch.channels_last,
        "torch.preserve_format": torch.preserve_format,
        "torch._utils._rebuild_tensor": _rebuild_tensor,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch.Tensor": _TENSOR_TYPE,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type,
    }
    for n in _DTYPE_NAMES:
        allowed[f"torch.{n}"] = getattr(torch, n)
    for n, dt in _STORAGE_DTYPES.items():
        allowed[f"torch.{n}"] = _StorageType(dt)
    allowed["torch.UntypedStorage"] = _StorageType(torch.uint8)
    return allowed


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    obj: Any = importlib.import_module(module)
    return getattr(obj, attr)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, what: str, allowed: dict[str, Any],
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
        nbytes = int(_numel) * stype.dtype.itemsize
        if (size is not None and size < nbytes) or offset + nbytes > self.limit:
            raise pickle.UnpicklingError(f"storage data/{key} of {nbytes} bytes at {offset} does not fit its record")
        return _StorageRef(str(key), stype.dtype, offset, nbytes)


@functools.lru_cache(maxsize=64)
def _allowed_cached(extra: tuple[str, ...], stubs: tuple[str, ...]) -> dict[str, Any]:
    allowed = _base_globals()
    for name in extra:
        allowed[name] = _resolve(name)
    for name in stubs:
        allowed[name] = _stub(name)
    return allowed


def _allowed(extra: Iterable[str], stubs: Iterable[str]) -> dict[str, Any]:
    """The allowlist for one read (built once per (extra, stubs) and shared: nothing mutates it)."""
    return _allowed_cached(tuple(extra), tuple(stubs))


def _unpickle(data: bytes, what: str, allowed: dict[str, Any],
              storages: dict[str, tuple[int, int | None]] | None, partial: bool = False, limit: int = 0) -> Any:
    try:
        return _Unpickler(data, what, allowed, storages, partial, limit).load()
    except (IntegrityError, _MissingStorage):
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle is the file's problem, typed
        raise IntegrityError(f"{what}: cannot read the pickle ({type(e).__name__}: {e}); the file is damaged "
                             "or not what it claims to be") from None


def loads(data: bytes, *, what: str, extra: Iterable[str] = (), stubs: Iterable[str] = ()) -> Any:
    """Unpickle ``data`` allowing only plain data, torch's dtypes/sizes and the globals in ``extra``
    (fully qualified names, imported) and ``stubs`` (names replaced by :class:`Stub` records).

    Raises IntegrityError naming ``what`` and the refused global, or on a malformed pickle.
    """
    return _unpickle(data, what, _allowed(extra, stubs), None)


# ---- torch.save zip files -------------------------------------------------------------------------

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"


@dataclass
class TorchZip:
    """A torch.save file read without running it: ``obj`` with tensors as :class:`TensorRef`."""

    obj: Any
    what: str

    def tensors(self) -> list[tuple[tuple[Any, ...], TensorRef]]:
        """Every TensorRef with its path (dict keys / sequence indices) from the root object."""
        out: list[tuple[tuple[Any, ...], TensorRef]] = []

        def walk(v: Any, path: tuple[Any, ...]) -> None:
            if isinstance(v, TensorRef):
                out.append((path, v))
            elif isinstance(v, dict):
                for k, x in v.items():
                    walk(x, (*path, k))
            elif isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    walk(x, (*path, i))

        walk(self.obj, ())
        return out


def _directory(read: Read, start: int, length: int, what: str) -> dict[str, tuple[int, int, int]]:
    """``name -> (local header offset, compressed size, method)`` from the zip's central directory."""
    tail_len = min(length, 65536 + 22)
    tail = read(start + length - tail_len, tail_len)
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        raise IntegrityError(f"{what}: bytes [{start}, {start + length}) are not a torch.save zip (no end of "
                             "central directory); the file is truncated, or saved with the legacy "
                             "_use_new_zipfile_serialization=False format (re-save with torch.save's defaults)")
    count, cd_size, cd_offset = struct.unpack_from("<10xHII", tail, at)
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF or cd_size == 0xFFFFFFFF:
        loc = at - 20
        if loc < 0 or tail[loc:loc + 4] != _EOCD64_LOCATOR:
            raise IntegrityError(f"{what}: zip64 end record locator missing")
        (eocd64,) = struct.unpack_from("<8xQ", tail, loc)
        rec = read(start + eocd64, 56)
        if rec[:4] != b"PK\x06\x06":
            raise IntegrityError(f"{what}: zip64 end record missing")
        count, cd_size, cd_offset = struct.unpack_from("<32xQQQ", rec)
    if cd_offset + cd_size > length:
        raise IntegrityError(f"{what}: zip directory [{cd_offset}, {cd_offset + cd_size}) lies beyond the "
                             f"{length} bytes of the item (truncated?)")
    cd = read(start + cd_offset, cd_size)
    out: dict[str, tuple[int, int, int]] = {}
    pos = 0
    for _ in range(count):
        if cd[pos:pos + 4] != _CENTRAL:
            raise IntegrityError(f"{what}: damaged zip central directory")
        method, = struct.unpack_from("<H", cd, pos + 10)
        csize, usize, nlen, xlen, clen = struct.unpack_from("<IIHHH", cd, pos + 20)
        (local,) = struct.unpack_from("<I", cd, pos + 42)
        name = cd[pos + 46:pos + 46 + nlen].decode("utf-8", "replace")
        extra = cd[pos + 46 + nlen:pos + 46 + nlen + xlen]
        xp = 0
        while xp + 4 <= len(extra):  # zip64 extended information: the fields that overflowed, in order
            tag, size = struct.unpack_from("<HH", extra, xp)
            if tag == 1:
                vals = list(struct.unpack_from(f"<{size // 8}Q", extra, xp + 4))
                if usize == 0xFFFFFFFF and vals:
                    usize = vals.pop(0)
                if csize == 0xFFFFFFFF and vals:
                    csize = vals.pop(0)
                if local == 0xFFFFFFFF and vals:
                    local = vals.pop(0)
            xp += 4 + size
        out[name] = (local, csize, method)
        pos += 46 + nlen + xlen + clen
    return out


def _entry(read: Read, start: int, length: int, rec: tuple[int, int, int], name: str, what: str) -> tuple[int, int]:
    """Absolute ``(offset, size)`` of a stored (uncompressed) entry's data."""
    local, size, method = rec
    if method != 0:
        raise IntegrityError(f"{what}: zip entry {name!r} is compressed (method {method}); torch.save stores entries")
    head = read(start + local, 30)
    if head[:4] != _LOCAL:
        raise IntegrityError(f"{what}: zip entry {name!r}: no local header at {start + local}")
    nlen, xlen = struct.unpack_from("<HH", head, 26)
    offset = local + 30 + nlen + xlen
    if offset + size > length:
        raise IntegrityError(f"{what}: zip entry {name!r} [{start + offset}, {start + offset + size}) lies beyond "
                             f"the item's end {start + length} (truncated?)")
    return start + offset, size


class _MissingStorage(Exception):
    """The pickle names a storage record the quick scan did not reach: read the zip directory."""


HEAD_BYTES = 4096  # a one-tensor torch.save (a DCP item) has every record header before its data in here


def _scan_head(read: Read, start: int, length: int) -> dict[str, tuple[int, int | None]] | None:
    """Records whose local headers lie in the first HEAD_BYTES: ``name -> (absolute offset, size)``.

    torch writes its zips in streaming mode (sizes in a data descriptor after each record), so a
    size is known here only where the descriptor is in the buffer too (``data.pkl``, ``byteorder``);
    a storage record's size then comes from the pickle (its element count) and is bounds-checked.
    Every header found is checked (name, lengths, descriptor position); anything unexpected returns
    None and the caller reads the zip's central directory instead. One read, at the item's start:
    cold, the readahead it starts also brings the tensor's bytes.
    """
    buf = read(start, min(length, HEAD_BYTES))
    out: dict[str, tuple[int, int | None]] = {}
    pos = 0
    while pos + 30 <= len(buf) and buf[pos:pos + 4] == _LOCAL:
        flags, method, csize, _usize, nlen, xlen = struct.unpack_from("<2xHH8xIIHH", buf, pos + 4)
        if method != 0 or pos + 30 + nlen > len(buf):
            return None
        name = buf[pos + 30:pos + 30 + nlen].decode("utf-8", "replace")
        data = pos + 30 + nlen + xlen
        if not flags & 8:  # sizes up front
            out[name] = (start + data, csize)
            pos = data + csize
            continue
        if "/data/" in name:  # the storage itself: its size comes from the pickle; stop here
            out[name] = (start + data, None)
            break
        # a small record followed by its descriptor: PK\x07\x08, crc, csize, usize
        end = buf.find(b"PK\x07\x08", data)
        while end >= 0 and end + 16 <= len(buf) and struct.unpack_from("<I", buf, end + 8)[0] != end - data:
            end = buf.find(b"PK\x07\x08", end + 1)
        if end < 0 or end + 16 > len(buf):
            return None
        out[name] = (start + data, end - data)
        pos = end + 16
    return out or None


def load_torch(read: Read, start: int, length: int, *, what: str, extra: Iterable[str] = (),
               stubs: Iterable[str] = ()) -> TorchZip:
    """Index the torch.save file in bytes ``[start, start + length)`` (read through ``read(offset,
    nbytes)``) and unpickle its object with the allowlist (see :func:`loads`); tensors come back
    as :class:`TensorRef`. Reads the local headers at its start (one read), or, when the records
    it needs are not all there, the zip directory; then ``data.pkl`` and ``byteorder``.

    Raises IntegrityError: not a zip, truncated, a compressed entry, big-endian data, a global
    outside the allowlist, or a malformed pickle.
    """
    allowed = _allowed(extra, stubs)
    head = _scan_head(read, start, length)
    # the quick path still requires the zip's end record where it must be (torch writes no comment):
    # a truncated file falls through to the directory path, which names the damage
    if head and length >= 22 and read(start + length - 22, 4) == _EOCD:
        try:
            return _from_records(read, head, what, allowed, partial=True, limit=start + length)
        except _MissingStorage:
            pass
    directory = _directory(read, start, length, what)
    records: dict[str, tuple[int, int | None]] = {
        name: _entry(read, start, length, rec, name, what) for name, rec in directory.items()}
    return _from_records(read, records, what, allowed, partial=False, limit=start + length)


def _from_records(read: Read, records: dict[str, tuple[int, int | None]], what: str, allowed: dict[str, Any],
                  *, partial: bool, limit: int) -> TorchZip:
    pkl = [n for n in records if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        if partial:
            raise _MissingStorage
        raise IntegrityError(f"{what}: no data.pkl record in the torch.save archive")
    prefix = pkl[0][: -len("data.pkl")]
    if f"{prefix}byteorder" in records:
        off, size = records[f"{prefix}byteorder"]
        if size is None or read(off, size).strip() not in (b"little", b""):
            raise IntegrityError(f"{what}: big-endian torch.save data is not supported")
    storages = {name[len(prefix) + 5:]: rec for name, rec in records.items() if name.startswith(f"{prefix}data/")}
    off, size = records[pkl[0]]
    if size is None:
        raise _MissingStorage
    obj = _unpickle(read(off, size), what, allowed, storages, partial, limit)
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
