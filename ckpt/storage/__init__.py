"""Storage backends, chosen from the URL and imported lazily."""

from __future__ import annotations

from typing import Any

from ckpt.storage.base import Storage, Writer

__all__ = ["Storage", "Writer", "get_storage", "join_url"]

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}


def join_url(url: str, name: str) -> str:
    """Join a child name to a local path or URL."""
    return f"{url.rstrip('/')}/{name}"


def get_storage(url: str, **storage_options: Any) -> Storage:
    """Return the backend for ``url``: a local path / ``file://`` or any fsspec URL.

    Raises ImportError with an install hint when the backend's extra is missing.
    """
    if "://" not in url or url.startswith("file://"):
        from ckpt.storage.local import LocalStorage

        return LocalStorage(url[len("file://"):] if url.startswith("file://") else url)
    protocol = url.split("://", 1)[0]
    try:
        from ckpt.storage.fsspec_backend import FsspecStorage

        return FsspecStorage(url, **storage_options)
    except ImportError as e:
        extra = _EXTRAS.get(protocol, protocol)
        raise ImportError(f"{protocol}:// needs an extra package: pip install 'ckpt[{extra}]' ({e})") from e
