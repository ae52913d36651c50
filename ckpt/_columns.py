"""Shard lists as columns: how format 2 stores a tensor's shards, decoded without per-shard objects.

A DeepSeek-V3-sized save on 16,384 ranks has over a million shards. As msgpack maps (format 1) they
were slow to decode into Python objects (measured in docs/BENCHMARKS.md, section "Planning at
scale"); as columns of fixed-width little-endian integers they decode with one ``np.frombuffer``
each, are validated with vectorized checks, and become ``ShardEntry`` objects only when something
asks for them (``TensorEntry.shards``). A loading rank that needs a few hundred of those shards
finds them with :meth:`ShardColumns.candidates` (a bounding-box test over the columns) instead of
walking every shard.

Every column is non-negative; each is stored in the narrowest of u1/u2/u4/u8 that holds its largest
value, as ``[width_code, bytes]`` (docs/FORMAT.md "Shard columns").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpt.errors import ManifestError
from ckpt.shards import Box, Flat, Region

INT64_MAX = 2**63 - 1
KIND_BOX, KIND_FLAT, KIND_FLAT_IN_BOX = 0, 1, 2
_CODES: dict[str, np.dtype[Any]] = {c: np.dtype("<" + c) for c in ("u1", "u2", "u4", "u8")}


def encode_column(values: np.ndarray) -> list[Any]:
    """``[code, bytes]`` for a column of non-negative integers, in the narrowest width that fits."""
    top = int(values.max()) if values.size else 0
    for code, dt in _CODES.items():
        if top <= np.iinfo(dt).max:
            return [code, np.ascontiguousarray(values, dtype=dt).tobytes()]
    raise ValueError(f"column value {top} does not fit 64 bits")  # pragma: no cover - callers pass int64


def decode_column(w: Any, count: int, what: str) -> np.ndarray:
    """Decode ``[code, bytes]`` holding ``count`` values to int64, rejecting anything malformed."""
    if not (isinstance(w, list) and len(w) == 2 and isinstance(w[0], str) and isinstance(w[1], bytes)):
        raise ManifestError(f"{what}: column is not [width, bytes]")
    dt = _CODES.get(w[0])
    if dt is None:
        raise ManifestError(f"{what}: column width {w[0]!r} unknown (u1, u2, u4 or u8)")
    if len(w[1]) != count * dt.itemsize:
        raise ManifestError(f"{what}: column holds {len(w[1])} bytes, expected {count} values of {w[0]}")
    arr = np.frombuffer(w[1], dtype=dt)
    if dt.itemsize == 8 and arr.size and int(arr.max()) > INT64_MAX:
        raise ManifestError(f"{what}: a value exceeds 2**63 - 1")
    return arr.astype(np.int64)



@dataclass(slots=True)
class ShardEntry:
    """One stored piece of a global tensor: its region and where its bytes are."""

    region: Region
    file: str
    offset: int
    length: int
    checksum: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"file": self.file, "offset": self.offset, "length": self.length}
        if isinstance(self.region, Box):
            d["box"] = self.region.to_list()
        else:
            d["flat"] = self.region.to_list()
            if self.region.box is not None:  # a flat range of this box's own flattening
                d["box"] = self.region.box.to_list()
        if self.checksum is not None:
            d["checksum"] = self.checksum
        return d

@dataclass(slots=True)
class ShardColumns:
    """The shards of one tensor, one array per field (row ``i`` is shard ``i``).

    ``box`` is ``(n, 2 * ndim)``: offsets then lengths (zeros for plain flat rows); ``flat`` is
    ``(n, 2)`` start/stop (zeros for box rows); ``checksum`` is -1 where a shard has none.
    ``file`` indexes ``files``, the manifest's list of data files.
    """

    kind: np.ndarray
    box: np.ndarray
    flat: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    checksum: np.ndarray
    files: list[str]

    def __len__(self) -> int:
        return len(self.kind)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    # -- rows ---------------------------------------------------------------------------------

    def rows(self, indices: np.ndarray | None = None) -> list[Any]:
        """``ShardEntry`` objects for the given rows (all by default), in row order."""

        idx = np.arange(len(self)) if indices is None else indices
        nd = self.box.shape[1] // 2
        kinds, boxes, flats = self.kind[idx].tolist(), self.box[idx].tolist(), self.flat[idx].tolist()
        files, offs, lens, sums = (self.file[idx].tolist(), self.offset[idx].tolist(), self.length[idx].tolist(),
                                   self.checksum[idx].tolist())
        out = []
        for j in range(len(kinds)):
            k, b = kinds[j], boxes[j]
            region: Region
            if k == KIND_BOX:
                region = Box(tuple(b[:nd]), tuple(b[nd:]))
            else:
                inner = Box(tuple(b[:nd]), tuple(b[nd:])) if k == KIND_FLAT_IN_BOX else None
                region = Flat(flats[j][0], flats[j][1], inner)
            c = sums[j]
            out.append(ShardEntry(region, self.files[files[j]], offs[j], lens[j], None if c < 0 else c))
        return out

    @classmethod
    def from_rows(cls, shards: list[Any], ndim: int, files: list[str], file_index: dict[str, int]) -> ShardColumns:
        """Columns of a list of ``ShardEntry`` (``file_index`` maps a path to its index in ``files``)."""
        n = len(shards)
        kinds, boxes, flats, fidx, offs, lens, sums = [], [], [], [], [], [], []
        zero_box, zero_flat = (0,) * (2 * ndim), (0, 0)
        for s in shards:
            r = s.region
            if isinstance(r, Box):
                kinds.append(KIND_BOX)
                boxes.append(r.offsets + r.lengths)
                flats.append(zero_flat)
            else:
                flats.append((r.start, r.stop))
                if r.box is None:
                    kinds.append(KIND_FLAT)
                    boxes.append(zero_box)
                else:
                    kinds.append(KIND_FLAT_IN_BOX)
                    boxes.append(r.box.offsets + r.box.lengths)
            fidx.append(file_index[s.file])
            offs.append(s.offset)
            lens.append(s.length)
            sums.append(-1 if s.checksum is None else s.checksum)
        box = np.array(boxes, dtype=np.int64).reshape(n, 2 * ndim)
        cols = np.array([fidx, offs, lens, sums], dtype=np.int64).reshape(4, n)
        kind, flat = np.array(kinds, dtype=np.int64), np.array(flats, dtype=np.int64).reshape(n, 2)
        return cls(kind, box, flat, cols[0], cols[1], cols[2], cols[3], files)

    # -- lookup -------------------------------------------------------------------------------

    def candidates(self, want: Region, shape: tuple[int, ...]) -> np.ndarray:
        """Rows that may hold elements of ``want`` (a superset of the shards that intersect it).

        Bounding boxes first; then flat ranges where both sides are flat ranges of the same block
        (ZeRO state split two ways: of a block's 128 pieces only the few that overlap are kept).
        """
        nd = len(shape)
        n = len(self)
        if nd == 0 or n == 0:
            return np.arange(n)
        lo, hi = self._bounds(shape)
        w_lo, w_hi = _bounds_of(want, shape)
        hit = ((lo < w_hi) & (hi > w_lo)).all(axis=1)
        if isinstance(want, Flat):
            if want.box is None:
                same = self.kind == KIND_FLAT
            else:
                key = np.asarray(want.box.offsets + want.box.lengths, dtype=np.int64)
                same = (self.kind == KIND_FLAT_IN_BOX) & (self.box == key).all(axis=1)
            hit &= ~same | ((self.flat[:, 0] < want.stop) & (self.flat[:, 1] > want.start))
        return np.nonzero(hit)[0]

    def _bounds(self, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Per row, the bounding box ``[lo, hi)`` of its region."""
        nd = len(shape)
        lo = self.box[:, :nd].copy()
        hi = lo + self.box[:, nd:]
        plain = self.kind == KIND_FLAT
        if plain.any():
            lo[plain], hi[plain] = _flat_rows(self.flat[plain, 0], self.flat[plain, 1], shape)
        return lo, hi

    # -- wire ---------------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """The tensor's ``shards`` map in format 2 (only the columns that are not all default)."""
        d: dict[str, Any] = {"n": len(self), "file": encode_column(self.file), "offset": encode_column(self.offset),
                             "length": encode_column(self.length)}
        if (self.kind != KIND_BOX).any():
            d["kind"] = encode_column(self.kind)
            d["flat"] = encode_column(self.flat.reshape(-1))
        if self.box.shape[1] and (self.kind != KIND_FLAT).any():
            d["box"] = encode_column(self.box.reshape(-1))
        has = self.checksum >= 0
        if has.any():
            d["checksum"] = encode_column(np.where(has, self.checksum, 0))
            if not has.all():
                d["has_checksum"] = encode_column(has.astype(np.int64))
        return d

    @classmethod
    def from_wire(cls, w: Any, shape: tuple[int, ...], isz: int, files: list[str], sizes: np.ndarray,
                  what: str) -> ShardColumns:
        """Decode and validate a format-2 ``shards`` map of a tensor of ``shape`` with ``isz``-byte items.

        Checks, vectorized: regions inside the shape, lengths equal to element counts times the item
        size, file indices valid, byte ranges inside their files. Raises ManifestError naming the
        tensor and the first bad shard.
        """
        if not isinstance(w, dict):
            raise ManifestError(f"{what}: shards is not a map of columns")
        n = w.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0 or n > INT64_MAX:
            raise ManifestError(f"{what}: shard count {n!r} is not a non-negative integer")
        nd = len(shape)

        def col(name: str, count: int, required: bool = True) -> np.ndarray | None:
            if name not in w:
                if required:
                    raise ManifestError(f"{what}: shard column {name!r} is missing")
                return None
            return decode_column(w[name], count, f"{what} column {name!r}")

        file, offset, length = (col(c, n) for c in ("file", "offset", "length"))
        assert file is not None and offset is not None and length is not None
        kind = col("kind", n, False)
        if kind is None:
            kind = np.zeros(n, dtype=np.int64)
        elif (kind > KIND_FLAT_IN_BOX).any():
            raise ManifestError(f"{what} shard {_first(kind > KIND_FLAT_IN_BOX)}: region kind unknown")
        flat_raw = col("flat", 2 * n, bool((kind != KIND_BOX).any()))
        flat = np.zeros((n, 2), dtype=np.int64) if flat_raw is None else flat_raw.reshape(n, 2)
        boxed = kind != KIND_FLAT
        box_raw = col("box", 2 * nd * n, bool(nd and boxed.any()))
        box = np.zeros((n, 2 * nd), dtype=np.int64) if box_raw is None else box_raw.reshape(n, 2 * nd)
        checksum = np.full(n, -1, dtype=np.int64)
        sums = col("checksum", n, False)
        if sums is not None:
            if (sums > 0xFFFFFFFF).any():
                raise ManifestError(f"{what} shard {_first(sums > 0xFFFFFFFF)}: checksum is not a 32-bit value")
            has = col("has_checksum", n, False)
            checksum = sums if has is None else np.where(has > 0, sums, -1)

        shp = np.asarray(shape, dtype=np.int64).reshape(1, nd)
        offs, lens = box[:, :nd], box[:, nd:]
        bad = boxed & ((lens > shp) | (offs > shp - lens)).any(axis=1)
        if bad.any():
            i = _first(bad)
            raise ManifestError(f"{what} shard {i}: box {[offs[i].tolist(), lens[i].tolist()]} exceeds the shape "
                                f"{list(shape)}")
        # Box element counts cannot overflow: each length is at most its dim and the shape's product
        # was checked to fit int64.
        box_numel = np.prod(lens, axis=1) if nd else np.ones(n, dtype=np.int64)
        total = 1
        for s in shape:
            total *= s
        limit = np.where(kind == KIND_FLAT_IN_BOX, box_numel, total)
        flat_rows = kind != KIND_BOX
        bad = flat_rows & ((flat[:, 1] < flat[:, 0]) | (flat[:, 1] > limit))
        if bad.any():
            i = _first(bad)
            raise ManifestError(f"{what} shard {i}: flat range {flat[i].tolist()} is not [start, stop) within "
                                f"{int(limit[i])} elements")
        numel = np.where(flat_rows, flat[:, 1] - flat[:, 0], box_numel)
        bad = (length % isz != 0) | (length // isz != numel)
        if bad.any():
            i = _first(bad)
            raise ManifestError(f"{what} shard {i}: length {int(length[i])} bytes does not match {int(numel[i])} "
                                f"elements of {isz} bytes")
        bad = file >= len(files)
        if bad.any():
            raise ManifestError(f"{what} shard {_first(bad)}: file index {int(file[_first(bad)])} is not in the "
                                f"manifest's {len(files)} files")
        bad = offset > sizes[file] - length if n else bad
        if bad.any():
            i = _first(bad)
            raise ManifestError(f"{what} shard {i}: bytes [{int(offset[i])}, {int(offset[i]) + int(length[i])}) lie "
                                f"beyond the end of {files[int(file[i])]!r}")
        return cls(kind, box, flat, file, offset, length, checksum, files)


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _flat_rows(start: np.ndarray, stop: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Bounding boxes of flat ranges of a tensor: rows ``[start // row, ceil(stop / row))`` of dim 0."""
    row = 1
    for s in shape[1:]:
        row *= s
    row = max(row, 1)
    lo = np.zeros((len(start), len(shape)), dtype=np.int64)
    hi = np.tile(np.asarray(shape, dtype=np.int64), (len(start), 1))
    lo[:, 0] = start // row
    hi[:, 0] = -(-stop // row)
    return lo, hi


def _bounds_of(region: Region, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The bounding box ``[lo, hi)`` of one region."""
    if isinstance(region, Flat) and region.box is None:
        lo, hi = _flat_rows(np.array([region.start]), np.array([region.stop]), shape)
        return lo[0], hi[0]
    box = region if isinstance(region, Box) else region.box
    assert box is not None
    lo = np.asarray(box.offsets, dtype=np.int64)
    return lo, lo + np.asarray(box.lengths, dtype=np.int64)
