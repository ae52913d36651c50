"""CRC32 (the zlib / IEEE polynomial) with the fastest implementation available.

ISA-L's crc32 gives the same values as ``zlib.crc32`` at ~4-5x the speed on this machine (28 vs
6.5 GB/s), which keeps checksumming off the critical path of a save even when every core is busy
(docs/BENCHMARKS.md "Checksum cost"). ``isal`` is a dependency; where its wheel is missing we fall
back to zlib and the values stay the same.
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
