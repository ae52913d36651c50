"""msgpack encodings of the manifest and of user objects. Never pickle.

Decoding bounds every container and string by the input size, so hostile bytes cannot make the
decoder allocate more than the file justifies.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import msgpack
import numpy as np

from ckpt._checksum import crc32
from ckpt.errors import ManifestError, ManifestIntegrityError, StateError
from ckpt.manifest import CODEC_VERSION, FORMAT_NAME, HASH_ALGORITHM, Manifest, parse_version

_EXT_NUMPY_SCALAR = 1
_EXT_TUPLE = 2
_EXT_SET = 3
_EXT_FROZENSET = 4


def encode_manifest(manifest: Manifest) -> bytes:
    """Encode a manifest: a small envelope (format, version, CRC32 of the body) around the body.

    The checksum covers every byte of the body (tensors, objects, per-rank objects, step, metadata),
    so a flipped byte anywhere in the manifest is caught when it is decoded.
    """
    body = msgpack.packb(manifest.to_dict(), use_bin_type=True)
    # compressed data files need a 2.1 reader (ckpt.manifest.CODEC_VERSION); everything else stays 2.0
    version = max(manifest.version, CODEC_VERSION) if manifest.codecs else manifest.version
    return msgpack.packb({"format": FORMAT_NAME, "version": list(version), "hash": HASH_ALGORITHM,
                          "checksum": crc32(body), "body": body}, use_bin_type=True)


def _unpack(data: bytes, what: str, ext_hook: Any = None) -> Any:
    n = len(data)
    try:
        kwargs: dict[str, Any] = dict(
            raw=False, strict_map_key=False,
            max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n // 2 + 1, max_ext_len=n,
        )
        if ext_hook is not None:
            kwargs["ext_hook"] = ext_hook
        return msgpack.unpackb(data, **kwargs)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{what}: not valid msgpack ({type(e).__name__}: {e}); the file is corrupted") from None


def decode_manifest(data: bytes, *, url: str = "manifest") -> Manifest:
    """Decode and validate manifest bytes; raise ManifestError (never anything else) on bad input.

    Format 2: the envelope's CRC32 must match the body (else ``ManifestIntegrityError``); the body's
    shard columns are validated here and turned into objects only when used. Format 1 manifests
    (no envelope, no checksum) are still read.
    """
    outer = _unpack(data, f"{url}")
    try:
        if isinstance(outer, dict) and "body" in outer:
            if outer.get("format") != FORMAT_NAME:
                raise ManifestError(f"manifest: format is {outer.get('format')!r}, expected {FORMAT_NAME!r}")
            version = parse_version(outer.get("version"))
            if outer.get("hash") != HASH_ALGORITHM:
                raise ManifestError(f"manifest: checksum algorithm {outer.get('hash')!r} unknown (this ckpt "
                                    f"knows {HASH_ALGORITHM})")
            body, want = outer["body"], outer.get("checksum")
            if not isinstance(body, bytes) or not isinstance(want, int) or isinstance(want, bool):
                raise ManifestError("manifest: envelope body or checksum malformed")
            got = crc32(body)
            if got != want:
                raise ManifestIntegrityError(
                    f"manifest: its checksum does not match ({got:#010x}, recorded {want:#010x}): the manifest "
                    "is corrupted; restore it from a copy or use an earlier checkpoint"
                )
            return Manifest.from_dict(_unpack(body, f"{url} body"), version)
        return Manifest.from_dict(outer)
    except ManifestError as e:
        raise type(e)(f"{url}: {e}") from None
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError, RecursionError, IndexError) as e:
        raise ManifestError(f"{url}: manifest violates the schema ({type(e).__name__}: {e})") from None


def _default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        arr = np.asarray(obj)
        return msgpack.ExtType(_EXT_NUMPY_SCALAR, msgpack.packb([arr.dtype.str, arr.tobytes()], use_bin_type=True))
    if isinstance(obj, tuple):
        if hasattr(obj, "_fields"):  # a namedtuple would come back as a plain tuple: say so instead
            raise TypeError(f"namedtuple {type(obj).__name__} is not stored as such; store obj._asdict() "
                            "or tuple(obj)")
        # strict_types: a tuple nested in this one is a tuple again, not a list
        return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(list(obj), use_bin_type=True, default=_default,
                                                         strict_types=True))
    if isinstance(obj, set | frozenset):
        # elements in the order of their encodings: equal sets encode to equal bytes on every rank
        items = sorted(msgpack.packb(x, use_bin_type=True, default=_default, strict_types=True) for x in obj)
        return msgpack.ExtType(_EXT_SET if isinstance(obj, set) else _EXT_FROZENSET,
                               msgpack.packb(items, use_bin_type=True))
    try:
        import torch

        if isinstance(obj, torch.dtype):
            return str(obj)
        if isinstance(obj, torch.Size):
            return list(obj)
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"{type(obj).__name__} is not msgpack-serializable")


_DEPTH = threading.local()
MAX_TUPLE_DEPTH = 64


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_NUMPY_SCALAR:
        dt, raw = _unpack(data, "object")
        # Only plain numeric dtype strings: np.dtype parses some others with ast.literal_eval.
        ok = isinstance(dt, str) and re.fullmatch(r"[<>|=]?[biufc]\d{1,2}", dt) is not None
        dtype = np.dtype(dt) if ok else None
        if dtype is None or dtype.kind not in "biufc" or not isinstance(raw, bytes) or len(raw) != dtype.itemsize:
            raise ManifestError("object: malformed numpy scalar")
        return np.frombuffer(raw, dtype=dtype)[0]
    if code == _EXT_TUPLE:
        # Each nested tuple is a nested unpack: bound the depth so hostile bytes cannot recurse deep.
        depth = getattr(_DEPTH, "n", 0)
        if depth >= MAX_TUPLE_DEPTH:
            raise ManifestError(f"object: tuples nested deeper than {MAX_TUPLE_DEPTH}")
        _DEPTH.n = depth + 1
        try:
            return tuple(_unpack(data, "object", _ext_hook))
        finally:
            _DEPTH.n = depth
    if code in (_EXT_SET, _EXT_FROZENSET):
        depth = getattr(_DEPTH, "n", 0)
        if depth >= MAX_TUPLE_DEPTH:
            raise ManifestError(f"object: containers nested deeper than {MAX_TUPLE_DEPTH}")
        _DEPTH.n = depth + 1
        try:
            items = _unpack(data, "object")
            if not isinstance(items, list) or not all(isinstance(x, bytes) for x in items):
                raise ManifestError("object: malformed set")
            try:
                values = [_unpack(x, "object", _ext_hook) for x in items]
                return set(values) if code == _EXT_SET else frozenset(values)
            except TypeError:
                raise ManifestError("object: a set holds an unhashable value") from None
        finally:
            _DEPTH.n = depth
    raise ManifestError(f"object: unknown msgpack extension type {code}")


def encode_object(value: Any, *, key: str = "?") -> bytes:
    """Encode a msgpack-able user value (numpy scalars and tuples are preserved)."""
    try:
        return msgpack.packb(value, use_bin_type=True, default=_default, strict_types=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise StateError(
            f"object {key!r}: cannot be stored ({e}); objects must be ints, floats, str, bytes, lists, "
            "tuples, sets, dicts or numpy scalars (tensors go in as tensors)"
        ) from None


def normalize_step(step: Any) -> int | None:
    """``step`` as a Python int (numpy / torch integer scalars accepted) or None; StateError for
    anything else (bool, float, even 2.0, str)."""
    if step is None or (isinstance(step, int) and not isinstance(step, bool)):
        return step
    if isinstance(step, np.integer):
        return int(step)
    try:
        import torch

        if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point() \
                and step.dtype != torch.bool and not step.is_complex():
            return int(step.item())
    except ImportError:  # pragma: no cover
        pass
    raise StateError(f"step must be an int or None, got {step!r} ({type(step).__name__})")


def normalize_metadata(value: Any, where: str) -> Any:
    """A copy of ``value`` (user metadata, layout) with numpy / torch scalars as Python values and
    tuples as lists; StateError naming the path of anything metadata cannot hold (sets, objects,
    non-string keys, strings that are not valid UTF-8)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise StateError(f"{where}: key {k!r} is not a string; metadata keys must be strings")
            _check_text(k, f"{where}: key {k!r}")
            out[k] = normalize_metadata(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [normalize_metadata(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | bytes):
        return value
    if isinstance(value, str):
        _check_text(value, where)
        return value
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    try:
        import torch

        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
            return value.item()
    except ImportError:  # pragma: no cover
        pass
    raise StateError(f"{where}: {type(value).__name__} cannot be stored in metadata; use ints, floats, "
                     "bools, str, bytes, lists and dicts with str keys")


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise StateError(f"{where}: not valid UTF-8 text (a lone surrogate?); it cannot be stored") from None


def decode_object(data: bytes, *, key: str = "?") -> Any:
    """Decode a user value written by :func:`encode_object`."""
    try:
        return _unpack(data, f"object {key!r}", _ext_hook)
    except ManifestError:
        raise
    except (TypeError, ValueError) as e:
        raise ManifestError(f"object {key!r}: cannot be decoded ({e})") from None


__all__ = ["encode_manifest", "decode_manifest", "MAX_TUPLE_DEPTH", "encode_object", "normalize_step",
           "normalize_metadata", "decode_object"]
