"""Checking source shards' CRC32 from the bytes a streaming reader reads anyway.

``export_hf`` reads sub-ranges of stored shards, out of order and from several threads; this
assembles each shard's CRC32 from those ranges (combining the CRCs of adjacent ones, each byte
hashed once), reads what was skipped (e.g. vocab padding) through one bounded buffer, and compares
with the manifest. ``VerifyingReads`` wraps a Storage so that every range the read planner reads
is handed to the checks.
"""

from __future__ import annotations

import bisect
import builtins
import threading
from collections.abc import Sequence

from ckpt._checksum import crc32, crc32_combine
from ckpt.errors import IntegrityError
from ckpt.manifest import Manifest, ShardEntry
from ckpt.storage.base import Storage

VERIFY_CHUNK = 16 << 20  # most bytes of the buffer that reads the parts of a shard the export skips
def _seg_start(seg: list[int]) -> int:
    return seg[0]


class ShardCheck:
    """The CRC32 of one stored source shard, assembled from the byte ranges the export reads, in any
    order and from any thread (the CRCs of adjacent ranges are combined); each byte is hashed once.
    ``finish`` reads and hashes what the export skipped (e.g. vocab padding)."""

    __slots__ = ("key", "index", "shard", "segs", "covered", "done", "lock")

    def __init__(self, key: str, index: int, shard: ShardEntry):
        self.key, self.index, self.shard = key, index, shard
        self.segs: list[list[int]] = []  # [start, end, crc] in shard coordinates: sorted, disjoint, not adjacent
        self.covered = 0
        self.done = False
        self.lock = threading.Lock()

    def add(self, start: int, data: memoryview, url: str) -> None:
        """``data`` holds the shard's bytes ``[start, start + len(data))``; hash those not seen yet."""
        end = start + len(data)
        with self.lock:
            if self.done:
                return
            gaps: list[tuple[int, int]] = []
            cur = start
            for s, e, _ in self.segs:
                if e <= cur:
                    continue
                if s >= end:
                    break
                if s > cur:
                    gaps.append((cur, s))
                cur = e
                if cur >= end:
                    break
            if cur < end:
                gaps.append((cur, end))
            for s, e in gaps:
                self._put(s, e, data[s - start : e - start])
            if self.covered == self.shard.length:
                self._check(url)

    def finish(self, storage: Storage, buf: memoryview, url: str) -> None:
        """Read and hash the bytes not seen yet (through ``buf``, in order), then compare."""
        with self.lock:
            if self.done:
                return
            s = self.shard
            gaps, cur = [], 0
            for a, e, _ in self.segs:
                if a > cur:
                    gaps.append((cur, a))
                cur = e
            if cur < s.length:
                gaps.append((cur, s.length))
            for a, e in gaps:
                while a < e:
                    n = min(len(buf), e - a)
                    storage.read_into(s.file, s.offset + a, buf[:n])
                    self._put(a, a + n, buf[:n])
                    a += n
            self._check(url)

    def gap_bytes(self) -> int:
        return self.shard.length - self.covered

    def _put(self, s: int, e: int, data: memoryview) -> None:
        segs = self.segs
        i = bisect.bisect_right(segs, s, key=_seg_start)
        if i and segs[i - 1][1] == s:  # continues the range before it: no combine needed
            g = segs[i - 1]
            g[1], g[2] = e, crc32(data, g[2])
        else:
            g = [s, e, crc32(data)]
            segs.insert(i, g)
            i += 1
        if i < len(segs) and segs[i][0] == e:  # and joins the range after it
            nxt = segs.pop(i)
            g[1], g[2] = nxt[1], crc32_combine(g[2], nxt[2], nxt[1] - nxt[0])
        self.covered += e - s

    def _check(self, url: str) -> None:
        self.done = True
        s = self.shard
        assert s.checksum is not None and len(self.segs) == 1 and self.segs[0][:2] == [0, s.length]
        found = self.segs[0][2]
        if found != s.checksum:
            raise IntegrityError(
                f"tensor {self.key!r} shard {self.index}: checksum mismatch in {url}/{s.file} bytes "
                f"[{s.offset}, {s.offset + s.length}) (stored {s.checksum:#010x}, found {found:#010x}); the source "
                "checkpoint is corrupted, so the export stopped and removed what it had written; restore that file "
                "(`ckpt verify --deep` lists every damaged shard), or pass verify_source=False (--no-verify-source) "
                "to export the bytes as they are")


class SourceChecks:
    """CRC32 checks of every stored shard (with a checksum) of the tensors an export reads."""

    def __init__(self, manifest: Manifest, keys: list[str], url: str, buf_bytes: int):
        self.url = url
        self.buf_bytes = max(1, buf_bytes)
        self.by_key: dict[str, list[ShardCheck]] = {}
        seen: set[tuple[str, int, int, int]] = set()
        by_file: dict[str, list[ShardCheck]] = {}
        for key in keys:
            checks = self.by_key.setdefault(key, [])
            for i, s in enumerate(manifest.tensors[key].shards):
                if not s.length:
                    continue  # nothing stored
                if s.checksum is None:  # every writer records one: the manifest was edited
                    raise IntegrityError(
                        f"tensor {key!r} shard {i}: no checksum in the manifest to verify {url}/{s.file} bytes "
                        f"[{s.offset}, {s.offset + s.length}) against; pass verify_source=False "
                        "(--no-verify-source) to export the bytes as they are")
                ident = (s.file, s.offset, s.length, s.checksum)
                if ident in seen:
                    continue
                seen.add(ident)
                c = ShardCheck(key, i, s)
                checks.append(c)
                by_file.setdefault(s.file, []).append(c)
        self.by_file: dict[str, tuple[list[int], list[ShardCheck]]] = {}
        for f, cs in by_file.items():
            cs.sort(key=lambda c: c.shard.offset)
            self.by_file[f] = ([c.shard.offset for c in cs], cs)

    def saw(self, file: str, offset: int, data: memoryview) -> None:
        """Bytes ``[offset, offset + len(data))`` of ``file`` were read: hash the parts of shards in them."""
        idx = self.by_file.get(file)
        if idx is None or not len(data):
            return
        starts, checks = idx
        end = offset + len(data)
        i = max(0, bisect.bisect_right(starts, offset) - 1)
        while i < len(checks) and starts[i] < end:
            c = checks[i]
            a, b = max(offset, starts[i]), min(end, starts[i] + c.shard.length)
            if a < b:
                c.add(a - starts[i], data[a - offset : b - offset], self.url)
            i += 1

    def finish(self, keys: list[str], storage: Storage) -> None:
        """Complete the checks of ``keys``' shards (reading what the export skipped, through one bounded
        buffer) and compare. Raises IntegrityError on a mismatch."""
        todo = [c for k in keys for c in self.by_key.get(k, ()) if not c.done]
        gap = max((c.gap_bytes() for c in todo), default=0)
        buf = memoryview(bytearray(min(self.buf_bytes, gap))) if gap else memoryview(b"")
        for c in todo:
            c.finish(storage, buf, self.url)


class VerifyingReads(Storage):
    """``storage`` for the read planner, handing every byte range it reads to ``checks.saw``.

    A :class:`Storage` of its own, so that capabilities it does not pass on keep the base class's
    defaults: it never maps files (``maps_files`` False), since a map would bypass the checks."""

    def __init__(self, storage: Storage, checks: SourceChecks):
        self.inner, self.checks, self.url = storage, checks, storage.url
        self.coalesce_gap, self.coalesce_waste = storage.coalesce_gap, storage.coalesce_waste
        self.merge_direct = storage.merge_direct

    def read_file(self, path: str) -> bytes:
        return self.inner.read_file(path)

    def size(self, path: str) -> int | None:
        return self.inner.size(path)

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.list(prefix)

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        self.inner.read_into(path, offset, buf)
        self.checks.saw(path, offset, memoryview(buf).cast("B"))

    def readv(self, path: str, ranges: Sequence[tuple[int, int]], buf: memoryview, base: int) -> None:
        self.inner.readv(path, ranges, buf, base)
        mv = memoryview(buf).cast("B")
        for off, n in ranges:
            self.checks.saw(path, off, mv[off - base : off - base + n])

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> builtins.list[bytes]:
        out = builtins.list(self.inner.read_ranges(path, ranges))
        for (off, _), data in zip(ranges, out, strict=True):
            self.checks.saw(path, off, memoryview(data).cast("B"))
        return out

