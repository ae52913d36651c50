"""Offline resharding: rewrite a checkpoint so that its shards follow another layout.

``reshard(src, dst, target)`` executes a :func:`~ckpt.resharders.plan.plan` as a streaming copy:

1. **Plan** (pure): the new files, their headers and offsets, and the pieces each one holds.
2. **Stream** (:func:`ckpt._stream.copy_files`, the engine every converter uses):
   ``workers`` threads each write one new data file at a time, largest first. A piece is cut into
   parts of at most one buffer (in the order of its bytes); each batch of parts is read from the
   source with the ordinary load planner into a reused buffer, hashed (CRC32) and handed to the
   file's writer thread while the next batch is read into a second buffer; by default every source
   shard's checksum is checked from the bytes read, so that corrupted bytes are never given fresh
   checksums in the new checkpoint. Memory stays within ``memory_budget``, whatever the piece sizes.
3. **Commit**: the manifest is written last, atomically, exactly as ``ckpt.save`` does. Until then
   ``dst`` is not a checkpoint.

Ownership (:mod:`ckpt._transaction`): every new file gets a fresh random name
(``data/<rank>-<random>.safetensors``) recorded in this run's written set; a run removes nothing but
that set (all of it when it loses the commit or reads a corrupted source; its unfinished files on
any other failure), never files it merely finds in ``dst``: two runs into one destination, or a run
beside a save or an import, cannot delete each other's files.

Crash safety and restart: each finished file leaves a small marker
``.reshard/<plan id>-<rank>-<writer token>.done`` (the plan id: a hash of the source manifest, the
target layout, the rules and the stages) holding the file's random name, size, checksums and its
writer (host, pid, token). Running the same command again adopts every finished file of the same plan
whose writer is provably gone (:func:`ckpt._transaction.writer_gone`) and whose bytes still match the
marker's checksums (re-read and re-hashed), writes the others under fresh names, and commits. Adopted
files are never in the re-run's written set; files of an interrupted run that are not adopted are
left for ``ckpt gc`` to report. A committed ``dst`` is never touched unless ``overwrite=True``; then
the old files are removed only after the new manifest is committed.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ckpt import _lease as lease
from ckpt import _transaction as transaction
from ckpt._checksum import crc32
from ckpt._regions import sub_region
from ckpt._save_plan import WriteAssignment
from ckpt._stream import Item, OutFile, Progress, copy_files
from ckpt.errors import CheckpointError, IntegrityError, StateError, StorageError
from ckpt.formats.msgpack_codec import encode_manifest
from ckpt.layout import Layout
from ckpt.load import _few, fetch_manifest
from ckpt.manifest import Manifest
from ckpt.resharders.plan import ReshardPlan, plan
from ckpt.resharders.rules import MOE_RULES, RuleSet
from ckpt.storage import Storage, get_storage

DEFAULT_MEMORY_BUDGET = 2 * 10**9  # bytes ("2GB")
MIN_MEMORY_BUDGET = 1 << 20
MAX_CHUNK = 64 << 20  # a bigger part does not go faster; it only delays the first write
MARKER_DIR = ".reshard"
MAX_MARKER = 1 << 20  # a marker holds a name, a size and a checksum per entry: anything larger is not ours


def reshard(src_url: str, dst_url: str, target: Layout, *, rules: RuleSet = MOE_RULES,
            stages: list[int] | None = None, memory_budget: int = DEFAULT_MEMORY_BUDGET, workers: int = 2,
            progress: Progress | None = None, overwrite: bool = False, verify_source: bool = True,
            verify_resumed: bool = True,
            storage_options: dict[str, Any] | None = None,
            dst_storage_options: dict[str, Any] | None = None,
            source_manifest: Manifest | None = None, strict_rules: bool = False) -> Manifest:
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
        strict_rules: refuse (before writing anything) when some tensor matches no sharding rule
            and would be held whole by every rank (see :func:`~ckpt.resharders.plan.plan`).

    Raises:
        CheckpointExistsError: ``dst_url`` holds a committed checkpoint and ``overwrite`` is False.
        LayoutError: the target layout cannot hold the model (naming the tensor and rank).
        UnmatchedTensorsError: (``strict_rules``) tensors no rule places; nothing was written.
        StateError: bad arguments (same source and destination, budget too small, workers < 1).
        IntegrityError: (``verify_source``) a source shard does not match its checksum, naming the
            tensor, file and byte range; ``dst`` holds no manifest and this attempt's files are removed.
        ManifestError / StorageError: unreadable source or failed writes; ``dst`` then holds no
            manifest, and running the same call again resumes.

    Example::

        reshard("/ckpt/step-100", "/ckpt/step-100-ep4", Layout.parse("tp=1,ep=4,pp=2"))
    """
    _check_resources(memory_budget, workers)
    dst_opts = dst_storage_options if dst_storage_options is not None else storage_options or {}
    src = get_storage(src_url, **(storage_options or {}))
    dst = get_storage(dst_url, **dst_opts)
    held: lease.Lease | None = None
    ok = False
    try:
        if _location(src) == _location(dst):
            raise StateError(f"{dst_url}: the destination is the source checkpoint; reshard never rewrites in "
                             "place, write to a new location")
        manifest = source_manifest if source_manifest is not None else fetch_manifest(src)
        previous = _begin(dst, overwrite)
        p = plan(manifest, target, rules, stages=stages, strict_rules=strict_rules)
        # leased before the first byte, as every writer's (ckpt.save.take_lease): gc never takes its files
        held = lease.acquire(dst_url, 0, dst_opts)
        m = _write_and_commit(src, dst, manifest, p, previous, memory_budget=memory_budget, workers=workers,
                              progress=progress, overwrite=overwrite, verify_source=verify_source,
                              verify_resumed=verify_resumed)
        ok = True
        return m
    finally:
        src.close()
        dst.close()
        if held is not None:
            held.release(tidy=not ok)


def _check_resources(memory_budget: int, workers: int) -> None:
    """Refuse a memory budget below the minimum or a worker count below one (StateError)."""
    if not isinstance(memory_budget, int) or memory_budget < MIN_MEMORY_BUDGET:
        raise StateError(f"memory budget {memory_budget!r} bytes is below the minimum of {MIN_MEMORY_BUDGET} "
                         "(1 MiB); pass a larger --memory-budget")
    if not isinstance(workers, int) or workers < 1:
        raise StateError(f"workers={workers!r}: pass a positive number of workers")


def _begin(dst: Storage, overwrite: bool) -> Manifest | None:
    """Open the transaction on ``dst`` and refuse a location holding files not ours; returns the
    committed checkpoint being replaced (None when there is none)."""
    previous = transaction.begin(dst, overwrite=overwrite)
    foreign = transaction.foreign_files(_listing(dst), previous)
    if foreign:
        raise StateError(f"{dst.url}: holds files that are not part of a ckpt checkpoint ({_few(foreign, 3)}); "
                         "reshard writes only to a new or empty location, an unfinished reshard, or over a "
                         "checkpoint (--overwrite). Choose another destination; nothing was changed")
    return previous


def _write_and_commit(src: Storage, dst: Storage, manifest: Manifest, p: ReshardPlan, previous: Manifest | None, *,
                      memory_budget: int, workers: int, progress: Progress | None, overwrite: bool,
                      verify_source: bool, verify_resumed: bool) -> Manifest:
    """Resume what an earlier run of plan ``p`` finished, write the rest and commit; on a failure,
    remove what must not stay (everything after a corrupted source, else the unfinished files)."""
    with transaction.live_writer() as me:  # markers name this run as the writer of its files
        job = _Rewrite(src, dst, manifest, p, memory_budget, workers, progress, me)
        # a file the checkpoint being replaced lists is never adopted (it is that checkpoint's)
        job.resume(verify_resumed, taken=set(previous.files) if previous is not None else set())
        try:
            job.run(verify_source)
        except IntegrityError:
            job.discard()  # files made from corrupted bytes must not be resumed later
            raise
        except BaseException:
            job.abandon()  # finished files stay (with their markers) for a resumed run
            raise
        return job.commit(overwrite)


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


def marker_name(plan_id: str, rank: int, token: str) -> str:
    """Path (inside the destination) of the marker that writer ``token`` leaves for a finished new
    data file of ``rank``: one per writer, so two runs of one plan never replace each other's."""
    return f"{MARKER_DIR}/{plan_id}-{rank:05d}-{token}.done"


_MARKER = re.compile(rf"^{re.escape(MARKER_DIR)}/([0-9a-f]{{12}})-(\d{{5}})-[0-9a-f]{{12}}\.done$")


@dataclass(slots=True)
class _Rewrite:
    src: Storage
    dst: Storage
    source: Manifest
    plan: ReshardPlan
    budget: int
    workers: int
    progress: Progress | None
    me: dict[str, Any]  # this run as a writer (transaction.live_writer), recorded in its markers
    sums: dict[int, list[int]] = field(default_factory=dict)  # rank -> checksums of its file's entries
    names: dict[int, str] = field(default_factory=dict)  # rank -> the new file's real (random) name
    written: transaction.WrittenSet = field(default_factory=transaction.WrittenSet)  # files this run made
    finished: set[str] = field(default_factory=set)  # of those, the ones complete (with a marker)
    markers: list[str] = field(default_factory=list)  # markers this run wrote
    adopted: list[str] = field(default_factory=list)  # markers of a gone writer whose files this run adopts
    resumed: list[str] = field(default_factory=list)
    done_bytes: int = 0
    bytes_verified: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(default_factory=time.perf_counter)

    @property
    def assignments(self) -> list[WriteAssignment]:
        return self.plan.save.assignments

    def resume(self, verify: bool, taken: set[str]) -> None:
        """Adopt the files an earlier run of this same plan finished, when that run is provably gone
        and the files still hash right; never files in ``taken``. Nothing found is deleted."""
        found: dict[int, list[str]] = {}
        try:
            listing = self.dst.list(MARKER_DIR)
        except CheckpointError:
            listing = []  # no destination yet
        for f in listing:
            m = _MARKER.match(f)
            if m is not None and m.group(1) == self.plan.plan_id:
                found.setdefault(int(m.group(2)), []).append(f)
        for rank, a in enumerate(self.assignments):
            if a.file is None:
                continue
            for marker in found.get(rank, []):
                got = self._check_finished(rank, a, marker, verify, taken)
                if got is None:
                    continue  # not adoptable: left alone (its writer may be running; gc reports leftovers)
                self.names[rank], self.sums[rank] = got
                taken.add(got[0])
                self.adopted.append(marker)
                self.resumed.append(got[0])
                self._advance(a.nbytes)
                break

    def _check_finished(self, rank: int, a: WriteAssignment, marker: str, verify: bool,
                        taken: set[str]) -> tuple[str, list[int]] | None:
        """``(file name, checksums)`` of the file ``marker`` names when it may be adopted, else None."""
        assert a.file is not None
        try:
            if (self.dst.size(marker) or 0) > MAX_MARKER:
                return None
            m = msgpack.unpackb(self.dst.read_file(marker), raw=False)
            name, sums, writer = m["file"], [int(s) for s in m["sums"]], m.get("writer")
            if (not isinstance(name, str) or transaction.data_file_rank(name) != rank or name in taken
                    or len(sums) != len(a.entries)):
                return None
            if not transaction.writer_gone(writer):
                return None  # its writer may still remove it (losing its commit): never share a live file
            if self.dst.size(name) != self.plan.manifest.files[a.file]:
                return None
            if not verify:
                return name, sums
            head = bytearray(len(a.header))
            self.dst.read_into(name, 0, memoryview(head))
            if bytes(head) != a.header:
                return None
            buf = bytearray(min(max((e.length for e in a.entries), default=1), 16 << 20) or 1)
            for e, want in zip(a.entries, sums, strict=True):
                crc, pos = 0, 0
                while pos < e.length:
                    n = min(len(buf), e.length - pos)
                    mv = memoryview(buf)[:n]
                    self.dst.read_into(name, e.offset + pos, mv)
                    crc = crc32(mv, crc)
                    pos += n
                if crc != want:
                    return None
        except (CheckpointError, ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException):
            return None
        return name, sums

    def _advance(self, n: int) -> None:
        with self.lock:  # the callback too: calls arrive in order, the last one with the total
            self.done_bytes += n
            if self.progress is not None:
                self.progress(self.done_bytes, self.plan.tensor_bytes)

    def run(self, verify_source: bool) -> None:
        """Write every new data file not already finished, ``workers`` at a time, largest first, with
        the streaming engine (:mod:`ckpt._stream`); with ``verify_source``, check every source
        shard's checksum from the bytes read (and read what finished files of an earlier attempt hold).

        Raises IntegrityError when the source is corrupted (before the bad bytes' batch is written).
        """
        todo = sorted((r for r, a in enumerate(self.assignments) if a.file is not None and r not in self.sums),
                      key=lambda r: (-self.assignments[r].nbytes, r))
        for r in todo:  # names no other writer can produce (recorded in the written set when opened)
            self.names[r] = transaction.fresh_data_file(r)
        files = [self._out_file(r) for r in todo]
        verify = None
        if verify_source and self.source.source_format == "ckpt":  # DCP/DeepSpeed sources have no checksums
            verify = [k for k, t in self.source.tensors.items() if t.num_shards]
        resumed = self.done_bytes

        def progress(done: int, _total: int) -> None:
            if self.progress is not None:
                self.progress(resumed + done, self.plan.tensor_bytes)

        def file_done(i: int, size: int, sums: list[int]) -> None:
            name = self.names[todo[i]]
            marker = marker_name(self.plan.plan_id, todo[i], self.me["token"])
            with self.lock:
                self.markers.append(marker)
            self.dst.commit(marker, msgpack.packb({"file": name, "size": size, "sums": sums, "writer": self.me},
                                                  use_bin_type=True))
            with self.lock:
                self.finished.add(name)
                self.sums[todo[i]] = list(sums)

        res = copy_files(self.src, self.source, self.dst, files, budget=self.budget, lanes=self.workers,
                         max_part=MAX_CHUNK, checksums=True, verify=verify, progress=progress,
                         file_done=file_done, written=self.written)
        self.bytes_verified = res.verified_bytes

    def discard(self) -> None:
        """After a corrupted source, nothing may be resumed: remove this run's files (its written set)
        and its markers, and the markers of the files it adopted (their writer is gone; the files
        stay for gc, no run will adopt them again)."""
        transaction.remove_files(self.dst, self.written)
        self._drop_markers(self.markers + self.adopted)

    def abandon(self) -> None:
        """After any other failure: remove this run's unfinished files; the finished ones and their
        markers stay for a resumed run to adopt."""
        transaction.remove_files(self.dst, self.written, keep=self.finished)

    def _out_file(self, rank: int) -> OutFile:
        a = self.assignments[rank]
        assert a.file is not None
        decl = self.plan.decls[rank]
        items = []
        for e in a.entries:
            piece = decl.pieces[e.piece]
            region = piece.region if e.count is None else sub_region(piece.region, e.start, e.count)
            items.append(Item(piece.key, piece.dtype, piece.shape, region))
        return OutFile(self.names[rank], a.header, items)

    def commit(self, overwrite: bool) -> Manifest:
        """Fill in checksums, commit the manifest through the transaction, then remove markers."""
        m = self.plan.manifest
        real = {a.file: self.names[rank] for rank, a in enumerate(self.assignments) if a.file is not None}
        for rank, a in enumerate(self.assignments):
            if a.file is None:
                continue
            for ent, crc in zip(a.entries, self.sums[rank], strict=True):
                m.tensors[ent.key].shards[ent.shard].checksum = crc
        for t in m.tensors.values():  # the plan's placeholder names -> the files' real names
            for sh in t.shards:
                sh.file = real.get(sh.file, sh.file)
        m.files = {real.get(f, f): n for f, n in m.files.items()}
        for obj in m.objects.values():
            if obj.data is not None and obj.checksum is None:
                obj.checksum = crc32(obj.data)
        m.created = time.time()
        m.stats = {"reshard_s": round(time.perf_counter() - self.started, 3), "bytes": self.plan.tensor_bytes,
                   "resumed_files": len(self.resumed), "plan_id": self.plan.plan_id,
                   "source_bytes_verified": self.bytes_verified}
        data = encode_manifest(m)
        try:
            # a loser (or any failure) removes this run's own files, never the adopted ones
            committed = transaction.commit_manifest(self.dst, data, overwrite=overwrite, written=self.written)
        except BaseException:
            self._drop_markers(self.markers)  # they name files that are gone now
            raise
        # Our markers, and those of the gone writers whose files are now committed: nothing to resume.
        self._drop_markers(self.markers + self.adopted)
        return committed

    def _drop_markers(self, markers: list[str]) -> None:
        for marker in markers:
            _quiet_delete(self.dst, marker)
        root = self.dst.local_dir
        if root is not None:
            try:
                os.rmdir(os.path.join(root, MARKER_DIR))
            except OSError:
                pass  # not empty (another run's markers) or not there: harmless


def _quiet_delete(storage: Storage, path: str) -> None:
    try:
        storage.delete(path)
    except StorageError:
        pass  # leftovers are harmless after the commit; gc removes them


__all__ = ["reshard", "marker_name", "DEFAULT_MEMORY_BUDGET", "MIN_MEMORY_BUDGET", "MARKER_DIR", "Progress"]
