"""The zarr v3 data layout: each global tensor is a zarr array under ``<tree>/<key>/``, one chunk per
shard, readable by plain ``zarr.open_array`` without this package. Each save writes its own tree
``zarr-<random>/`` (:func:`fresh_root`; the manifest names it, :func:`tree_of` finds it): zarr fixes the
chunk names inside a tree, so only the tree's name keeps two writers' chunks apart. Checkpoints of
earlier versions used a plain ``zarr/`` tree; they load as before.

Chunks are stored uncompressed (codec ``bytes``, little endian), so a chunk file *is* the shard's
row-major bytes: the manifest indexes each chunk as a shard at offset 0 of its file, and
``ckpt.load`` reshards from a zarr checkpoint exactly as from safetensors files. The sharding must
be a uniform grid (every shard the same shape, offsets on the grid), because zarr pads partial
edge chunks; anything else is refused with a clear error. bfloat16 and float8 are stored as
uint16 / uint8 with the real dtype in the array's ``ckpt_dtype`` attribute.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ckpt._checksum import crc32
from ckpt.errors import LayoutError, StateError
from ckpt.shards import Box, Region
from ckpt.storage.base import Storage

ZARR_DIR = "zarr"

# zarr v3 core data types; others are stored as raw unsigned ints of the same width.
_ZARR_DTYPES = {
    "float64": "float64", "float32": "float32", "float16": "float16", "complex64": "complex64",
    "complex128": "complex128", "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool",
}
_RAW_BY_SIZE = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def zarr_dtype(dtype: str, itemsize: int) -> str:
    """The zarr data type a tensor of ``dtype`` is stored as."""
    return _ZARR_DTYPES.get(dtype) or _RAW_BY_SIZE[itemsize]


def check_key(key: str) -> None:
    """Keys become directory names: refuse what would escape, nest unexpectedly or not survive the
    manifest's path rules (no '/', '\\', NUL or leading '.')."""
    if (not key or any(c in key for c in "/\\\x00") or key.startswith(".")
            or any(0xD800 <= ord(c) <= 0xDFFF for c in key)):
        raise StateError(f"tensor {key!r}: keys with '/', '\\', NUL, a lone surrogate or a leading '.' cannot "
                         "be zarr array names; rename it or use the safetensors layout")


def fresh_root(storage: Storage | None = None) -> str:
    """The zarr tree for a new save: always ``zarr-<random>`` (:func:`ckpt._transaction.fresh_zarr_root`),
    whatever the destination holds. Chunk names are fixed by zarr, so a tree shared by two writers
    (two saves racing into one new step) would let the loser's clean-up delete the winner's chunks.
    ``storage`` is not consulted (kept for callers that pass it)."""
    from ckpt._transaction import fresh_zarr_root

    return fresh_zarr_root()


def tree_of(files: Any) -> str | None:
    """The zarr tree a zarr checkpoint's manifest ``files`` live in (``zarr-<id>`` or ``zarr``)."""
    for f in files:
        head, sep, _ = str(f).partition("/")
        if sep and (head == ZARR_DIR or head.startswith(f"{ZARR_DIR}-")):
            return head
    return None


def chunk_shape(key: str, shape: tuple[int, ...], regions: list[Region]) -> tuple[int, ...]:
    """The chunk shape of a uniform shard grid; LayoutError naming the tensor otherwise."""
    boxes = [r for r in regions if isinstance(r, Box)]
    if len(boxes) != len(regions):
        raise LayoutError(f"tensor {key!r}: flat (ZeRO-style) shards have no zarr chunk grid; "
                          "save with data_format='safetensors'")
    if math.prod(shape) == 0:
        return tuple(max(1, n) for n in shape)
    lens = {b.lengths for b in boxes if b.numel}
    if len(lens) != 1:
        raise LayoutError(f"tensor {key!r}: shards of different shapes {sorted(lens)} form no regular zarr chunk "
                          "grid (zarr pads edge chunks); use a sharding that divides the shape evenly, or "
                          "data_format='safetensors'")
    (chunk,) = lens
    for b in boxes:
        if any(o % c for o, c in zip(b.offsets, chunk, strict=True)):
            raise LayoutError(f"tensor {key!r}: shard at offsets {list(b.offsets)} is off the {list(chunk)} chunk "
                              "grid; use data_format='safetensors'")
    return chunk


def chunk_path(key: str, region: Box, root: str = ZARR_DIR) -> str:
    """Relative path of the chunk file holding ``region`` (default key encoding, '/' separator)."""
    idx = [str(o // n) if n else "0" for o, n in zip(region.offsets, region.lengths, strict=True)]
    return "/".join([root, key, "c", *idx])


def array_metadata(dtype: str, itemsize: int, shape: tuple[int, ...], chunks: tuple[int, ...]) -> bytes:
    """``zarr.json`` of one array (zarr format 3)."""
    zd = zarr_dtype(dtype, itemsize)
    fill: Any = False if zd == "bool" else (0.0 if zd.startswith("float") else 0)
    if zd.startswith("complex"):
        fill = [0.0, 0.0]
    meta: dict[str, Any] = {
        "zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": zd,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "attributes": {"ckpt_dtype": dtype},
    }
    return json.dumps(meta, indent=1).encode()


def group_metadata() -> bytes:
    """``zarr.json`` of the root group."""
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {"written_by": "ckpt"}}).encode()


def write_chunks(storage: Storage, pieces: list[tuple[str, Box, torch.Tensor]],
                 wait_piece: Any = None, indices: list[int] | None = None, *,
                 root: str) -> list[tuple[str, int, int]]:
    """Write each ``(key, region, tensor)`` as its own chunk file under the zarr tree ``root``;
    returns ``(path, size, crc32)`` each. ``tensor`` may be a callable returning it when it is ready
    (an async save's staged copy)."""
    from ckpt._io import host_bytes
    from ckpt._transaction import WrittenSet, remove_files

    out: list[tuple[str, int, int]] = []
    written = WrittenSet()  # this rank's own chunks: the only files its failure may remove
    try:
        for n, (key, region, t) in enumerate(pieces):
            if wait_piece is not None and indices is not None:
                wait_piece(indices[n])
            path = chunk_path(key, region, root)
            mv, owner = host_bytes(t() if callable(t) else t)
            written.append(path)
            w = storage.open_writer(path)
            try:
                w.write(mv)
                size = w.close()
            except BaseException:
                w.abort()
                raise
            out.append((path, size, crc32(mv)))
            del owner
    except BaseException:
        remove_files(storage, written)  # a failed save leaves none of its chunks behind
        raise
    return out
