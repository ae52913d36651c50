"""Reading compressed checkpoints: :class:`DecodingReads` serves the raw byte layout of the
compressed data files a manifest records (:mod:`ckpt._codec` holds the frame format and the writer).

Kept apart from :mod:`ckpt._codec` because it reads manifests, which themselves carry codec records:
the codec stays below the manifest, this module above it.
"""

from __future__ import annotations

import builtins
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckpt import _codec as _codec
from ckpt._checksum import crc32
from ckpt._codec import FileCodec, decompress_frame
from ckpt.errors import IntegrityError
from ckpt.formats.msgpack_codec import decode_manifest
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage.base import Storage


class _Frames(threading.local):
    key: tuple[str, int] | None = None
    data: bytearray | None = None


class DecodingReads(Storage):
    """``storage`` serving the raw layout of the compressed files in ``codecs`` (others pass through).

    Never maps files (a map would bypass decompression); the planner coalesces reads within a
    frame's size (``coalesce_gap``) since a frame is read whole anyway. Each reader thread keeps its
    last decompressed frame, so the many short runs a resharding plan reads from one frame cost one
    decompression.
    """

    def __init__(self, storage: Storage, codecs: dict[str, FileCodec]):
        self.inner, self.codecs, self.url = storage, codecs, storage.url
        self.coalesce_gap = max(storage.coalesce_gap, _codec.FRAME_RAW)
        self.coalesce_waste, self.merge_direct = storage.coalesce_waste, storage.merge_direct
        self.local_dir = storage.local_dir
        self._last = _Frames()

    def read_file(self, path: str) -> bytes:
        if path in self.codecs:
            c = self.codecs[path]
            buf = bytearray(c.raw_size)
            self.read_into(path, 0, memoryview(buf))
            return bytes(buf)
        return self.inner.read_file(path)

    def size(self, path: str) -> int | None:
        return self.inner.size(path)  # what is on storage: the manifest's ``files`` records stored sizes

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        c = self.codecs.get(path)
        if c is None:
            self.inner.read_into(path, offset, buf)
            return
        mv = memoryview(buf).cast("B")
        end = offset + len(mv)
        if offset < 0 or end > c.raw_size:
            raise IntegrityError(f"{path}: bytes [{offset}, {end}) lie beyond its raw size {c.raw_size}")
        lo = max(int(np.searchsorted(c.raw_offset, offset, side="right")) - 1, 0)
        hi = int(np.searchsorted(c.raw_offset, end, side="left"))
        todo = [i for i in range(lo, hi) if int(c.raw_offset[i] + c.raw_length[i]) > offset]
        pos = offset
        # frames of one read decode in parallel (zstd and the plane copies release the GIL), a
        # bounded window at a time so memory stays a few frames whatever the read's length
        window = 2 * _workers()
        for w in range(0, len(todo), window):
            part = todo[w : w + window]
            datas = [self._frame(path, c, part[0])] if len(part) == 1 else \
                list(_pool().map(lambda i: self._decode(path, c, i), part))
            for i, data in zip(part, datas, strict=True):
                ro, rl = int(c.raw_offset[i]), int(c.raw_length[i])
                if ro > pos:  # bytes no frame stores (the planned header, padding): no shard claims them
                    mv[pos - offset : ro - offset] = bytes(ro - pos)
                    pos = ro
                stop = min(end, ro + rl)
                mv[pos - offset : stop - offset] = memoryview(data)[pos - ro : stop - ro]
                pos = stop
        if pos < end:
            mv[pos - offset :] = bytes(end - pos)

    def readv(self, path: str, ranges: Sequence[tuple[int, int]], buf: memoryview, base: int) -> None:
        mv = memoryview(buf).cast("B")
        for off, n in ranges:
            self.read_into(path, off, mv[off - base : off - base + n])

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> builtins.list[bytes]:
        out = []
        for off, n in ranges:
            b = bytearray(n)
            self.read_into(path, off, memoryview(b))
            out.append(bytes(b))
        return out

    def _frame(self, path: str, c: FileCodec, i: int) -> bytearray:
        last = self._last
        if last.key == (path, i) and last.data is not None:
            return last.data
        data = self._decode(path, c, i)
        last.key, last.data = (path, i), data
        return data

    def _decode(self, path: str, c: FileCodec, i: int) -> bytearray:
        """Frame ``i`` of ``path``: read whole, stored CRC checked, decompressed to its raw length."""
        so, sl, rl = int(c.offset[i]), int(c.length[i]), int(c.raw_length[i])
        stored = bytearray(sl)
        self.inner.read_into(path, so, memoryview(stored))
        where = f"{path} frame {i} (raw bytes [{int(c.raw_offset[i])}, {int(c.raw_offset[i]) + rl}))"
        got = crc32(stored)
        if got != int(c.checksum[i]):
            raise IntegrityError(f"{where}: checksum of its stored bytes does not match ({got:#010x}, recorded "
                                 f"{int(c.checksum[i]):#010x}); the file is corrupted")
        return decompress_frame(stored, rl, int(c.planes[i]), where)


_POOL: dict[int, ThreadPoolExecutor] = {}  # by pid: a forked child's copy has no threads, it gets its own
_POOL_LOCK = threading.Lock()


def _workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _pool() -> ThreadPoolExecutor:
    """The process's frame decoders (created on first use; threads idle otherwise)."""
    pid = os.getpid()
    with _POOL_LOCK:
        if pid not in _POOL:
            _POOL.clear()  # an inherited executor's threads do not exist in this process
            _POOL[pid] = ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="ckpt-unzstd")
        return _POOL[pid]


_FOUND: weakref.WeakKeyDictionary[Storage, DecodingReads] = weakref.WeakKeyDictionary()
_FOUND_LOCK = threading.Lock()


def decoding(storage: Storage, files: Iterable[str]) -> Storage:
    """The storage to execute reads of ``files`` with: ``storage`` itself unless one of them is a
    compressed data file (``.zst``: :func:`ckpt._transaction.fresh_data_file` names) and ``storage``
    does not decode it. Then a :class:`DecodingReads` over the codec records of the checkpoint
    ``storage`` is rooted at (its manifest, read once per storage object): data file names are
    unique, so the record found for a name is that file's. The executors of read plans
    (``ckpt._io``) call this, so a reader that got its storage elsewhere than :func:`data_storage`
    (reshard, diff, exports: ``ckpt._stream``) still reads raw bytes, never frames."""
    zst = [f for f in files if f.endswith(".zst")]
    if not zst:
        return storage
    layer: Any = storage
    while layer is not None:  # already decoded underneath a wrapper (source_checks.VerifyingReads ...)
        if isinstance(layer, DecodingReads) and all(f in layer.codecs for f in zst):
            return storage
        layer = getattr(layer, "inner", None)
    inner = storage.inner if isinstance(storage, DecodingReads) else storage
    with _FOUND_LOCK:
        found = _FOUND.get(inner)
    if found is None or not all(f in found.codecs for f in zst):
        m = decode_manifest(inner.read_file(MANIFEST_NAME), url=f"{inner.url}/{MANIFEST_NAME}")
        found = DecodingReads(inner, m.codecs)
        with _FOUND_LOCK:
            _FOUND[inner] = found
    missing = [f for f in zst if f not in found.codecs]
    if missing:
        raise IntegrityError(f"{inner.url}: {missing[0]} is named like a compressed data file but the checkpoint's "
                             "manifest has no codec record for it; the manifest or the file is not this checkpoint's")
    return found


def data_storage(storage: Storage, manifest: Any) -> Storage:
    """The storage to read ``manifest``'s shard bytes through: ``storage`` itself when no data file
    is compressed, else a :class:`DecodingReads` over it. Every reader of shard bytes calls this."""
    codecs = getattr(manifest, "codecs", None)
    if not codecs or isinstance(storage, DecodingReads):
        return storage
    return DecodingReads(storage, codecs)


__all__ = ["DecodingReads", "data_storage", "decoding"]
