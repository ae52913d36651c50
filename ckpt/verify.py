"""Checkpoint auditing: structure, file sizes, safetensors headers, coverage, and (deep) checksums."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpt._checksum import crc32
from ckpt._codec_reads import data_storage
from ckpt._io import crc_of_range
from ckpt._regions import check_tiling
from ckpt.errors import CheckpointError
from ckpt.formats.msgpack_codec import decode_manifest, decode_object
from ckpt.formats.safetensors_header import MAX_HEADER_BYTES, parse_header
from ckpt.interop.sources import detect, foreign_manifest
from ckpt.manifest import MANIFEST_NAME, Manifest, entry_name
from ckpt.shards import Box
from ckpt.storage import Storage, get_storage


@dataclass(slots=True)
class Problem:
    """One thing wrong with a checkpoint."""

    kind: str  # manifest | missing-file | size | header | coverage | checksum | object | internal
    message: str
    tensor: str | None = None
    file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "tensor": self.tensor, "file": self.file}


@dataclass(slots=True)
class VerifyReport:
    """Result of :func:`verify`: ``ok`` only when no problem was found."""

    url: str
    deep: bool
    problems: list[Problem] = field(default_factory=list)
    tensors: int = 0
    shards: int = 0
    files: int = 0
    bytes_hashed: int = 0
    source_format: str = "ckpt"
    note: str = ""  # e.g. what could not be checked for a foreign (DCP, DeepSpeed) source

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "ok": self.ok, "deep": self.deep, "tensors": self.tensors, "shards": self.shards,
                "files": self.files, "bytes_hashed": self.bytes_hashed, "source_format": self.source_format,
                "note": self.note, "problems": [p.to_dict() for p in self.problems]}


def inspect(url: str, *, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``url`` (no data is read).

    Not collective: any one rank may call it (it reads the manifest itself, even when
    torch.distributed is up; ``ckpt.load`` shares one read among the ranks instead).

    Raises ManifestError when there is no committed checkpoint or the manifest is invalid.
    """
    from ckpt.load import fetch_manifest

    storage = get_storage(url, **(storage_options or {}))
    try:
        return fetch_manifest(storage, manifest_read="each")
    finally:
        storage.close()


def verify(url: str, *, deep: bool = False, storage_options: dict[str, Any] | None = None,
           progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Audit the checkpoint at ``url``; never raises for problems in the checkpoint, reports them.

    Checks the manifest schema, that every data file exists with the recorded size, that each
    file's safetensors header agrees with the manifest, that each tensor's shards tile it exactly
    (no gap, no overlap), that objects decode, and with ``deep=True`` every checksum.
    ``progress(bytes hashed, bytes to hash)`` is called after each shard's checksum (deep only).
    """
    report = VerifyReport(url=url, deep=deep)
    try:
        storage = get_storage(url, **(storage_options or {}))
    except CheckpointError as e:
        report.problems.append(Problem("manifest", str(e), file=MANIFEST_NAME))
        return report
    try:
        _verify(storage, report, deep, progress)
    except Exception as e:  # noqa: BLE001 - verify reports, it never raises (MemoryError, a backend's bug)
        report.problems.append(Problem("internal", f"verification stopped: {type(e).__name__}: {e}"))
    finally:
        storage.close()
    return report


def _verify(storage: Storage, report: VerifyReport, deep: bool,
            progress: Callable[[int, int], None] | None = None) -> None:
    m = _read_manifest(storage, report)
    if m is None:
        return
    report.tensors = len(m.tensors)
    report.files = len(m.files)
    good_files, headers = _check_files(storage, m, report)
    # shard checksums are of raw bytes: compressed files are read through their frames (ckpt._codec)
    storage = data_storage(storage, m)
    _check_shards(storage, m, report, good_files, headers, deep, progress)
    _check_objects(m, report)


def _read_manifest(storage: Storage, report: VerifyReport) -> Manifest | None:
    """Our manifest, decoded; None when it is reported as a problem or a foreign source was audited instead."""
    try:
        if storage.size(MANIFEST_NAME) is None and detect(storage) not in (None, "ckpt"):
            _verify_foreign(storage, report)
            return None
        raw = storage.read_file(MANIFEST_NAME)
        return decode_manifest(raw, url=f"{storage.url}/{MANIFEST_NAME}")
    except CheckpointError as e:
        report.problems.append(Problem("manifest", str(e), file=MANIFEST_NAME))
        return None


def _check_files(storage: Storage, m: Manifest,
                 report: VerifyReport) -> tuple[set[str], dict[str, dict[str, Any]]]:
    """Check every data file's presence, size and safetensors header; the good files and their headers."""
    good_files: set[str] = set()
    headers: dict[str, dict[str, Any]] = {}
    for path, size in m.files.items():
        try:
            actual = storage.size(path)
        except CheckpointError as e:  # e.g. a symlink that leads outside the checkpoint
            report.problems.append(Problem("path", str(e), file=path))
            continue
        if actual is None:
            report.problems.append(Problem("missing-file", f"{path}: file is missing", file=path))
            continue
        if actual != size:
            report.problems.append(Problem("size", f"{path}: {actual} bytes on storage, manifest records {size} "
                                           "(truncated or overwritten)", file=path))
            continue
        if path in m.codecs or not path.endswith(".safetensors"):
            # zarr chunks and metadata: raw bytes, sizes checked; compressed files (ckpt._codec): frames,
            # checked through their stored CRCs and the shards' raw ones (deep)
            good_files.add(path)
            continue
        try:
            headers[path] = _read_header(storage, path, size)
            good_files.add(path)
        except CheckpointError as e:
            report.problems.append(Problem("header", str(e), file=path))
    return good_files, headers


def _read_header(storage: Storage, path: str, size: int) -> dict[str, Any]:
    """The parsed safetensors header of ``path`` (``size`` bytes); raises CheckpointError when invalid."""
    head = bytearray(min(size, 1 << 16))
    storage.read_into(path, 0, memoryview(head))
    if len(head) >= 8:
        n = int.from_bytes(head[:8], "little")
        # the header cap applies before allocating: a file claiming a huge header is refused by
        # parse_header below without us reading (or allocating) it
        if 8 + n > len(head) and 8 + n <= size and n <= MAX_HEADER_BYTES:
            head = bytearray(8 + n)
            storage.read_into(path, 0, memoryview(head))
    return dict(parse_header(bytes(head), size, path=path))


def _check_shards(storage: Storage, m: Manifest, report: VerifyReport, good_files: set[str],
                  headers: dict[str, dict[str, Any]], deep: bool,
                  progress: Callable[[int, int], None] | None) -> None:
    """Check each tensor's coverage, and each shard in a good file against its header and (deep) checksum."""
    names_at: dict[tuple[str, int, int], list[str]] = {}  # built on the first shard not named after itself
    to_hash = sum(s.length for t in m.tensors.values() for s in t.shards if s.file in good_files) if deep else 0
    for key, t in m.tensors.items():
        _coverage(report, key, t)
        for i, s in enumerate(t.shards):
            if s.file not in good_files:
                continue
            if s.file in headers and not _header_lists(m, headers[s.file], key, i, t.dtype, s, names_at):
                report.problems.append(Problem(
                    "header", f"tensor {key!r} shard {i}: {s.file} header does not list bytes "
                    f"[{s.offset}, {s.offset + s.length}) as {entry_name(key, i)!r} with dtype/shape "
                    f"{_header_type(t.dtype, s)}", tensor=key, file=s.file))
                continue
            if deep and s.length:
                _check_checksum(storage, report, key, i, s, to_hash, progress)


def _header_lists(m: Manifest, header: dict[str, Any], key: str, i: int, dtype: str, s: Any,
                  names_at: dict[tuple[str, int, int], list[str]]) -> bool:
    """Whether ``header`` lists shard ``i`` of ``key`` at its exact range, dtype and shape."""
    he = header.get(entry_name(key, i))
    if he is None:
        # a tied key's shard lists the very bytes of the key it shares (ckpt._aliases): the
        # header names them after one of the shards at that exact range, never another name
        if not names_at:
            for k2, t2 in m.tensors.items():
                for j, s2 in enumerate(t2.shards):
                    names_at.setdefault((s2.file, s2.offset, s2.length), []).append(entry_name(k2, j))
        for name in names_at.get((s.file, s.offset, s.length), ()):
            he = header.get(name)
            if he is not None:
                break
    return not (he is None or he.start != s.offset or he.length != s.length
                or (he.dtype, he.shape) != _header_type(dtype, s))


def _check_checksum(storage: Storage, report: VerifyReport, key: str, i: int, s: Any, to_hash: int,
                    progress: Callable[[int, int], None] | None) -> None:
    """Hash shard ``i`` of ``key`` (non-empty) and report a missing or mismatched checksum."""
    if s.checksum is None:
        # Every writer records one: a missing checksum means the manifest was edited.
        report.problems.append(Problem(
            "checksum", f"tensor {key!r} shard {i}: no checksum in the manifest to verify {s.file} bytes "
            f"[{s.offset}, {s.offset + s.length}) against", tensor=key, file=s.file))
        return
    try:
        crc = crc_of_range(storage, s.file, s.offset, s.length)
    except CheckpointError as e:
        report.problems.append(Problem("checksum", str(e), tensor=key, file=s.file))
        return
    report.bytes_hashed += s.length
    if progress is not None:
        progress(report.bytes_hashed, to_hash)
    if crc != s.checksum:
        report.problems.append(Problem(
            "checksum", f"tensor {key!r} shard {i}: checksum mismatch in {s.file} bytes "
            f"[{s.offset}, {s.offset + s.length}) (stored {s.checksum:#010x}, found {crc:#010x})",
            tensor=key, file=s.file))


def _check_objects(m: Manifest, report: VerifyReport) -> None:
    """Report each object that does not decode or whose checksum does not match."""
    for key, o in m.objects.items():
        blobs = list(o.per_rank.values()) if o.per_rank is not None else [o.data or b""]
        try:
            for b in blobs:
                decode_object(b, key=key)
            if o.data is not None and o.checksum is not None and crc32(o.data) != o.checksum:
                raise CheckpointError(f"object {key!r}: checksum mismatch")
        except CheckpointError as e:
            report.problems.append(Problem("object", str(e), tensor=key))


def _coverage(report: VerifyReport, key: str, t: Any) -> None:
    """Count the tensor's shards; report a gap or overlap in its tiling."""
    report.shards += len(t.shards)
    try:
        check_tiling(key, t.shape, [s.region for s in t.shards])
    except CheckpointError as e:
        report.problems.append(Problem("coverage", str(e), tensor=key))


def _verify_foreign(storage: Storage, report: VerifyReport) -> None:
    """A DCP / DeepSpeed source: its metadata read (allowlist), every item inside its file, every
    tensor tiled by its chunks, objects decodable. These formats record no checksums."""
    fmt = detect(storage) or "?"
    report.source_format = fmt
    try:
        m = foreign_manifest(storage)
    except CheckpointError as e:
        report.problems.append(Problem("manifest", str(e)))
        return
    assert m is not None
    report.note = (f"a {fmt} checkpoint: {fmt} records no checksums, so it was checked for structure and sizes "
                   "only (metadata, files, byte ranges, coverage); `ckpt import` it to get checksums")
    report.tensors, report.files = len(m.tensors), len(m.files)
    for key, t in m.tensors.items():
        _coverage(report, key, t)
    for key, o in m.objects.items():
        try:
            decode_object(o.data or b"", key=key)
        except CheckpointError as e:
            report.problems.append(Problem("object", str(e), tensor=key))


def _header_type(dtype: str, s: Any) -> tuple[str, tuple[int, ...]]:
    """The (safetensors dtype, shape) a shard's header entry must have (see docs/FORMAT.md)."""
    st = _st_dtype(dtype)
    if st is None:
        return "U8", (s.length,)
    return st, tuple(s.region.lengths) if isinstance(s.region, Box) else (s.region.numel,)


@functools.lru_cache(maxsize=64)
def _st_dtype(dtype: str) -> str | None:
    """The safetensors name of a manifest dtype (None: stored as raw bytes); once per dtype, not per
    shard (a tensor of 42,000 shards is checked shard by shard)."""
    from ckpt._dtypes import dtype_from_name, safetensors_dtype

    return safetensors_dtype(dtype_from_name(dtype))


__all__ = ["Problem", "VerifyReport", "inspect", "verify"]
