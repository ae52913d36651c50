"""The streaming copy engine: exact element ranges of stored tensors -> new files, under a memory budget.

Every writer of tensor data it does not hold in memory copies it with this module: ``ckpt reshard``
and the converters built on it (DCP, Megatron, DeepSpeed and ``torch.save`` imports), ``export-hf``,
``import-hf`` and ``export-dcp``. The source is a :class:`~ckpt.storage.Storage` and a
:class:`~ckpt.manifest.Manifest`: a checkpoint's own, or one synthesized over another tool's files
(each shard a byte range of them). The output is a list of :class:`OutFile`: a header, then the
bytes of its :class:`Item` s back to back, each item one region (a box, a flat range) of one stored
tensor in the region's row-major order, cast to another dtype if asked.

:func:`copy_files`:

1. **Parts.** An item longer than a buffer is cut into parts of at most one buffer
   (:func:`~ckpt._chunks.split_region`, in the order of its bytes); consecutive parts fill
   a buffer (a *batch*) and are read with one read plan (:func:`~ckpt._load_plan.plan_load`).
2. **Lanes.** ``lanes`` threads each write one file at a time (with one lane, all files in order on
   the calling thread). A lane owns two buffers: a batch is read into one (``readers`` threads, or
   one reused scratch buffer when 1), cast, hashed (CRC32 of each item's output bytes), and handed
   to the lane's writer thread while the next batch is read into the other.
3. **Source checks** (``verify``): every stored shard of the named tensors is checked against its
   CRC32 from the bytes the reads bring in (:mod:`ckpt._source_checks`; each byte hashed once), once
   the last batch reading its tensor is read and before that batch is written; the parts no batch
   reads (vocab padding, files another attempt finished) are read at the end through one more
   buffer of at most ``VERIFY_CHUNK``.

Memory: ``budget`` less a sixteenth (at most ``VERIFY_CHUNK``, the source checks' buffer) is shared by
the lanes; each holds two buffers of at most 3/8 of its share and the read planner's buffers (a
quarter of it); whatever the size of the largest tensor.

Files: the engine opens only the paths of ``files``, recording each in ``written`` (the caller's
:class:`~ckpt._transaction.WrittenSet`) just before; on a failure it aborts the files it has open and
raises, and removes nothing else: what to do with the finished files (remove them through the written
set, or keep them for a resumed run) is the caller's decision.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from queue import Empty, Queue
from typing import Any, cast

import torch

from ckpt._checksum import crc32
from ckpt._chunks import split_region
from ckpt._codec_reads import data_storage
from ckpt._dtypes import dtype_from_name
from ckpt._io import ScratchReader, byte_view, run_read_plan
from ckpt._load_plan import DEFAULT_MAX_READ, LoadRequest, plan_load
from ckpt._regions import may_overlap
from ckpt._source_checks import VERIFY_CHUNK, SourceChecks, VerifyingReads
from ckpt._transaction import WrittenSet
from ckpt.errors import IntegrityError, MismatchError
from ckpt.manifest import Manifest, TensorEntry
from ckpt.shards import Box, Region
from ckpt.storage import Storage

__all__ = ["Item", "OutFile", "Copied", "Progress", "copy_files", "read_items"]

Progress = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)`` of output tensor bytes written, one call at a time, with
non-decreasing ``bytes_done``; keep it quick."""

ALIGN = 64  # every part starts at a multiple of this in its buffer (any dtype's alignment)
MIN_LANE_BUFFER = 4096  # a tiny budget runs fewer lanes rather than tiny reads


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(slots=True, frozen=True)
class Item:
    """One run of output bytes: the elements of ``region`` of the stored tensor ``key`` (stored as
    ``dtype``, global ``shape``), in the region's row-major order, cast to ``out_dtype`` if given.
    ``name``: the caller's label (e.g. the safetensors entry name)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    region: Region
    out_dtype: torch.dtype | None = None
    name: str = ""

    @property
    def src_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype, key=self.key)

    @property
    def dst_dtype(self) -> torch.dtype:
        return self.out_dtype or self.src_dtype

    @property
    def cast(self) -> bool:
        return self.out_dtype is not None and self.out_dtype != self.src_dtype

    @property
    def numel(self) -> int:
        return self.region.numel

    @property
    def out_bytes(self) -> int:
        return self.numel * self.dst_dtype.itemsize

    def request(self, region: Region | None = None) -> LoadRequest:
        return LoadRequest(self.key, self.dtype, self.shape, self.region if region is None else region)


@dataclass(slots=True)
class OutFile:
    """A file to write: ``header``, then its items' bytes back to back."""

    path: str
    header: bytes
    items: list[Item]

    @property
    def size(self) -> int:
        return len(self.header) + sum(it.out_bytes for it in self.items)


@dataclass(slots=True)
class Copied:
    """What :func:`copy_files` did."""

    sizes: list[int]  # per file, as its writer reported it
    checksums: list[list[int]]  # per file, per item: CRC32 of the item's output bytes (with ``checksums``)
    buffer_bytes: int  # most data-buffer bytes held at once
    verified_bytes: int = 0  # source bytes whose CRC32 was checked (``verify``)


@dataclass(slots=True)
class _Part:
    """A run of one item's bytes (``region`` is a part of ``item.region``), or, with ``item`` None,
    the place of a file that has no items (it is opened, given its header and closed there)."""

    file: int
    index: int  # the item's index in its file
    item: Item | None
    region: Region | None
    first: bool  # the first part of its file
    last: bool  # the last part of its file

    @property
    def numel(self) -> int:
        return self.region.numel if self.region is not None else 0

    @property
    def src_bytes(self) -> int:
        return self.numel * self.item.src_dtype.itemsize if self.item is not None else 0

    @property
    def out_bytes(self) -> int:
        return self.numel * self.item.dst_dtype.itemsize if self.item is not None else 0

    @property
    def cost(self) -> int:
        """Buffer bytes: the stored bytes, plus the cast result when the dtype changes."""
        if self.item is None:
            return 0
        return _up(self.src_bytes) + (_up(self.out_bytes) if self.item.cast else 0)


def _parts(files: Sequence[OutFile], order: list[int], cap: int) -> Iterator[_Part]:
    """The parts of ``files[order]``, each at most ``cap`` buffer bytes (at least one element)."""
    for fi in order:
        f = files[fi]
        if not f.items:
            yield _Part(fi, -1, None, None, True, True)
            continue
        for ii, it in enumerate(f.items):
            room = cap - cap % ALIGN  # a part's bytes are rounded up to ALIGN in the buffer
            most = (room - ALIGN) // (it.src_dtype.itemsize + it.dst_dtype.itemsize) if it.cast else \
                room // it.src_dtype.itemsize
            regions = list(split_region(it.region, max(1, most)))
            for k, r in enumerate(regions):
                yield _Part(fi, ii, it, r, ii == 0 and k == 0, ii == len(f.items) - 1 and k == len(regions) - 1)


def _batches(parts: Iterator[_Part], cap: int) -> list[list[_Part]]:
    """Consecutive runs of parts whose buffer cost fits ``cap`` (a larger part is a batch of its own)."""
    out: list[list[_Part]] = []
    cur: list[_Part] = []
    cost = 0
    for p in parts:
        c = p.cost
        if cur and cost + c > cap:
            out.append(cur)
            cur, cost = [], 0
        cur.append(p)
        cost += c
    if cur:
        out.append(cur)
    return out


def _narrow(manifest: Manifest, reqs: list[LoadRequest]) -> Manifest:
    """The tensors of ``reqs`` with only the shards that may overlap them: planning a small read does
    not visit every shard of a many-shard tensor."""
    regions: dict[str, list[Region]] = {}
    for q in reqs:
        regions.setdefault(q.key, []).append(q.region)
    tensors: dict[str, TensorEntry] = {}
    for key, rs in regions.items():
        t = manifest.tensors[key]
        shape = tuple(t.shape)
        seen: set[int] = set()
        shards = []
        for r in rs:
            for i, s in t.indexed_shards_overlapping(r):
                if i not in seen and may_overlap(s.region, r, shape):
                    seen.add(i)
                    shards.append(s)
        tensors[key] = TensorEntry(t.dtype, shape, shards)
    return Manifest(tensors=tensors, files=manifest.files)


class _Reader:
    """Fills batches of parts into a buffer: reads (``readers`` threads, or one scratch buffer),
    casts (refusing float16 overflow), hashes."""

    def __init__(self, storage: Storage, manifest: Manifest, *, readers: int, max_read: int):
        self.storage, self.manifest, self.readers, self.max_read = storage, manifest, readers, max_read
        self.gap = storage.coalesce_gap
        self.scratch = ScratchReader(storage, max_read) if readers <= 1 else None

    def fill(self, batch: list[_Part], buf: torch.Tensor) -> list[torch.Tensor]:
        """Read ``batch`` into ``buf``; return each part's output elements (views of ``buf``)."""
        targets: list[torch.Tensor] = []
        off = 0
        for p in batch:
            if p.item is None or p.region is None:
                targets.append(buf[:0])
                continue
            lengths = p.region.lengths if isinstance(p.region, Box) else (p.numel,)
            targets.append(buf[off : off + p.src_bytes].view(p.item.src_dtype).view(lengths))
            off += _up(p.src_bytes)
        wanted = [i for i, p in enumerate(batch) if p.numel]
        if wanted:
            reqs = [cast(Item, batch[i].item).request(batch[i].region) for i in wanted]
            plan = plan_load(_narrow(self.manifest, reqs), reqs, contiguous_targets=[True] * len(reqs),
                             max_read=self.max_read, max_gap=self.gap)
            dtypes = [r.dtype for r in reqs]
            if self.scratch is not None:
                self.scratch.run(plan, [targets[i] for i in wanted], dtypes)
            else:
                run_read_plan(self.storage, plan, [targets[i] for i in wanted], dtypes, workers=self.readers)
        out: list[torch.Tensor] = []
        for p, t in zip(batch, targets, strict=True):
            it = p.item
            if it is not None and it.cast:
                o = buf[off : off + p.out_bytes].view(it.dst_dtype).view(t.shape)
                off += _up(p.out_bytes)
                o.copy_(t)
                _check_cast(it, t, o)
                t = o
            out.append(t)
        return out


def _check_cast(it: Item, src: torch.Tensor, out: torch.Tensor) -> None:
    # Only float16 is narrower than its possible sources (float32/64, bfloat16); bf16 has float32's range.
    if it.dst_dtype != torch.float16 or it.src_dtype not in (torch.float64, torch.float32, torch.bfloat16):
        return
    overflow = int(torch.isinf(out).sum()) - int(torch.isinf(src).sum())
    if overflow > 0:
        raise MismatchError(f"tensor {it.key!r}: {overflow} values overflow float16 (|x| > 65504) and would "
                            "become inf; export as bf16 or fp32 instead")


class _Cancelled(Exception):
    """Another lane failed: stop this one."""


@dataclass(slots=True)
class _Lane:
    reader: _Reader
    writer: ThreadPoolExecutor
    slabs: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])
    out: Any = None  # the storage writer of the file being written
    broken: bool = False  # a write failed: the rest of this run's writes are skipped


class _Copy:
    """One :func:`copy_files` call (see the module docstring)."""

    def __init__(self, src: Storage, manifest: Manifest, dst: Storage, files: Sequence[OutFile], *,
                 checksums: bool, progress: Progress | None, file_done: Callable[[int, int, list[int]], None] | None,
                 written: WrittenSet | list[str]):
        self.src, self.manifest, self.dst, self.files = src, manifest, dst, files
        self.progress, self.file_done, self.written = progress, file_done, written
        self.checksums = checksums
        self.sums: list[list[int]] = [[0] * len(f.items) for f in files]
        self.sizes = [0] * len(files)
        self.total = sum(it.out_bytes for f in files for it in f.items)
        self.done = 0
        self.peak = 0  # buffer bytes allocated (each kept to the end)
        self.lock = threading.Lock()
        self.failed = threading.Event()
        self.checks: SourceChecks | None = None
        self.remaining: dict[str, int] = {}  # tensor key -> batches still to read it (source checks)

    def _advance(self, n: int) -> None:
        with self.lock:  # the callback too: calls arrive in order, the last one with the total
            self.done += n
            if self.progress is not None:
                self.progress(self.done, self.total)

    def run_lane(self, lane: _Lane, batches: list[list[_Part]], slab: int) -> None:
        pending: deque[tuple[Future[None], int]] = deque()

        def collect() -> None:
            fut, n = pending.popleft()
            fut.result()
            self._advance(n)

        try:
            for k, batch in enumerate(batches):
                if self.failed.is_set():
                    raise _Cancelled
                if len(pending) == 2:  # the buffer this batch reuses must be written out first
                    collect()
                buf = lane.slabs[k % 2]
                if buf is None:
                    buf = lane.slabs[k % 2] = torch.empty(slab, dtype=torch.uint8)
                    with self.lock:
                        self.peak += slab
                values = lane.reader.fill(batch, buf)
                views = [byte_view(v) for v in values]
                if self.checksums:
                    for p, mv in zip(batch, views, strict=True):
                        if p.item is not None:
                            self.sums[p.file][p.index] = crc32(mv, self.sums[p.file][p.index])
                self._checked(batch)
                pending.append((lane.writer.submit(self._write, lane, batch, views, buf),
                                sum(len(mv) for mv in views)))
                del buf, values, views
            while pending:
                collect()
        except BaseException:
            self.failed.set()
            for fut, _ in pending:
                fut.exception()  # let the writer finish what it holds before aborting
            if lane.out is not None:
                lane.out.abort()
                lane.out = None
            raise

    def _checked(self, batch: list[_Part]) -> None:
        """Source checks: complete those of the tensors no later batch reads (all match, or raise)."""
        if self.checks is None:
            return
        keys = {p.item.key for p in batch if p.item is not None and p.numel}
        done = []
        with self.lock:
            for key in keys:
                self.remaining[key] -= 1
                if not self.remaining[key]:
                    done.append(key)
        if done:
            self.checks.finish(sorted(done), self.src)

    def _write(self, lane: _Lane, batch: list[_Part], views: list[memoryview], _keepalive: torch.Tensor) -> None:
        if lane.broken:
            return  # an earlier write failed: the file it left open is aborted, nothing more is opened
        try:
            self._write_parts(lane, batch, views)
        except BaseException:
            lane.broken = True
            raise

    def _write_parts(self, lane: _Lane, batch: list[_Part], views: list[memoryview]) -> None:
        for p, mv in zip(batch, views, strict=True):
            f = self.files[p.file]
            if p.first:
                self.written.append(f.path)
                lane.out = self.dst.open_writer(f.path)
                lane.out.write(f.header)
            if len(mv):
                lane.out.write(mv)
            if p.last:
                size = lane.out.close()
                lane.out = None
                if size != f.size:
                    raise IntegrityError(f"{self.dst.url}/{f.path}: wrote {size} bytes, expected {f.size}; the "
                                         "storage lost data: run the same command again")
                self.sizes[p.file] = size
                if self.file_done is not None:
                    self.file_done(p.file, size, self.sums[p.file])


def _sizes(budget: int, lanes: int, readers: int, max_part: int | None) -> tuple[int, int, int]:
    """``(lanes, buffer cap, max_read)`` for a budget: per lane two buffers of 3/8 of its share and
    read buffers of a quarter; a budget too small for ``MIN_LANE_BUFFER`` runs fewer lanes."""
    while lanes > 1 and budget // lanes * 3 // 8 < MIN_LANE_BUFFER:
        lanes -= 1
    share = budget // lanes
    cap = max(ALIGN * 4, share * 3 // 8)
    if max_part is not None:
        cap = max(ALIGN * 4, min(cap, max_part))
    max_read = max(ALIGN * 64, min(DEFAULT_MAX_READ, share // (4 * max(1, readers))))
    return lanes, cap, max_read


def copy_files(src: Storage, manifest: Manifest, dst: Storage, files: Sequence[OutFile], *, budget: int,
               lanes: int = 1, readers: int = 1, max_part: int | None = None, checksums: bool = False,
               verify: Collection[str] | None = None, progress: Progress | None = None,
               file_done: Callable[[int, int, list[int]], None] | None = None,
               written: WrittenSet | list[str] | None = None) -> Copied:
    """Write ``files`` to ``dst``, reading their items from ``manifest``'s tensors in ``src``.

    Args:
        budget: bytes of data buffers (reads and writes overlap within it); see the module docstring.
        lanes: files written at a time; 1 writes them in order from the calling thread, more from a
            pool that takes them in the order given (pass the largest first).
        readers: threads per read plan (1: one reused scratch buffer per lane).
        max_part: most bytes of one batch (a smaller first write, no faster copy beyond it).
        checksums: compute each item's CRC32 (:attr:`Copied.checksums`).
        verify: tensor keys whose stored shards to check against the manifest's CRC32s (None: none);
            shards the items do not read whole are completed by reading the rest.
        progress: ``progress(bytes written, total bytes)``; from the calling thread with one lane.
        file_done: ``file_done(index, size, checksums)`` after a file is closed (writer thread).
        written: the paths opened are recorded here (before each is opened): the caller's written set,
            the only files its clean-up may remove.

    Raises whatever reading or writing raised (a file already opened is aborted; finished files stay):
    IntegrityError (a source shard that does not match its CRC32, a file of the wrong size),
    MismatchError (a float16 overflow in a cast), StorageError, LayoutError (a source that does not
    cover an item).
    """
    written = written if written is not None else WrittenSet()
    src = data_storage(src, manifest)  # compressed data files (ckpt._codec) read as their raw bytes, checks included
    job = _Copy(src, manifest, dst, files, checksums=checksums, progress=progress, file_done=file_done,
                written=written)
    reader_storage: Storage = src
    # kept for the source checks' reads of skipped bytes, verifying or not: the same parts either way
    vbytes = min(VERIFY_CHUNK, budget // 16)
    budget = max(1, budget - vbytes)
    if verify is not None:
        job.checks = SourceChecks(manifest, sorted(verify), src.url, max(ALIGN, vbytes))
        reader_storage = cast(Storage, VerifyingReads(src, job.checks))
    tasks = [list(range(len(files)))] if lanes <= 1 else [[i] for i in range(len(files))]
    lanes, cap, max_read = _sizes(budget, max(1, min(lanes, len(tasks))), readers, max_part)
    work = [_batches(_parts(files, t, cap), cap) for t in tasks]
    slab = max((sum(p.cost for p in b) for w in work for b in w), default=0)
    if job.checks is not None:
        for w in work:
            for b in w:
                for key in {p.item.key for p in b if p.item is not None and p.numel}:
                    job.remaining[key] = job.remaining.get(key, 0) + 1
    if progress is not None:
        progress(0, job.total)
    made = [_Lane(_Reader(reader_storage, manifest, readers=readers, max_read=max_read),
                  ThreadPoolExecutor(1, "ckpt-stream-write")) for _ in range(lanes)]
    try:
        if lanes == 1:
            for w in work:
                job.run_lane(made[0], w, slab)
        else:
            _run_lanes(job, made, work, slab)
        if job.checks is not None:  # shards no batch read whole (e.g. of files a previous attempt wrote)
            job.checks.finish(sorted(verify or ()), src)
    finally:
        for lane in made:
            lane.writer.shutdown(wait=True)
    verified = 0
    if job.checks is not None:
        verified = sum(c.shard.length for cs in job.checks.by_key.values() for c in cs if c.done)
    return Copied(job.sizes, job.sums if checksums else [[] for _ in files], job.peak, verified)


def _run_lanes(job: _Copy, lanes: list[_Lane], work: list[list[list[_Part]]], slab: int) -> None:
    """Run ``work`` (one list of batches per file, taken in order) on one thread per lane; raise the
    first real error (an IntegrityError before the errors it caused elsewhere, never a cancellation)."""
    todo: Queue[list[list[_Part]]] = Queue()
    for w in work:
        todo.put(w)

    def lane_loop(lane: _Lane) -> None:
        while True:
            try:
                w = todo.get_nowait()
            except Empty:
                return
            job.run_lane(lane, w, slab)

    with ThreadPoolExecutor(len(lanes), thread_name_prefix="ckpt-stream") as ex:
        futures = [ex.submit(lane_loop, lane) for lane in lanes]
        errors = [e for e in (f.exception() for f in futures) if e is not None and not isinstance(e, _Cancelled)]
    if errors:
        raise next((e for e in errors if isinstance(e, IntegrityError)), errors[0])


def read_items(src: Storage, manifest: Manifest, items: Sequence[Item], *, buffer: int,
               readers: int = 1) -> Iterator[tuple[int, Region, torch.Tensor]]:
    """``(item index, part region, values)`` for every part of ``items`` in order, read through one
    reused buffer of about ``buffer`` bytes (an item larger than that comes in parts). ``values`` (in
    the output dtype, shaped like the part) is valid until the next iteration: copy what you keep.
    """
    if not items:
        return  # nothing to read (an empty file's parts would be its header alone)
    cap = _up(max(ALIGN * 4, buffer))
    batches = _batches(_parts([OutFile("", b"", list(items))], [0], cap), cap)
    slab = max((sum(p.cost for p in b) for b in batches), default=0)
    reader = _Reader(src, manifest, readers=readers,
                     max_read=max(ALIGN * 64, min(DEFAULT_MAX_READ, cap // max(1, readers))))
    buf = torch.empty(slab, dtype=torch.uint8)
    for batch in batches:
        for p, v in zip(batch, reader.fill(batch, buf), strict=True):
            assert p.region is not None
            yield p.index, p.region, v
