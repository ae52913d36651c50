"""Generic backend for any fsspec URL (``memory://`` in tests, and others fsspec reaches).

Every request goes through the same :class:`~ckpt.storage.retry.RetryPolicy` as S3's (storage options
``retries``, ``retry_base_delay``, ``retry_max_delay``): throttling, 5xx and dropped connections are
retried with backoff, a missing file or a denied request fails at once. Streaming writes are not
retried (their bytes are gone once handed over); whole-object commits are.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ckpt.errors import CheckpointExistsError, StorageError
from ckpt.storage.base import Storage
from ckpt.storage.retry import RetryPolicy

_COMMIT_LOCK = threading.RLock()
T = TypeVar("T")


class FsspecWriter:
    """Buffers into an fsspec file opened for writing; the object appears at ``close``."""

    def __init__(self, fs: Any, full: str):
        self.fs = fs
        self.full = full
        self.size = 0
        try:
            self.f = fs.open(full, "wb")
        except Exception as e:  # fsspec backends raise many types
            raise StorageError(f"{full}: cannot open for writing ({e})") from e

    def write(self, data: memoryview | bytes) -> None:
        try:
            self.f.write(memoryview(data).cast("B"))
        except Exception as e:
            raise StorageError(f"{self.full}: write failed ({e})") from e
        self.size += memoryview(data).nbytes

    def close(self) -> int:
        try:
            self.f.close()
        except Exception as e:
            raise StorageError(f"{self.full}: close failed ({e})") from e
        return self.size

    def abort(self) -> None:
        # Drop the pending upload where the file supports it, then remove whatever is visible
        # under the name (memory:// files exist from open on; like the local backend's unlink).
        try:
            self.f.discard() if hasattr(self.f, "discard") else self.f.close()
        except Exception:
            pass
        try:
            self.fs.rm_file(self.full)
        except Exception:
            pass


def _missing(url: str, path: str) -> Callable[[BaseException], Any]:
    def fail(e: BaseException) -> Any:
        raise StorageError(f"{url}/{path}: file is missing; the checkpoint is incomplete (run `ckpt verify`)") from None
    return fail


class FsspecStorage(Storage):
    """A checkpoint prefix on an fsspec filesystem."""

    coalesce_gap = 4096  # bytes of unneeded data worth reading to merge two ranges into one request

    def __init__(self, url: str, **storage_options: Any):
        import fsspec

        opts = dict(storage_options)
        self.retry = RetryPolicy.from_options(opts)
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **opts)
        self.root = self.root.rstrip("/")

    def _call(self, path: str, op: str, fn: Callable[[], T],
              not_found: Callable[[BaseException], T] | None = None) -> T:
        return self.retry.call(fn, what=f"{self.url}/{path}", op=op, not_found=not_found)

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def open_writer(self, path: str) -> FsspecWriter:
        return FsspecWriter(self.fs, self._full(path))

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        mv = memoryview(buf).cast("B")
        data = self._call(path, f"ranged read at {offset}", lambda: self.fs.cat_file(
            self._full(path), start=offset, end=offset + len(mv)), not_found=_missing(self.url, path))
        if len(data) != len(mv):
            raise StorageError(f"{self.url}/{path}: file ends before byte {offset + len(mv)}; it is truncated")
        mv[:] = data

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Bytes of each ``(offset, length)`` range, through fsspec's (possibly concurrent) ``cat_ranges``."""
        if not ranges:
            return []
        full = self._full(path)
        got = self._call(path, "ranged reads", lambda: self.fs.cat_ranges(
            [full] * len(ranges), [o for o, _ in ranges], [o + n for o, n in ranges], on_error="return"))
        out: list[bytes] = []
        for (offset, length), data in zip(ranges, got, strict=True):
            if isinstance(data, FileNotFoundError):
                raise StorageError(f"{self.url}/{path}: file is missing; the checkpoint is incomplete") from data
            if isinstance(data, BaseException):
                raise StorageError(f"{self.url}/{path}: ranged read at {offset} failed ({data})") from data
            if len(data) != length:
                raise StorageError(f"{self.url}/{path}: file ends before byte {offset + length}; it is truncated")
            out.append(bytes(data))
        return out

    def read_file(self, path: str) -> bytes:
        return bytes(self._call(path, "read", lambda: self.fs.cat_file(self._full(path)),
                                not_found=_missing(self.url, path)))

    def size(self, path: str) -> int | None:
        info = self._call(path, "stat", lambda: self.fs.info(self._full(path)), not_found=lambda e: None)
        return None if info is None else int(info["size"])

    def exists(self, path: str) -> bool:
        return bool(self._call(path, "exists", lambda: self.fs.exists(self._full(path))))

    def list(self, prefix: str = "") -> list[str]:
        base = self._full(prefix)
        found = self._call(prefix, "list", lambda: self.fs.find(base), not_found=lambda e: [])
        n = len(self.root) + 1
        return sorted(p[n:] if p.startswith(self.root + "/") else p for p in found
                      if (p if p.startswith("/") else "/" + p).startswith("/" + self.root.lstrip("/")))

    def delete(self, path: str) -> None:
        self._call(path, "delete", lambda: self.fs.rm_file(self._full(path)), not_found=lambda e: None)

    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """One whole-object write (atomic for readers on object stores: they have no rename).

        ``exclusive``: fsspec has no portable conditional write, so this checks then writes under a
        process-wide lock: exclusive within a process; across processes a race stays possible (the
        S3 and local backends are exclusive everywhere).
        """
        if exclusive:
            with _COMMIT_LOCK:
                if self.exists(path):
                    raise CheckpointExistsError(f"{self.url}/{path}: already exists; nothing of this save was "
                                                "committed (pass overwrite=True to replace it)")
                self.commit(path, data)
            return
        def put() -> None:
            with self.fs.open(self._full(path), "wb") as f:
                f.write(io.BytesIO(data).getbuffer())

        try:
            self._call(path, "commit", put)
        except StorageError as e:
            raise StorageError(f"{e}; the checkpoint is not committed") from e.__cause__

    def close(self) -> None:
        pass


__all__ = ["T", "FsspecWriter", "FsspecStorage"]
