"""The manifest model: plain dataclasses with ``to_dict``/``from_dict``, validated once at the boundary.

The byte encoding (msgpack) lives in ``ckpt.formats.manifest_codec``; docs/FORMAT.md is the spec.
"""

from __future__ import annotations

import math
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckpt._codec import FileCodec
from ckpt._columns import ShardColumns, ShardEntry
from ckpt._dtypes import dtype_from_name, itemsize
from ckpt.errors import FormatVersionError, ManifestError
from ckpt.shards import Box, Flat, Region

FORMAT_NAME = "ckpt"
FORMAT_VERSION = (2, 0)
# Written when a data file is compressed (ckpt._codec): its ``files`` entry gets a third element,
# the codec record, which a 2.0 reader refuses ("files is not a list of [path, size]") instead of
# reading compressed bytes as raw ones.
CODEC_VERSION = (2, 1)
READABLE_MAJORS = (1, 2)  # format 1: shards as maps, no manifest checksum (still read)
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


class TensorEntry:
    """A global tensor: dtype name, global shape, and its stored shards.

    A decoded format-2 manifest keeps the shards as columns (``ShardColumns``) and builds the
    ``ShardEntry`` list only when ``shards`` is first read; :meth:`shards_overlapping` finds the
    shards a region needs without building it.
    """

    __slots__ = ("dtype", "shape", "_shards", "_cols")

    def __init__(self, dtype: str, shape: tuple[int, ...], shards: list[ShardEntry] | None = None, *,
                 columns: ShardColumns | None = None):
        self.dtype = dtype
        self.shape = tuple(shape)
        self._cols = columns
        self._shards: list[ShardEntry] | None = shards if shards is not None or columns is not None else []

    @property
    def shards(self) -> list[ShardEntry]:
        """The shards as objects (built from the columns on first access; mutations stick)."""
        if self._shards is None:
            assert self._cols is not None
            self._shards = self._cols.rows()
            self._cols = None  # the list is the truth from now on
        return self._shards

    @shards.setter
    def shards(self, value: list[ShardEntry]) -> None:
        self._shards, self._cols = value, None

    @property
    def num_shards(self) -> int:
        return len(self._shards) if self._shards is not None else len(self._cols or ())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if self._shards is None and self._cols is not None:
            return self._cols.nbytes
        return sum(s.length for s in self.shards)

    def shards_overlapping(self, region: Region) -> list[ShardEntry]:
        """The shards that may hold elements of ``region`` (a superset; cheap on decoded manifests)."""
        return [s for _, s in self.indexed_shards_overlapping(region)]

    def indexed_shards_overlapping(self, region: Region) -> list[tuple[int, ShardEntry]]:
        """Like :meth:`shards_overlapping`, with each shard's index in the tensor's shard list."""
        if self._shards is not None or self._cols is None:
            return list(enumerate(self.shards))
        idx = self._cols.candidates(region, self.shape)
        return list(zip(idx.tolist(), self._cols.rows(idx), strict=True))

    def columns(self, files: list[str], file_index: dict[str, int]) -> ShardColumns:
        """The shards as columns against the manifest's file list."""
        if self._shards is None and self._cols is not None and self._cols.files is files:
            return self._cols
        return ShardColumns.from_rows(self.shards, len(self.shape), files, file_index)

    def to_dict(self, files: list[str], file_index: dict[str, int]) -> dict[str, Any]:
        """Format-2 form: shards as columns against the manifest's ``files`` (``file_index``: path -> index)."""
        return {"dtype": self.dtype, "shape": list(self.shape), "shards": self.columns(files, file_index).to_wire()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return (self.dtype, self.shape, self.shards) == (other.dtype, other.shape, other.shards)

    def __repr__(self) -> str:
        return f"TensorEntry(dtype={self.dtype!r}, shape={self.shape}, shards={self.num_shards})"


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
    # compressed data files (ckpt._codec): path -> codec record; ``files`` keeps their stored sizes
    codecs: dict[str, FileCodec] = field(default_factory=dict)
    partial: bool = False  # not stored: a non-coordinator rank's view of a save (its own pieces only)
    # not stored: where the manifest came from: "ckpt", or a foreign format read in place ("dcp",
    # "deepspeed"; ckpt.interop.sources), whose shards carry no checksums
    source_format: str = "ckpt"
    _file_list: list[str] | None = field(default=None, repr=False, compare=False)  # as decoded (columns index it)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data stored (sum of shard lengths)."""
        return sum(t.nbytes for t in self.tensors.values())

    def to_dict(self) -> dict[str, Any]:
        """The format-2 body: everything but the envelope (format, version, checksum) that
        ``ckpt.formats.msgpack_codec.encode_manifest`` wraps around its encoding."""
        files = list(self.files)
        if self._file_list is not None and self._file_list == files:
            files = self._file_list  # decoded columns refer to this list: re-encode them as they are
        index = {f: i for i, f in enumerate(files)}
        tensors: dict[str, Any] = {}
        for key, t in self.tensors.items():
            try:
                tensors[key] = t.to_dict(files, index)
            except KeyError as e:  # a shard's file missing from self.files (looked up while building columns)
                raise ManifestError(f"tensor {key!r}: shard file {e.args[0]!r} is not listed in the manifest's "
                                    "files") from None
        d: dict[str, Any] = {
            "step": self.step,
            "created": self.created,
            "world_size": self.world_size,
            "layout": self.layout,
            "tensors": tensors,
            "objects": {k: o.to_dict() for k, o in self.objects.items()},
            "files": [[p, self.files[p], self.codecs[p].to_wire()] if p in self.codecs else [p, self.files[p]]
                      for p in files],
            "user": self.user_metadata,
        }
        if self.stats is not None:
            d["stats"] = self.stats
        if self.data_format != "safetensors":
            d["data_format"] = self.data_format
        return d

    @classmethod
    def from_dict(cls, d: Any, version: tuple[int, int] | None = None) -> Manifest:
        """Validate a decoded manifest against the schema; raise ManifestError naming the field.

        ``d`` is a format-1 manifest (a map carrying its own format and version) or, with
        ``version`` given by the envelope, a format-2 body.
        """
        version = _check_envelope(d, version)
        files, codecs = _files_from_dict(d, version)
        file_list = list(files)
        tensors = _tensors_from_dict(d, version, files, codecs, file_list)
        objects: dict[str, ObjectEntry] = {}
        for key, o in _get(d, "objects", dict, "manifest").items():
            objects[_key(key)] = _object_from_dict(key, o)
        return cls(tensors=tensors, objects=objects, files=files, version=version, codecs=codecs,
                   _file_list=file_list, **_header_from_dict(d))


def _check_envelope(d: Any, version: tuple[int, int] | None) -> tuple[int, int]:
    """The manifest's format version: ``version`` (given by a format-2 envelope), or a format-1 map's own."""
    if not isinstance(d, dict):
        raise ManifestError("manifest: top level is not a map; the file is not a ckpt manifest")
    if version is None:
        if d.get("format") != FORMAT_NAME:
            raise ManifestError(f"manifest: format is {d.get('format')!r}, expected {FORMAT_NAME!r}")
        version = parse_version(d.get("version"))
        if version[0] >= 2:
            raise ManifestError(f"manifest: a format {version[0]} manifest without its checksum envelope")
    return version


def _files_from_dict(d: dict[str, Any], version: tuple[int, int]) -> tuple[dict[str, int], dict[str, FileCodec]]:
    """The validated ``files`` (path -> stored size) and the codec records of the compressed ones."""
    codec_raw: dict[Any, Any] = {}
    if version[0] == 1:
        files_raw = _get(d, "files", dict, "manifest")
        pairs: list[tuple[Any, Any]] = [(p, f.get("size") if isinstance(f, dict) else None)
                                        for p, f in files_raw.items()]
    else:
        files_raw = _get(d, "files", list, "manifest")
        if not all(isinstance(f, list) and (len(f) == 2 or (len(f) == 3 and version >= CODEC_VERSION))
                   for f in files_raw):
            raise ManifestError("manifest: files is not a list of [path, size] (or [path, size, codec] from 2.1)")
        pairs = [(f[0], f[1]) for f in files_raw]
        codec_raw = {f[0]: f[2] for f in files_raw if len(f) == 3}
    files: dict[str, int] = {}
    size: Any
    for p, size in pairs:
        check_relpath(p, "manifest files")
        if not _is_int(size) or size < 0:
            raise ManifestError(f"file {p!r}: size missing or negative in manifest")
        if p in files:
            raise ManifestError(f"file {p!r}: listed twice in the manifest's files")
        files[p] = size
    codecs: dict[str, FileCodec] = {}
    for p, w in codec_raw.items():
        codecs[p] = FileCodec.from_wire(w, p, files[p])
    return files, codecs


def _tensors_from_dict(d: dict[str, Any], version: tuple[int, int], files: dict[str, int],
                       codecs: dict[str, FileCodec], file_list: list[str]) -> dict[str, TensorEntry]:
    """The validated tensor entries, their shards checked against the files' (raw) sizes and frames."""
    # shard offsets and lengths are positions in a file's raw layout: a compressed file's raw size bounds them
    sizes = np.array([codecs[p].raw_size if p in codecs else files[p] for p in file_list], dtype=np.int64)
    tensors: dict[str, TensorEntry] = {}
    file_index = {f: i for i, f in enumerate(file_list)}
    for key, t in _get(d, "tensors", dict, "manifest").items():
        if version[0] == 1:
            tensors[_key(key)] = _tensor_from_dict(key, t, files)
        else:
            tensors[_key(key)] = _tensor_from_columns(key, t, file_list, sizes)
            if codecs:
                _check_frames(key, tensors[key], file_list, file_index, codecs)
    return tensors


def _header_from_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The validated scalar fields (step, created, world size, layout, user metadata, ...) as Manifest arguments."""
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
    return dict(step=step, created=float(created), world_size=world_size, layout=layout, user_metadata=user,
                hash_algorithm=hash_alg, stats=stats if isinstance(stats, dict) else None, data_format=data_format)


def parse_version(version: Any) -> tuple[int, int]:
    """``[major, minor]`` as a tuple; FormatVersionError for a major this ckpt cannot read."""
    if not (isinstance(version, list) and len(version) == 2 and all(_is_int(v) for v in version)):
        raise ManifestError(f"manifest: version {version!r} is not [major, minor]")
    if version[0] not in READABLE_MAJORS:
        raise FormatVersionError(
            f"manifest: format version {version[0]}.{version[1]} is not supported by this ckpt "
            f"(reads {', '.join(f'{m}.x' for m in READABLE_MAJORS)}); upgrade ckpt to read this checkpoint"
        )
    return (version[0], version[1])


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


def _tensor_head(key: str, t: Any) -> tuple[str, str, int, tuple[int, ...]]:
    """A tensor entry's ``(what, dtype, itemsize, shape)``, validated (both formats)."""
    what = f"tensor {key!r}"
    dtype = _get(t, "dtype", str, what)
    size = itemsize(dtype_from_name(dtype, key=key))
    shape = _int_list(_get(t, "shape", list, what), f"{what} shape")
    if math.prod(shape) > _INT_MAX:
        raise ManifestError(f"{what}: shape {list(shape)} has more than 2**63 elements")
    return what, dtype, size, shape


def _tensor_from_dict(key: str, t: Any, files: dict[str, int]) -> TensorEntry:
    what, dtype, size, shape = _tensor_head(key, t)
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


def _tensor_from_columns(key: str, t: Any, files: list[str], sizes: np.ndarray) -> TensorEntry:
    what, dtype, size, shape = _tensor_head(key, t)
    cols = ShardColumns.from_wire(_get(t, "shards", dict, what), shape, size, files, sizes, what)
    return TensorEntry(dtype, shape, columns=cols)


def _check_frames(key: str, t: TensorEntry, files: list[str], file_index: dict[str, int],
                  codecs: dict[str, FileCodec]) -> None:
    """Every shard stored in a compressed file lies inside that file's frames (``FileCodec.check_covers``)."""
    cols = t.columns(files, file_index)
    for i in np.unique(cols.file).tolist():
        path = files[i]
        if path in codecs:
            mine = cols.file == i
            codecs[path].check_covers(key, cols.offset[mine], cols.length[mine], path)


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


__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "CODEC_VERSION", "READABLE_MAJORS", "MANIFEST_NAME", "DATA_DIR",
           "HASH_ALGORITHM", "entry_name", "check_relpath", "TensorEntry", "ObjectEntry", "Manifest", "parse_version",
           "MAX_DIMS"]
