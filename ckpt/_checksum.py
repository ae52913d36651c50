"""CRC32 (the zlib / IEEE polynomial) with the fastest implementation available.

ISA-L's crc32 gives the same values as ``zlib.crc32`` several times faster, which keeps
checksumming off the critical path of a save even when every core is busy (measured in
docs/RELIABILITY.md, section "Checksum cost"). ``isal`` is a dependency; where its wheel is missing
we fall back to zlib and the values stay the same.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

_crc: Callable[[Any, int], int]
try:
    from isal import isal_zlib as _isal

    _crc = _isal.crc32
    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - exercised only where isal has no wheel
    _crc = zlib.crc32
    IMPLEMENTATION = "zlib"


def crc32(data: Any, value: int = 0) -> int:
    """CRC32 of a bytes-like ``data`` continuing from ``value`` (same result as ``zlib.crc32``)."""
    return _crc(data, value)


_POLY = 0xEDB88320  # CRC32 (zlib), reflected


def _multmodp(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the CRC32 polynomial (zlib's ``multmodp``; ``a`` nonzero)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's ``crc32_combine``)."""
    p, k, n = 1 << 31, 3, len2  # x^(8 * len2)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


crc32_combine: Callable[[int, int, int], int]
"""CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
try:
    from isal.isal_zlib import crc32_combine as _isal_combine

    crc32_combine = _isal_combine
except ImportError:  # pragma: no cover - where isal has no wheel
    crc32_combine = crc32_combine_py


def crc32_parallel(buffers: list[Any], workers: int, chunk: int = 32 << 20, nice: int = 0,
                   before: Callable[[int], None] | None = None) -> list[int]:
    """CRC32 of each bytes-like buffer, on ``workers`` threads: large buffers are cut into ``chunk``
    pieces whose CRCs are combined (the CRC releases the GIL, so threads add up: measured in
    docs/BENCHMARKS.md, section "Memory tier on one H200"). Buffers are taken in order. ``nice``:
    the threads' niceness (Linux; background work that must not take cores from training).
    ``before(i)``: called before buffer ``i`` is read (e.g. to wait until its bytes have landed)."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    def lower() -> None:
        if nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except (OSError, AttributeError):  # not Linux, or not allowed: full priority
                pass

    def one(i: int, s: int, n: int) -> int:
        if before is not None:
            before(i)
        return crc32(buffers[i][s : s + n])

    parts = [(i, s, min(chunk, len(b) - s)) for i, b in enumerate(buffers) for s in range(0, len(b), chunk)]
    if workers <= 1 or len(parts) <= 1:
        return [one(i, 0, len(b)) for i, b in enumerate(buffers)]
    with ThreadPoolExecutor(max_workers=min(workers, len(parts)), thread_name_prefix="ckpt-crc",
                            initializer=lower) as ex:
        got = list(ex.map(lambda p: one(*p), parts))
    out = [0] * len(buffers)
    for (i, _s, n), c in zip(parts, got, strict=True):
        out[i] = crc32_combine(out[i], c, n)
    return out
