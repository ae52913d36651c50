"""Optional per-file compression of data files (zstd, with byte planes): the format's codec layer.

A compressed data file keeps the byte layout the save planner gave it (the *raw* layout: shard
``offset``/``length`` in the manifest are positions in it, exactly as in an uncompressed file),
but stores each piece as zstd frames of at most :data:`FRAME_RAW` raw bytes, back to back. The
manifest records per file its codec and a frame table: each frame's raw range, its stored range
and the CRC-32 of its stored bytes (docs/FORMAT.md "Compressed data files"). Shard checksums stay
CRC-32s of the RAW piece bytes, so ``load(verify=True)`` and ``verify --deep`` check the data after
decompression.

With ``planes`` each frame's elements are split into byte planes before compressing (for bf16: all
high bytes, then all low bytes): the exponent bytes of trained weights repeat a lot and compress
well once they are no longer interleaved with the near-random mantissa bytes.

Reading goes through ONE place, :class:`DecodingReads`: a ``Storage`` that serves the raw layout of
compressed files (every ``read_into``/``readv`` of the planner's byte ranges) by reading the frames
they overlap whole, checking their stored CRC, and decompressing each into a buffer of exactly the
frame's recorded raw length (never what the frame's own header claims), so a corrupt or hostile
frame is an ``IntegrityError``, never a memory bomb. :func:`data_storage` wraps a storage when its
manifest has codecs; loading, verification and every other reader of shard bytes go through it.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpt._checksum import crc32
from ckpt._columns import decode_column, encode_column
from ckpt.errors import FormatVersionError, IntegrityError, ManifestError, StateError

CODECS = ("zstd",)  # codec names this ckpt reads and writes
FRAME_RAW = 4 << 20  # raw bytes per frame at most (a multiple of every item size)
MAX_FRAME_RAW = 64 << 20  # a frame table claiming more raw bytes per frame is refused (bounds a reader's buffer)
# zstd level 1: on byte planes of bf16 weights it compresses both better and faster than level 3
# (the near-constant exponent plane costs higher levels' match finders much time for nothing;
# measured in docs/BENCHMARKS.md, section "Compression")
DEFAULT_LEVEL = 1
INSTALL_HINT = "pip install 'ckpt[zstd]' (or: pip install zstandard)"


class UnsupportedCodecError(FormatVersionError):
    """A manifest names a data-file codec this ckpt does not know (written by a newer ckpt)."""


@dataclass(frozen=True, slots=True)
class Codec:
    """How a save compresses its data files: ``ckpt.save(..., compression=Codec(level=9))``.

    ``planes``: split each frame's elements into byte planes first (item sizes 2, 4, 8).
    """

    name: str = "zstd"
    level: int = DEFAULT_LEVEL
    planes: bool = True

    def planes_for(self, itemsize: int) -> int:
        return itemsize if self.planes and itemsize in (2, 4, 8) else 1


def resolve(compression: Any) -> Codec | None:
    """``compression`` as given to ``save`` (None / "none", "zstd", a :class:`Codec`) as a Codec or None.

    Raises StateError for an unknown value and ImportError (with the install hint) when zstandard
    is missing.
    """
    if compression is None or compression is False or compression == "none":
        return None
    if isinstance(compression, str):
        if compression not in CODECS:
            raise StateError(f"compression={compression!r} is unknown; use None or one of {', '.join(CODECS)}")
        compression = Codec(name=compression)
    if not isinstance(compression, Codec):
        raise StateError(f"compression must be None, 'zstd' or a ckpt._codec.Codec, got {type(compression).__name__}")
    if compression.name not in CODECS:
        raise StateError(f"compression codec {compression.name!r} is unknown; use one of {', '.join(CODECS)}")
    if not isinstance(compression.level, int) or not -7 <= compression.level <= 22:
        raise StateError(f"compression level {compression.level!r} is not an int in [-7, 22]")
    _zstd()
    return compression


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ImportError(f"compression='zstd' needs the zstandard package: {INSTALL_HINT}") from None
    return zstandard


# -- the manifest record ----------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class FileCodec:
    """A compressed data file's manifest record: codec, raw size, frame table (columns, int64)."""

    name: str
    level: int
    raw_size: int
    raw_offset: np.ndarray
    raw_length: np.ndarray
    offset: np.ndarray  # stored (compressed) byte offset of each frame
    length: np.ndarray
    planes: np.ndarray
    checksum: np.ndarray  # CRC-32 of each frame's stored bytes

    def __eq__(self, other: object) -> bool:  # the columns are arrays: compare what is stored
        return isinstance(other, FileCodec) and self.to_wire() == other.to_wire()

    __hash__ = None  # type: ignore[assignment]

    def to_wire(self) -> dict[str, Any]:
        cols = ("raw_offset", "raw_length", "offset", "length", "planes", "checksum")
        return {"name": self.name, "level": self.level, "raw_size": self.raw_size,
                "frames": {"n": len(self.raw_offset), **{c: encode_column(getattr(self, c)) for c in cols}}}

    @classmethod
    def from_wire(cls, w: Any, path: str, stored_size: int) -> FileCodec:
        """Decode and validate a file's codec record; ManifestError naming the file and frame, or
        UnsupportedCodecError for a codec name this ckpt does not know."""
        what = f"file {path!r} codec"
        if not isinstance(w, dict):
            raise ManifestError(f"{what}: not a map")
        name = w.get("name")
        if name not in CODECS:
            raise UnsupportedCodecError(f"{what}: {name!r} is not a codec this ckpt knows ({', '.join(CODECS)}); "
                                        "upgrade ckpt to read this checkpoint")
        level, raw_size, fr = w.get("level", 0), w.get("raw_size"), w.get("frames")
        if not isinstance(level, int) or not isinstance(raw_size, int) or isinstance(raw_size, bool) \
                or not 0 <= raw_size <= 2**63 - 1:
            raise ManifestError(f"{what}: level or raw_size missing or not an integer")
        if not isinstance(fr, dict) or not isinstance(fr.get("n"), int) or not 0 <= fr["n"] <= stored_size:
            raise ManifestError(f"{what}: frames is not a table of at most {stored_size} frames")
        n = fr["n"]
        cols = {c: decode_column(fr.get(c), n, f"{what} frames column {c!r}")
                for c in ("raw_offset", "raw_length", "offset", "length", "planes", "checksum")}
        ro, rl, so, sl, pl = (cols[c] for c in ("raw_offset", "raw_length", "offset", "length", "planes"))
        checks = [
            ((rl <= 0) | (rl > MAX_FRAME_RAW), f"raw length not in (0, {MAX_FRAME_RAW}]"),
            (~np.isin(pl, (1, 2, 4, 8)) | (rl % np.maximum(pl, 1) != 0), "planes not 1, 2, 4 or 8 dividing its length"),
            (ro > raw_size - rl, f"raw range beyond the file's raw size {raw_size}"),
            ((sl <= 0) | (sl > bound(rl)), "stored length not in (0, zstd's bound of its raw length]"),
            (so > stored_size - sl, f"stored range beyond the file's {stored_size} bytes"),
            (cols["checksum"] > 0xFFFFFFFF, "checksum is not a 32-bit value"),
        ]
        if n > 1:
            gap = np.zeros(n, dtype=bool)
            gap[1:] = ro[1:] < ro[:-1] + rl[:-1]
            checks.append((gap, "raw range overlaps the previous frame (frames must be in raw order)"))
        for bad, why in checks:
            if bad.any():
                i = int(np.argmax(bad))
                raise ManifestError(f"{what} frame {i}: {why}; the manifest is corrupted")
        return cls(name, level, raw_size, ro, rl, so, sl, pl, cols["checksum"])

    def check_covers(self, key: str, offset: np.ndarray, length: np.ndarray, path: str) -> None:
        """ManifestError unless every non-empty byte range ``[offset, offset + length)`` (a
        tensor's shards in this file) lies in one run of back-to-back frames: a reader never fills a
        shard's bytes from anywhere but a frame."""
        if not len(offset):
            return
        ro, rl = self.raw_offset, self.raw_length
        starts = np.ones(len(ro), dtype=bool)
        if len(ro) > 1:
            starts[1:] = ro[1:] != ro[:-1] + rl[:-1]
        run_start = ro[starts]
        run_end = np.append(ro[np.nonzero(starts)[0][1:] - 1] + rl[np.nonzero(starts)[0][1:] - 1],
                            ro[-1] + rl[-1]) if len(ro) else np.zeros(0, dtype=np.int64)
        live = length > 0
        j = np.searchsorted(run_start, offset, side="right") - 1
        ok = (j >= 0) & (run_end[np.maximum(j, 0)] >= offset + length) if len(run_start) else np.zeros_like(live)
        bad = live & ~ok
        if bad.any():
            i = int(np.argmax(bad))
            raise ManifestError(f"tensor {key!r}: shard bytes [{int(offset[i])}, {int(offset[i] + length[i])}) of "
                                f"{path!r} are not stored in its codec's frames; the manifest is corrupted")


def bound(raw: np.ndarray) -> np.ndarray:
    """An upper bound of zstd's compressed size of ``raw`` bytes (ZSTD_compressBound, rounded up)."""
    return raw + (raw >> 7) + (1 << 17)


# -- writing ----------------------------------------------------------------------------------


def to_planes(raw: memoryview | bytes, planes: int) -> bytes | memoryview:
    """The bytes of ``raw`` (a whole number of ``planes``-byte items) as ``planes`` byte planes."""
    if planes == 1:
        return raw
    items = np.frombuffer(raw, dtype=np.uint8).reshape(-1, planes)
    out = np.empty((planes, len(items)), dtype=np.uint8)
    # one strided pass per plane: numpy's .T copy loops over the 2-byte inner dim, far slower
    # (measured in docs/BENCHMARKS.md, section "Figures that code comments used to quote")
    for i in range(planes):
        out[i] = items[:, i]
    return out.data


def from_planes(data: bytearray, planes: int) -> bytearray:
    """Inverse of :func:`to_planes`."""
    if planes == 1:
        return data
    out = bytearray(len(data))
    src = np.frombuffer(data, dtype=np.uint8).reshape(planes, -1)
    items = np.frombuffer(out, dtype=np.uint8).reshape(-1, planes)
    for i in range(planes):
        items[:, i] = src[i]
    return out


class FrameWriter:
    """Compresses pieces into frames and writes them in order to ``write`` (a file writer's write).

    Frames are compressed on ``pool`` threads (zstd releases the GIL) at most ``depth`` ahead of the
    writes, so memory stays bounded by ``depth`` frames whatever the file's size.
    """

    def __init__(self, codec: Codec, write: Callable[[bytes], None], pool: ThreadPoolExecutor, depth: int = 4):
        self.codec, self.write, self.pool, self.depth = codec, write, pool, depth
        self.local = threading.local()
        self.pending: list[tuple[Future[bytes], int, int, int]] = []
        self.stored = 0
        self.rows: list[tuple[int, int, int, int, int, int]] = []

    def _compress(self, raw: bytes | memoryview, planes: int) -> bytes:
        c = getattr(self.local, "c", None)
        if c is None:
            c = self.local.c = _zstd().ZstdCompressor(level=self.codec.level, write_content_size=True)
        return bytes(c.compress(to_planes(raw, planes)))

    def frame(self, raw_offset: int, raw: bytes, planes: int) -> None:
        """Queue one frame (``raw`` is owned by the writer from now on)."""
        self.pending.append((self.pool.submit(self._compress, raw, planes), raw_offset, len(raw), planes))
        while len(self.pending) > self.depth:
            self._drain_one()

    def _drain_one(self) -> None:
        fut, ro, rl, planes = self.pending.pop(0)
        data = fut.result()
        self.write(data)
        self.rows.append((ro, rl, self.stored, len(data), planes, crc32(data)))
        self.stored += len(data)

    def piece(self, raw_offset: int, length: int, parts: Iterator[memoryview], planes: int) -> int:
        """Frame one piece of ``length`` raw bytes from ``parts``; returns the CRC-32 of its raw bytes."""
        step = FRAME_RAW - FRAME_RAW % planes
        crc, pos, buf = 0, 0, bytearray()
        for seg in parts:
            crc = crc32(seg, crc)
            mv = memoryview(seg).cast("B")
            while len(mv):
                take = min(len(mv), step - len(buf))
                if not buf and take == step:  # a whole frame straight from the segment: one copy
                    self.frame(raw_offset + pos, bytes(mv[:take]), planes)
                else:
                    buf += mv[:take]
                    if len(buf) == step:
                        self.frame(raw_offset + pos, bytes(buf), planes)
                        buf = bytearray()
                pos += take
                mv = mv[take:]
            if pos > length:
                break
        if buf:
            self.frame(raw_offset + pos - len(buf), bytes(buf), planes)
        if pos != length:
            raise StorageFault(f"piece has {pos} bytes, plan says {length}")
        return crc

    def finish(self, raw_size: int) -> FileCodec:
        while self.pending:
            self._drain_one()
        cols = np.array(self.rows, dtype=np.int64).reshape(-1, 6).T
        return FileCodec(self.codec.name, self.codec.level, raw_size, *cols)

    def cancel(self) -> None:
        for fut, *_ in self.pending:
            fut.cancel()
        self.pending.clear()


class StorageFault(Exception):
    """A piece's byte count disagrees with its plan (io.write_assignment turns it into StorageError)."""


# -- reading ----------------------------------------------------------------------------------


def decompress_frame(stored: bytes | bytearray | memoryview, raw_length: int, planes: int, where: str) -> bytearray:
    """One frame's raw bytes: exactly ``raw_length`` bytes decompressed into a buffer of that size
    (the frame's own content size is never trusted), back from planes. IntegrityError otherwise."""
    zstd = _zstd()
    out = bytearray(raw_length)
    try:
        r = zstd.ZstdDecompressor().stream_reader(io.BytesIO(stored), read_across_frames=False)
        got, mv = 0, memoryview(out)
        while got < raw_length:
            n = r.readinto(mv[got:])
            if not n:
                break
            got += n
        extra = r.read(1) if got == raw_length else b""
    except zstd.ZstdError as e:
        raise IntegrityError(f"{where}: the frame does not decompress ({e}); the file is corrupted") from None
    if got != raw_length or extra:
        raise IntegrityError(f"{where}: the frame decompresses to {'more than ' if extra else ''}{got} bytes, the "
                             f"manifest records {raw_length}; the file is corrupted")
    return from_planes(out, planes)


__all__ = ["CODECS", "Codec", "FileCodec", "FrameWriter", "StorageFault", "UnsupportedCodecError", "decompress_frame",
           "resolve"]
