"""The manifest model: plain dataclasses with ``to_dict``/``from_dict``, validated once at the boundary.

The byte encoding (msgpack) lives in ``ckpt.formats.manifest_codec``; docs/FORMAT.md is the spec.
"""

from __future__ import annotations

import math
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any

from ckpt.dtypes import dtype_from_name, itemsize
from ckpt.errors import FormatVersionError, ManifestError
from ckpt.shards import Box, Flat, Region

FORMAT_NAME = "ckpt"
FORMAT_VERSION = (1, 0)
MANIFEST_NAME = "manifest.msgpack"
DATA_DIR = "data"
HASH_ALGORITHM = "crc32"


def entry_name(key: str, index: int) -> str:
    """Name of shard ``index`` of tensor ``key`` inside its safetensors data file."""
    return f"{key}@{index}"


def check_relpath(path: Any, what: str) -> str:
    """Reject any manifest path that is not a relative, normalized path inside the checkpoint."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{what}: file path {path!r} is not a non-empty string")
    if (
        path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or posixpath.normpath(path) != path
        or path.split("/")[0] in ("..", ".")
        or ".." in path.split("/")
        or ":" in path.split("/")[0]
    ):
        raise ManifestError(
            f"{what}: file path {path!r} escapes or is not normalized inside the checkpoint directory; "
            "refusing to read it (the manifest may be hostile or corrupted)"
        )
    return path


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
class TensorEntry:
    """A global tensor: dtype name, global shape, and its stored shards."""

    dtype: str
    shape: tuple[int, ...]
    shards: list[ShardEntry] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "shards": [s.to_dict() for s in self.shards]}


@dataclass(slots=True)
class ObjectEntry:
    """A non-tensor value, msgpack-encoded. ``per_rank`` maps rank -> bytes for per-rank objects."""

    data: bytes | None = None
    checksum: int | None = None
    per_rank: dict[int, bytes] | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.per_rank is not None:
            return {"per_rank": {int(r): v for r, v in self.per_rank.items()}}
        d: dict[str, Any] = {"inline": self.data}
        if self.checksum is not None:
            d["checksum"] = self.checksum
        return d


@dataclass(slots=True)
class Manifest:
    """Everything a reader needs; written last, its presence commits a checkpoint."""

    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    step: int | None = None
    created: float = field(default_factory=time.time)
    world_size: int = 1
    layout: dict[str, Any] | None = None
    user_metadata: dict[str, Any] = field(default_factory=dict)
    hash_algorithm: str = HASH_ALGORITHM
    version: tuple[int, int] = FORMAT_VERSION
    stats: dict[str, Any] | None = None
    data_format: str = "safetensors"  # or "zarr" (docs/FORMAT.md)
    partial: bool = False  # not stored: a non-coordinator rank's view of a save (its own pieces only)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data stored (sum of shard lengths)."""
        return sum(t.nbytes for t in self.tensors.values())

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": list(self.version),
            "step": self.step,
            "created": self.created,
            "world_size": self.world_size,
            "layout": self.layout,
            "hash": self.hash_algorithm,
            "tensors": {k: t.to_dict() for k, t in self.tensors.items()},
            "objects": {k: o.to_dict() for k, o in self.objects.items()},
            "files": {p: {"size": s} for p, s in self.files.items()},
            "user": self.user_metadata,
        }
        if self.stats is not None:
            d["stats"] = self.stats
        if self.data_format != "safetensors":
            d["data_format"] = self.data_format
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Manifest:
        """Validate a decoded manifest against the schema; raise ManifestError naming the field."""
        if not isinstance(d, dict):
            raise ManifestError("manifest: top level is not a map; the file is not a ckpt manifest")
        if d.get("format") != FORMAT_NAME:
            raise ManifestError(f"manifest: format is {d.get('format')!r}, expected {FORMAT_NAME!r}")
        version = d.get("version")
        if not (isinstance(version, list) and len(version) == 2 and all(_is_int(v) for v in version)):
            raise ManifestError(f"manifest: version {version!r} is not [major, minor]")
        if version[0] != FORMAT_VERSION[0]:
            raise FormatVersionError(
                f"manifest: format version {version[0]}.{version[1]} is not supported by this ckpt "
                f"(reads {FORMAT_VERSION[0]}.x); upgrade ckpt to read this checkpoint"
            )
        files_raw = _get(d, "files", dict, "manifest")
        files: dict[str, int] = {}
        for p, f in files_raw.items():
            check_relpath(p, "manifest files")
            size = _get(f, "size", int, f"file {p!r}") if isinstance(f, dict) else None
            if size is None or size < 0:
                raise ManifestError(f"file {p!r}: size missing or negative in manifest")
            files[p] = size
        tensors: dict[str, TensorEntry] = {}
        for key, t in _get(d, "tensors", dict, "manifest").items():
            tensors[_key(key)] = _tensor_from_dict(key, t, files)
        objects: dict[str, ObjectEntry] = {}
        for key, o in _get(d, "objects", dict, "manifest").items():
            objects[_key(key)] = _object_from_dict(key, o)
        step = d.get("step")
        if step is not None and not _is_int(step):
            raise ManifestError(f"manifest: step {step!r} is not an integer")
        created = d.get("created", 0.0)
        if not isinstance(created, int | float):
            raise ManifestError("manifest: created is not a number")
        world_size = d.get("world_size", 1)
        if not _is_int(world_size) or world_size < 1:
            raise ManifestError(f"manifest: world_size {world_size!r} is not a positive integer")
        layout = d.get("layout")
        if layout is not None and not isinstance(layout, dict):
            raise ManifestError("manifest: layout is not a map")
        user = d.get("user") or {}
        if not isinstance(user, dict):
            raise ManifestError("manifest: user metadata is not a map")
        hash_alg = d.get("hash", HASH_ALGORITHM)
        if hash_alg != HASH_ALGORITHM:
            raise ManifestError(f"manifest: hash algorithm {hash_alg!r} unknown (this ckpt knows crc32)")
        stats = d.get("stats")
        data_format = d.get("data_format", "safetensors")
        if data_format not in ("safetensors", "zarr"):
            raise ManifestError(f"manifest: data_format {data_format!r} unknown (safetensors or zarr)")
        return cls(
            tensors=tensors, objects=objects, files=files, step=step, created=float(created),
            world_size=world_size, layout=layout, user_metadata=user, hash_algorithm=hash_alg,
            version=(version[0], version[1]), stats=stats if isinstance(stats, dict) else None,
            data_format=data_format,
        )


_INT_MAX = 2**63 - 1  # every offset, length and size must fit an int64 (numpy, file offsets)
MAX_DIMS = 64


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_INT_MAX <= v <= _INT_MAX


def _key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise ManifestError(f"manifest: key {key!r} is not a non-empty string")
    return key


def _get(d: Any, name: str, typ: type, what: str) -> Any:
    if not isinstance(d, dict) or name not in d:
        raise ManifestError(f"{what}: field {name!r} is missing")
    v = d[name]
    if typ is int:
        if not _is_int(v):
            raise ManifestError(f"{what}: field {name!r} is {v!r}, expected an integer")
    elif not isinstance(v, typ):
        raise ManifestError(f"{what}: field {name!r} has type {type(v).__name__}, expected {typ.__name__}")
    return v


def _int_list(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_DIMS or not all(_is_int(x) and x >= 0 for x in v):
        raise ManifestError(f"{what}: {str(v)[:80]} is not a list of at most {MAX_DIMS} non-negative int64 values")
    return tuple(v)


def _tensor_from_dict(key: str, t: Any, files: dict[str, int]) -> TensorEntry:
    what = f"tensor {key!r}"
    dtype = _get(t, "dtype", str, what)
    size = itemsize(dtype_from_name(dtype, key=key))
    shape = _int_list(_get(t, "shape", list, what), f"{what} shape")
    if math.prod(shape) > _INT_MAX:
        raise ManifestError(f"{what}: shape {list(shape)} has more than 2**63 elements")
    shards: list[ShardEntry] = []
    for i, s in enumerate(_get(t, "shards", list, what)):
        swhat = f"{what} shard {i}"
        if not isinstance(s, dict):
            raise ManifestError(f"{swhat}: not a map")
        region: Region
        box_region: Box | None = None
        if "box" in s:
            box = s["box"]
            if not (isinstance(box, list) and len(box) == 2):
                raise ManifestError(f"{swhat}: box is not [offsets, lengths]")
            offs, lens = _int_list(box[0], f"{swhat} offsets"), _int_list(box[1], f"{swhat} lengths")
            if len(offs) != len(shape) or len(lens) != len(shape):
                raise ManifestError(f"{swhat}: box rank does not match shape {list(shape)}")
            if any(o + n > g for o, n, g in zip(offs, lens, shape, strict=True)):
                raise ManifestError(f"{swhat}: box {[list(offs), list(lens)]} exceeds the shape {list(shape)}")
            box_region = Box(offs, lens)
        if "flat" in s:
            fl = _int_list(s["flat"], f"{swhat} flat")
            limit = box_region.numel if box_region is not None else math.prod(shape)
            if len(fl) != 2 or fl[1] < fl[0] or fl[1] > limit:
                raise ManifestError(f"{swhat}: flat range {list(fl)} is not [start, stop) within {limit} elements")
            region = Flat(fl[0], fl[1], box_region)
        elif box_region is not None:
            region = box_region
        else:
            raise ManifestError(f"{swhat}: neither 'box' nor 'flat' given")
        file = check_relpath(_get(s, "file", str, swhat), swhat)
        offset = _get(s, "offset", int, swhat)
        length = _get(s, "length", int, swhat)
        if offset < 0 or length < 0:
            raise ManifestError(f"{swhat}: negative offset or length")
        if length != region.numel * size:
            raise ManifestError(
                f"{swhat}: length {length} bytes does not match {region.numel} elements of {dtype}"
            )
        if file not in files:
            raise ManifestError(f"{swhat}: file {file!r} is not listed in the manifest's files")
        if offset + length > files[file]:
            raise ManifestError(f"{swhat}: bytes [{offset}, {offset + length}) lie beyond the end of {file!r}")
        checksum = s.get("checksum")
        if checksum is not None and not _is_int(checksum):
            raise ManifestError(f"{swhat}: checksum {checksum!r} is not an integer")
        shards.append(ShardEntry(region, file, offset, length, checksum))
    return TensorEntry(dtype, shape, shards)


def _object_from_dict(key: str, o: Any) -> ObjectEntry:
    what = f"object {key!r}"
    if not isinstance(o, dict):
        raise ManifestError(f"{what}: not a map")
    if "per_rank" in o:
        pr = o["per_rank"]
        if not isinstance(pr, dict) or not all(_is_int(r) and isinstance(v, bytes) for r, v in pr.items()):
            raise ManifestError(f"{what}: per_rank is not a map of rank -> bytes")
        return ObjectEntry(per_rank=dict(pr))
    data = o.get("inline")
    if not isinstance(data, bytes):
        raise ManifestError(f"{what}: inline value is missing or not bytes")
    checksum = o.get("checksum")
    if checksum is not None and not _is_int(checksum):
        raise ManifestError(f"{what}: checksum is not an integer")
    return ObjectEntry(data=data, checksum=checksum)
