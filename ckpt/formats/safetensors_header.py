"""safetensors data-file headers: build them for the writer, parse them (strictly) for verify.

A safetensors file is ``u64 little-endian header length N``, ``N`` bytes of JSON header (padded
with spaces to a multiple of 8), then the data buffer. Entries are laid out in descending itemsize
order so that every entry is aligned to its element size (the buffer has no holes).
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckpt.errors import IntegrityError
from ckpt.formats.budget import INT64_MAX, MAX_DIMS
from ckpt.formats.foreign_json import HEADER_DEPTH, HEADER_ITEMS, Budget, loads

MAX_HEADER_BYTES = 100 * 1024 * 1024  # same bound as the safetensors library


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor entry of a data file: name, safetensors dtype, shape, byte range within the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    length: int


def build_header(entries: Iterable[tuple[str, str, tuple[int, ...], int]],
                 metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """Lay out ``(name, st_dtype, shape, nbytes)`` entries in the given order (names must be unique).

    Returns the header bytes (length prefix included) and each entry's absolute file offset. The JSON
    is the same as ``json.dumps(header, separators=(",", ":"))`` of the header dict, written out
    directly: a 16,384-rank save plans 1.3 M entries, and building a dict per entry for the encoder
    cost more than the rest of the file layout.
    """
    parts = ['"__metadata__":' + json.dumps(metadata, separators=(",", ":"))] if metadata else []
    pos = 0
    rel: list[int] = []
    for name, dtype, shape, nbytes in entries:
        parts.append(f"{_json_str(name)}{_type_json(dtype, tuple(shape))}{pos},{pos + nbytes}]}}")
        rel.append(pos)
        pos += nbytes
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, [len(prefix) + r for r in rel]


@functools.lru_cache(maxsize=1 << 14)
def _type_json(dtype: str, shape: tuple[int, ...]) -> str:
    """``:{"dtype":..,"shape":[..],"data_offsets":[`` of an entry. Cached across calls: the ranks of a
    large save hold blocks of the same few thousand shapes, and formatting one is not free (measured
    in docs/BENCHMARKS.md, section "Figures that code comments used to quote")."""
    return f':{{"dtype":{_json_str(dtype)},"shape":{json.dumps(list(shape), separators=(",", ":"))},"data_offsets":['


# ``json.dumps(s)`` for a str (quoted, escaped, ASCII-only), without the encoder set-up per call:
# this is the function json.dumps itself uses for strings (the C one when available).
_json_str = json.encoder.encode_basestring_ascii


def parse_header(head: bytes, file_size: int, *, path: str) -> dict[str, HeaderEntry]:
    """Parse the header at the start of a data file; ``head`` must hold at least the header.

    Raises IntegrityError naming ``path`` for anything that is not a valid safetensors header.
    """
    if len(head) < 8:
        raise IntegrityError(f"{path}: shorter than a safetensors header (8 bytes)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise IntegrityError(f"{path}: safetensors header length {n} exceeds the file ({file_size} bytes)")
    if len(head) < 8 + n:
        raise IntegrityError(f"{path}: header truncated")
    # the one bounded JSON reader: size (the length prefix, checked above against the file), depth and
    # item count measured before decoding; NaN / Infinity refused
    budget = Budget(MAX_HEADER_BYTES, HEADER_DEPTH, HEADER_ITEMS)
    obj = loads(bytes(head[8 : 8 + n]), where=f"{path}: safetensors header", budget=budget, error=IntegrityError)
    if not isinstance(obj, dict):
        raise IntegrityError(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    out: dict[str, HeaderEntry] = {}
    for name, ent in obj.items():
        if name == "__metadata__":
            continue
        e: Any = ent
        if not (isinstance(e, dict) and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in e["data_offsets"])
                # the shape's range too (budget.dims' bounds, inline: ckpt's own headers hold a million entries)
                and len(e["shape"]) <= MAX_DIMS
                and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT64_MAX for x in e["shape"])):
            raise IntegrityError(f"{path}: safetensors entry {name!r} is malformed")
        s, t = e["data_offsets"]
        if t < s or base + t > file_size:
            raise IntegrityError(f"{path}: safetensors entry {name!r} data_offsets [{s}, {t}) exceed the file")
        out[name] = HeaderEntry(name, e["dtype"], tuple(e["shape"]), base + s, t - s)
    _check_disjoint(out, path)
    return out


def _check_disjoint(entries: dict[str, HeaderEntry], path: str) -> None:
    """Entries' byte ranges must not overlap (safetensors' own rule): so the entries holding data are
    at most as many as the data buffer has bytes, and no two tensors are read from the same bytes."""
    spans = sorted((h.start, h.start + h.length, h.name) for h in entries.values() if h.length)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise IntegrityError(f"{path}: safetensors entries {a!r} and {b!r} overlap in the file; it is damaged "
                                 "(or not written by a safetensors writer)")


__all__ = ["MAX_HEADER_BYTES", "HeaderEntry", "build_header", "parse_header"]
