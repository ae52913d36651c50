"""Offline resharding: rewrite a checkpoint so that its shards follow another layout.

``reshard(src, dst, target)`` executes a :func:`~ckpt.resharders.plan.plan` as a streaming copy:

1. **Plan** (pure): the new files, their headers and offsets, and the pieces each one holds.
2. **Stream** (:func:`ckpt.resharders.stream.copy_files`, the engine every converter uses):
   ``workers`` threads each write one new data file at a time, largest first. A piece is cut into
   parts of at most one buffer (in the order of its bytes); each batch of parts is read from the
   source with the ordinary load planner into a reused buffer, hashed (CRC32) and handed to the
   file's writer thread while the next batch is read into a second buffer; by default every source
   shard's checksum is checked from the bytes read, so that corrupted bytes are never given fresh
   checksums in the new checkpoint. Memory stays within ``memory_budget``, whatever the piece sizes.
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
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ckpt import transaction
from ckpt.checksum import crc32
from ckpt.errors import CheckpointError, IntegrityError, StateError, StorageError
from ckpt.formats.msgpack_codec import encode_manifest
from ckpt.layout import Layout
from ckpt.load import _few, fetch_manifest
from ckpt.manifest import DATA_DIR, MANIFEST_NAME, Manifest
from ckpt.planner import WriteAssignment
from ckpt.regions import sub_region
from ckpt.resharders.plan import ReshardPlan, plan
from ckpt.resharders.rules import MOE_RULES, RuleSet
from ckpt.resharders.stream import Item, OutFile, Progress, copy_files
from ckpt.storage import Storage, get_storage

DEFAULT_MEMORY_BUDGET = 2 * 10**9  # bytes ("2GB")
MIN_MEMORY_BUDGET = 1 << 20
MAX_CHUNK = 64 << 20  # a bigger part does not go faster; it only delays the first write
MARKER_DIR = ".reshard"


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
        verify_source: check every source shard's CRC32 against the source manifest (from the bytes
            the rewrite reads, each hashed once); on a mismatch nothing is committed. Without it,
            corrupted source bytes would be copied and given fresh checksums, i.e. hidden from
            ``ckpt verify``.
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
        """Write every new data file not already finished, ``workers`` at a time, largest first, with
        the streaming engine (:mod:`ckpt.resharders.stream`); with ``verify_source``, check every source
        shard's checksum from the bytes read (and read what finished files of an earlier attempt hold).

        Raises IntegrityError when the source is corrupted (before the bad bytes' batch is written).
        """
        todo = sorted((r for r, a in enumerate(self.assignments) if a.file is not None and r not in self.sums),
                      key=lambda r: (-self.assignments[r].nbytes, r))
        files = [self._out_file(r) for r in todo]
        verify = None
        if verify_source and self.source.source_format == "ckpt":  # DCP/DeepSpeed sources have no checksums
            verify = [k for k, t in self.source.tensors.items() if t.num_shards]
        resumed = self.done_bytes

        def progress(done: int, _total: int) -> None:
            if self.progress is not None:
                self.progress(resumed + done, self.plan.tensor_bytes)

        def file_done(i: int, size: int, sums: list[int]) -> None:
            a = self.assignments[todo[i]]
            self.dst.commit(marker_name(self.plan.plan_id, todo[i]),
                            msgpack.packb({"file": a.file, "size": size, "sums": sums}, use_bin_type=True))
            self.sums[todo[i]] = list(sums)

        res = copy_files(self.src, self.source, self.dst, files, budget=self.budget, lanes=self.workers,
                         max_part=MAX_CHUNK, checksums=True, verify=verify, progress=progress,
                         file_done=file_done)
        self.bytes_verified = res.verified_bytes

    def discard(self) -> None:
        """Remove this attempt's files and markers (after a corrupted source: nothing may be resumed)."""
        for rank, a in enumerate(self.assignments):
            if a.file is not None:
                _quiet_delete(self.dst, a.file)
            _quiet_delete(self.dst, marker_name(self.plan.plan_id, rank))

    def _out_file(self, rank: int) -> OutFile:
        a = self.assignments[rank]
        assert a.file is not None
        decl = self.plan.decls[rank]
        items = []
        for e in a.entries:
            piece = decl.pieces[e.piece]
            region = piece.region if e.count is None else sub_region(piece.region, e.start, e.count)
            items.append(Item(piece.key, piece.dtype, piece.shape, region))
        return OutFile(a.file, a.header, items)

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
