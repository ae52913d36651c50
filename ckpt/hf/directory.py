"""A Hugging Face model directory on storage: its file names, the dtypes it holds, reading its index and
safetensors headers (no tensor data), and cutting an export into ``model-0000k-of-0000n.safetensors``
files with their headers and ``model.safetensors.index.json``.

Shared by the embedded MoE (:mod:`ckpt.hf.embedded`) and the adapter families (:mod:`ckpt.hf.engine`);
the streaming itself is :mod:`ckpt._stream`'s.
"""

from __future__ import annotations

import json
import math
import re
import struct
from typing import Any

import torch

from ckpt._dtypes import safetensors_dtype
from ckpt._stream import Item, OutFile
from ckpt.errors import IntegrityError, ManifestError, MismatchError, StateError
from ckpt.formats import foreign_json
from ckpt.formats.safetensors_header import MAX_HEADER_BYTES, HeaderEntry, build_header, parse_header
from ckpt.manifest import check_relpath
from ckpt.storage import Storage

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# The names of a model's weights as exports (ours and ``save_pretrained``) give them: an export with
# overwrite replaces these and nothing else (a user's ``adapter_model.safetensors`` beside them stays).
WEIGHTS_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
# The index an export with overwrite puts over the old one on an object store while it replaces files of
# the same names (ckpt.hf.publish): no weight_map, so that no reader takes the directory for a model.
INCOMPLETE_KEY = "ckpt_incomplete_export"
INCOMPLETE_MESSAGE = ("an export with overwrite into this directory did not finish while it replaced the model's "
                      "files (object stores replace them one at a time): the previous model is gone and the new one "
                      "is incomplete; run the export again (export_hf(..., overwrite=True) / ckpt export-hf "
                      "--overwrite)")
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # "5GB", as transformers counts it
ST_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it

# Output dtypes a Hugging Face export may use, and the float dtypes an import may read.
DTYPE_ALIASES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
HF_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
IMPORTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
ST_TO_TORCH = {st: dt for dt in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2) if (st := safetensors_dtype(dt)) is not None}

Tensors = list[tuple[str, tuple[int, ...], list[Item]]]
"""Hugging Face tensors of an export, in order: (name, shape, the items written back to back)."""


def few(items: list[str], n: int = 6) -> str:
    return "; ".join(items[:n]) + (f"; and {len(items) - n} more" if len(items) > n else "")


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "k": 10**3, "m": 10**6, "g": 10**9,
          "t": 10**12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Bytes from ``5000``, ``"5GB"`` (10**9, as transformers counts) or ``"1GiB"`` (2**30).

    Raises StateError on anything else or on a size below one byte.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.match(str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise StateError(f"{what} {value!r} is not a size; write e.g. 5GB, 500MB, 1GiB or a number of bytes")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise StateError(f"{what} {value!r} must be at least one byte")
    return n


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"|"fp16"|"fp32"`` (or torch names / dtypes) -> torch dtype; None stays None.

    Raises StateError for any other dtype: a Hugging Face export holds float32, float16 or bfloat16.
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        dt: torch.dtype | None = value
    else:
        dt = DTYPE_ALIASES.get(str(value).lower().removeprefix("torch."))
    if dt not in HF_DTYPES:
        raise StateError(f"dtype {value!r} is not supported: a Hugging Face checkpoint of this model holds "
                         "bf16, fp16 or fp32 weights; pass one of those")
    return dt


def export_dtype(stored: set[torch.dtype], dtype: torch.dtype | None, *, url: str) -> torch.dtype:
    """The export's dtype: ``dtype`` when given, else the one stored dtype, else float32 for mixed
    float16/bfloat16/float32 (the widest, so the export is lossless); MismatchError otherwise."""
    if dtype is not None:
        return dtype
    if len(stored) == 1 and next(iter(stored)) in HF_DTYPES:
        return next(iter(stored))
    if stored <= set(HF_DTYPES):
        return torch.float32
    raise MismatchError(f"{url}: stored dtypes {sorted(str(k) for k in stored)} cannot be written to a "
                        "Hugging Face checkpoint as they are; pass dtype bf16, fp16 or fp32")


# ---------------------------------------------------------------------------------------------
# Reading: config, index, safetensors headers
# ---------------------------------------------------------------------------------------------


def read_json(storage: Storage, name: str) -> Any:
    """The JSON file ``name`` of a model directory, through the one bounded reader
    (:mod:`ckpt.formats.foreign_json`): the index's budget for the index, a config's for any other.

    Raises ConfigError (too large, too deep, too many values, not valid JSON).
    """
    return foreign_json.read_storage(storage, name, budget=foreign_json.INDEX if name == INDEX_NAME
                                     else foreign_json.CONFIG)


def read_header(storage: Storage, path: str, size: int) -> dict[str, HeaderEntry]:
    """The entries of the safetensors file ``path`` (``size`` bytes), from its header alone."""
    where = f"{storage.url}/{path}"
    if size < 8:
        raise IntegrityError(f"{where}: {size} bytes, shorter than a safetensors header; the file is truncated")
    head = bytearray(8)
    storage.read_into(path, 0, memoryview(head))
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise IntegrityError(f"{where}: safetensors header length {n} exceeds the file ({size} bytes)")
    full = bytearray(8 + n)
    storage.read_into(path, 0, memoryview(full))
    return parse_header(bytes(full), size, path=where)


def read_entries(storage: Storage) -> tuple[dict[str, tuple[str, HeaderEntry]], dict[str, int]]:
    """Every tensor of the directory's safetensors files (as the index assigns them) and file sizes.

    Raises ManifestError (no weights, unreadable index), IntegrityError (a file the index names is
    missing, malformed headers, an index that disagrees with the files), MismatchError (a tensor
    stored twice).
    """
    url = storage.url
    wanted: dict[str, str] | None = None
    if storage.size(INDEX_NAME) is not None:
        idx = read_json(storage, INDEX_NAME)
        if isinstance(idx, dict) and INCOMPLETE_KEY in idx:
            raise ManifestError(f"{url}/{INDEX_NAME}: {INCOMPLETE_MESSAGE}")
        wmap = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
            raise ManifestError(f"{url}/{INDEX_NAME}: no weight_map of tensor name -> file name")
        wanted = dict(wmap)
        names = sorted(set(wanted.values()))
    elif storage.size(SINGLE_NAME) is not None:
        names = [SINGLE_NAME]
    else:
        raise ManifestError(f"{url}: neither {SINGLE_NAME} nor {INDEX_NAME}; no safetensors weights to import")
    sizes: dict[str, int] = {}
    for name in names:
        check_relpath(name, f"{url}/{INDEX_NAME}")
        size = storage.size(name)
        if size is None:
            example = next(k for k, v in (wanted or {}).items() if v == name)
            raise IntegrityError(f"{url}/{name}: missing, but {INDEX_NAME} names it (e.g. for {example!r}); "
                                 "the download is incomplete: fetch that file again")
        sizes[name] = size
    entries: dict[str, tuple[str, HeaderEntry]] = {}
    dupes: list[str] = []
    for name in names:
        for key, h in read_header(storage, name, sizes[name]).items():
            if wanted is not None and wanted.get(key) != name:
                continue  # transformers reads a tensor from the file the index names
            if key in entries:
                dupes.append(key)
            entries[key] = (name, h)
    if wanted is not None:
        absent = sorted(k for k in wanted if k not in entries)
        if absent:
            raise IntegrityError(f"{url}: {INDEX_NAME} maps {few(absent, 3)} to files whose headers lack them; "
                                 "the index and the files disagree")
    if dupes:
        raise MismatchError(f"{url}: tensors stored twice: {few(sorted(dupes))}")
    return entries, sizes


# ---------------------------------------------------------------------------------------------
# Writing: model-k-of-n files and the index
# ---------------------------------------------------------------------------------------------


def _dtype(t: tuple[str, tuple[int, ...], list[Item]], default: torch.dtype) -> torch.dtype:
    """A tensor's dtype in the file: its items' (fp8 weights and their scales keep theirs), else ``default``."""
    return t[2][0].dst_dtype if t[2] else default


def _files(groups: list[Tensors], dtype: torch.dtype) -> list[OutFile]:
    files = []
    for k, group in enumerate(groups):
        entries = []
        for t in group:
            dt = _dtype(t, dtype)
            st = safetensors_dtype(dt)
            assert st is not None
            entries.append((t[0], st, t[1], math.prod(t[1]) * dt.itemsize))
        header, _ = build_header(entries, ST_METADATA)
        files.append(OutFile(f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors", header,
                             [it for _, _, items in group for it in items]))
    return files


def split_files(tensors: Tensors, dtype: torch.dtype, limit: int) -> list[OutFile]:
    """Fill files in order up to ``limit`` bytes, header included (each header entry counted at its
    longest); a larger tensor gets a file of its own. Every export (the embedded MoE's and the
    adapter families'). Each tensor is written as its items' dtype (``dtype`` unless kept, e.g. fp8)."""
    sizes = [math.prod(t[1]) * _dtype(t, dtype).itemsize for t in tensors]
    digits = len(str(sum(sizes)))
    big = 10**digits - 1  # no data offset has more digits: header estimates are upper bounds
    fixed = 8 + len(json.dumps({"__metadata__": ST_METADATA}, separators=(",", ":"))) + 8

    def entry(name: str, shape: tuple[int, ...], dt: torch.dtype) -> int:
        e = {name: {"dtype": safetensors_dtype(dt), "shape": list(shape), "data_offsets": [big, big]}}
        return len(json.dumps(e, separators=(",", ":")))  # braces stand in for the comma

    groups: list[Tensors] = []
    cur: Tensors = []
    size = fixed
    for t, nbytes in zip(tensors, sizes, strict=True):
        add = entry(t[0], t[1], _dtype(t, dtype)) + nbytes
        if cur and size + add > limit:
            groups.append(cur)
            cur, size = [], fixed
        cur.append(t)
        size += add
    if cur:
        groups.append(cur)
    return _files(groups, dtype)


def index_of(files: list[OutFile], computed: tuple[str, dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """``model.safetensors.index.json``'s body for ``files`` (and the ``computed`` file's tensors)."""
    items = [it for f in files for it in f.items]
    weight_map = {it.name: f.path for f in files for it in f.items}
    extra = 0
    if computed is not None:
        weight_map |= {name: computed[0] for name in computed[1]}
        extra = sum(t.numel() * t.element_size() for t in computed[1].values())
    return {"metadata": {"total_size": sum(it.out_bytes for it in items) + extra,
                         "total_parameters": sum(it.numel for it in items)},
            "weight_map": dict(sorted(weight_map.items()))}


def add_computed_file(files: list[OutFile], tensors: dict[str, torch.Tensor],
                      dtype: torch.dtype) -> tuple[str, dict[str, torch.Tensor], bytes] | None:
    """Make room for one more file, the last, holding ``tensors`` (buffers an adapter computes from the
    config, cast to ``dtype``): renames ``files`` to ``model-k-of-(n+1)``; returns that file's name,
    its tensors and its bytes, or None when there are none."""
    if not tensors:
        return None
    import safetensors.torch

    n = len(files) + 1
    for k, f in enumerate(files):
        f.path = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    cast = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
    return f"model-{n:05d}-of-{n:05d}.safetensors", cast, safetensors.torch.save(cast, metadata=ST_METADATA)


__all__ = ["CONFIG_NAME", "INDEX_NAME", "SINGLE_NAME", "WEIGHTS_NAME", "INCOMPLETE_KEY", "INCOMPLETE_MESSAGE",
           "DEFAULT_MAX_SHARD_SIZE", "ST_METADATA",
           "DTYPE_ALIASES", "HF_DTYPES", "IMPORTABLE", "ST_TO_TORCH", "Tensors", "few", "parse_size", "parse_dtype",
           "export_dtype", "read_json", "read_header", "read_entries", "split_files", "index_of", "add_computed_file"]
