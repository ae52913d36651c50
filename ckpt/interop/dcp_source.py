"""A torch.distributed.checkpoint (DCP) directory as a ckpt source: its chunks become ckpt shards.

DCP writes ``.metadata`` (a pickle of ``Metadata``: per key a ``TensorStorageMetadata`` with the
chunks' offsets and sizes, or a ``BytesStorageMetadata``; per chunk a ``_StorageInfo`` naming the
``__<rank>_<n>.distcp`` file and the byte range of the item) and data files in which each item is
a ``torch.save`` blob (a zip whose ``data/0`` entry holds the tensor's raw bytes, stored, not
compressed), or, with ``FileSystemWriter(serialization_format=SAFETENSORS)``, one safetensors file
after the file's bytes items (every tensor's ``_StorageInfo`` then points at that file's header).
:func:`dcp_manifest` reads ``.metadata`` with the restricted unpickler
(:mod:`ckpt.formats.torch_pickle`: no code from the file runs), finds inside each blob the exact
byte range of the tensor's elements, and returns a ckpt :class:`~ckpt.manifest.Manifest` whose
shards point at those ranges. The load planner then reads only the bytes each rank needs, resharded
into any layout, exactly as for a ckpt checkpoint. DCP records no checksums: such a source is
checked for structure and sizes only (``Manifest.source_format`` says where it came from).

Non-tensor values (DCP's bytes items) are ``torch.save`` blobs too, read with the restricted
unpickler and stored through ckpt's one object mapping (:mod:`ckpt.formats.objects`), so they come
back of the type DCP gives (``torch.dtype``, numpy values, datetimes, ...). A value ckpt cannot read
or represent exactly is kept as a refusal: loading that key raises a typed error naming it, the
other keys load (such keys are listed in ``user_metadata["source"]["refused_objects"]``).

A chunk torch.save wrote with strides (DCP saves a transposed or channels_last tensor as it is in
memory) becomes several shards, one per contiguous run of its elements. A chunk ckpt cannot locate
for a reason of its own (a dtype written through ``torch._utils._rebuild_tensor_v3`` (float8,
uint16/32/64, complex32) while :mod:`~ckpt.formats.torch_pickle` does not read it; a layout of more
than :data:`MAX_PIECES` runs) is refused for its key alone, the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckpt._checksum import crc32
from ckpt._dtypes import dtype_name, itemsize, safetensors_dtype
from ckpt.errors import CheckpointError, IntegrityError, ManifestError, StateError
from ckpt.formats import budget as _budget
from ckpt.formats import foreign_json
from ckpt.formats import torch_pickle as safe_pickle
from ckpt.formats.msgpack_codec import encode_object
from ckpt.formats.objects import PICKLE_EXTRA, PICKLE_STUBS, encode_value, from_torch_save, refusal
from ckpt.formats.safetensors_header import MAX_HEADER_BYTES, HeaderEntry, parse_header
from ckpt.manifest import Manifest, ObjectEntry, ShardEntry, TensorEntry, check_relpath
from ckpt.shards import Box
from ckpt.storage import Storage

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # a pickle this large is not a DCP metadata file we should trust


def is_dcp(storage: Storage) -> bool:
    """Whether ``storage`` holds a DCP checkpoint (its ``.metadata`` file)."""
    return storage.size(METADATA_NAME) is not None


def reader(storage: Storage, path: str) -> Callable[[int, int], bytes]:
    """``read(offset, nbytes)`` of one file of ``storage`` (what :mod:`safe_pickle` reads through)."""

    def read(offset: int, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        storage.read_into(path, offset, memoryview(buf))
        return bytes(buf)

    return read


def read_metadata(storage: Storage) -> Any:
    """DCP's ``Metadata`` object, unpickled with the DCP allowlist only."""
    what = f"{storage.url}/{METADATA_NAME}"
    size = storage.size(METADATA_NAME)
    if size is None:
        raise ManifestError(f"{what}: missing; not a DCP checkpoint")
    if size > MAX_METADATA_BYTES:
        raise ManifestError(f"{what}: {size} bytes; refusing a DCP metadata file over 1 GiB")
    md = safe_pickle.loads(storage.read_file(METADATA_NAME), what=what, extra=safe_pickle.DCP_GLOBALS)
    if type(md).__name__ != "Metadata" or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise ManifestError(f"{what}: does not hold DCP's Metadata (got {type(md).__name__})")
    return md


def _storage_index(md: Any, what: str) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """``(key, chunk offsets or None for bytes items) -> _StorageInfo``."""
    out: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for idx, info in (md.storage_data or {}).items():
        offset = (_budget.dims(idx.offset, what, f"storage_data[{str(idx.fqn)[:100]!r}] offset")
                  if getattr(idx, "offset", None) is not None else None)
        out[(str(idx.fqn), offset)] = info
        if getattr(info, "transform_descriptors", None):
            raise ManifestError(
                f"{what}: {idx.fqn!r} was written with DCP transform(s) {list(info.transform_descriptors)} "
                "(e.g. compression), which ckpt does not decode; load it with torch.distributed.checkpoint "
                "and save it again without transforms")
    return out


# dtypes torch.save writes with a legacy typed storage (torch._utils._rebuild_tensor_v2); the others
# (float8, uint16/32/64, complex32, ...) go through _rebuild_tensor_v3 over an untyped storage
_V2_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})
MAX_PIECES = 1 << 16  # contiguous runs one strided chunk may become (shards in memory); more: that key is refused


class _Refused(CheckpointError):
    """A chunk ckpt cannot serve for a reason of its own (not damage): its key alone is refused."""

    def __init__(self, error: CheckpointError):
        super().__init__(str(error))
        self.error = error


def _locate(read: Callable[[int, int], bytes], info: Any, key: str, dtype: torch.dtype, box: Box,
            file_size: int, what: str, headers: _Headers) -> list[tuple[Box, int, int]]:
    """One chunk's elements as ``(box, absolute offset, length)`` runs inside its item's bytes (one
    run for a contiguous chunk; one per contiguous run of a strided one)."""
    sizes = box.lengths
    head = read(int(info.offset), 4) if info.length >= 4 else b""
    if head != b"PK\x03\x04":
        offset, length = _safetensors_chunk(read, info, key, dtype, box, file_size, what, headers)
        return [(box, offset, length)]
    try:
        z = safe_pickle.load_torch(read, int(info.offset), int(info.length), what=f"{what} ({key!r})")
    except IntegrityError as e:
        if dtype in _V2_DTYPES:
            raise
        raise _Refused(IntegrityError(
            f"{what}: {key!r}: DCP stored this {dtype} tensor through torch._utils._rebuild_tensor_v3, which ckpt's "
            f"restricted unpickler does not read ({e}); load this key with torch.distributed.checkpoint")) from None
    refs = z.tensors()
    if len(refs) != 1:
        raise ManifestError(f"{what}: {key!r}: the item holds {len(refs)} tensors, DCP writes one")
    ref = refs[0][1]
    if ref.dtype != dtype or tuple(ref.shape) != tuple(sizes):
        raise ManifestError(f"{what}: {key!r}: the stored chunk is {ref.dtype} {list(ref.shape)}, the metadata says "
                            f"{dtype} {list(sizes)}")
    return _runs(ref, box, key, what, int(info.offset), int(info.offset) + int(info.length))


def _runs(ref: safe_pickle.TensorRef, box: Box, key: str, what: str, lo: int, hi: int) -> list[tuple[Box, int, int]]:
    """The chunk ``ref`` (stored with any strides) as row-major runs: each run is a sub-box whose
    elements lie one after the other in the file. The run's dimensions are found innermost first:
    the dimension of stride 1, then the one whose stride is the run so far, and so on, each left of
    the last; every other dimension is iterated (length 1 in the run's box)."""
    size = ref.dtype.itemsize
    shape, stride = ref.shape, ref.stride
    if min(stride, default=0) < 0:
        raise ManifestError(f"{what}: {key!r}: negative strides {list(stride)}")
    reach = ref.storage_offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1
    start = ref.data_offset + ref.storage_offset * size
    if reach * size > ref.storage_nbytes or not (lo <= start and ref.data_offset + reach * size <= hi):
        raise ManifestError(f"{what}: {key!r}: the tensor's elements reach past its storage or the item "
                            f"[{lo}, {hi})")
    run: list[int] = []
    need, left = 1, len(shape)
    while True:
        dims = [d for d in range(left) if shape[d] > 1 and stride[d] == need]
        if not dims:
            break
        left = dims[-1]
        run.insert(0, left)
        need *= shape[left]
    outer = [d for d in range(len(shape)) if d not in run and shape[d] > 1]
    count = math.prod(shape[d] for d in outer)
    if count > MAX_PIECES:
        raise _Refused(ManifestError(
            f"{what}: {key!r}: stored with strides {list(stride)} for shape {list(shape)}, it is {count} separate runs "
            f"of elements (ckpt reads at most {MAX_PIECES}); load this key with torch.distributed.checkpoint"))
    lengths = tuple(n if d in run else 1 for d, n in enumerate(shape))
    out = []
    for idx in itertools.product(*(range(shape[d]) for d in outer)):
        offsets = list(box.offsets)
        elem = ref.storage_offset
        for d, i in zip(outer, idx, strict=True):
            offsets[d] += i
            elem += i * stride[d]
        out.append((Box(tuple(offsets), lengths), ref.data_offset + elem * size, need * size))
    return out


class _Headers:
    """Parsed safetensors headers of a DCP checkpoint's data files, by ``(file, offset)``: every
    chunk in a file points at the same header, parsed once (chunks are located on several threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.parsed: dict[tuple[str, int], tuple[dict[str, HeaderEntry], dict[str, Any]]] = {}

    def get(self, read: Callable[[int, int], bytes], start: int, size: int,
            what: str) -> tuple[dict[str, HeaderEntry], dict[str, Any]]:
        with self.lock:
            if (what, start) not in self.parsed:
                self.parsed[(what, start)] = _parse_safetensors(read, start, size, what)
            return self.parsed[(what, start)]


def _parse_safetensors(read: Callable[[int, int], bytes], start: int, size: int,
                       what: str) -> tuple[dict[str, HeaderEntry], dict[str, Any]]:
    """Entries (offsets absolute in the file) and DCP's sharding info of the safetensors blob that
    starts at ``start`` and runs to the end of the file (``size`` bytes)."""
    prefix = read(start, 8) if size >= 8 else b""
    n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 2 <= n <= min(size - 8, MAX_HEADER_BYTES):
        raise ManifestError(f"{what}: the item at {start} is neither a torch.save blob nor a safetensors file; "
                            "not a DCP data file ckpt can read")
    head = prefix + read(start + 8, n)
    if head[8:9] != b"{":
        raise ManifestError(f"{what}: the item at {start} is neither a torch.save blob nor a safetensors file")
    entries = parse_header(head, size, path=what)
    # the metadata's values are JSON text of their own (DCP_SHARDING_INFO): decoded by the one bounded
    # reader too, under the header's budget (a 100k-deep string of brackets raised a raw RecursionError)
    budget = foreign_json.Budget(MAX_HEADER_BYTES, foreign_json.HEADER_DEPTH, foreign_json.HEADER_ITEMS)
    header = foreign_json.loads(head[8:], where=f"{what}: safetensors header", budget=budget, error=ManifestError)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise ManifestError(f"{what}: safetensors __metadata__ is {type(meta).__name__}, not a JSON object")
    text = meta.get(DCP_SHARDING_KEY, "{}")
    if not isinstance(text, str):
        raise ManifestError(f"{what}: safetensors metadata {DCP_SHARDING_KEY!r} is not JSON text")
    sharding = foreign_json.loads(text.encode("utf-8", "surrogatepass"),
                                  where=f"{what}: safetensors metadata {DCP_SHARDING_KEY!r}", budget=budget,
                                  error=ManifestError)
    return ({k: dataclasses.replace(e, start=start + e.start) for k, e in entries.items()},
            sharding if isinstance(sharding, dict) else {})


DCP_SHARDING_KEY = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY


def _safetensors_chunk(read: Callable[[int, int], bytes], info: Any, key: str, dtype: torch.dtype, box: Box,
                       file_size: int, what: str, headers: _Headers) -> tuple[int, int]:
    """A chunk DCP wrote with its safetensors serialization: the file's header names it by key, and
    its ``DCP_SHARDING_INFO`` metadata holds the chunk's offsets in the full tensor."""
    entries, sharding = headers.get(read, int(info.offset), file_size - int(info.offset), what)
    ent = entries.get(key)
    want = safetensors_dtype(dtype)
    if ent is None or ent.dtype != want or ent.shape != tuple(box.lengths):
        found = "absent" if ent is None else f"{ent.dtype} {list(ent.shape)}"
        raise ManifestError(f"{what}: {key!r}: the safetensors header has it {found}; the metadata says "
                            f"{want} {list(box.lengths)}")
    saved = (sharding.get(key) or {}).get("saved_offsets") if isinstance(sharding.get(key), dict) else None
    if saved is not None and list(_budget.dims(saved, what, f"{DCP_SHARDING_KEY}[{key!r}] saved_offsets",
                                               ManifestError)) != list(box.offsets):
        raise ManifestError(f"{what}: {key!r}: the file holds the chunk at {list(saved)}, the metadata says "
                            f"{list(box.offsets)}")
    nbytes = itemsize(dtype) * _numel(box.lengths)
    if ent.length != nbytes or int(info.length) != nbytes:
        raise ManifestError(f"{what}: {key!r}: {ent.length} bytes stored, {nbytes} expected")
    return ent.start, ent.length


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def _object(read: Callable[[int, int], bytes], info: Any, key: str, what: str) -> tuple[bytes, bool]:
    """An object item as ckpt object bytes (msgpack, through the object mapping), and whether it
    was refused (then loading ``key`` raises the recorded error)."""
    try:
        z = safe_pickle.load_torch(read, int(info.offset), int(info.length), what=f"{what} ({key!r})",
                                   extra=PICKLE_EXTRA, stubs=PICKLE_STUBS)
        return encode_object(encode_value(from_torch_save(z.obj, key=key), key=key), key=key), False
    except CheckpointError as e:
        # not a torch.save blob we may read, or a value ckpt cannot represent exactly: this key only
        err = type(e)(f"{what}: {e}; DCP can load it (torch.distributed.checkpoint), ckpt refuses rather than "
                      "return another type")
        return encode_object(refusal(err), key=key), True


_Job = tuple[str, int, Box, Any, torch.dtype]  # (key, chunk number, its box, its storage entry, dtype)


def _data_files(storage: Storage, index: dict[Any, Any], what: str) -> dict[str, int]:
    """Size of each data file ``.metadata`` names; every item's byte range checked against its file."""
    files: dict[str, int] = {}
    for info in index.values():
        path = check_relpath(info.relative_path, f"{what}/{METADATA_NAME}")
        if path not in files:
            size = storage.size(path)
            if size is None:
                raise ManifestError(f"{what}: data file {path!r} named by {METADATA_NAME} is missing")
            files[path] = size
        # typed before they are compared or read at (a float offset was truncated by int(), inf overflowed)
        offset = _budget.integer(info.offset, f"{what}/{METADATA_NAME}", f"the offset of an item in {path!r}")
        length = _budget.integer(info.length, f"{what}/{METADATA_NAME}", f"the length of an item in {path!r}")
        if offset + length > files[path]:
            raise IntegrityError(f"{what}/{path}: item [{offset}, {offset + length}) lies beyond the "
                                 f"file's {files[path]} bytes (truncated?)")
    return files


def _chunk_jobs(md: Any, index: dict[Any, Any], what: str) -> tuple[list[_Job], dict[str, TensorEntry], list[str]]:
    """One job per tensor chunk, the tensors' entries (shards still empty) and the object keys."""
    jobs: list[_Job] = []
    tensors: dict[str, TensorEntry] = {}
    object_keys: list[str] = []
    for key, meta in md.state_dict_metadata.items():
        key = str(key)
        if type(meta).__name__ == "BytesStorageMetadata":
            object_keys.append(key)
            continue
        where = f"{what}/{METADATA_NAME}"
        dtype = meta.properties.dtype
        if not isinstance(dtype, torch.dtype):
            raise ManifestError(f"{where}: {key!r} has dtype {dtype!r:.100}, not a torch dtype")
        try:
            name = dtype_name(dtype, key=key)
        except StateError as e:  # the file's, not the caller's state: named with the file
            raise ManifestError(f"{where}: {e}") from None
        shape = _budget.dims(meta.size, where, f"{key!r} size")
        tensors[key] = TensorEntry(name, shape, [])
        for n, chunk in enumerate(meta.chunks):
            offsets = _budget.dims(chunk.offsets, where, f"{key!r} chunk {n} offsets")
            sizes = _budget.dims(chunk.sizes, where, f"{key!r} chunk {n} sizes")
            if not len(offsets) == len(sizes) == len(shape):  # a box of another rank than its tensor
                raise ManifestError(f"{where}: {key!r} chunk {n} has offsets {list(offsets)} and sizes {list(sizes)} "
                                    f"for a tensor of shape {list(shape)}")
            info = index.get((key, offsets))
            if info is None:
                raise ManifestError(f"{where}: {key!r} chunk at {list(offsets)} has no storage entry")
            jobs.append((key, n, Box(offsets, sizes), info, dtype))
    return jobs, tensors, object_keys


def _locate_chunks(storage: Storage, jobs: list[_Job], files: dict[str, int], workers: int) \
        -> list[list[ShardEntry] | _Refused]:
    """Where each chunk's bytes lie in its file (or why this key is refused), read in parallel."""
    what = storage.url
    headers = _Headers()

    def locate(job: _Job) -> list[ShardEntry] | _Refused:
        key, _, box, info, dtype = job
        path = str(info.relative_path)
        if box.numel == 0:
            return [ShardEntry(box, path, 0, 0)]
        try:
            runs = _locate(reader(storage, path), info, key, dtype, box, files[path], f"{what}/{path}", headers)
        except _Refused as e:
            return e
        return [ShardEntry(b, path, offset, length) for b, offset, length in runs]

    with ThreadPoolExecutor(max(1, workers)) as pool:  # a few small reads per chunk: overlap them
        return list(pool.map(locate, jobs))


def _read_objects(storage: Storage, index: dict[Any, Any], object_keys: list[str], objects: dict[str, ObjectEntry],
                  raw_keys: list[str]) -> None:
    """Decode each object item into ``objects`` (through the allowlist); refused ones go in ``raw_keys``."""
    what = storage.url
    for key in object_keys:
        info = index.get((key, None))
        if info is None:
            raise ManifestError(f"{what}/{METADATA_NAME}: object {key!r} has no storage entry")
        data, raw = _object(reader(storage, str(info.relative_path)), info, key, f"{what}/{info.relative_path}")
        objects[key] = ObjectEntry(data=data, checksum=crc32(data))
        if raw:
            raw_keys.append(key)


def dcp_manifest(storage: Storage, *, workers: int = 4) -> Manifest:
    """A ckpt manifest describing the DCP checkpoint in ``storage`` (no data is copied).

    Raises:
        ManifestError: ``.metadata`` is missing, not DCP's, refers to missing files or ranges outside
            them, or uses DCP transforms; a global outside the allowlist stops the read (IntegrityError).
    """
    what = storage.url
    md = read_metadata(storage)
    index = _storage_index(md, f"{what}/{METADATA_NAME}")
    files = _data_files(storage, index, what)
    jobs, tensors, object_keys = _chunk_jobs(md, index, what)
    shards = _locate_chunks(storage, jobs, files, workers)
    objects: dict[str, ObjectEntry] = {}
    raw_keys: list[str] = []  # refused keys
    for (key, _, _, _, _), found in zip(jobs, shards, strict=True):
        if isinstance(found, _Refused):  # this key alone: loading it raises the error, others load
            if key in tensors:
                del tensors[key]
                data = encode_object(refusal(found.error), key=key)
                objects[key] = ObjectEntry(data=data, checksum=crc32(data))
                raw_keys.append(key)
        elif key in tensors:
            tensors[key].shards.extend(found)
    _read_objects(storage, index, object_keys, objects, raw_keys)
    source: dict[str, Any] = {"format": "dcp", "version": str(getattr(md, "version", None) or "")}
    user: dict[str, Any] = {"source": source}
    if raw_keys:
        source["refused_objects"] = raw_keys
    text_keys: list[str] = []
    _megatron(storage, user, objects, text_keys)
    if text_keys:  # Megatron's stand-in objects, kept as their repr text
        source["raw_objects"] = text_keys
    m = Manifest(tensors=tensors, objects=objects, files=files, world_size=1, user_metadata=user)
    m.source_format = "dcp"
    return m


MEGATRON_METADATA = "metadata.json"
MEGATRON_COMMON = "common.pt"
# Megatron's metadata.json: a flat object of a few entries ({"sharded_backend": "torch_dist", ...});
# a larger file of that name is some other tool's, ignored
MEGATRON_JSON = foreign_json.Budget(1 << 20, 16, 100_000, allow_nan=True)


def _megatron(storage: Storage, user: dict[str, Any], objects: dict[str, ObjectEntry], raw_keys: list[str]) -> None:
    """Megatron-Core's ``torch_dist`` is DCP plus ``metadata.json`` (its backend, kept as
    ``user_metadata["megatron"]``) and, in some versions, ``common.pt`` (the non-sharded state, kept
    as objects ``common.<key>``, read with the allowlist; Megatron's own classes become stand-ins)."""
    size = storage.size(MEGATRON_METADATA)
    if size is None or size > MEGATRON_JSON.max_bytes:
        return
    # the one bounded JSON reader (a deep document raised a raw RecursionError): ConfigError, a ManifestError
    meta = foreign_json.read_storage(storage, MEGATRON_METADATA, budget=MEGATRON_JSON)
    if not isinstance(meta, dict) or "sharded_backend" not in meta:
        return  # some other tool's file of that name
    user["megatron"] = meta
    user["source"]["format"] = f"megatron-{meta.get('sharded_backend')}"
    csize = storage.size(MEGATRON_COMMON)
    if csize is None:
        return
    obj = safe_pickle.load_torch(reader(storage, MEGATRON_COMMON), 0, csize, what=f"{storage.url}/{MEGATRON_COMMON}",
                                 stubs=("argparse.Namespace", "megatron.core.enums.ModelType",
                                        "megatron.training.arguments.Namespace")).obj
    for key, value in (obj.items() if isinstance(obj, dict) else [("value", obj)]):
        name = f"common.{key}"
        try:
            data = encode_object(value, key=name)
        except CheckpointError:
            data = encode_object(repr(value), key=name)  # e.g. a stand-in for Megatron's args: kept as text
            raw_keys.append(name)
        objects[name] = ObjectEntry(data=data, checksum=crc32(data))


__all__ = ["METADATA_NAME", "MAX_METADATA_BYTES", "is_dcp", "reader", "read_metadata", "MAX_PIECES",
           "DCP_SHARDING_KEY", "dcp_manifest", "MEGATRON_METADATA", "MEGATRON_COMMON"]
