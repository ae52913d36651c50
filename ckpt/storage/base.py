"""The storage base class: the one boundary between checkpoint logic and bytes at rest.

A ``Storage`` is rooted at one checkpoint directory (or prefix); every path it takes is relative
to that root and has already been validated by the manifest layer. Call order for a save:
``open_writer`` for each data file (``write`` ..., ``close``), then ``commit`` of the manifest.

A backend implements the required methods (``open_writer``, ``read_into``, ``read_file``, ``size``,
``list``, ``delete``, ``commit``) and inherits working defaults for the rest, as fsspec's
``AbstractFileSystem`` gives ``cat_ranges`` over ``cat_file``: callers never probe a backend with
``hasattr``/``getattr``; a fast backend overrides a default (``readv`` with ``preadv`` locally,
``read_ranges`` with parallel ranged GETs on S3) or flips a capability attribute.
"""

from __future__ import annotations

import builtins
import mmap
from collections.abc import Sequence
from typing import Protocol


class Writer(Protocol):
    """A sequential writer of one file; ``close`` makes the bytes durable, ``abort`` discards them."""

    def write(self, data: memoryview | bytes) -> None: ...

    def close(self) -> int:
        """Flush, make durable, and return the file's size in bytes."""
        ...

    def abort(self) -> None: ...


class Storage:
    """Backend base class. Policies (retention, latest, retries) live above it, not in it.

    Capability attributes (class-level defaults; a backend overrides what it does better):

    - ``coalesce_gap``: bytes of unneeded data worth reading to merge two ranges into one request;
    - ``coalesce_waste``: at most this fraction of a merged read may be unneeded (None: no bound);
    - ``merge_direct``: small whole-tensor reads may share one request with their neighbours;
    - ``maps_files``: :meth:`map_range` can hand out memory maps (local files);
    - ``local_dir``: the local directory the storage's root is, or None (object stores, fsspec).
      Only a storage that *is* a local directory sets it: fsspec's own ``root`` is a path inside
      its filesystem and must never be taken for a local one.
    """

    url: str = ""
    coalesce_gap: int = 4096
    coalesce_waste: float | None = None
    merge_direct: bool = False
    maps_files: bool = False
    local_dir: str | None = None

    # -- required -----------------------------------------------------------------------------

    def open_writer(self, path: str) -> Writer:
        """A writer of a new file at ``path`` (parent directories made as needed)."""
        raise NotImplementedError(f"{type(self).__name__} cannot write files")

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``[offset, offset + len(buf))`` of ``path``; StorageError if short."""
        raise NotImplementedError(f"{type(self).__name__} cannot read byte ranges")

    def read_file(self, path: str) -> bytes:
        """The whole file at ``path``; StorageError when it is missing."""
        raise NotImplementedError(f"{type(self).__name__} cannot read files")

    def size(self, path: str) -> int | None:
        """Size in bytes, or None when the file does not exist."""
        raise NotImplementedError(f"{type(self).__name__} cannot stat files")

    def list(self, prefix: str = "") -> list[str]:
        """Relative paths of all files under ``prefix`` (recursive)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list files")

    def delete(self, path: str) -> None:
        """Remove the file at ``path``; a missing file is not an error."""
        raise NotImplementedError(f"{type(self).__name__} cannot delete files")

    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write ``data`` to ``path`` atomically: readers see the old content or all of the new.

        ``exclusive``: create only; CheckpointExistsError when ``path`` exists (no-clobber rename
        locally, a conditional PUT on S3, a check-then-write elsewhere).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot commit files")

    # -- defaults -----------------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        """True when a file is at ``path``."""
        return self.size(path) is not None

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> builtins.list[bytes]:
        """Bytes of each ``(offset, length)`` range of ``path``; one :meth:`read_into` each by
        default, fetched in parallel by object stores. StorageError if any is short."""
        out: builtins.list[bytes] = []
        for offset, length in ranges:
            buf = bytearray(length)
            self.read_into(path, offset, memoryview(buf))
            out.append(bytes(buf))
        return out

    def readv(self, path: str, ranges: Sequence[tuple[int, int]], buf: memoryview, base: int) -> None:
        """Fill ``buf[off - base : off - base + n]`` for each ``(off, n)`` of ``path`` (several runs
        of one file into one buffer). By default through :meth:`read_ranges`, so a backend with
        parallel ranged reads gets them here too."""
        mv = memoryview(buf).cast("B")
        data: bytes
        for (off, n), data in zip(ranges, self.read_ranges(path, ranges), strict=True):
            mv[off - base : off - base + n] = data

    def map_range(self, path: str, offset: int, length: int) -> tuple[mmap.mmap, int] | None:
        """A private memory map of bytes ``[offset, offset + length)``: ``(map, index)``, or None
        where the backend cannot map (the caller reads instead). Only when ``maps_files``."""
        return None

    def sync_dir(self, path: str = "") -> None:
        """Make the names created in directory ``path`` durable (a no-op where a commit already is)."""

    def close(self) -> None:
        """Release descriptors and connections; the storage may be used again afterwards."""


__all__ = ["Storage", "Writer"]
