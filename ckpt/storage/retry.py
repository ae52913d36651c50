"""Bounded retries with exponential backoff and full jitter, for object-store requests.

One policy object per storage; :meth:`RetryPolicy.call` runs one request (a zero-argument
callable) and turns its final failure into a :class:`~ckpt.errors.StorageError` that names the
object and the last cause. What is retried: throttling (``SlowDown``, 429/503), other 5xx, request
timeouts and dropped or refused connections. What is not: missing objects, denied access and every
other 4xx, which fail at once.
"""

from __future__ import annotations

import asyncio
import errno
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckpt.errors import StorageError

T = TypeVar("T")

# S3 error codes that mean "try again later", whatever the HTTP status says.
RETRYABLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "TooManyRequestsException", "RequestLimitExceeded", "ProvisionedThroughputExceededException",
    "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException", "InternalError",
    "ServiceUnavailable", "PriorRequestNotComplete", "OperationAborted",
})
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "404", "NotFound"})
RETRYABLE_ERRNOS = frozenset({
    errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.ENETRESET, errno.EAGAIN,
})


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Exception types of the HTTP stack that mean a dropped, refused or timed-out request."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError, socket.timeout, asyncio.TimeoutError]
    try:
        from botocore import exceptions as be
        from botocore.parsers import ResponseParserError

        types += [be.HTTPClientError, be.ConnectionError, be.IncompleteReadError, be.ChecksumError,
                  ResponseParserError]
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:  # pragma: no cover
        pass
    try:
        from fsspec.exceptions import FSTimeoutError

        types.append(FSTimeoutError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


_TRANSPORT: tuple[type[BaseException], ...] | None = None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes/contexts (s3fs wraps botocore's ClientError in an OSError)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def http_error(exc: BaseException) -> tuple[int | None, str | None]:
    """(HTTP status, S3 error code) of the first server reply in ``exc``'s chain, else (None, None)."""
    for e in _chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and ("Error" in resp or "ResponseMetadata" in resp):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = resp.get("Error", {}).get("Code")
            return (int(status) if status is not None else None), (str(code) if code else None)
    return None, None


def is_not_found(exc: BaseException) -> bool:
    """True when ``exc`` says the object (or bucket, or upload) does not exist."""
    status, code = http_error(exc)
    if status is not None or code is not None:
        return status == 404 or code in NOT_FOUND_CODES
    return isinstance(exc, FileNotFoundError)


def is_retryable(exc: BaseException) -> bool:
    """True for throttling, 5xx, timeouts and connection failures; False for every other error."""
    global _TRANSPORT
    status, code = http_error(exc)
    if status is not None or code is not None:
        return code in RETRYABLE_CODES or status in (408, 429) or (status is not None and status >= 500)
    if _TRANSPORT is None:
        _TRANSPORT = _transport_errors()
    for e in _chain(exc):
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        if isinstance(e, _TRANSPORT):
            return True
        if isinstance(e, OSError) and e.errno in RETRYABLE_ERRNOS:
            return True
    return False


def describe(exc: BaseException) -> str:
    """A one-line cause: the error type, the S3 code / HTTP status when there is one, the message."""
    status, code = http_error(exc)
    msg = str(exc).strip() or repr(exc)
    tag = type(exc).__name__
    if code or status:
        tag += f" {code or ''}{' ' if code and status else ''}{f'HTTP {status}' if status else ''}"
    return f"{tag}: {msg}" if msg not in tag else tag


@dataclass
class RetryPolicy:
    """``tries`` attempts per request, sleeping ``uniform(0, min(max_delay, base_delay * 2**i))``.

    Storage options (see :class:`ckpt.storage.s3.S3Storage`): ``retries`` (tries, >= 1),
    ``retry_base_delay`` and ``retry_max_delay`` (seconds).
    """

    tries: int = 5
    base_delay: float = 0.1
    max_delay: float = 10.0
    sleep: Callable[[float], None] = time.sleep
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if int(self.tries) < 1:
            raise ValueError(f"retries must be >= 1 (the number of tries per request), got {self.tries}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("retry delays must be >= 0 seconds")
        self.tries = int(self.tries)

    def backoff(self, attempt: int) -> float:
        """Full-jitter delay before try ``attempt + 1`` (``attempt`` counts from 0)."""
        cap = min(self.max_delay, self.base_delay * (2.0 ** min(attempt, 62)))
        with self._lock:
            return self._rng.uniform(0.0, cap)

    def call(self, fn: Callable[[], T], *, what: str, op: str,
             not_found: Callable[[BaseException], T] | None = None,
             retryable: Callable[[BaseException], bool] = is_retryable) -> T:
        """Run ``fn`` until it succeeds, a non-retryable error occurs, or the tries are spent.

        ``what`` names the object (``s3://bucket/key``) and ``op`` the request, for messages.
        ``not_found``, when given, maps a "does not exist" error to a result instead of raising.
        Raises StorageError with the last cause chained.
        """
        for attempt in range(self.tries):
            try:
                return fn()
            except StorageError:
                raise
            except Exception as e:  # every backend raises its own types; classify, never swallow
                if not_found is not None and is_not_found(e):
                    return not_found(e)
                if not retryable(e):
                    if is_not_found(e):
                        raise StorageError(f"{what}: {op} failed: the object does not exist ({describe(e)})") from e
                    status, code = http_error(e)
                    if status == 403 or code == "AccessDenied" or isinstance(e, PermissionError):
                        raise StorageError(f"{what}: {op} failed: access denied ({describe(e)}); check the "
                                           "credentials and the bucket policy") from e
                    raise StorageError(f"{what}: {op} failed ({describe(e)}); not retried") from e
                if attempt + 1 >= self.tries:
                    raise StorageError(f"{what}: {op} failed after {self.tries} tries; last error: "
                                       f"{describe(e)}") from e
                self.sleep(self.backoff(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> RetryPolicy:
        """Pop ``retries``, ``retry_base_delay``, ``retry_max_delay`` from ``options``."""
        kw: dict[str, Any] = {}
        if "retries" in options:
            kw["tries"] = int(options.pop("retries"))
        if "retry_base_delay" in options:
            kw["base_delay"] = float(options.pop("retry_base_delay"))
        if "retry_max_delay" in options:
            kw["max_delay"] = float(options.pop("retry_max_delay"))
        return cls(**kw)


__all__ = ["RetryPolicy", "is_retryable", "is_not_found", "http_error", "describe"]
