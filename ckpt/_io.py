"""Executing plans: write a rank's data file (hashing in the same pass), run a rank's reads."""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ckpt._checksum import crc32
from ckpt._codec import Codec, FileCodec, FrameWriter, StorageFault
from ckpt._codec_reads import decoding
from ckpt._dtypes import dtype_from_name
from ckpt._load_plan import ReadOp, ReadPlan, SegmentCopy, StridedCopy
from ckpt._save_plan import WriteAssignment
from ckpt.errors import StorageError
from ckpt.storage.base import Storage

CHUNK = 16 * 1024 * 1024


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor's memory (no copy)."""
    if t.numel() == 0:
        return memoryview(b"")
    # as_strided, not reshape: a contiguous tensor may still carry odd strides on size-1 dims
    # (``w[:, 3]`` of a (1, 8) matrix has stride (8,)), which the byte reinterpretation refuses.
    flat = t.as_strided((t.numel(),), (1,))
    arr: Any = flat.view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


def host_bytes(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """Bytes of ``t`` on the host; returns the view and the tensor that owns them (keep it alive)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return byte_view(t), t


def entry_source(t: torch.Tensor, start: int, count: int | None) -> torch.Tensor:
    """What a write entry writes of its piece's local tensor ``t``: all of it (``count`` None), or
    elements ``[start, start + count)`` of its row-major data (a part, see ``WriteEntry``).

    A part is whole rows of a box piece or a range of a (1-D) flat piece, so it is ``t.narrow``
    along dim 0: a view whatever ``t``'s strides or device, and what gets copied to the host (or
    made contiguous) afterwards is the part only, not the whole piece.
    """
    if count is None:
        return t
    if t.dim():
        row = math.prod(t.shape[1:])
        if row and start % row == 0 and count % row == 0:
            return t.narrow(0, start // row, count // row)
    return t.reshape(-1).narrow(0, start, count)  # not row-aligned (no planner makes these): copies if strided


def write_assignment(storage: Storage, a: WriteAssignment, sources: list[torch.Tensor],
                     pool: ThreadPoolExecutor | None = None,
                     wait_piece: Callable[[int], None] | None = None,
                     segments: Callable[[int], Iterator[memoryview]] | None = None) -> tuple[int, list[int]]:
    """Write one rank's data file: header, then each entry's bytes (its piece, or the part of it the
    entry names: ``entry_source``), hashing as they go.

    ``segments(piece)``, when given, yields the entry's bytes instead (an async save's staged
    copy, segment by segment); the next segment is asked for only once the previous one is
    written, so the stager may reuse its memory then.

    Writes and CRC32 run concurrently (both release the GIL): while the writer thread writes a
    chunk, the calling thread hashes it. Returns ``(file size, checksums in entry order)``.
    Raises StorageError; on failure the partial file is removed.
    """
    assert a.file is not None
    w = storage.open_writer(a.file)
    own_pool = pool is None
    ex = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-write")
    sums: list[int] = []
    try:
        w.write(a.header)
        pending: Future[Any] | None = None
        for e in a.entries:
            if wait_piece is not None:
                wait_piece(e.piece)
            if segments is None:
                mv, owner = host_bytes(entry_source(sources[e.piece], e.start, e.count))
                parts: Iterator[memoryview] = iter((mv,))
            else:
                parts, owner = segments(e.piece), None
            crc, n = 0, 0
            while True:
                if segments is not None and pending is not None:
                    pending.result()  # the previous segment is written before its memory may be reused
                seg = next(parts, None)
                if seg is None:
                    break
                n += len(seg)
                if n > e.length:
                    break
                for i in range(0, len(seg), CHUNK):
                    chunk = seg[i : i + CHUNK]
                    if pending is not None:
                        pending.result()
                    pending = ex.submit(w.write, chunk)
                    crc = crc32(chunk, crc)
            if n != e.length:
                raise StorageError(f"{a.file}: piece {e.key!r} has {n} bytes, plan says {e.length}")
            sums.append(crc)
            del owner
        if pending is not None:
            pending.result()
        size = w.close()
    except BaseException:
        w.abort()
        raise
    finally:
        if own_pool:
            ex.shutdown(wait=True)
    return size, sums


def write_compressed(storage: Storage, a: WriteAssignment, sources: list[torch.Tensor], codec: Codec,
                     pool: ThreadPoolExecutor | None = None,
                     wait_piece: Callable[[int], None] | None = None,
                     segments: Callable[[int], Iterator[memoryview]] | None = None) -> tuple[int, list[int], FileCodec]:
    """:func:`write_assignment` for a compressed data file (``ckpt._codec``): each entry's bytes go
    out as zstd frames (no safetensors header: the file is the frames back to back), the CRC-32 of
    each entry's RAW bytes computed in the same pass. Returns ``(stored size, raw checksums in entry
    order, the file's codec record)``. Raises StorageError; on failure the partial file is removed."""
    assert a.file is not None
    w = storage.open_writer(a.file)
    own_pool = pool is None
    ex = pool or ThreadPoolExecutor(max_workers=max(1, min(4, cpus_per_rank())), thread_name_prefix="ckpt-zstd")
    fw = FrameWriter(codec, w.write, ex)
    sums: list[int] = []
    try:
        for e in a.entries:
            if wait_piece is not None:
                wait_piece(e.piece)
            planes = codec.planes_for(sources[e.piece].element_size())
            if segments is None:
                mv, owner = host_bytes(entry_source(sources[e.piece], e.start, e.count))
                parts: Iterator[memoryview] = iter((mv,))
            else:
                parts, owner = segments(e.piece), None
            try:
                sums.append(fw.piece(e.offset, e.length, parts, planes))
            except StorageFault as err:
                raise StorageError(f"{a.file}: piece {e.key!r}: {err}") from None
            del owner
        fc = fw.finish(max([len(a.header)] + [e.offset + e.length for e in a.entries]))
        size = w.close()
    except BaseException:
        fw.cancel()
        w.abort()
        raise
    finally:
        if own_pool:
            ex.shutdown(wait=True)
    return size, sums, fc


class _Buffers(threading.local):
    buf: torch.Tensor | None = None


def _typed(buf: torch.Tensor, off: int, dtype: torch.dtype, isz: int, n: int | None = None) -> torch.Tensor:
    """``n`` elements (default: as many as fit) of ``dtype`` at byte ``off`` of ``buf``; a copy of
    just those bytes when they are not aligned for the dtype (other tools' files, e.g. DCP's
    torch.save items, do not align tensor data within the file)."""
    n = (buf.numel() - off) // isz if n is None else n
    raw = buf[off : off + n * isz]
    try:
        return raw.view(dtype)
    except RuntimeError:  # misaligned for this dtype: pay one copy of these bytes
        return raw.clone().view(dtype)


def _strided(buf: torch.Tensor, c: StridedCopy, t: torch.Tensor, isz: int) -> None:
    """One strided block copy from ``buf`` into target ``t``. Misaligned source bytes whose rows
    are contiguous are copied as bytes (no staging copy); others through :func:`_typed`."""
    box = tuple(slice(o, o + n) for o, n in zip(c.dst_offsets, c.lengths, strict=True))
    dst = t[box] if t.dim() else t
    if (buf.storage_offset() + c.buf_offset) % isz and c.lengths and c.src_strides[-1] == 1 \
            and dst.dim() and dst.stride(-1) == 1 and 0 not in c.lengths:
        lengths = (*c.lengths[:-1], c.lengths[-1] * isz)
        src = torch.as_strided(buf[c.buf_offset:], lengths, (*(s * isz for s in c.src_strides[:-1]), 1))
        dst.view(torch.uint8).copy_(src)
        return
    span = 1 + sum((n - 1) * s for n, s in zip(c.lengths, c.src_strides, strict=True)) if 0 not in c.lengths else 0
    dst.copy_(torch.as_strided(_typed(buf, c.buf_offset, t.dtype, isz, span), c.lengths, c.src_strides))


# A mapped op's unneeded bytes are never copied and, warm, barely touched (the kernel maps a few
# neighbouring cached pages per fault anyway); cold, readahead fetches gaps this small regardless.
MAP_GAP = 1 << 20


def _mapper(storage: Storage) -> Callable[[str, int, int], tuple[mmap.mmap, int] | None] | None:
    """``storage.map_range`` where the storage maps files (``maps_files``), else None.

    A wrapper that must see every byte read (``VerifyingReads``, through ``read_into``/``readv``)
    keeps the base class's ``maps_files = False``, so a map of the files underneath never bypasses it.
    """
    return storage.map_range if storage.maps_files else None


def read_gap(storage: Storage) -> int:
    """The ``max_gap`` to plan a load from ``storage`` with, for ``run_read_plan(map_files=True)``.

    Where ``run_read_plan`` maps the files (local storage), unneeded bytes between two runs cost
    nothing until touched: planning with a wide gap gives one range per op instead of one per run
    (a column block of row-major shards is one short run per row: ~0.2 M ranges per GB to build).
    Elsewhere the storage's ``coalesce_gap``.
    """
    if storage.maps_files:
        return MAP_GAP
    return int(storage.coalesce_gap)


def default_workers(storage: Storage, world: int) -> int:
    """Reader threads per rank for ``run_read_plan(map_files=True)`` (and the verify pass) when the
    caller names none.

    Mapped local files: the work is copies out of the page cache (and, cold, page faults that each
    read ahead far), so more threads than this rank's share of the cores only contend: at most 4,
    at most the CPUs this process may run on divided among the ranks on this host
    (``LOCAL_WORLD_SIZE`` as torchrun sets it, else all ``world`` ranks): with more ranks than
    cores, one thread per rank loaded a resharded state faster, warm and cold, than four each
    (measured in docs/BENCHMARKS.md, section "Multi-rank save and resharded load").
    Other storages: 4 (their reads wait on the network, not on the cores).
    """
    if _mapper(storage) is None:
        return 4
    return max(1, min(4, cpus_per_rank(world)))


def cpus_per_rank(world: int = 1) -> int:
    """The CPUs this process may run on divided among the ranks on this host (``LOCAL_WORLD_SIZE``
    as torchrun sets it, else ``world``); at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    local = int(env) if env.isdigit() and int(env) > 0 else max(1, world)
    return max(1, cpus // local)


def _read_direct(storage: Storage, op: ReadOp, targets: list[torch.Tensor]) -> None:
    """Read ``op``'s ranges straight into its target (``op.direct``: a contiguous run of it), no buffer."""
    assert op.direct is not None
    ti, off = op.direct
    dst = byte_view(targets[ti])
    for fo, n in op.ranges:
        storage.read_into(op.file, fo, dst[off + fo - op.start : off + fo - op.start + n])


def _copy_out(buf: torch.Tensor, op: ReadOp, targets: list[torch.Tensor], isz: list[int]) -> None:
    """Run ``op``'s copies from ``buf`` (its bytes ``[op.start, op.start + op.length)``) into ``targets``."""
    for c in op.copies:
        t = targets[c.target]
        if isinstance(c, StridedCopy):
            _strided(buf, c, t, isz[c.target])
        else:
            _segments(buf, c, t, isz[c.target])


def _unmap(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view of it is still alive (a traceback's frame): unmapped when that dies
        pass


def run_read_plan(storage: Storage, plan: ReadPlan, targets: list[torch.Tensor], dtypes: list[str],
                  *, workers: int = 4, map_files: bool = False) -> None:
    """Fill ``targets`` (contiguous CPU tensors shaped like their regions) by executing ``plan``.

    Ops that go straight into a target are read into it. The others are read into a per-thread
    buffer (``readv`` of the op's ranges, or parallel ranged requests) and copied from there; or,
    with ``map_files`` where the storage maps files (local storage: ``map_range``), copied from a
    memory map of the op's span, so that the only copy is the one from the page cache into the
    target (no read call per run, no buffer; plan with :func:`read_gap`).
    """
    storage = decoding(storage, plan.files)  # compressed files: raw bytes from their frames (ckpt._codec)
    local = _Buffers()
    tdt = [dtype_from_name(d) for d in dtypes]
    isz = [torch.empty((), dtype=d).element_size() for d in tdt]
    mapper = _mapper(storage) if map_files else None

    def mapped(op: ReadOp) -> bool:
        assert mapper is not None
        m = mapper(op.file, op.start, op.length)
        if m is None:
            return False
        mm, at = m
        try:
            _copy_out(torch.frombuffer(mm, dtype=torch.uint8, count=op.length, offset=at), op, targets, isz)
        finally:
            _unmap(mm)
        return True

    def run(op: ReadOp) -> None:
        if op.direct is not None:
            _read_direct(storage, op, targets)
            return
        if mapper is not None and mapped(op):
            return
        if local.buf is None or local.buf.numel() < op.length:
            local.buf = torch.empty(max(op.length, 1 << 20), dtype=torch.uint8)
        buf = local.buf[: op.length]
        mv = byte_view(buf)
        if len(op.ranges) > 1:  # preadv locally; parallel ranged GETs on object stores
            storage.readv(op.file, op.ranges, mv, op.start)
        else:
            for fo, n in op.ranges:
                storage.read_into(op.file, fo, mv[fo - op.start : fo - op.start + n])
        _copy_out(buf, op, targets, isz)

    if workers <= 1 or len(plan.ops) <= 1:
        for op in plan.ops:
            run(op)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-read") as ex:
        for f in [ex.submit(run, op) for op in plan.ops]:
            f.result()


def _segments(buf: torch.Tensor, c: SegmentCopy, t: torch.Tensor, isz: int) -> None:
    flat = t.view(-1)
    offsets = c.buf_offsets.tolist()
    if (buf.storage_offset() + (offsets[0] if offsets else 0)) % isz or any(b % isz for b in offsets):
        # bytes not aligned for the dtype (another tool's file): copy each segment as bytes
        fb = flat.view(torch.uint8) if flat.numel() else flat
        for b, d, n in zip(offsets, c.dst_offsets.tolist(), c.lengths.tolist(), strict=True):
            fb[d * isz : (d + n) * isz].copy_(buf[b : b + n * isz])
        return
    typed = _typed(buf, 0, t.dtype, isz)
    for b, d, n in zip(offsets, c.dst_offsets.tolist(), c.lengths.tolist(), strict=True):
        flat[d : d + n].copy_(typed[b // isz : b // isz + n])


def crc_of_range(storage: Storage, path: str, offset: int, length: int) -> int:
    """CRC32 of bytes ``[offset, offset + length)`` of ``path``, read in bounded chunks."""
    storage = decoding(storage, (path,))
    crc = 0
    buf = bytearray(min(length, CHUNK))
    pos = 0
    while pos < length:
        n = min(len(buf), length - pos)
        mv = memoryview(buf)[:n]
        storage.read_into(path, offset + pos, mv)
        crc = crc32(mv, crc)
        pos += n
    return crc


def verify_shards(storage: Storage, manifest: Any, requests: list[Any], *, workers: int = 4) -> int:
    """Check the CRC32 of every stored shard that intersects ``requests``; returns bytes hashed.

    Raises IntegrityError naming tensor, file and byte range on the first mismatch (or a shard
    without a checksum: nothing to verify against).
    """
    from ckpt._regions import global_runs
    from ckpt.errors import IntegrityError

    todo: list[tuple[str, int, Any]] = []
    for req in requests:
        t = manifest.tensors[req.key]
        want_s, want_l = global_runs(req.region, tuple(t.shape))
        for i, s in t.indexed_shards_overlapping(req.region):  # decoded manifests: only the candidates
            if s.length == 0:
                continue
            have_s, have_l = global_runs(s.region, tuple(t.shape))
            if _runs_intersect(want_s, want_l, have_s, have_l):
                todo.append((req.key, i, s))

    def check(item: tuple[str, int, Any]) -> int:
        key, i, s = item
        if s.checksum is None:
            raise IntegrityError(f"tensor {key!r} shard {i}: no checksum in the manifest to verify {s.file} "
                                 f"bytes [{s.offset}, {s.offset + s.length}); load with verify=False")
        crc = crc_of_range(storage, s.file, s.offset, s.length)
        if crc != s.checksum:
            raise IntegrityError(f"tensor {key!r} shard {i}: checksum mismatch in {s.file} bytes "
                                 f"[{s.offset}, {s.offset + s.length}) (stored {s.checksum:#010x}, "
                                 f"found {crc:#010x}); the file is corrupted, nothing was loaded from it")
        return int(s.length)

    unique = list({(it[2].file, it[2].offset, it[2].length, it[2].checksum): it for it in todo}.values())
    if workers <= 1 or len(unique) <= 1:
        return sum(check(it) for it in unique)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-verify") as ex:
        return sum(ex.map(check, unique))


def _runs_intersect(a_s: Any, a_l: Any, b_s: Any, b_l: Any) -> bool:
    import numpy as np

    if not len(a_s) or not len(b_s):
        return False
    a_e = a_s + a_l
    idx = np.searchsorted(a_e, b_s, side="right")  # first a-run ending after each b-run start
    ok = idx < len(a_s)
    return bool(np.any(a_s[np.minimum(idx, len(a_s) - 1)][ok] < (b_s + b_l)[ok]))


class ScratchReader:
    """Executes read plans one op at a time through one reusable scratch buffer.

    For streaming rewrites (``ckpt reshard``, ``ckpt diff``) that run many small plans: no buffer is
    allocated per call (fresh memory is slow to touch), and memory stays bounded by ``scratch_bytes``
    (ops longer than that, which plans made with ``max_read <= scratch_bytes`` do not produce, grow it).
    Targets must be contiguous CPU tensors shaped like their regions, as for :func:`run_read_plan`.
    """

    def __init__(self, storage: Storage, scratch_bytes: int):
        self.storage = storage
        self.buf = torch.empty(max(int(scratch_bytes), 64), dtype=torch.uint8)

    def run(self, plan: ReadPlan, targets: list[torch.Tensor], dtypes: list[str]) -> None:
        """Fill ``targets`` by executing ``plan`` (sequentially, in plan order)."""
        isz = [torch.empty((), dtype=dtype_from_name(d)).element_size() for d in dtypes]
        storage = decoding(self.storage, plan.files)  # compressed files: raw bytes from their frames
        for op in plan.ops:
            if op.direct is not None:
                _read_direct(storage, op, targets)
                continue
            if self.buf.numel() < op.length:
                self.buf = torch.empty(op.length, dtype=torch.uint8)
            buf = self.buf[: op.length]
            mv = byte_view(buf)
            for fo, n in op.ranges:
                storage.read_into(op.file, fo, mv[fo - op.start : fo - op.start + n])
            _copy_out(buf, op, targets, isz)
