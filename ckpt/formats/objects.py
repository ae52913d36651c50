"""The one mapping between Python values and what a checkpoint stores for an object.

``torch.distributed.checkpoint`` stores objects with ``torch.save`` and gives back exactly what went
in. ckpt stores objects with msgpack (never pickle), which carries only some types exactly; a value
converted on the way (a ``torch.dtype`` to the string ``'torch.bfloat16'``, a ``torch.Size`` to a
list) would come back as a different type without a word. This module decides, for every value,
one of three things, from an explicit table:

* **carried as is** by ckpt's msgpack codec (:mod:`ckpt.formats.msgpack_codec`), which round-trips
  exactly: ``None``, ``bool``, ``int`` in [-2**63, 2**64), ``float`` (bitwise, NaN payloads too),
  ``str`` (valid UTF-8), ``bytes``, ``list``, ``tuple`` (not namedtuples), ``dict``, ``set``,
  ``frozenset`` and numpy scalars of kinds b/i/u/f/c;
* **tagged**: stored as the tuple ``(TAG, kind, payload)`` of carried values and rebuilt by
  :func:`decode_value` to the same type and value: ``torch.dtype``, ``torch.Size``,
  ``torch.device``, ``complex``, ints beyond 64 bits, ``bytearray``, ``OrderedDict``, strings that
  are not valid UTF-8 (lone surrogates), numpy arrays and dtypes of kinds b/i/u/f/c,
  ``datetime.date`` / ``datetime`` / ``time`` / ``timedelta`` (time zones: fixed offsets only),
  and user tuples that themselves start with ``TAG`` (escaped, so the encoding stays injective);
* **refused**, with a :class:`~ckpt.errors.StateError` naming the key and the type: anything else
  (other classes, subclasses of the types above, numpy strings / objects / datetimes...).

Reading a checkpoint that DCP wrote, :func:`from_torch_save` turns what the restricted unpickler
(:mod:`ckpt.formats.torch_pickle`, with :data:`PICKLE_EXTRA` and :data:`PICKLE_STUBS`) gave into
the same Python values, building numpy values itself from validated stand-ins (no numpy code runs
on the file's data). A foreign value that cannot be read or represented is stored as a *refusal*
(:func:`refusal`): loading that key raises the recorded typed error naming it, other keys load.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ckpt import errors
from ckpt.errors import CheckpointError, ManifestError, StateError
from ckpt.formats.torch_pickle import Stub, TensorRef

TAG = "\x00ckpt.obj"  # first element of a tagged tuple: a NUL-led string no sensible value starts a tuple with
INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1
MAX_BIG_INT_BYTES = 1 << 16  # a stored big int larger than this is not one we wrote
MAX_DEPTH = 64

# numpy dtype strings built here: plain numeric kinds only (np.dtype parses some others with
# ast.literal_eval); the same rule as the msgpack codec's numpy scalars
_NUMERIC_DTYPE = re.compile(r"[<>|=]?[biufc]\d{1,2}")
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}

# Globals a torch.save of the tagged types names, for the restricted unpickler. datetime's classes
# are immutable C types whose constructors only validate and store numbers (read as `extra`, real);
# numpy's are read as stand-ins (`stubs`): :func:`from_torch_save` builds the values from their
# recorded arguments after checking them (numpy 2 names, then numpy 1's). ``bytes`` too: protocol 2
# spells ``b""`` as ``bytes()``, and the real ``bytes(n)`` would allocate n bytes the file chose.
PICKLE_EXTRA = ("datetime.date", "datetime.datetime", "datetime.time", "datetime.timedelta", "datetime.timezone")
PICKLE_STUBS = ("builtins.bytes", "numpy.dtype", "numpy.ndarray",
                "numpy._core.multiarray.scalar", "numpy._core.multiarray._reconstruct",
                "numpy.core.multiarray.scalar", "numpy.core.multiarray._reconstruct")


def _fail(key: str, path: str, what: str) -> StateError:
    at = f" at {path}" if path else ""
    return StateError(f"object {key!r}{at}: {what} cannot be stored exactly by ckpt; convert it to a supported type "
                      "(None, bool, int, float, complex, str, bytes, list, tuple, dict, set, numpy numbers and "
                      "arrays, torch dtype/Size/device, datetime) or keep it out of the checkpoint")


def encode_value(value: Any, *, key: str) -> Any:
    """``value`` as something ckpt's msgpack codec stores exactly (see the module's table).

    Raises StateError naming ``key`` (and the position inside it) for a value of another type.
    """
    return _enc(value, key, "", 0)


def _enc(v: Any, key: str, path: str, depth: int) -> Any:  # noqa: C901 - one branch per row of the table
    if depth > MAX_DEPTH:
        raise _fail(key, path, f"a value nested deeper than {MAX_DEPTH}")
    t = type(v)
    if v is None or t is bool or t is float or t is bytes:
        return v
    if t is int:
        if INT64_MIN <= v <= UINT64_MAX:
            return v
        return (TAG, "int", v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True))
    if t is str:
        try:
            v.encode("utf-8")
            return v
        except UnicodeEncodeError:
            return (TAG, "str", v.encode("utf-8", "surrogatepass"))
    if t is list:
        return [_enc(x, key, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
    if t is tuple:
        items = tuple(_enc(x, key, f"{path}[{i}]", depth + 1) for i, x in enumerate(v))
        return (TAG, "tuple", items) if items and _is_tag_head(items[0]) else items
    if t is dict or t is OrderedDict:
        pairs = [(_enc(k, key, f"{path}<key {k!r}>", depth + 1), _enc(x, key, f"{path}[{k!r}]", depth + 1))
                 for k, x in v.items()]
        return {k: x for k, x in pairs} if t is dict else (TAG, "odict", tuple(pairs))
    if t is set or t is frozenset:
        return t(_enc(x, key, f"{path}{{{x!r}}}", depth + 1) for x in v)
    if t is complex:
        return (TAG, "complex", (v.real, v.imag))
    if t is bytearray:
        return (TAG, "bytearray", bytes(v))
    if t is torch.dtype:
        return (TAG, "dtype", str(v).removeprefix("torch."))
    if t is torch.Size:
        return (TAG, "size", tuple(int(n) for n in v))
    if t is torch.device:
        return (TAG, "device", str(v))
    if isinstance(v, np.generic) and t is v.dtype.type:
        if _NUMERIC_DTYPE.fullmatch(v.dtype.str):
            return v  # the codec's numpy-scalar extension carries it bitwise
        raise _fail(key, path, f"numpy scalar of dtype {v.dtype}")
    if t is np.ndarray:
        if not _NUMERIC_DTYPE.fullmatch(v.dtype.str):
            raise _fail(key, path, f"numpy array of dtype {v.dtype}")
        return (TAG, "ndarray", (v.dtype.str, tuple(int(n) for n in v.shape), np.ascontiguousarray(v).tobytes()))
    if isinstance(v, np.dtype) and _NUMERIC_DTYPE.fullmatch(v.str) and t is type(np.dtype(v.str)):
        return (TAG, "npdtype", v.str)
    if t is _dt.date:
        return (TAG, "date", (v.year, v.month, v.day))
    if t is _dt.datetime:
        return (TAG, "datetime", (v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, v.fold,
                                  _enc_tz(v.tzinfo, key, path)))
    if t is _dt.time:
        return (TAG, "time", (v.hour, v.minute, v.second, v.microsecond, v.fold, _enc_tz(v.tzinfo, key, path)))
    if t is _dt.timedelta:
        return (TAG, "timedelta", (v.days, v.seconds, v.microseconds))
    raise _fail(key, path, f"a value of type {t.__module__}.{t.__qualname__}")


def _is_tag_head(x: Any) -> bool:
    return type(x) is str and x == TAG


def _enc_tz(tz: Any, key: str, path: str) -> Any:
    if tz is None:
        return None
    if type(tz) is not _dt.timezone:
        raise _fail(key, path, f"a datetime with time zone {type(tz).__qualname__} (only fixed offsets are stored)")
    off = tz.utcoffset(None)
    name = tz.tzname(None)
    return ((off.days, off.seconds, off.microseconds), None if name == _dt.timezone(off).tzname(None) else name)


def decode_value(stored: Any, *, key: str) -> Any:
    """The value :func:`encode_value` encoded as ``stored`` (the inverse; plain values pass through).

    Raises the recorded typed error for a refusal (a foreign value ckpt could not read), naming
    ``key``; ManifestError for a malformed tag.
    """
    return _dec(stored, key, 0)


def _dec(v: Any, key: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ManifestError(f"object {key!r}: nested deeper than {MAX_DEPTH}")
    t = type(v)
    if t is list:
        return [_dec(x, key, depth + 1) for x in v]
    if t is dict:
        return {_dec(k, key, depth + 1): _dec(x, key, depth + 1) for k, x in v.items()}
    if t is set or t is frozenset:
        return t(_dec(x, key, depth + 1) for x in v)
    if t is tuple:
        if len(v) == 3 and _is_tag_head(v[0]) and type(v[1]) is str:
            try:
                return _untag(v[1], v[2], key, depth)
            except CheckpointError:
                raise
            except (TypeError, ValueError, OverflowError, KeyError, IndexError) as e:
                raise ManifestError(f"object {key!r}: malformed stored {v[1]!r} value ({type(e).__name__}: {e})"
                                    ) from None
        return tuple(_dec(x, key, depth + 1) for x in v)
    return v


def _untag(kind: str, p: Any, key: str, depth: int) -> Any:  # noqa: C901 - one branch per tagged type
    if kind == "tuple":
        return tuple(_dec(x, key, depth + 1) for x in p)
    if kind == "odict":
        return OrderedDict((_dec(k, key, depth + 1), _dec(x, key, depth + 1)) for k, x in p)
    if kind == "int":
        if type(p) is not bytes or len(p) > MAX_BIG_INT_BYTES:
            raise ValueError("not the bytes of an int")
        return int.from_bytes(p, "little", signed=True)
    if kind == "str":
        return _bytes(p).decode("utf-8", "surrogatepass")
    if kind == "bytearray":
        return bytearray(_bytes(p))
    if kind == "complex":
        re_, im = p
        if type(re_) is not float or type(im) is not float:
            raise TypeError("complex parts are not floats")
        return complex(re_, im)
    if kind == "dtype":
        return _TORCH_DTYPES[p]
    if kind == "size":
        return torch.Size([_int(n) for n in p])
    if kind == "device":
        if type(p) is not str or len(p) > 64:
            raise ValueError("not a device name")
        return torch.device(p)
    if kind == "npdtype":
        return _np_dtype(p)
    if kind == "ndarray":
        dts, shape, raw = p
        return _np_array(_np_dtype(dts), tuple(_int(n) for n in shape), _bytes(raw), fortran=False)
    if kind == "date":
        return _dt.date(*(_int(n) for n in p))
    if kind == "datetime":
        y, mo, d, h, mi, sec, us, fold, tz = p
        return _dt.datetime(_int(y), _int(mo), _int(d), _int(h), _int(mi), _int(sec), _int(us), tzinfo=_dec_tz(tz),
                            fold=_int(fold))
    if kind == "time":
        h, mi, sec, us, fold, tz = p
        return _dt.time(_int(h), _int(mi), _int(sec), _int(us), tzinfo=_dec_tz(tz), fold=_int(fold))
    if kind == "timedelta":
        return _dt.timedelta(*(_int(n) for n in p))
    if kind == "refused":
        cls_name, message = p
        cls = getattr(errors, str(cls_name), None)
        if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
            cls = StateError
        raise cls(f"{key!r}: {message}")
    raise ManifestError(f"object {key!r}: unknown stored kind {kind!r}; written by a newer ckpt? upgrade ckpt")


def _int(n: Any) -> int:
    if type(n) is not int:
        raise TypeError(f"{n!r} is not an int")
    return n


def _bytes(b: Any) -> bytes:
    if type(b) is not bytes:
        raise TypeError("not bytes")
    return b


def _dec_tz(tz: Any) -> _dt.timezone | None:
    if tz is None:
        return None
    (days, seconds, micro), name = tz
    off = _dt.timedelta(_int(days), _int(seconds), _int(micro))
    return _dt.timezone(off) if name is None else _dt.timezone(off, str(name))


def _np_dtype(s: Any) -> np.dtype[Any]:
    if type(s) is not str or not _NUMERIC_DTYPE.fullmatch(s):
        raise ValueError(f"numpy dtype {s!r} is not a plain numeric dtype")
    return np.dtype(s)


def _np_array(dtype: np.dtype[Any], shape: tuple[int, ...], raw: bytes, *, fortran: bool) -> np.ndarray[Any, Any]:
    if any(n < 0 for n in shape) or math.prod(shape) * dtype.itemsize != len(raw):
        raise ValueError(f"{len(raw)} bytes do not hold a {dtype} array of shape {list(shape)}")
    flat = np.frombuffer(raw, dtype=dtype).copy()  # a writable array of its own, as numpy's unpickling gives
    return flat.reshape(shape, order="F" if fortran else "C")


def refusal(error: CheckpointError) -> tuple[str, str, tuple[str, str]]:
    """The stored form of a foreign value ckpt could not read or represent: loading its key raises
    ``error``'s type with its message (other keys load as usual)."""
    return (TAG, "refused", (type(error).__name__, str(error)))


def from_torch_save(obj: Any, *, key: str) -> Any:
    """The Python value a DCP bytes item held (``obj``: the restricted unpickler's result, read with
    :data:`PICKLE_EXTRA` / :data:`PICKLE_STUBS`): numpy stand-ins become numpy values after their
    arguments are checked; tensors and other stand-ins are refused (StateError naming ``key``)."""
    return _np_values(obj, key, "", 0)


def _np_values(v: Any, key: str, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _fail(key, path, f"a value nested deeper than {MAX_DEPTH}")
    t = type(v)
    if t is list:
        return [_np_values(x, key, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
    if t is tuple:
        return tuple(_np_values(x, key, f"{path}[{i}]", depth + 1) for i, x in enumerate(v))
    if t is dict or t is OrderedDict:
        return t((_np_values(k, key, path, depth + 1), _np_values(x, key, f"{path}[{k!r}]", depth + 1))
                 for k, x in v.items())
    if t is set or t is frozenset:
        return t(_np_values(x, key, path, depth + 1) for x in v)
    if isinstance(v, TensorRef):
        raise _fail(key, path, "a tensor inside an object (DCP saved the container whole)")
    if isinstance(v, Stub) or (isinstance(v, type) and issubclass(v, Stub)):
        try:
            return _from_stub(v)
        except (TypeError, ValueError) as e:
            raise _fail(key, path, f"a {getattr(v, 'qualname', '?')} ({e})") from None
    return v


def _from_stub(s: Any) -> Any:
    name = getattr(s, "qualname", "?").replace("numpy.core.", "numpy._core.")
    if name == "builtins.bytes":
        if s.args == ():
            return b""
        if len(s.args) == 1 and type(s.args[0]) is bytes:
            return s.args[0]
        raise ValueError("bytes() of something other than bytes")
    if name == "numpy.dtype":
        code, _align, _copy = s.args
        st = s.state
        if type(st) is not tuple or len(st) < 5 or st[1] not in "<>|=" or any(x is not None for x in st[2:5]):
            raise ValueError("not a plain numeric dtype")
        return _np_dtype((st[1] if st[1] in "<>" else "") + str(code))
    if name == "numpy._core.multiarray.scalar":
        dtype, raw = s.args
        dtype = _from_stub(dtype)
        raw = _raw(raw)
        if len(raw) != dtype.itemsize:
            raise ValueError("scalar bytes do not match the dtype")
        return np.frombuffer(raw, dtype=dtype)[0]
    if name == "numpy._core.multiarray._reconstruct":
        cls = s.args[0]
        if getattr(cls, "qualname", None) != "numpy.ndarray":
            raise ValueError(f"an array of class {getattr(cls, 'qualname', cls)!r}")
        version, shape, dtype, fortran, raw = s.state
        if version != 1 or type(fortran) is not bool:
            raise ValueError("unknown array state")
        return _np_array(_from_stub(dtype), tuple(_int(n) for n in shape), _raw(raw), fortran=fortran)
    raise ValueError("not a type ckpt stores")


def _raw(b: Any) -> bytes:
    # b"" inside a pickle is the stand-in for bytes()
    return _bytes(_from_stub(b) if isinstance(b, Stub) else b)


__all__ = ["TAG", "MAX_BIG_INT_BYTES", "MAX_DEPTH", "PICKLE_EXTRA", "PICKLE_STUBS", "encode_value", "decode_value",
           "refusal", "from_torch_save"]
