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

from ckpt.checksum import crc32
from ckpt.errors import ManifestError, ManifestIntegrityError, StateError
from ckpt.manifest import FORMAT_NAME, HASH_ALGORITHM, Manifest, parse_version

_EXT_NUMPY_SCALAR = 1
_EXT_TUPLE = 2


def encode_manifest(manifest: Manifest) -> bytes:
    """Encode a manifest: a small envelope (format, version, CRC32 of the body) around the body.

    The checksum covers every byte of the body (tensors, objects, per-rank objects, step, metadata),
    so a flipped byte anywhere in the manifest is caught when it is decoded.
    """
    body = msgpack.packb(manifest.to_dict(), use_bin_type=True)
    return msgpack.packb({"format": FORMAT_NAME, "version": list(manifest.version), "hash": HASH_ALGORITHM,
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
        return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(list(obj), use_bin_type=True, default=_default))
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
    raise ManifestError(f"object: unknown msgpack extension type {code}")


def encode_object(value: Any, *, key: str = "?") -> bytes:
    """Encode a msgpack-able user value (numpy scalars and tuples are preserved)."""
    try:
        return msgpack.packb(value, use_bin_type=True, default=_default, strict_types=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise StateError(
            f"object {key!r}: cannot be stored ({e}); objects must be ints, floats, str, bytes, lists, "
            "tuples, dicts or numpy scalars (tensors go in as tensors)"
        ) from None


def decode_object(data: bytes, *, key: str = "?") -> Any:
    """Decode a user value written by :func:`encode_object`."""
    try:
        return _unpack(data, f"object {key!r}", _ext_hook)
    except ManifestError:
        raise
    except (TypeError, ValueError) as e:
        raise ManifestError(f"object {key!r}: cannot be decoded ({e})") from None
