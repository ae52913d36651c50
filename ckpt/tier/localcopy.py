"""A peer's memory checkpoint copied straight from its files, on several threads, every piece's CRC checked.

Why: ranks of one host (simulated nodes, or ``CKPT_NODE`` set apart on one machine) share its
``/dev/shm``, so the bytes a rank keeps for a peer need not travel through gloo's sockets (several
copies and a loopback TCP stream): the receiver reads the sender's committed step files itself.
Each thread takes *units* (at most :data:`UNIT` bytes of one file) and, :data:`SUB` bytes at a
time, ``pread``\\ s them straight into the destination mapping (a kernel copy: no page faults on
the source, and the reused slot's pages exist) and checksums them there.
A piece's CRC is its units' CRCs combined, compared with the one its manifest records; so what is
checked is what is kept, and a file changed, truncated or replaced after the sender committed it
is refused. Bytes no piece covers (the safetensors header) are copied unchecked, as every reader
takes the pieces' places from the manifest.

Safety is :mod:`ckpt.tier.safefs`'s: the sender's files are opened ``O_NOFOLLOW`` below the trusted
run directory, only regular files of this user, never a FIFO. The caller commits nothing unless
:func:`copy_verified` returned (see :func:`ckpt.tier.transfer.exchange`).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from ckpt._checksum import crc32, crc32_combine
from ckpt._io import cpus_per_rank
from ckpt.errors import IntegrityError, ManifestError, StorageError
from ckpt.manifest import Manifest
from ckpt.tier import safefs
from ckpt.tier.pace import Pace

UNIT = 64 << 20  # bytes a thread takes at a time: few hand-offs, yet every thread busy on a large file
# bytes copied then checksummed at once: a whole unit. Both calls release the GIL, but each return
# takes it back, and while training runs Python on the main thread a take can wait out the switch
# interval and then make the training thread wait in turn: with 4 MiB at a time (a CRC still in
# cache: ~4,700 takes per 9.4 GB) the training steps beside the replication ran 2.67x, with 64 MiB
# 1.87x (docs/BENCHMARKS.md, "Memory tier at steady state"); the CRC reading memory again costs less
SUB = UNIT
MAX_THREADS = 8


@dataclass(frozen=True, slots=True)
class FileCopy:
    """One file to copy: the sender's ``src`` (``size`` bytes, its manifest name ``rel``) into ``dst``,
    a writable buffer of exactly ``size`` bytes (the receiver's slot mapping)."""

    rel: str
    size: int
    src: str
    dst: memoryview


@dataclass(frozen=True, slots=True)
class Piece:
    """A checksummed byte range of a data file (one shard of the manifest)."""

    key: str
    file: int  # index into the copy's files
    offset: int
    length: int
    checksum: int | None


@dataclass(frozen=True, slots=True)
class Unit:
    """What one thread copies at a time: ``length`` bytes at ``offset`` of file ``file``, inside piece
    ``piece`` (-1: bytes no piece covers, copied unchecked)."""

    file: int
    offset: int
    length: int
    piece: int


def plan_units(manifest: Manifest, files: list[tuple[str, int]], unit: int = UNIT) -> tuple[list[Piece], list[Unit]]:
    """The pieces of ``files`` (``(name, size)``, the order of the copy) and the units covering every
    byte of every file exactly once, each at most ``unit`` bytes and inside one piece or one gap,
    a piece's units in order. Pure: no I/O.

    Raises ManifestError for a piece in a file not copied, past its file's end, or overlapping another.
    """
    index = {rel: i for i, (rel, _size) in enumerate(files)}
    pieces: list[Piece] = []
    for key, t in manifest.tensors.items():
        for s in t.shards:
            if not s.length:
                continue
            i = index.get(s.file)
            if i is None:
                raise ManifestError(f"{key}: its piece is in {s.file!r}, not among the files copied {sorted(index)}")
            if s.offset < 0 or s.offset + s.length > files[i][1]:
                raise ManifestError(f"{key}: bytes [{s.offset}, {s.offset + s.length}) lie past the end of {s.file} "
                                    f"({files[i][1]} bytes); the copy is damaged")
            pieces.append(Piece(key, i, s.offset, s.length, s.checksum))
    units: list[Unit] = []
    by_file = sorted(range(len(pieces)), key=lambda p: (pieces[p].file, pieces[p].offset))
    at = [0] * len(files)
    for p in by_file:
        pc = pieces[p]
        if pc.offset < at[pc.file]:
            raise ManifestError(f"{pc.key}: its bytes at {pc.offset} of {files[pc.file][0]} overlap another piece's; "
                                "the copy is damaged")
        units += _cut(pc.file, at[pc.file], pc.offset, -1, unit) + _cut(pc.file, pc.offset, pc.offset + pc.length, p,
                                                                        unit)
        at[pc.file] = pc.offset + pc.length
    for i, (_rel, size) in enumerate(files):
        units += _cut(i, at[i], size, -1, unit)
    return pieces, units


def _cut(file: int, start: int, stop: int, piece: int, unit: int) -> list[Unit]:
    return [Unit(file, o, min(unit, stop - o), piece) for o in range(start, stop, unit)]


def threads_for(ranks_here: int) -> int:
    """Copy threads of one rank: three quarters of this process's share of the CPUs among the
    ``ranks_here`` ranks of the host that copy at the same time, at most :data:`MAX_THREADS`. Why
    not all: the copies run beside training, whose own threads (the Python loop, NCCL's proxies,
    the CUDA waits that spin) lose their cores to them otherwise, and host memory bandwidth is spent
    well before every core copies. ``CKPT_TIER_COPY_THREADS`` sets the number instead."""
    env = os.environ.get("CKPT_TIER_COPY_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(MAX_THREADS, cpus_per_rank(max(1, ranks_here)) * 3 // 4))


def copy_verified(copies: list[FileCopy], manifest: Manifest, *, threads: int = 4, deadline: float | None = None,
                  what: str = "memory tier copy", unit: int = UNIT,
                  pace: Pace | None = None) -> int:
    """Copy each ``copies[i].src`` into ``copies[i].dst`` on ``threads`` threads, checking every piece
    ``manifest`` lists against its recorded CRC-32 as its bytes land; returns the bytes copied.

    ``deadline`` (``time.monotonic()``): a copy still running then is abandoned. Nothing is committed
    here: the caller keeps the destination only when this returns. ``pace(nbytes, deadline)``:
    called before each read, returning by ``deadline`` (a bandwidth budget:
    :meth:`ckpt.tier.pace.Pacer.take`).

    Raises UnsafePathError (a source is a link, a FIFO, another user's file, or below one),
    IntegrityError (a source is not the size its manifest records, or a piece's CRC differs: the
    sender's copy changed after its commit), ManifestError (pieces that do not fit the files),
    StorageError (a read failed, or the deadline passed).
    """
    files = [(c.rel, c.size) for c in copies]
    for c in copies:
        if c.dst.nbytes != c.size:
            raise StorageError(f"{what}: {c.rel}: destination of {c.dst.nbytes} bytes for a {c.size}-byte file")
    pieces, units = plan_units(manifest, files, unit)
    fds: list[int] = []
    try:
        for c in copies:
            fds.append(safefs.open_file(c.src))  # never a link, a FIFO or another user's file
            found = os.fstat(fds[-1]).st_size
            if found != c.size:
                raise IntegrityError(f"{what}: {c.src}: {found} bytes, its manifest says {c.size}; the sender's copy "
                                     "was truncated or replaced after its commit, not kept")
        crcs = _run(units, copies, fds, max(1, threads), deadline, what, pace)
    finally:
        for fd in fds:
            os.close(fd)
    _check(pieces, units, crcs, copies, what)
    return sum(c.size for c in copies)


def _run(units: list[Unit], copies: list[FileCopy], fds: list[int], threads: int, deadline: float | None,
         what: str, pace: Pace | None = None) -> list[int]:
    """Copy every unit on ``threads`` threads; each unit's CRC, or raise the first failure."""
    crcs = [0] * len(units)
    stop = threading.Event()

    def one(k: int) -> None:
        if stop.is_set():
            return
        u = units[k]
        dst, fd, crc, done = copies[u.file].dst, fds[u.file], 0, 0
        while done < u.length:
            n = min(SUB, u.length - done)
            if pace is not None:
                pace(n, deadline)  # (returns by the deadline at the latest)
            if deadline is not None and time.monotonic() > deadline:
                raise StorageError(f"{what}: still copying {copies[u.file].rel} at its deadline; not kept")
            view = dst[u.offset + done : u.offset + done + n]
            got = os.preadv(fd, [view], u.offset + done)
            if got <= 0:
                raise IntegrityError(f"{what}: {copies[u.file].src} ended at byte {u.offset + done}, its manifest "
                                     f"says {copies[u.file].size}; the sender's copy was truncated, not kept")
            if u.piece >= 0:
                crc = crc32(view[:got], crc)
            done += got
        crcs[k] = crc

    if threads == 1 or len(units) == 1:
        for k in range(len(units)):
            one(k)
        return crcs
    with ThreadPoolExecutor(max_workers=min(threads, len(units)), thread_name_prefix="ckpt-tier-copy") as pool:
        futures = [pool.submit(one, k) for k in range(len(units))]
        wait(futures, return_when=FIRST_EXCEPTION)
        stop.set()  # (after a failure the units not started are skipped; none is left otherwise)
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:
        raise errors[0]
    return crcs


def _check(pieces: list[Piece], units: list[Unit], crcs: list[int], copies: list[FileCopy], what: str) -> None:
    combined: dict[int, int] = {}
    for u, crc in zip(units, crcs, strict=True):
        if u.piece >= 0:
            combined[u.piece] = crc32_combine(combined[u.piece], crc, u.length) if u.piece in combined else crc
    for p, pc in enumerate(pieces):
        if pc.checksum is not None and combined.get(p, 0) != pc.checksum:
            raise IntegrityError(f"{what}: {pc.key}: checksum mismatch in {copies[pc.file].src} (bytes {pc.offset}-"
                                 f"{pc.offset + pc.length}: {combined.get(p, 0):08x}, its manifest says "
                                 f"{pc.checksum:08x}); the sender's copy changed after its commit, not kept")


__all__ = ["UNIT", "SUB", "MAX_THREADS", "FileCopy", "Piece", "Unit", "plan_units", "threads_for", "copy_verified"]
