"""ckpt.storage.retry: what is retried, how long it waits, and what the final error says."""

from __future__ import annotations

import errno
from typing import Any

import pytest

from ckpt.errors import StorageError
from ckpt.storage.retry import RetryPolicy, describe, is_not_found, is_retryable

botocore_exceptions = pytest.importorskip("botocore.exceptions")
ClientError = botocore_exceptions.ClientError

WHAT = "s3://bucket/ckpt/data/00000.safetensors"


def client_error(code: str, status: int, op: str = "GetObject") -> Exception:
    return ClientError({"Error": {"Code": code, "Message": f"{code} happened"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, op)


def wrapped(err: Exception) -> OSError:
    """What s3fs's translate_boto_error makes of a ClientError: an OSError caused by it."""
    out = OSError(errno.EIO, str(err))
    out.__cause__ = err
    return out


class Flaky:
    """Raises the given errors in turn, then returns "ok"."""

    def __init__(self, *errors: Exception):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def policy(tries: int = 5, **kw: Any) -> tuple[RetryPolicy, list[float]]:
    sleeps: list[float] = []
    return RetryPolicy(tries=tries, base_delay=0.1, max_delay=1.0, sleep=sleeps.append, **kw), sleeps


@pytest.mark.parametrize("err", [
    client_error("SlowDown", 503, "PutObject"),
    client_error("InternalError", 500),
    client_error("ServiceUnavailable", 503),
    client_error("500", 500),
    client_error("RequestTimeout", 400),
    client_error("Throttling", 429),
    wrapped(client_error("SlowDown", 503)),
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
    TimeoutError("timed out"),
    OSError(errno.EPIPE, "broken pipe"),
    botocore_exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
    botocore_exceptions.ConnectionClosedError(endpoint_url="http://127.0.0.1:9"),
    botocore_exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
])
def test_transient_errors_are_retried(err: Exception) -> None:
    assert is_retryable(err)
    p, sleeps = policy()
    fn = Flaky(err, err)
    assert p.call(fn, what=WHAT, op="read") == "ok"
    assert fn.calls == 3 and len(sleeps) == 2


def test_aiohttp_errors_are_retried() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    assert is_retryable(aiohttp.ServerDisconnectedError())
    assert is_retryable(aiohttp.ClientPayloadError("truncated body"))


@pytest.mark.parametrize("err, words", [
    (client_error("NoSuchKey", 404), "does not exist"),
    (wrapped(client_error("NoSuchKey", 404)), "does not exist"),
    (FileNotFoundError("nope"), "does not exist"),
    (client_error("AccessDenied", 403), "access denied"),
    (PermissionError("denied"), "access denied"),
    (client_error("InvalidArgument", 400), "not retried"),
    (ValueError("a bug"), "not retried"),
])
def test_permanent_errors_fail_at_once(err: Exception, words: str) -> None:
    assert not is_retryable(err)
    p, sleeps = policy()
    fn = Flaky(err, err, err)
    with pytest.raises(StorageError, match=words) as ei:
        p.call(fn, what=WHAT, op="read")
    assert fn.calls == 1 and sleeps == []
    assert WHAT in str(ei.value) and ei.value.__cause__ is err


def test_gives_up_after_tries_naming_object_and_last_cause() -> None:
    p, sleeps = policy(tries=4)
    fn = Flaky(client_error("SlowDown", 503), ConnectionResetError("reset 1"), client_error("InternalError", 500),
               ConnectionResetError(errno.ECONNRESET, "the last one"), client_error("SlowDown", 503))
    with pytest.raises(StorageError) as ei:
        p.call(fn, what=WHAT, op="upload")
    msg = str(ei.value)
    assert fn.calls == 4 and len(sleeps) == 3
    assert WHAT in msg and "upload failed after 4 tries" in msg and "the last one" in msg
    assert isinstance(ei.value.__cause__, ConnectionResetError)


def test_not_found_handler() -> None:
    p, _ = policy()
    assert p.call(Flaky(client_error("404", 404, "HeadObject")), what=WHAT, op="head",
                  not_found=lambda e: None) is None
    assert p.call(Flaky(wrapped(client_error("NoSuchKey", 404))), what=WHAT, op="head",
                  not_found=lambda e: -1) == -1
    assert is_not_found(client_error("NoSuchUpload", 404)) and not is_not_found(client_error("SlowDown", 503))


def test_storage_errors_pass_through() -> None:
    p, sleeps = policy()
    err = StorageError("already explained")
    with pytest.raises(StorageError, match="already explained"):
        p.call(Flaky(err), what=WHAT, op="read")
    assert sleeps == []


def test_backoff_is_full_jitter_exponential_and_capped() -> None:
    p = RetryPolicy(tries=10, base_delay=0.1, max_delay=1.0)
    for attempt, cap in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (30, 1.0), (500, 1.0)]:
        draws = [p.backoff(attempt) for _ in range(300)]
        assert all(0 <= d <= cap for d in draws)
        assert max(draws) > cap * 0.7 and min(draws) < cap * 0.3  # spread over [0, cap]


def test_options() -> None:
    opts: dict[str, Any] = {"retries": "3", "retry_base_delay": 0.5, "retry_max_delay": 2, "other": 1}
    p = RetryPolicy.from_options(opts)
    assert (p.tries, p.base_delay, p.max_delay) == (3, 0.5, 2.0)
    assert opts == {"other": 1}
    assert RetryPolicy.from_options({}).tries == 5
    with pytest.raises(ValueError):
        RetryPolicy(tries=0)


def test_describe() -> None:
    d = describe(wrapped(client_error("SlowDown", 503)))
    assert "SlowDown" in d and "503" in d
    assert describe(ConnectionResetError("reset")) == "ConnectionResetError: reset"
