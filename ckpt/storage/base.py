"""The storage protocol: the one boundary between checkpoint logic and bytes at rest.

A ``Storage`` is rooted at one checkpoint directory (or prefix); every path it takes is relative
to that root and has already been validated by the manifest layer. Call order for a save:
``open_writer`` for each data file (``write`` ..., ``close``), then ``commit`` of the manifest.
"""

from __future__ import annotations

from typing import Protocol


class Writer(Protocol):
    """A sequential writer of one file; ``close`` makes the bytes durable, ``abort`` discards them."""

    def write(self, data: memoryview | bytes) -> None: ...

    def close(self) -> int:
        """Flush, make durable, and return the file's size in bytes."""
        ...

    def abort(self) -> None: ...


class Storage(Protocol):
    """Backend interface. Policies (retention, latest, retries) live above it, not in it."""

    url: str

    def open_writer(self, path: str) -> Writer: ...

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``[offset, offset + len(buf))`` of ``path``; StorageError if short."""
        ...

    def read_file(self, path: str) -> bytes: ...

    def size(self, path: str) -> int | None:
        """Size in bytes, or None when the file does not exist."""
        ...

    def exists(self, path: str) -> bool: ...

    def list(self, prefix: str = "") -> list[str]:
        """Relative paths of all files under ``prefix`` (recursive)."""
        ...

    def delete(self, path: str) -> None: ...

    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write ``data`` to ``path`` atomically: readers see the old content or all of the new.

        ``exclusive``: create only; CheckpointExistsError when ``path`` exists (no-clobber rename
        locally, a conditional PUT on S3, a check-then-write elsewhere).
        """
        ...

    def close(self) -> None: ...

    # Optional, used when present (object stores):
    #   coalesce_gap: int - bytes of unneeded data worth reading to merge two ranges (local 4096, S3 1 MiB)
    #   read_ranges(path, [(offset, length), ...]) -> list[bytes] - ranges fetched in parallel
    #   sync_dir(path) - make names created in a directory durable (local)
    #   readv(path, [(offset, length), ...], buf, base) - several ranges into one buffer (local)
    #   map_range(path, offset, length) -> (mmap, index) | None - a private map of a byte range,
    #       copied from directly by ckpt.load (local; looked up on the class, see ckpt.io._mapper)
