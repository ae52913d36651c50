"""Restore one rank's memory checkpoint in one pass: read, check, copy, chunk by chunk, on many threads.

``ckpt.load(verify=True)`` reads every shard twice (a checksum pass, then the load) and moves GPU
targets through four bounce threads: a small fraction of pinned host-to-device bandwidth from shared
memory (measured in docs/BENCHMARKS.md, section "Issue 20: GPU figures", part 2). A memory
checkpoint is simpler than what ``ckpt.load`` serves: one data file holding each of this rank's
pieces whole, as the targets want them. So each piece is cut into chunks; a thread ``pread``\\ s a
chunk from shared memory (a kernel copy: no page faults on a fresh mapping) straight into a CPU
target, or into one of its two pinned slabs for a GPU target, checksums it while it is in cache, and
queues the slab's host-to-device copy on its own stream. A piece's checksum is the chunks' CRCs
combined; a mismatch raises IntegrityError naming the piece.

Faster still when the file is already mapped and pinned (a slot the tier mapped ahead of the restore,
:meth:`ckpt.tier.MemoryTier.pin_ahead`, or one a snapshot of this process pinned): each chunk is
copied by DMA straight from the mapping while a thread checksums the same bytes there. ``pread`` +
slab + DMA share the host memory bandwidth, so they reach about half of pinned host-to-device speed;
DMA + CRC from a pinned mapping come close to it. Pinning costs more than the copy itself, which is
why it is done ahead, while the job starts, and kept for the snapshots that reuse the slot
(measured in docs/BENCHMARKS.md, section "Memory tier, second pass").

Unlike ``ckpt.load(verify=True)`` a piece is written into its target *before* its checksum is known
(that second pass is what this avoids), so a corrupt copy leaves the targets partly overwritten:
:func:`load_pieces` marks the error (``partial = True``) and the tier's restore goes on to the next
copy, which overwrites every piece again (see ``MemoryTier.restore``).
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt._checksum import crc32, crc32_combine
from ckpt._dtypes import dtype_from_name
from ckpt._io import byte_view, cpus_per_rank
from ckpt.errors import CheckpointError, IntegrityError, UnsafePathError
from ckpt.formats.msgpack_codec import decode_manifest
from ckpt.manifest import MANIFEST_NAME, Manifest
from ckpt.shards import Box
from ckpt.tier import safefs

CHUNK = 4 << 20  # bytes read and checksummed at a time: stays in cache between the read and the CRC
# SLAB: pinned bytes per host-to-device copy (fewer, larger copies: smaller ones cost markedly more);
# MAPPED: bytes per copy from a mapped file (smaller copies were no faster). Both measured in
# docs/BENCHMARKS.md, section "Figures that code comments used to quote".
SLAB = 16 << 20
MAPPED = 64 << 20


@dataclass(frozen=True, slots=True)
class _Piece:
    key: str
    target: torch.Tensor
    file: str
    offset: int
    length: int
    checksum: int


def workers_for_restore() -> int:
    """Threads for one rank's restore: this process's CPUs shared among the ranks of the host
    (``LOCAL_WORLD_SIZE``), at most 16 (more do not help: measured in docs/BENCHMARKS.md, section
    "Figures that code comments used to quote")."""
    return min(16, cpus_per_rank())


_DECODED: dict[tuple[str, int, int, int, int], Manifest] = {}


def read_manifest(mpath: str) -> Manifest:
    """The decoded manifest file ``mpath``, decoded once per file version (path, inode, mtime, size):
    a restore reads the same one to scan, plan and size the step (each decode costs measurable
    time: docs/BENCHMARKS.md, section "Memory tier, second pass"). Not to be changed by the caller.
    Raises OSError, CheckpointError."""
    with os.fdopen(safefs.open_file(mpath), "rb") as f:  # never a link, FIFO or another user's file
        st = os.fstat(f.fileno())
        key = (mpath, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        got = _DECODED.get(key)
        if got is None:
            got = decode_manifest(f.read(), url=mpath)
            if len(_DECODED) >= 16:
                _DECODED.clear()
            _DECODED[key] = got
    return got


def plan_pieces(flat: dict[str, Any], url: str) -> tuple[Manifest, list[_Piece]] | None:
    """The pieces to read for ``flat``'s tensors, or None when the checkpoint at ``url`` is not a
    whole-piece copy of exactly them (another dtype or shape, a piece split in shards, a missing key,
    a non-contiguous target): the caller then goes through ``ckpt.load``, which says what is wrong."""
    try:
        m = read_manifest(os.path.join(url, MANIFEST_NAME))
    except (OSError, CheckpointError):
        return None
    pieces: list[_Piece] = []
    root = os.path.realpath(url)
    for key, t in flat.items():
        if not isinstance(t, torch.Tensor):
            continue
        e = m.tensors.get(key)
        try:
            same = e is not None and dtype_from_name(e.dtype) == t.dtype and list(e.shape) == list(t.shape)
        except CheckpointError:
            same = False
        if e is None or not same or len(e.shards) != 1:
            return None
        s = e.shards[0]
        n = t.numel() * t.element_size()
        whole = isinstance(s.region, Box) and list(s.region.lengths) == list(t.shape) and not any(s.region.offsets)
        if not whole or s.length != n or s.checksum is None or not t.is_contiguous():
            return None
        path = os.path.join(url, s.file)
        if t.device.type not in ("cpu", "cuda") or not os.path.realpath(path).startswith(root + os.sep):
            return None  # (a file outside the copy: ckpt.load refuses it by name)
        pieces.append(_Piece(key, t, path, s.offset, n, s.checksum))
    return m, pieces


def load_pieces(pieces: list[_Piece], *, workers: int | None = None,
                mapped: dict[tuple[int, int], torch.Tensor] | None = None, stats: dict[str, Any] | None = None) -> int:
    """Fill every piece's target from its file, checking each piece's CRC32. Returns bytes read.

    ``mapped``: byte tensors mapping whole files, by (device, inode) (the tier's mapped slots,
    pinned for a GPU job): pieces of those files are copied from the mapping, straight to the GPU
    when it is pinned (no host copy: close to pinned host-to-device speed with the CRCs, about twice
    what ``pread`` and the slabs reach; measured in docs/BENCHMARKS.md, section "Memory tier, second
    pass"), and checked there. ``stats`` gets ``bytes_mapped``.

    Raises IntegrityError (``partial`` set when targets were already written) or StorageError-like
    OSErrors wrapped in IntegrityError naming the file."""
    workers = workers or workers_for_restore()
    fds, maps = _open_files(pieces, mapped)
    chunks = _chunks(pieces, maps)
    if stats is not None:
        stats["bytes_mapped"] = sum(p.length for p in pieces if p.file in maps)
    if not chunks:
        for fd in fds.values():
            os.close(fd)
        return 0
    slabs = any(p.target.device.type == "cuda" and p.file not in maps for p in pieces)
    run = _Restore(pieces, fds, maps, cuda=slabs)
    for c in chunks:
        run.todo.put(c)
    try:
        with ThreadPoolExecutor(max_workers=min(workers, len(chunks)), thread_name_prefix="ckpt-tier-load") as ex:
            futures = [ex.submit(run.guarded) for _ in range(min(workers, len(chunks)))]
            errors = [f.exception() for f in futures]
    finally:
        for fd in fds.values():
            os.close(fd)
    for err in errors:
        if err is not None:
            raise _partial(err if isinstance(err, IntegrityError) else
                           IntegrityError(f"memory checkpoint read failed ({type(err).__name__}: {err})"))
    return _check_pieces(pieces, chunks, run.crcs)


def _open_files(pieces: list[_Piece], mapped: dict[tuple[int, int], torch.Tensor] | None
                ) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """A descriptor for each piece's file, and the mappings (from ``mapped``) of those mapped whole;
    raises IntegrityError naming a file that cannot be opened (UnsafePathError as is)."""
    fds: dict[str, int] = {}
    maps: dict[str, torch.Tensor] = {}
    try:
        for p in pieces:
            if p.file not in fds:
                fds[p.file] = fd = safefs.open_file(p.file)  # never a link, FIFO (it would block) or device
                st = os.fstat(fd)
                m = (mapped or {}).get((st.st_dev, st.st_ino))
                if m is not None and m.numel() == st.st_size:
                    maps[p.file] = m
    except OSError as e:
        for fd in fds.values():
            os.close(fd)
        if isinstance(e, UnsafePathError):
            raise
        raise IntegrityError(f"{e.filename}: cannot open ({e.strerror}); the memory checkpoint is damaged") from e
    return fds, maps


def _chunks(pieces: list[_Piece], maps: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """Every piece cut into (piece, start, length) chunks, each piece's in order: copy-sized from a
    mapping, slab-sized for a GPU target, cache-sized for a CPU one."""
    chunks: list[tuple[int, int, int]] = []
    for i, p in enumerate(pieces):
        step = MAPPED if p.file in maps else SLAB if p.target.device.type == "cuda" else CHUNK
        chunks += [(i, s, min(step, p.length - s)) for s in range(0, p.length, step)]
    return chunks


@dataclass(slots=True)
class _Restore:
    """What the threads of one :func:`load_pieces` share: the chunks left to do and each chunk's CRC."""

    pieces: list[_Piece]
    fds: dict[str, int]
    maps: dict[str, torch.Tensor]
    todo: queue.SimpleQueue[tuple[int, int, int]] = field(default_factory=queue.SimpleQueue)
    crcs: dict[tuple[int, int], int] = field(default_factory=dict)  # (piece, start) -> that chunk's CRC32
    failed: threading.Event = field(default_factory=threading.Event)
    cuda: bool = False  # some GPU target is read through pinned slabs

    def guarded(self) -> None:
        """One thread's work; a failure stops the other threads at their next chunk."""
        try:
            self.work()
        except BaseException:
            self.failed.set()
            raise

    def work(self) -> None:
        """Take chunks until none is left (or a thread failed): read, checksum and copy each into its target."""
        slabs = [torch.empty(SLAB, dtype=torch.uint8, pin_memory=True) for _ in range(2)] if self.cuda else []
        events: list[Any] = [None, None]
        streams: dict[int, Any] = {}
        j = 0
        while not self.failed.is_set():
            try:
                i, start, n = self.todo.get_nowait()
            except queue.Empty:
                break
            p = self.pieces[i]
            fd = self.fds[p.file]
            m = self.maps.get(p.file)
            if m is not None:
                self.crcs[(i, start)] = _copy_mapped(m, p, start, n, streams)
                continue
            if p.target.device.type == "cpu":
                dst = byte_view(p.target)[start : start + n]
                self.crcs[(i, start)] = _read_crc(fd, dst, p.offset + start, p.file)
                continue
            self.crcs[(i, start)], events[j] = _via_slab(fd, p, start, n, slabs[j], events[j], streams)
            j ^= 1
        for s in streams.values():
            s.synchronize()


def _via_slab(fd: int, p: _Piece, start: int, n: int, slab: torch.Tensor, last: Any,
              streams: dict[int, Any]) -> tuple[int, Any]:
    """Read ``n`` bytes of ``p`` at ``start`` into pinned ``slab`` once its ``last`` copy has left it, and
    queue their copy into the GPU target; their CRC32 and the event marking the copy's end."""
    if last is not None:
        last.synchronize()  # the slab's previous copy has left it
    crc = _read_crc(fd, byte_view(slab)[:n], p.offset + start, p.file)
    s = _stream_for(p.target, streams)
    with torch.cuda.stream(s):
        p.target.view(-1).view(torch.uint8)[start : start + n].copy_(slab[:n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(s)
    return crc, ev


def _check_pieces(pieces: list[_Piece], chunks: list[tuple[int, int, int]], crcs: dict[tuple[int, int], int]) -> int:
    """Combine each piece's chunk CRCs and compare with its checksum; the bytes restored."""
    combined = [0] * len(pieces)
    for i, start, n in chunks:
        combined[i] = crc32_combine(combined[i], crcs[(i, start)], n)
    total = 0
    for i, p in enumerate(pieces):
        crc = combined[i]
        if crc != p.checksum:
            raise _partial(IntegrityError(f"{p.file}: tensor {p.key!r} fails its checksum (stored {p.checksum:#010x}, "
                                          f"read {crc:#010x}): this memory copy is corrupt"))
        total += p.length
    return total


def _stream_for(target: torch.Tensor, streams: dict[int, Any]) -> Any:
    """This worker's copy stream for ``target``'s GPU (made on first use)."""
    dev = target.device.index if target.device.index is not None else torch.cuda.current_device()
    s = streams.get(dev)
    if s is None:
        s = streams[dev] = torch.cuda.Stream(device=dev)
    return s


def _copy_mapped(m: torch.Tensor, p: _Piece, start: int, n: int, streams: dict[int, Any]) -> int:
    """Copy ``n`` bytes of ``p`` from the mapping ``m`` of its file into its target at ``start``;
    their CRC32: of the target for a CPU one (what was loaded, while in cache), of the mapping for
    a GPU one (read while the DMA runs; nothing writes a linked slot, see ckpt.tier.slots)."""
    src = m[p.offset + start : p.offset + start + n]
    dst = p.target.view(-1).view(torch.uint8)[start : start + n]
    if p.target.device.type == "cpu":
        crc = 0
        for q in range(0, n, CHUNK):
            dst[q : q + CHUNK].copy_(src[q : q + CHUNK])
            crc = crc32(byte_view(dst[q : q + CHUNK]), crc)
        return crc
    with torch.cuda.stream(_stream_for(p.target, streams)):
        dst.copy_(src, non_blocking=True)  # DMA when the mapping is pinned, else a staged copy
    return crc32(byte_view(src))  # one call: the bytes come from memory either way, not from cache


def _read_crc(fd: int, dst: memoryview, offset: int, path: str) -> int:
    """``pread`` ``len(dst)`` bytes at ``offset`` into ``dst`` in cache-sized steps; their CRC32."""
    crc, got, n = 0, 0, len(dst)
    while got < n:
        want = min(CHUNK, n - got)
        r = os.preadv(fd, [dst[got : got + want]], offset + got)
        if r <= 0:
            raise IntegrityError(f"{path}: ends before byte {offset + got + want}; the memory checkpoint is truncated")
        crc = crc32(dst[got : got + r], crc)
        got += r
    return crc


def _partial(e: IntegrityError) -> IntegrityError:
    e.partial = True  # type: ignore[attr-defined]
    return e


__all__ = ["CHUNK", "SLAB", "MAPPED", "workers_for_restore", "read_manifest", "plan_pieces", "load_pieces"]
