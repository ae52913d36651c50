"""Editing a manifest in tests: the format-1 view (plain maps, shard lists, no checksum).

Format 2 wraps the manifest in a checksummed envelope and stores shards as columns; tests that
damage single fields on purpose read the manifest as the equivalent format-1 map, edit it, and
write it back as format 1 (which ckpt still reads, with the same validation of every field). The
format-2 envelope and columns have their own tests (tests/core/test_manifest_columns.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgpack

from ckpt.formats.msgpack_codec import decode_manifest
from ckpt.manifest import MANIFEST_NAME


def v1_dict(raw: bytes) -> dict[str, Any]:
    """The format-1 map of the manifest encoded in ``raw`` (either format)."""
    m = decode_manifest(raw)
    d: dict[str, Any] = {
        "format": "ckpt", "version": [1, 0], "step": m.step, "created": m.created, "world_size": m.world_size,
        "layout": m.layout, "hash": m.hash_algorithm,
        "tensors": {k: {"dtype": t.dtype, "shape": list(t.shape), "shards": [s.to_dict() for s in t.shards]}
                    for k, t in m.tensors.items()},
        "objects": {k: o.to_dict() for k, o in m.objects.items()},
        "files": {p: {"size": s} for p, s in m.files.items()},
        "user": m.user_metadata,
    }
    if m.stats is not None:
        d["stats"] = m.stats
    if m.data_format != "safetensors":
        d["data_format"] = m.data_format
    return d


def read_manifest(url: str) -> dict[str, Any]:
    """The manifest of the checkpoint at ``url`` as a format-1 map."""
    with open(os.path.join(url, MANIFEST_NAME), "rb") as f:
        return v1_dict(f.read())


def write_manifest(url: str, d: dict[str, Any]) -> None:
    """Write ``d`` as the checkpoint's manifest, encoded as format 1."""
    with open(os.path.join(url, MANIFEST_NAME), "wb") as f:
        f.write(msgpack.packb(d, use_bin_type=True))


def edit_manifest(url: str, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Apply ``edit`` to the format-1 map of the manifest and write the result back."""
    d = read_manifest(url)
    edit(d)
    write_manifest(url, d)
