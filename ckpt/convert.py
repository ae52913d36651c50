"""Converters between ckpt and the ecosystem's formats, streaming under a memory budget.

- :func:`import_checkpoint`: a DCP directory (torchtitan, FSDP2, Megatron-Core ``torch_dist``), a
  DeepSpeed ZeRO directory or a ``torch.save`` file -> a committed ckpt checkpoint, whole tensors or
  resharded to ``to`` (the offline resharder does the copying: its source is the foreign files'
  byte ranges, its destination a normal ckpt checkpoint with checksums).
- :func:`export_dcp`: a ckpt checkpoint (or any source above) -> a DCP directory that
  ``torch.distributed.checkpoint.load`` reads on any layout; one ``__<r>_0.distcp`` per target rank
  of ``to`` (or per source data file), each tensor piece a ``torch.save`` blob as DCP writes it.

Both read through the one streaming engine, :mod:`ckpt._stream` (``copy_files`` under
``reshard``; ``read_items`` for the DCP blobs), so memory stays within the budget.

Nothing from a foreign file is unpickled outside the allowlist (:mod:`ckpt.formats.torch_pickle`).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt import _transaction as transaction
from ckpt._checksum import crc32
from ckpt._chunks import split_region
from ckpt._dtypes import dtype_from_name, dtype_name, itemsize
from ckpt._io import byte_view
from ckpt._stream import Item, Progress, read_items
from ckpt.errors import CheckpointError, CheckpointExistsError, ForeignFormatError, ManifestError, StateError
from ckpt.formats import budget as _budget
from ckpt.formats import torch_pickle
from ckpt.formats.foreign_json import MAX_LAYERS
from ckpt.formats.msgpack_codec import decode_manifest, decode_object, encode_object
from ckpt.interop.dcp_source import METADATA_NAME, read_metadata, reader
from ckpt.interop.sources import encode_foreign
from ckpt.layout import Layout
from ckpt.load import fetch_manifest
from ckpt.manifest import MANIFEST_NAME, Manifest, ObjectEntry, ShardEntry, TensorEntry
from ckpt.resharders.plan import plan as reshard_plan
from ckpt.resharders.reshard import DEFAULT_MEMORY_BUDGET, reshard
from ckpt.resharders.rules import MOE_RULES, RuleSet
from ckpt.shards import Box, Flat, Region
from ckpt.storage import Storage, get_storage


def torch_save_manifest(storage: Storage, name: str) -> Manifest:
    """A manifest describing the ``torch.save`` file ``name`` of ``storage`` in place: tensors (nested
    dict keys joined with ``.``) point at their bytes; other values become objects."""
    what = f"{storage.url}/{name}"
    size = storage.size(name)
    if size is None:
        raise ManifestError(f"{what}: no such file")
    z = torch_pickle.load_torch(reader(storage, name), 0, size, what=what)
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}

    def fresh(key: str) -> str:
        # nested keys are joined with "." (and ints spelled as strings): {"a.b": x, "a": {"b": y}} or
        # {1: x, "1": y} name two values alike, and the second silently replaced the first
        if key in tensors or key in objects:
            raise ForeignFormatError(f"{what}: two values of the file flatten to the key {key!r} (nested keys are "
                                     "joined with '.'); ckpt cannot import both under one name: torch.load it, "
                                     "rename one and ckpt.save it instead")
        return key

    # iterative, in the file's order: the value passed torch_pickle's budget (a finite tree of
    # bounded depth and size), and this walk visits each of its nodes at most twice
    stack: list[tuple[str, Any]] = [("", z.obj)]
    while stack:
        key, v = stack.pop()
        if isinstance(v, dict) and v and all(isinstance(k, (str, int)) for k in v):
            stack.extend((f"{key}.{k}" if key else str(k), x) for k, x in reversed(list(v.items())))
            continue
        if isinstance(v, torch_pickle.TensorRef):
            if not v.contiguous:
                raise ManifestError(f"{what}: tensor {key!r} is stored non-contiguous (strides {list(v.stride)}); "
                                    "torch.load it, make it contiguous and ckpt.save it instead")
            offset, length = v.byte_range()
            whole = Box((0,) * len(v.shape), v.shape)
            tensors[fresh(key or "tensor")] = TensorEntry(dtype_name(v.dtype, key=key), v.shape,
                                                          [ShardEntry(whole, name, offset, length)])
            continue
        if torch_pickle.TorchZip(v, what).tensors():
            raise ManifestError(f"{what}: {key!r} holds tensors inside a list or tuple; ckpt imports tensors "
                                "under dict keys (torch.load it and ckpt.save it instead)")
        try:
            data = encode_object(v, key=key or "value")
        except StateError as e:  # (a value msgpack cannot hold, e.g. an int of 2**64: the file's, not the caller's)
            raise ForeignFormatError(f"{what}: {e}") from None
        objects[fresh(key or "value")] = ObjectEntry(data=data, checksum=crc32(data))
    m = Manifest(tensors=tensors, objects=objects, files={name: size},
                 user_metadata={"source": {"format": "torch.save", "file": name}})
    # through the one gate of foreign manifests (as DCP's and DeepSpeed's): encodable (a key with a
    # lone surrogate raised a raw UnicodeEncodeError at the import's commit), then ckpt's schema checks
    out = decode_manifest(encode_foreign(m, what), url=what)
    out.source_format = "torch.save"
    return out


def unstack_layers(manifest: Manifest, marker: str = "layers", *, what: str = "manifest") -> Manifest:
    """Split tensors stored stacked over layers into per-layer tensors, in place (no data read).

    Megatron-Core saves ``decoder.layers.<name>`` with a leading dimension of the layer count; each
    becomes ``decoder.layers.<i>.<name>``, whose shards are the exact byte sub-ranges of the stored
    ones (a stored box that covers layers ``[a, b)`` holds layer ``i``'s block contiguously). Keys
    with ``marker`` followed by a digit, flat shards and 0-d tensors are left as stored. ``what``
    names the source in errors (a leading dimension over ``MAX_LAYERS``: ForeignFormatError).
    """
    out: dict[str, TensorEntry] = {}
    for key, t in manifest.tensors.items():
        parts = key.split(".")
        if marker not in parts[:-1] or parts[parts.index(marker) + 1].isdigit() or not t.shape \
                or any(not isinstance(sh.region, Box) for sh in t.shards):
            out[key] = t
            continue
        # one tensor entry per layer is made below: the layer count a (foreign) manifest claims is
        # checked first (a stacked tensor of shape [2**40, 0] holds no bytes and looped for ever)
        _budget.integer(t.shape[0], f"{what}: tensor {key!r}", "its leading (layer) dimension", 0, MAX_LAYERS)
        at = parts.index(marker) + 1
        isz = itemsize(dtype_from_name(t.dtype))
        for layer in range(t.shape[0]):
            name = ".".join([*parts[:at], str(layer), *parts[at:]])
            shards = []
            for sh in t.shards:
                box = sh.region
                assert isinstance(box, Box)
                if not box.offsets[0] <= layer < box.offsets[0] + box.lengths[0]:
                    continue
                per = math.prod(box.lengths[1:]) * isz
                shards.append(ShardEntry(Box(box.offsets[1:], box.lengths[1:]), sh.file,
                                         sh.offset + (layer - box.offsets[0]) * per, per))
            out[name] = TensorEntry(t.dtype, t.shape[1:], shards)
    manifest.tensors = out
    return manifest


def import_checkpoint(src: str, dst: str, *, to: Layout | None = None, rules: RuleSet = MOE_RULES,
                      memory_budget: int = DEFAULT_MEMORY_BUDGET, workers: int = 2, progress: Progress | None = None,
                      overwrite: bool = False, storage_options: dict[str, Any] | None = None,
                      unstack: bool = False) -> Manifest:
    """Convert a DCP / DeepSpeed directory or a ``torch.save`` file at ``src`` into a committed ckpt
    checkpoint at ``dst`` (whole tensors, or resharded to ``to`` with ``rules``), streaming.
    ``unstack``: split layer-stacked tensors (Megatron's ``decoder.layers.*``) per layer
    (:func:`unstack_layers`).

    Raises:
        ManifestError: ``src`` is none of those formats (the message lists what was looked for), or
            already a ckpt checkpoint (use ``ckpt reshard``).
        IntegrityError: a pickle names a global outside the allowlist, or a file is damaged.
    """
    manifest: Manifest | None = None
    src_dir = src
    if "://" not in src and os.path.isfile(src):
        src_dir, name = os.path.split(os.path.abspath(src))
        st = get_storage(src_dir)
        try:
            manifest = torch_save_manifest(st, name)
        finally:
            st.close()
    else:
        st = get_storage(src, **(storage_options or {}))
        try:
            if st.size(MANIFEST_NAME) is not None:
                raise ManifestError(f"{src}: already a ckpt checkpoint; use `ckpt reshard` to change its layout")
            manifest = fetch_manifest(st)
        finally:
            st.close()
    if unstack:
        manifest = unstack_layers(manifest, what=src)
    return reshard(src_dir, dst, to or Layout(), rules=rules, memory_budget=memory_budget, workers=workers,
                   progress=progress, overwrite=overwrite, storage_options=storage_options,
                   source_manifest=manifest)


def _pieces(manifest: Manifest, to: Layout | None, rules: RuleSet) -> dict[int, list[tuple[str, Box]]]:
    """Target file index -> the (key, box) pieces it stores: the ranks of ``to``, or the source's own
    shards (flat shards, e.g. ZeRO-1 optimizer state, are stored as their whole tensor or box)."""
    out: dict[int, list[tuple[str, Box]]] = {}
    seen: set[tuple[str, Box]] = set()

    def add(f: int, key: str, r: Region, shape: tuple[int, ...]) -> None:
        box = r if isinstance(r, Box) else (r.box if isinstance(r, Flat) and r.box is not None
                                            else Box((0,) * len(shape), shape))
        if (key, box) not in seen:
            seen.add((key, box))
            out.setdefault(f, []).append((key, box))

    if to is None:
        files = {name: i for i, name in enumerate(sorted(manifest.files))}
        for key, t in sorted(manifest.tensors.items()):
            for s in t.shards:
                add(files.get(s.file, 0), key, s.region, t.shape)
    else:
        p = reshard_plan(manifest, to, rules)
        for rp in p.ranks:
            for key, r in sorted(rp.holds.items()):
                add(rp.rank, key, r, manifest.tensors[key].shape)
    return out


def export_dcp(src: str, dst_dir: str, *, to: Layout | None = None, rules: RuleSet = MOE_RULES,
               memory_budget: int = DEFAULT_MEMORY_BUDGET, workers: int = 4, progress: Progress | None = None,
               overwrite: bool = False, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the checkpoint at ``src`` (ckpt, or any source ckpt reads) as a DCP checkpoint in the
    local directory ``dst_dir``; returns a summary (files, bytes, tensors, objects).

    Pieces larger than a quarter of ``memory_budget`` are written as several DCP chunks, so peak
    memory stays near the budget. Data files get fresh names (``__<i>_0-<random>.distcp``: DCP
    finds them through ``.metadata``), so that no other writer can produce them; ``.metadata`` is
    written last, atomically (exclusively unless ``overwrite``): until then ``dst_dir`` holds the
    previous export, whole. Only after that commit are the files the replaced ``.metadata`` listed
    removed; on a failure, only this export's own files are. Per-rank objects (``ckpt.PerRank``)
    become ``{rank: value}`` objects.

    Raises:
        CheckpointExistsError: ``dst_dir`` already holds a DCP checkpoint and ``overwrite`` is False
            (also when another export commits there first; this one's files are removed).
        StateError: ``dst_dir`` holds other files.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    _check_dcp_destination(dst_dir, overwrite)
    st = get_storage(src, **(storage_options or {}))
    written: list[str] = []  # this export's own files: the only ones its failure removes
    committed = False
    try:
        manifest = fetch_manifest(st)
        pieces = _pieces(manifest, to, rules)
        if not pieces and manifest.objects:
            pieces = {0: []}  # no tensors: one file still carries the objects
        total = sum(b.numel * itemsize(dtype_from_name(manifest.tensors[k].dtype)) for ps in pieces.values()
                    for k, b in ps)
        writer = _DcpWriter(st, manifest, dst_dir, max(1 << 20, memory_budget // 4), workers, progress, total)
        for f in sorted(pieces):
            rel = f"__{f}_0-{transaction.new_id()}.distcp"  # a name no other writer can produce
            written.append(rel)
            writer.write_file(rel, pieces[f], objects=f == min(pieces))
        # planner_data: the nesting DCP's own planners rebuild for an empty target (keys split on ".")
        meta = Metadata(state_dict_metadata=writer.sdm, planner_data={k: tuple(k.split(".")) for k in writer.sdm},
                        storage_data=writer.storage_data, version="1.0.0")
        replaced = _dcp_files(dst_dir) if overwrite else set()  # what the commit replaces
        _commit_dcp(dst_dir, meta, overwrite)
        committed = True
        _remove_quietly(dst_dir, sorted(replaced - set(writer.sizes)))  # the replaced export's, after the commit only
        return {"dst": dst_dir, "files": len(writer.sizes), "bytes": sum(writer.sizes.values()),
                "tensor_bytes": writer.done, "tensors": len([k for k in writer.sdm if k in manifest.tensors]),
                "objects": len(manifest.objects)}
    except BaseException:
        if not committed:
            _remove_quietly(dst_dir, written)
        raise
    finally:
        st.close()


def _check_dcp_destination(dst_dir: str, overwrite: bool) -> None:
    """Create the local directory ``dst_dir``; refuse a URL, a DCP checkpoint there (unless
    ``overwrite``: CheckpointExistsError) and files that are not a DCP checkpoint's (StateError)."""
    if "://" in dst_dir:
        raise StateError(f"{dst_dir}: DCP export writes to a local directory")
    os.makedirs(dst_dir, exist_ok=True)
    present = os.listdir(dst_dir)
    if METADATA_NAME in present and not overwrite:
        raise CheckpointExistsError(f"{dst_dir}: already holds a DCP checkpoint; pass --overwrite to replace it")
    stray = [n for n in present if n != METADATA_NAME and not (n.startswith("__") and n.endswith(".distcp"))]
    if stray:
        raise StateError(f"{dst_dir}: holds other files ({', '.join(sorted(stray)[:3])}); export to an empty directory")


@dataclass(slots=True)
class _DcpWriter:
    """Writes an export's DCP data files one at a time, collecting the ``.metadata`` that describes
    them: ``sdm`` (key -> tensor or bytes metadata) and ``storage_data`` (chunk -> file byte range)."""

    st: Storage
    manifest: Manifest
    dst_dir: str
    chunk: int  # bytes: the largest DCP chunk, and the streaming engine's buffer
    workers: int
    progress: Progress | None
    total: int  # tensor bytes of the whole export, for ``progress``
    sdm: dict[str, Any] = field(default_factory=dict)
    storage_data: dict[Any, Any] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # file written -> its size in bytes
    done: int = 0  # tensor bytes written so far

    def write_file(self, rel: str, pieces: list[tuple[str, Box]], *, objects: bool) -> None:
        """Create ``rel`` exclusively and write ``pieces`` into it (and, with ``objects``, the
        checkpoint's objects), then fsync it."""
        items = self._items(pieces)
        with open(os.path.join(self.dst_dir, rel), "xb") as out:
            self._write_tensors(out, rel, items)
            if objects:
                self._write_objects(out, rel)
            out.flush()
            os.fsync(out.fileno())
            self.sizes[rel] = out.tell()

    def _items(self, pieces: list[tuple[str, Box]]) -> list[Item]:
        """One item per DCP chunk: pieces larger than ``chunk`` go in several; declares each tensor."""
        from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

        items: list[Item] = []
        for key, box in pieces:
            t = self.manifest.tensors[key]
            dtype = dtype_from_name(t.dtype)
            self.sdm.setdefault(key, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(t.shape), []))
            parts = [box] if box.numel == 0 else list(split_region(box, max(1, self.chunk // itemsize(dtype))))
            items += [Item(key, t.dtype, tuple(t.shape), part) for part in parts]
        return items

    def _write_tensors(self, out: io.BufferedWriter, rel: str, items: list[Item]) -> None:
        """Each item as a ``torch.save`` blob, as DCP writes a chunk, read through the streaming engine."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

        for i, part, value in read_items(self.st, self.manifest, items, buffer=self.chunk, readers=self.workers):
            assert isinstance(part, Box)
            key = items[i].key
            offset = out.tell()
            torch.save(_own_storage(value), out)
            self.sdm[key].chunks.append(ChunkStorageMetadata(torch.Size(part.offsets), torch.Size(part.lengths)))
            self.storage_data[MetadataIndex(key, torch.Size(part.offsets))] = _StorageInfo(
                rel, offset, out.tell() - offset)
            self.done += value.numel() * value.element_size()
            if self.progress is not None:
                self.progress(self.done, self.total)

    def _write_objects(self, out: io.BufferedWriter, rel: str) -> None:
        """The checkpoint's objects as ``torch.save`` blobs; per-rank ones become ``{rank: value}``."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        for key, o in sorted(self.manifest.objects.items()):
            obj = ({r: decode_object(b, key=key) for r, b in o.per_rank.items()}
                   if o.per_rank is not None else decode_object(o.data or b"", key=key))
            buf = io.BytesIO()
            torch.save(obj, buf)
            offset = out.tell()
            out.write(buf.getbuffer())
            self.sdm[key] = BytesStorageMetadata()
            self.storage_data[MetadataIndex(key)] = _StorageInfo(rel, offset, out.tell() - offset)


def _commit_dcp(dst_dir: str, meta: Any, overwrite: bool) -> None:
    """Write ``meta`` as ``dst_dir``'s ``.metadata``: the commit, atomic, and exclusive unless replacing."""
    out_st = get_storage(dst_dir)
    try:
        out_st.commit(METADATA_NAME, pickle.dumps(meta), exclusive=not overwrite)
    finally:
        out_st.close()


def _remove_quietly(dst_dir: str, names: list[str]) -> None:
    """Remove the files ``names`` of ``dst_dir``, in order, ignoring those already gone."""
    for n in names:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(dst_dir, n))


def _dcp_files(dst_dir: str) -> set[str]:
    """The data files the DCP checkpoint in ``dst_dir`` lists (read with the DCP allowlist); empty
    when its ``.metadata`` cannot be read (then nothing is removed: leftovers beat lost data)."""
    out_st = get_storage(dst_dir)
    try:
        md = read_metadata(out_st)
        names = {getattr(info, "relative_path", None) for info in (getattr(md, "storage_data", None) or {}).values()}
    except (CheckpointError, AttributeError, TypeError):
        return set()
    finally:
        out_st.close()
    return {n for n in names if isinstance(n, str) and n.startswith("__") and n.endswith(".distcp") and "/" not in n}


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a view of the engine's buffer) as a tensor whose storage is exactly its bytes, without a
    copy: ``torch.save`` writes a tensor's whole storage, which for the view is the whole buffer."""
    if not t.numel():
        return t.clone()
    return torch.frombuffer(byte_view(t), dtype=t.dtype).view(t.shape)


__all__ = ["torch_save_manifest", "unstack_layers", "import_checkpoint", "export_dcp"]
