"""Offline resharding: rewrite a checkpoint so that its shards follow another layout.

``reshard(src, dst, target)`` executes a :func:`~ckpt.resharders.plan.plan` as a streaming copy:

1. **Plan** (pure): the new files, their headers and offsets, and the pieces each one holds.
2. **Stream**: ``workers`` threads each write one new data file at a time (and, by default, one
   more thread checks every source shard's checksum, so that corrupted bytes are never given fresh
   checksums in the new checkpoint). A piece is cut into
   parts of at most one buffer (:func:`~ckpt.resharders.chunks.split_region`, in the order of its
   bytes); each part is read from the source with the ordinary load planner into a reused buffer,
   hashed (CRC32) and handed to the file's writer thread while the next part is read into a second
   buffer. Memory: ``workers x 3`` buffers of at most ``chunk`` bytes (two for the read/write
   overlap, one scratch for strided reads), all within ``memory_budget``, whatever the piece sizes.
3. **Commit**: the manifest is written last, atomically, exactly as ``ckpt.save`` does. Until then
   ``dst`` is not a checkpoint.

Crash safety and restart: the new files are named after the plan id (a hash of the source
manifest, the target layout, the rules and the stages), and each finished file leaves a small
marker ``.reshard/<plan id>-<rank>.done`` (its size and checksums). Running the same command again
keeps every finished file whose bytes still match its marker's checksums (re-read and re-hashed),
rewrites the others, removes files left by other attempts, and commits. A committed ``dst`` is
never touched unless ``overwrite=True``; then the old files are removed only after the new manifest
is committed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from queue import Queue
from typing import Any

import msgpack
import torch

from ckpt import transaction
from ckpt.checksum import crc32
from ckpt.dtypes import dtype_from_name, itemsize
from ckpt.errors import CheckpointError, IntegrityError, StateError, StorageError
from ckpt.formats.msgpack_codec import encode_manifest
from ckpt.io import ScratchReader, byte_view
from ckpt.load import _few, fetch_manifest
from ckpt.manifest import DATA_DIR, MANIFEST_NAME, Manifest
from ckpt.planner import LoadRequest, WriteAssignment, plan_load
from ckpt.resharders.chunks import split_region
from ckpt.resharders.layout import Layout
from ckpt.resharders.plan import ReshardPlan, narrowed, plan
from ckpt.resharders.rules import MOE_RULES, RuleSet
from ckpt.shards import Box
from ckpt.storage import Storage, get_storage

DEFAULT_MEMORY_BUDGET = 2 * 10**9  # bytes ("2GB")
MIN_MEMORY_BUDGET = 1 << 20
MAX_CHUNK = 64 << 20  # a bigger part does not go faster; it only delays the first write
MARKER_DIR = ".reshard"
VERIFY_CHUNK = 16 << 20  # the source verifier's buffer

Progress = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)`` of tensor bytes, called from worker threads one at a time,
with non-decreasing ``bytes_done``; keep it quick."""


def reshard(src_url: str, dst_url: str, target: Layout, *, rules: RuleSet = MOE_RULES,
            stages: list[int] | None = None, memory_budget: int = DEFAULT_MEMORY_BUDGET, workers: int = 2,
            progress: Progress | None = None, overwrite: bool = False, verify_source: bool = True,
            verify_resumed: bool = True,
            storage_options: dict[str, Any] | None = None,
            dst_storage_options: dict[str, Any] | None = None,
            source_manifest: Manifest | None = None) -> Manifest:
    """Write a new committed checkpoint at ``dst_url`` holding the checkpoint at ``src_url`` with
    shards that follow layout ``target``; returns the new manifest.

    Args:
        src_url / dst_url: checkpoint locations (local paths or storage URLs); must differ.
        target: the layout of the new shards, e.g. ``Layout.parse("tp=1,ep=4,pp=2")``.
        rules: the sharding rules (the embedded MoE's by default; others from
            :func:`~ckpt.resharders.rules.load_rules`).
        stages: explicit layers per pipeline stage; balanced when None.
        memory_budget: bytes of buffers the rewrite may use (at least 1 MiB). Peak memory is the
            process's baseline plus at most this, whatever the size of the largest piece.
        workers: new data files written concurrently.
        progress: called with ``(bytes done, bytes total)`` as tensor bytes are written.
        overwrite: replace a committed checkpoint at ``dst_url``.
        verify_source: check every source shard's CRC32 against the source manifest (in a thread
            alongside the rewrite); on a mismatch nothing is committed. Without it, corrupted source
            bytes would be copied and given fresh checksums, i.e. hidden from ``ckpt verify``.
        verify_resumed: when resuming, re-hash finished files before keeping them.
        source_manifest: the source's manifest when the caller built it (``ckpt import`` of a
            ``torch.save`` file: shards are byte ranges of that file under ``src_url``).

    Raises:
        CheckpointExistsError: ``dst_url`` holds a committed checkpoint and ``overwrite`` is False.
        LayoutError: the target layout cannot hold the model (naming the tensor and rank).
        StateError: bad arguments (same source and destination, budget too small, workers < 1).
        IntegrityError: (``verify_source``) a source shard does not match its checksum, naming the
            tensor, file and byte range; ``dst`` holds no manifest and this attempt's files are removed.
        ManifestError / StorageError: unreadable source or failed writes; ``dst`` then holds no
            manifest, and running the same call again resumes.

    Example::

        reshard("/ckpt/step-100", "/ckpt/step-100-ep4", Layout.parse("tp=1,ep=4,pp=2"))
    """
    if not isinstance(memory_budget, int) or memory_budget < MIN_MEMORY_BUDGET:
        raise StateError(f"memory budget {memory_budget!r} bytes is below the minimum of {MIN_MEMORY_BUDGET} "
                         "(1 MiB); pass a larger --memory-budget")
    if not isinstance(workers, int) or workers < 1:
        raise StateError(f"workers={workers!r}: pass a positive number of workers")
    src = get_storage(src_url, **(storage_options or {}))
    dst = get_storage(dst_url, **(dst_storage_options if dst_storage_options is not None else
                                  storage_options or {}))
    try:
        if _location(src) == _location(dst):
            raise StateError(f"{dst_url}: the destination is the source checkpoint; reshard never rewrites in "
                             "place, write to a new location")
        manifest = source_manifest if source_manifest is not None else fetch_manifest(src)
        previous = transaction.begin(dst, overwrite=overwrite)
        foreign = transaction.foreign_files(_listing(dst), previous)
        if foreign:
            raise StateError(f"{dst.url}: holds files that are not part of a ckpt checkpoint ({_few(foreign, 3)}); "
                             "reshard writes only to a new or empty location, an unfinished reshard, or over a "
                             "checkpoint (--overwrite). Choose another destination; nothing was changed")
        p = plan(manifest, target, rules, stages=stages)
        if previous is not None and set(p.target_files) & set(previous.files):
            # Never write into a file the committed manifest references (same source and target
            # again): other names, still deterministic so that an interrupted overwrite resumes.
            p = plan(manifest, target, rules, stages=stages, salt=f"replacing {previous.created!r}")
        job = _Rewrite(src, dst, manifest, p, memory_budget, workers, progress)
        job.clean(previous)
        job.resume(verify_resumed)
        try:
            job.run(verify_source)
        except IntegrityError:
            job.discard()  # files made from corrupted bytes must not be resumed later
            raise
        return job.commit(overwrite)
    finally:
        src.close()
        dst.close()


def _listing(dst: Storage) -> list[str]:
    try:
        return dst.list()
    except CheckpointError:
        return []  # the location does not exist yet


def _location(s: Storage) -> str:
    root = getattr(s, "root", None)
    if isinstance(root, str) and "://" not in s.url:
        return os.path.realpath(root)
    return s.url.rstrip("/")


def marker_name(plan_id: str, rank: int) -> str:
    """Path (inside the destination) of the marker a finished new data file leaves."""
    return f"{MARKER_DIR}/{plan_id}-{rank:05d}.done"


class _Cancelled(Exception):
    """Another worker failed: stop this file."""


@dataclass(slots=True)
class _Worker:
    bufs: list[torch.Tensor]
    reader: ScratchReader
    writer: ThreadPoolExecutor


@dataclass(slots=True)
class _Rewrite:
    src: Storage
    dst: Storage
    source: Manifest
    plan: ReshardPlan
    budget: int
    workers: int
    progress: Progress | None
    sums: dict[int, list[int]] = field(default_factory=dict)  # rank -> checksums of its file's entries
    resumed: list[str] = field(default_factory=list)
    done_bytes: int = 0
    bytes_verified: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    failed: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)

    @property
    def assignments(self) -> list[WriteAssignment]:
        return self.plan.save.assignments

    def clean(self, previous: Manifest | None) -> None:
        """Remove what earlier, different attempts of ours left: data files with our writers' names
        that no committed manifest lists and this plan does not resume, and stale markers. Nothing
        else is touched (a committed checkpoint whose manifest cannot be read keeps its files)."""
        if previous is None and self.dst.size(MANIFEST_NAME) is not None:
            return
        keep = set(self.plan.target_files) | set(previous.files if previous is not None else ())
        stale = [f for f in _listing(self.dst) if f.startswith(f"{DATA_DIR}/") and f not in keep
                 and transaction.OUR_DATA_FILE.match(f)]
        transaction.remove_files(self.dst, stale)
        for f in _listing(self.dst):
            if f.startswith(f"{MARKER_DIR}/") and not f.startswith(f"{MARKER_DIR}/{self.plan.plan_id}-"):
                _quiet_delete(self.dst, f)

    def resume(self, verify: bool) -> None:
        """Keep the files a previous attempt of this same plan finished (and that still hash right)."""
        for rank, a in enumerate(self.assignments):
            if a.file is None:
                continue
            marker = marker_name(self.plan.plan_id, rank)
            if self.dst.size(marker) is None:
                continue
            sums = self._check_finished(rank, a, marker, verify)
            if sums is None:
                self.dst.delete(marker)
                continue
            self.sums[rank] = sums
            self.resumed.append(a.file)
            self._advance(a.nbytes)

    def _check_finished(self, rank: int, a: WriteAssignment, marker: str, verify: bool) -> list[int] | None:
        assert a.file is not None
        try:
            m = msgpack.unpackb(self.dst.read_file(marker), raw=False)
            sums = [int(s) for s in m["sums"]]
            if m["file"] != a.file or len(sums) != len(a.entries):
                return None
        except (CheckpointError, ValueError, TypeError, KeyError, msgpack.UnpackException):
            return None
        if self.dst.size(a.file) != self.plan.manifest.files[a.file]:
            return None
        if not verify:
            return sums
        head = bytearray(len(a.header))
        self.dst.read_into(a.file, 0, memoryview(head))
        if bytes(head) != a.header:
            return None
        buf = bytearray(min(max((e.length for e in a.entries), default=1), 16 << 20) or 1)
        for e, want in zip(a.entries, sums, strict=True):
            crc, pos = 0, 0
            while pos < e.length:
                n = min(len(buf), e.length - pos)
                mv = memoryview(buf)[:n]
                self.dst.read_into(a.file, e.offset + pos, mv)
                crc = crc32(mv, crc)
                pos += n
            if crc != want:
                return None
        return sums

    def _advance(self, n: int) -> None:
        with self.lock:  # the callback too: calls arrive in order, the last one with the total
            self.done_bytes += n
            if self.progress is not None:
                self.progress(self.done_bytes, self.plan.tensor_bytes)

    def run(self, verify_source: bool) -> None:
        """Write every new data file not already finished, ``workers`` at a time, largest first;
        with ``verify_source``, check every source shard's checksum meanwhile (one more thread).

        Raises the verifier's IntegrityError when the source is corrupted (the writers stop early).
        """
        budget = self.budget
        vex: ThreadPoolExecutor | None = None
        verifier: Future[None] | None = None
        if verify_source and self.source.source_format == "ckpt":  # DCP/DeepSpeed sources have no checksums
            vbytes = min(VERIFY_CHUNK, max(4096, budget // 8))
            budget -= vbytes
            vex = ThreadPoolExecutor(1, "ckpt-reshard-verify")
            verifier = vex.submit(self._verify_source, vbytes)
        try:
            self._write_all(budget)
            if verifier is not None:
                verifier.result()
        except BaseException:
            self.failed.set()
            if verifier is not None:
                err = verifier.exception()  # waits: the verifier stops at its next part
                if isinstance(err, IntegrityError):
                    raise err from None  # the cause; the writers only stopped because of it
            raise
        finally:
            if vex is not None:
                vex.shutdown(wait=True)

    def _verify_source(self, buf_bytes: int) -> None:
        """CRC32 of every stored source shard against the source manifest, file by file in offset
        order (sequential reads), with one reused buffer. Raises IntegrityError on a mismatch."""
        buf = memoryview(bytearray(buf_bytes))
        shards = sorted((s.file, s.offset, s.length, s.checksum, key, i)
                        for key, t in self.source.tensors.items() for i, s in enumerate(t.shards) if s.length)
        for file, offset, length, checksum, key, i in shards:
            where = f"tensor {key!r} shard {i}: {self.src.url}/{file} bytes [{offset}, {offset + length})"
            if checksum is None:
                raise IntegrityError(f"{where} have no checksum in the source manifest, so they cannot be "
                                     "verified; pass verify_source=False (--no-verify-source) to copy them as they are")
            crc, pos = 0, 0
            while pos < length:
                if self.failed.is_set():
                    return  # a writer failed: its error is the one to report
                n = min(len(buf), length - pos)
                self.src.read_into(file, offset + pos, buf[:n])
                crc = crc32(buf[:n], crc)
                pos += n
            if crc != checksum:
                self.failed.set()
                raise IntegrityError(f"{where}: checksum mismatch (stored {checksum:#010x}, found {crc:#010x}); the "
                                     "source checkpoint is corrupted and nothing was committed; restore that file "
                                     "(`ckpt verify --deep` lists every damaged shard)")
            self.bytes_verified += length

    def discard(self) -> None:
        """Remove this attempt's files and markers (after a corrupted source: nothing may be resumed)."""
        for rank, a in enumerate(self.assignments):
            if a.file is not None:
                _quiet_delete(self.dst, a.file)
            _quiet_delete(self.dst, marker_name(self.plan.plan_id, rank))

    def _write_all(self, budget: int) -> None:
        todo = sorted((r for r, a in enumerate(self.assignments) if a.file is not None and r not in self.sums),
                      key=lambda r: (-self.assignments[r].nbytes, r))
        if not todo:
            return
        n = max(1, min(self.workers, len(todo)))
        chunk = min(MAX_CHUNK, budget // (3 * n))
        while chunk < 4096 and n > 1:  # a tiny budget: fewer workers, not tiny reads
            n -= 1
            chunk = min(MAX_CHUNK, budget // (3 * n))
        largest = max((e.length for r in todo for e in self.assignments[r].entries), default=0)
        chunk = min(chunk - chunk % 64, max(4096, -(-largest // 64) * 64))  # no bigger than the largest piece
        pool: Queue[_Worker] = Queue()
        for _ in range(n):
            # Touched once here and reused for every part: fresh pages are slow to fault in.
            bufs = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(2)]
            pool.put(_Worker(bufs, ScratchReader(self.src, chunk), ThreadPoolExecutor(1, "ckpt-reshard-write")))
        gap = getattr(self.src, "coalesce_gap", 4096)

        def one(rank: int) -> None:
            wk = pool.get()
            try:
                self.sums[rank] = self._write_file(rank, wk, chunk, gap)
            finally:
                pool.put(wk)

        try:
            with ThreadPoolExecutor(n, thread_name_prefix="ckpt-reshard") as ex:
                futures = [ex.submit(one, r) for r in todo]
                try:
                    for f in futures:
                        f.result()
                except BaseException:
                    self.failed.set()
                    for f in futures:
                        f.cancel()
                    raise
        finally:
            while not pool.empty():
                pool.get().writer.shutdown(wait=True)

    def _write_file(self, rank: int, wk: _Worker, chunk: int, gap: int) -> list[int]:
        a = self.assignments[rank]
        assert a.file is not None
        decl = self.plan.decls[rank]
        w = self.dst.open_writer(a.file)
        inflight: list[Future[Any] | None] = [None, None]
        turn = 0
        sums: list[int] = []
        try:
            w.write(a.header)
            for e in a.entries:
                piece = decl.pieces[e.piece]
                dtype = dtype_from_name(piece.dtype, key=piece.key)
                isz = itemsize(dtype)
                crc = 0
                for part in split_region(piece.region, chunk // isz):
                    nbytes = part.numel * isz
                    if nbytes == 0:
                        continue
                    if self.failed.is_set():
                        raise _Cancelled
                    prev = inflight[turn]
                    if prev is not None:
                        prev.result()  # the write that last used this buffer is done
                    raw = wk.bufs[turn][:nbytes]
                    mv = byte_view(raw)
                    lens = part.lengths if isinstance(part, Box) else (part.numel,)
                    req = LoadRequest(piece.key, piece.dtype, piece.shape, part)
                    rp = plan_load(narrowed(self.source, piece.key, part), [req], contiguous_targets=[True],
                                   max_read=chunk, max_gap=gap)
                    wk.reader.run(rp, [raw.view(dtype).view(lens)], [piece.dtype])
                    crc = crc32(mv, crc)
                    inflight[turn] = wk.writer.submit(w.write, mv)
                    turn ^= 1
                    self._advance(nbytes)
                sums.append(crc)
            for f in inflight:
                if f is not None:
                    f.result()
            size = w.close()
        except BaseException:
            for f in inflight:
                if f is not None:
                    f.exception()  # wait: the writer thread must be done with this file
            w.abort()
            raise
        expected = self.plan.manifest.files[a.file]
        if size != expected:
            raise IntegrityError(f"{self.dst.url}/{a.file}: wrote {size} bytes, the plan says {expected}; "
                                 "run the same command again to redo this file")
        self.dst.commit(marker_name(self.plan.plan_id, rank),
                        msgpack.packb({"file": a.file, "size": size, "sums": sums}, use_bin_type=True))
        return sums

    def commit(self, overwrite: bool) -> Manifest:
        """Fill in checksums, commit the manifest through the transaction, then remove markers."""
        m = self.plan.manifest
        for rank, a in enumerate(self.assignments):
            if a.file is None:
                continue
            for ent, crc in zip(a.entries, self.sums[rank], strict=True):
                m.tensors[ent.key].shards[ent.shard].checksum = crc
        for obj in m.objects.values():
            if obj.data is not None and obj.checksum is None:
                obj.checksum = crc32(obj.data)
        m.created = time.time()
        m.stats = {"reshard_s": round(time.perf_counter() - self.started, 3), "bytes": self.plan.tensor_bytes,
                   "resumed_files": len(self.resumed), "plan_id": self.plan.plan_id,
                   "source_bytes_verified": self.bytes_verified}
        data = encode_manifest(m)
        written = [a.file for a in self.assignments if a.file is not None]
        committed = transaction.commit_manifest(self.dst, data, overwrite=overwrite, written=written)
        for rank in range(len(self.assignments)):
            _quiet_delete(self.dst, marker_name(self.plan.plan_id, rank))
        root = getattr(self.dst, "root", None)
        if isinstance(root, str):
            try:
                os.rmdir(os.path.join(root, MARKER_DIR))
            except OSError:
                pass  # not empty or not there: harmless
        return committed


def _quiet_delete(storage: Storage, path: str) -> None:
    try:
        storage.delete(path)
    except StorageError:
        pass  # leftovers are harmless after the commit; gc removes them


__all__ = ["reshard", "marker_name", "DEFAULT_MEMORY_BUDGET", "MIN_MEMORY_BUDGET", "MARKER_DIR", "Progress"]
