"""Storage backends, chosen from the URL and imported lazily."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckpt.storage.base import Storage, Writer

__all__ = ["Storage", "Writer", "get_storage", "join_url", "read_ranges"]

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}


def join_url(url: str, name: str) -> str:
    """Join a child name to a local path or URL."""
    return f"{url.rstrip('/')}/{name}"


def get_storage(url: str, **storage_options: Any) -> Storage:
    """Return the backend for ``url``: a local path / ``file://``, ``s3://bucket/prefix``, or any fsspec URL.

    ``storage_options`` go to the backend (for S3 see :mod:`ckpt.storage.s3`; for other fsspec
    URLs, to the fsspec filesystem). Every backend is a :class:`Storage` (its capabilities are
    attributes and methods with working defaults there).

    Raises ImportError with an install hint when the backend's extra is missing, StorageError for
    a protocol nobody knows.
    """
    if "://" not in url or url.startswith("file://"):
        from ckpt.storage.local import LocalStorage

        return LocalStorage(url[len("file://"):] if url.startswith("file://") else url)
    protocol = url.split("://", 1)[0]
    if protocol in ("s3", "s3a"):
        from ckpt.storage.s3 import S3Storage  # imports s3fs itself, raising ImportError with the hint

        return S3Storage(url, **storage_options)
    try:
        from ckpt.storage.fsspec_backend import FsspecStorage

        return FsspecStorage(url, **storage_options)
    except ValueError as e:  # fsspec: "Protocol not known", bad options
        from ckpt.errors import StorageError

        raise StorageError(f"{url}: {e}; use a local path, s3://bucket/prefix or another URL fsspec knows") from None
    except ImportError as e:
        extra = _EXTRAS.get(protocol, protocol)
        raise ImportError(f"{protocol}:// needs an extra package: pip install 'ckpt[{extra}]' ({e})") from e


def read_ranges(storage: Storage, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """Bytes of each ``(offset, length)`` range of ``path`` (``storage.read_ranges``: parallel ranged
    reads on object stores, one ``read_into`` per range elsewhere). StorageError if any is short."""
    return list(storage.read_ranges(path, ranges))
