"""Dtype names used in manifests and in safetensors headers."""

from __future__ import annotations

import functools

import torch

from ckpt.errors import ManifestError, StateError

# Manifest names are torch's own names (without the "torch." prefix) so that every dtype torch has
# can be represented; safetensors names are only used inside data-file headers.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in [
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
    ]
    if hasattr(torch, name)
}
_NAME_OF: dict[torch.dtype, str] = {v: k for k, v in _TORCH_DTYPES.items()}

# safetensors header dtype for each torch dtype it can name; others are stored as raw U8 bytes
# (the file stays a valid safetensors file; the manifest carries the real dtype).
_SAFETENSORS_NAME: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


def dtype_name(dtype: torch.dtype, *, key: str = "?") -> str:
    """Return the manifest name of ``dtype``; raise StateError for dtypes the format cannot hold."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise StateError(f"tensor {key!r}: dtype {dtype} is not supported by the checkpoint format") from None


def dtype_from_name(name: str, *, key: str = "?") -> torch.dtype:
    """Return the torch dtype for a manifest dtype name; raise ManifestError when unknown."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ManifestError(
            f"tensor {key!r}: unknown dtype {name!r} in manifest; upgrade ckpt or check the file"
        ) from None


def safetensors_dtype(dtype: torch.dtype) -> str | None:
    """Return the safetensors header name for ``dtype``, or None when it must be stored as U8."""
    return _SAFETENSORS_NAME.get(dtype)


@functools.cache
def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()
