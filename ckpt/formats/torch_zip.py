"""The zip container of ``torch.save`` files, read without reading their data: the central
directory (from the item's last bytes), each record's local header, and the item's first bytes.

Nothing here unpickles (:mod:`ckpt.formats.torch_pickle` does, from the records found here). Every
size and offset read from the file is checked against the item's length before it is used, and the
central directory's size against the :class:`~ckpt.formats.budget.Budget` before it is read; a
short or damaged record is a typed error naming the file.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from ckpt.errors import ForeignFormatError, IntegrityError
from ckpt.formats.budget import Budget

Read = Callable[[int, int], bytes]

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"


def _u(fmt: str, buf: bytes, at: int, what: str) -> tuple[Any, ...]:
    """``struct.unpack_from`` whose short read is the file's fault, typed."""
    try:
        return struct.unpack_from(fmt, buf, at)
    except struct.error:
        raise ForeignFormatError(f"{what}: zip record cut short at byte {at} (truncated or damaged)") from None


QUICK_TAIL = 4096  # a torch.save item's zip directory (a few records) fits in its last 4 KiB


def _directory(read: Read, start: int, length: int, what: str, budget: Budget,
               quick: bool = False) -> dict[str, tuple[int, int, int]] | None:
    """``name -> (local header offset, compressed size, method)`` from the zip's central directory.

    ``quick``: from one read of the item's last QUICK_TAIL bytes only; None when the directory is
    not all in there (the caller then reads it in full).
    """
    tail_len = min(length, QUICK_TAIL if quick else 65536 + 22)
    base = length - tail_len  # item offset of tail[0]
    tail = read(start + base, tail_len)
    at = tail.rfind(_EOCD)
    if quick and at != len(tail) - 22:  # torch writes no zip comment: the end record is last
        return None
    if at < 0 or len(tail) - at < 22:
        raise IntegrityError(f"{what}: bytes [{start}, {start + length}) are not a torch.save zip (no end of "
                             "central directory); the file is truncated, or saved with the legacy "
                             "_use_new_zipfile_serialization=False format (re-save with torch.save's defaults)")
    count, cd_size, cd_offset = _u("<10xHII", tail, at, what)
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF or cd_size == 0xFFFFFFFF:
        loc = at - 20
        if loc < 0 or tail[loc:loc + 4] != _EOCD64_LOCATOR:
            raise IntegrityError(f"{what}: zip64 end record locator missing")
        (eocd64,) = _u("<8xQ", tail, loc, what)
        if eocd64 + 56 > length:
            raise ForeignFormatError(f"{what}: zip64 end record at {eocd64} lies beyond the item's {length} bytes")
        if eocd64 >= base:
            rec = tail[eocd64 - base:eocd64 - base + 56]
        elif quick:
            return None
        else:
            rec = read(start + eocd64, 56)
        if rec[:4] != b"PK\x06\x06":
            raise IntegrityError(f"{what}: zip64 end record missing")
        count, cd_size, cd_offset = _u("<32xQQQ", rec, 0, what)
    if cd_offset + cd_size > length:
        raise IntegrityError(f"{what}: zip directory [{cd_offset}, {cd_offset + cd_size}) lies beyond the "
                             f"{length} bytes of the item (truncated?)")
    budget.check_bytes(cd_size, what, "the zip central directory")
    if cd_offset >= base:
        cd = tail[cd_offset - base:cd_offset - base + cd_size]
    elif quick:
        return None
    else:
        cd = read(start + cd_offset, cd_size)
    out: dict[str, tuple[int, int, int]] = {}
    pos = 0
    for _ in range(count):  # each record is >= 46 bytes of cd: bounded by the directory's size
        if cd[pos:pos + 4] != _CENTRAL:
            raise IntegrityError(f"{what}: damaged zip central directory")
        (method,) = _u("<H", cd, pos + 10, what)
        csize, usize, nlen, xlen, clen = _u("<IIHHH", cd, pos + 20, what)
        (local,) = _u("<I", cd, pos + 42, what)
        name = cd[pos + 46:pos + 46 + nlen].decode("utf-8", "replace")
        extra = cd[pos + 46 + nlen:pos + 46 + nlen + xlen]
        xp = 0
        while xp + 4 <= len(extra):  # zip64 extended information: the fields that overflowed, in order
            tag, size = _u("<HH", extra, xp, what)
            if tag == 1:
                vals = list(_u(f"<{min(size, len(extra) - xp - 4) // 8}Q", extra, xp + 4, what))
                if usize == 0xFFFFFFFF and vals:
                    usize = vals.pop(0)
                if csize == 0xFFFFFFFF and vals:
                    csize = vals.pop(0)
                if local == 0xFFFFFFFF and vals:
                    local = vals.pop(0)
            xp += 4 + size
        out[name] = (local, csize, method)
        pos += 46 + nlen + xlen + clen
    return out


def _entry(read: Read, start: int, length: int, rec: tuple[int, int, int], name: str, what: str,
           head: bytes = b"") -> tuple[int, int] | None:
    """Absolute ``(offset, size)`` of a stored (uncompressed) entry's data: its local header read
    from ``head`` (the item's first bytes) when it lies there, else read (None with ``head`` given:
    the caller does not read it now)."""
    local, size, method = rec
    if method != 0:
        raise IntegrityError(f"{what}: zip entry {name!r} is compressed (method {method}); torch.save stores entries")
    if local + 30 > length:  # checked before the read: the header must lie in this item, not a neighbour's bytes
        raise IntegrityError(f"{what}: zip entry {name!r}: local header at {local} lies beyond the item's {length} "
                             "bytes (truncated or damaged)")
    if head:
        if local + 30 > len(head):
            return None
        hdr = head[local:local + 30]
    else:
        hdr = read(start + local, 30)
    if hdr[:4] != _LOCAL:
        raise IntegrityError(f"{what}: zip entry {name!r}: no local header at {start + local}")
    nlen, xlen = _u("<HH", hdr, 26, what)
    offset = local + 30 + nlen + xlen
    if head and offset > len(head):
        return None
    if offset + size > length:
        raise IntegrityError(f"{what}: zip entry {name!r} [{start + offset}, {start + offset + size}) lies beyond "
                             f"the item's end {start + length} (truncated?)")
    return start + offset, size


HEAD_BYTES = 4096  # a one-tensor torch.save (a DCP item) has every record header before its data in here


def _scan_head(read: Read, start: int, length: int) -> bytes | None:
    """The item's first HEAD_BYTES (one read, at the item's start: cold, the readahead it starts also
    brings the tensor's bytes), where a small torch.save has the local headers of its records; None
    when they cannot be there."""
    buf = read(start, min(length, HEAD_BYTES))
    return buf if buf[:4] == _LOCAL else None


__all__ = ["Read", "QUICK_TAIL", "HEAD_BYTES"]
