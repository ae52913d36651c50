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

Non-tensor values (DCP's bytes items) are ``torch.save`` blobs too; they come back as objects when
the restricted unpickler accepts them and msgpack can hold them, else as the blob's raw bytes
(listed in ``user_metadata["source"]["raw_objects"]``).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckpt.checksum import crc32
from ckpt.dtypes import dtype_name, itemsize, safetensors_dtype
from ckpt.errors import CheckpointError, IntegrityError, ManifestError
from ckpt.formats import torch_pickle as safe_pickle
from ckpt.formats.msgpack_codec import encode_object
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
        offset = tuple(int(o) for o in idx.offset) if getattr(idx, "offset", None) is not None else None
        out[(str(idx.fqn), offset)] = info
        if getattr(info, "transform_descriptors", None):
            raise ManifestError(
                f"{what}: {idx.fqn!r} was written with DCP transform(s) {list(info.transform_descriptors)} "
                "(e.g. compression), which ckpt does not decode; load it with torch.distributed.checkpoint "
                "and save it again without transforms")
    return out


def _locate(read: Callable[[int, int], bytes], info: Any, key: str, dtype: torch.dtype, box: Box,
            file_size: int, what: str, headers: _Headers) -> tuple[int, int]:
    """The absolute ``(offset, length)`` of one chunk's elements inside its item's bytes."""
    sizes = box.lengths
    nbytes = itemsize(dtype) * _numel(sizes)
    head = read(int(info.offset), 4) if info.length >= 4 else b""
    if head != b"PK\x03\x04":
        return _safetensors_chunk(read, info, key, dtype, box, file_size, what, headers)
    z = safe_pickle.load_torch(read, int(info.offset), int(info.length), what=f"{what} ({key!r})")
    refs = z.tensors()
    if len(refs) != 1:
        raise ManifestError(f"{what}: {key!r}: the item holds {len(refs)} tensors, DCP writes one")
    ref = refs[0][1]
    if ref.dtype != dtype or tuple(ref.shape) != tuple(sizes) or not ref.contiguous:
        raise ManifestError(f"{what}: {key!r}: the stored chunk is {ref.dtype} {list(ref.shape)} "
                            f"(contiguous: {ref.contiguous}), the metadata says {dtype} {list(sizes)}")
    offset, length = ref.byte_range()
    if length != nbytes or not (info.offset <= offset and offset + length <= info.offset + info.length):
        raise ManifestError(f"{what}: {key!r}: tensor bytes [{offset}, {offset + length}) fall outside the item "
                            f"[{info.offset}, {info.offset + info.length})")
    return offset, length


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
    meta = json.loads(head[8:]).get("__metadata__") or {}
    try:
        sharding = json.loads(meta.get(DCP_SHARDING_KEY, "{}"))
    except (TypeError, ValueError):
        raise ManifestError(f"{what}: safetensors metadata {DCP_SHARDING_KEY!r} is not JSON") from None
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
    if saved is not None and [int(o) for o in saved] != list(box.offsets):
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
    """An object item as ckpt object bytes (msgpack), and whether it had to be kept raw."""
    raw = read(int(info.offset), int(info.length))
    try:
        z = safe_pickle.load_torch(read, int(info.offset), int(info.length), what=f"{what} ({key!r})")
        if not z.tensors():
            return encode_object(z.obj, key=key), False
    except CheckpointError:
        pass  # not a torch.save blob we may read, or a value msgpack cannot hold: keep the bytes
    return encode_object(raw, key=key), True


def dcp_manifest(storage: Storage, *, workers: int = 4) -> Manifest:
    """A ckpt manifest describing the DCP checkpoint in ``storage`` (no data is copied).

    Raises:
        ManifestError: ``.metadata`` is missing, not DCP's, refers to missing files or ranges outside
            them, or uses DCP transforms; a global outside the allowlist stops the read (IntegrityError).
    """
    what = storage.url
    md = read_metadata(storage)
    index = _storage_index(md, f"{what}/{METADATA_NAME}")
    files: dict[str, int] = {}
    for info in index.values():
        path = check_relpath(str(info.relative_path), f"{what}/{METADATA_NAME}")
        if path not in files:
            size = storage.size(path)
            if size is None:
                raise ManifestError(f"{what}: data file {path!r} named by {METADATA_NAME} is missing")
            files[path] = size
        if info.offset < 0 or info.length < 0 or info.offset + info.length > files[path]:
            raise IntegrityError(f"{what}/{path}: item [{info.offset}, {info.offset + info.length}) lies beyond the "
                                f"file's {files[path]} bytes (truncated?)")
    jobs: list[tuple[str, int, Box, Any, torch.dtype]] = []
    tensors: dict[str, TensorEntry] = {}
    object_keys: list[str] = []
    for key, meta in md.state_dict_metadata.items():
        key = str(key)
        if type(meta).__name__ == "BytesStorageMetadata":
            object_keys.append(key)
            continue
        dtype = meta.properties.dtype
        shape = tuple(int(s) for s in meta.size)
        tensors[key] = TensorEntry(dtype_name(dtype, key=key), shape, [])
        for n, chunk in enumerate(meta.chunks):
            offsets = tuple(int(o) for o in chunk.offsets)
            info = index.get((key, offsets))
            if info is None:
                raise ManifestError(f"{what}/{METADATA_NAME}: {key!r} chunk at {list(offsets)} has no storage entry")
            jobs.append((key, n, Box(offsets, tuple(int(s) for s in chunk.sizes)), info, dtype))

    headers = _Headers()

    def locate(job: tuple[str, int, Box, Any, torch.dtype]) -> ShardEntry:
        key, _, box, info, dtype = job
        path = str(info.relative_path)
        if box.numel == 0:
            return ShardEntry(box, path, 0, 0)
        offset, length = _locate(reader(storage, path), info, key, dtype, box, files[path], f"{what}/{path}", headers)
        return ShardEntry(box, path, offset, length)

    with ThreadPoolExecutor(max(1, workers)) as pool:  # a few small reads per chunk: overlap them
        shards = list(pool.map(locate, jobs))
    for (key, _, _, _, _), shard in zip(jobs, shards, strict=True):
        tensors[key].shards.append(shard)
    objects: dict[str, ObjectEntry] = {}
    raw_keys: list[str] = []
    for key in object_keys:
        info = index.get((key, None))
        if info is None:
            raise ManifestError(f"{what}/{METADATA_NAME}: object {key!r} has no storage entry")
        data, raw = _object(reader(storage, str(info.relative_path)), info, key, f"{what}/{info.relative_path}")
        objects[key] = ObjectEntry(data=data, checksum=crc32(data))
        if raw:
            raw_keys.append(key)
    source: dict[str, Any] = {"format": "dcp", "version": str(getattr(md, "version", None) or "")}
    user: dict[str, Any] = {"source": source}
    _megatron(storage, user, objects, raw_keys)
    if raw_keys:
        source["raw_objects"] = raw_keys
    m = Manifest(tensors=tensors, objects=objects, files=files, world_size=1, user_metadata=user)
    m.source_format = "dcp"
    return m


MEGATRON_METADATA = "metadata.json"
MEGATRON_COMMON = "common.pt"


def _megatron(storage: Storage, user: dict[str, Any], objects: dict[str, ObjectEntry], raw_keys: list[str]) -> None:
    """Megatron-Core's ``torch_dist`` is DCP plus ``metadata.json`` (its backend, kept as
    ``user_metadata["megatron"]``) and, in some versions, ``common.pt`` (the non-sharded state, kept
    as objects ``common.<key>``, read with the allowlist; Megatron's own classes become stand-ins)."""
    size = storage.size(MEGATRON_METADATA)
    if size is None or size > 1 << 20:
        return
    try:
        meta = json.loads(storage.read_file(MEGATRON_METADATA))
    except ValueError as e:
        raise ManifestError(f"{storage.url}/{MEGATRON_METADATA}: not JSON ({e})") from None
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
