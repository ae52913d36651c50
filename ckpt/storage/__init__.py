"""Storage backends, chosen from the URL and imported lazily.

A backend of ckpt's own for ``<protocol>://`` is one module, ``ckpt/storage/<protocol>.py``, that
names its :class:`Storage` subclass in ``BACKEND`` (``s3.py``: ``BACKEND = S3Storage``); nothing
else lists it. Any other protocol goes to fsspec.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
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
    native = _native_backend(protocol)  # imports s3fs & co itself, raising ImportError with the hint
    if native is not None:
        return native(url, **storage_options)
    try:
        from ckpt.storage.fsspec_backend import FsspecStorage

        return FsspecStorage(url, **storage_options)
    except ValueError as e:  # fsspec: "Protocol not known", bad options
        from ckpt.errors import StorageError

        raise StorageError(f"{url}: {e}; use a local path, s3://bucket/prefix or another URL fsspec knows") from None
    except ImportError as e:
        extra = _EXTRAS.get(protocol, protocol)
        raise ImportError(f"{protocol}:// needs an extra package: pip install 'ckpt[{extra}]' ({e})") from e


_ALIASES = {"s3a": "s3"}


def _native_backend(protocol: str) -> Callable[..., Storage] | None:
    """The ``BACKEND`` of ``ckpt.storage.<protocol>`` when that module exists and names one."""
    name = _ALIASES.get(protocol, protocol)
    if not name.isidentifier() or name.startswith("_") or not name.islower():
        return None
    try:
        module = importlib.import_module(f"ckpt.storage.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"ckpt.storage.{name}":
            raise  # the backend exists but lacks a package of its own: say which
        return None
    backend = getattr(module, "BACKEND", None)
    return backend if isinstance(backend, type) and issubclass(backend, Storage) else None


def read_ranges(storage: Storage, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """Bytes of each ``(offset, length)`` range of ``path`` (``storage.read_ranges``: parallel ranged
    reads on object stores, one ``read_into`` per range elsewhere). StorageError if any is short."""
    return list(storage.read_ranges(path, ranges))
