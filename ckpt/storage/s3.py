"""S3 backend over s3fs/aiobotocore: multipart uploads, ranged GETs, our own bounded retries.

Chosen by :func:`ckpt.storage.get_storage` for ``s3://bucket/prefix`` (and ``s3a://``). Every
request goes through :class:`ckpt.storage.retry.RetryPolicy`; the retries of s3fs and botocore
are turned off so that one policy, with one budget, decides.

Storage options (all optional; the rest go to ``s3fs.S3FileSystem``, e.g. ``key``, ``secret``,
``token``, ``anon``, ``client_kwargs``, ``config_kwargs``, ``s3_additional_kwargs``):

- ``endpoint_url``: defaults to ``$AWS_ENDPOINT_URL_S3`` or ``$AWS_ENDPOINT_URL``;
- ``region``: defaults to ``$AWS_REGION`` when ``$AWS_DEFAULT_REGION`` is not set;
- ``retries`` (tries per request, default 5), ``retry_base_delay`` (s, default 0.1),
  ``retry_max_delay`` (s, default 10);
- ``part_size`` (bytes per multipart part, default 16 MiB, at least 5 MiB; it doubles every
  1000 parts so that any object fits S3's 10000-part limit);
- ``upload_workers`` (parts in flight per file, default 4), ``read_workers`` (parallel ranged
  GETs in :meth:`S3Storage.read_ranges`, default 8);
- ``coalesce_gap`` (bytes, default 1 MiB): ranges of a file closer than this are read with one
  GET (the load planner reads this attribute); 0 reads only the needed bytes;
- ``connect_timeout`` / ``read_timeout`` (s, per request, default 5 / 30);
- ``upload_checksums`` (default True): every upload (single PUT, multipart part, manifest PUT)
  carries the CRC32 of its body (``x-amz-checksum-crc32``) and a multipart completion lists the
  part checksums, so S3 itself refuses a body that changed on the way (``BadDigest``, retried:
  the body is sent again from our buffer). False for S3-compatible stores that reject these headers.

Credentials come from the options or botocore's usual chain (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, profiles, instance roles).
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from ckpt._checksum import crc32
from ckpt.errors import CheckpointExistsError, StorageError
from ckpt.storage.base import Storage
from ckpt.storage.retry import RetryPolicy, describe, http_error, is_not_found, is_retryable

T = TypeVar("T")

MiB = 1024 * 1024
MIN_PART = 5 * MiB
MAX_PART = 5 * 1024 * MiB
DEFAULT_PART = 16 * MiB
DEFAULT_COALESCE_GAP = 1 * MiB
MAX_PARTS = 10_000
INSTALL_HINT = "s3:// URLs need s3fs: pip install 'ckpt[s3]'"


def crc32_b64(crc: int) -> str:
    """S3's encoding of a CRC32 checksum (``x-amz-checksum-crc32``): base64 of the 4 big-endian
    bytes of the same value as ``zlib.crc32`` (which ``ckpt._checksum.crc32`` computes)."""
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def upload_retryable(exc: BaseException) -> bool:
    """:func:`is_retryable`, plus S3's ``BadDigest``: the store got a body whose checksum is not the
    one we sent, i.e. bytes changed on the way; the next try sends our buffer again. If our buffer
    itself changed after it was hashed, every try fails and the tries run out (a StorageError)."""
    return is_retryable(exc) or http_error(exc)[1] == "BadDigest"


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ``("bucket", "some/prefix")``."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("s3", "s3a"):
        raise StorageError(f"{url}: not an s3:// URL")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StorageError(f"{url}: no bucket in the URL; use s3://bucket/prefix")
    return bucket, prefix.strip("/")


class S3Writer:
    """Uploads one object: a single PUT when it fits in one part, else a multipart upload.

    Parts go up in a small thread pool while the caller keeps writing; at most
    ``upload_workers + 1`` parts are buffered or in flight, so memory stays bounded.
    ``close`` completes the upload (the object appears atomically); ``abort`` aborts it.
    """

    def __init__(self, storage: S3Storage, key: str):
        self.s = storage
        self.key = key
        self.what = storage.what(key)
        self.size = 0
        self.buf = bytearray()
        self.upload_id: str | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.futures: list[Future[dict[str, Any]]] = []
        self.nparts = 0
        self.crc = 0  # CRC32 of ``buf``, hashed as the caller's bytes arrive (before any copy is sent)
        self.done = False

    def _threshold(self) -> int:
        return min(MAX_PART, self.s.part_size * 2 ** (self.nparts // 1000))

    def write(self, data: memoryview | bytes) -> None:
        if self.done:
            raise StorageError(f"{self.what}: write after close or abort")
        self._raise_failed()
        mv = memoryview(data).cast("B")
        self.size += len(mv)
        while len(mv):
            room = self._threshold() - len(self.buf)
            self.buf += mv[:room]
            self.crc = crc32(mv[:room], self.crc)
            mv = mv[room:]
            if len(self.buf) >= self._threshold():
                self._ship(*self._take())

    def _take(self) -> tuple[bytearray, int]:
        """The buffered part and its CRC32; the buffer starts over."""
        part, crc = self.buf, self.crc
        self.buf, self.crc = bytearray(), 0
        return part, crc

    def _raise_failed(self) -> None:
        for f in self.futures:
            if f.done() and not f.cancelled():
                exc = f.exception()
                if exc is not None:
                    raise exc

    def _ship(self, part: bytearray, crc: int) -> None:
        if self.nparts >= MAX_PARTS:
            raise StorageError(f"{self.what}: more than {MAX_PARTS} parts; raise part_size")
        if self.upload_id is None:
            # the algorithm is declared up front: S3 then keeps each part's CRC32 and checks the
            # list that the completion sends against them
            algo: dict[str, Any] = {"ChecksumAlgorithm": "CRC32"} if self.s.upload_checksums else {}
            out = self.s.request(self.key, "create multipart upload", "create_multipart_upload",
                                 Bucket=self.s.bucket, Key=self.key, **algo)
            self.upload_id = str(out["UploadId"])
            self.pool = ThreadPoolExecutor(max_workers=self.s.upload_workers, thread_name_prefix="ckpt-s3-up")
        assert self.pool is not None
        while sum(not f.done() for f in self.futures) > self.s.upload_workers:
            wait([f for f in self.futures if not f.done()], return_when=FIRST_COMPLETED)
        self._raise_failed()
        self.nparts += 1
        self.futures.append(self.pool.submit(self._upload_part, self.nparts, part, crc))

    def _upload_part(self, number: int, body: bytearray, crc: int) -> dict[str, Any]:
        sums = self.s.checksum_args(crc)
        out = self.s.request(self.key, f"upload of part {number}", "upload_part", retryable=upload_retryable,
                             Bucket=self.s.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number,
                             Body=body, **sums)
        part = {"PartNumber": number, "ETag": out["ETag"]}
        if sums:  # ours, not the reply's echo: completion then checks what S3 kept against what we hashed
            part["ChecksumCRC32"] = sums["ChecksumCRC32"]
        return part

    def close(self) -> int:
        if self.done:
            return self.size
        try:
            self._raise_failed()
            if self.upload_id is None:
                body, crc = self._take()
                self.s.request(self.key, "upload", "put_object", retryable=upload_retryable, Bucket=self.s.bucket,
                               Key=self.key, Body=body, **self.s.checksum_args(crc))
            else:
                if self.buf:
                    self._ship(*self._take())
                parts = [f.result() for f in self.futures]
                self._complete(parts)
        except BaseException:
            self.abort()
            raise
        self.done = True
        self._shutdown()
        return self.size

    def _complete(self, parts: list[dict[str, Any]]) -> None:
        tries = [0]

        async def complete() -> Any:
            tries[0] += 1
            try:
                return await self.s.call(
                    "complete_multipart_upload", Bucket=self.s.bucket, Key=self.key, UploadId=self.upload_id,
                    MultipartUpload={"Parts": parts})
            except Exception as e:
                # A retried complete whose first try did succeed (the reply was lost) finds the
                # upload gone; the object is there with our size, so that try counts.
                if tries[0] > 1 and is_not_found(e):
                    head = await self.s.call("head_object", Bucket=self.s.bucket, Key=self.key)
                    if int(head["ContentLength"]) == self.size:
                        return head
                raise

        self.s.run(self.key, "complete multipart upload", complete)

    def abort(self) -> None:
        self.done = True
        self.buf, self.crc = bytearray(), 0
        for f in self.futures:
            f.cancel()
        self._shutdown()
        if self.upload_id is not None:
            upload_id, self.upload_id = self.upload_id, None
            try:
                self.s.request(self.key, "abort multipart upload", "abort_multipart_upload",
                               not_found=lambda e: None, Bucket=self.s.bucket, Key=self.key, UploadId=upload_id)
            except StorageError:
                pass  # best effort: a lifecycle rule for incomplete uploads cleans what is left

    def _shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


class S3Storage(Storage):
    """A checkpoint prefix in an S3 bucket (AWS or any S3-compatible endpoint)."""

    # Unneeded bytes worth reading to merge two ranges into one GET. A GET costs a round trip and a
    # request fee; 1 MiB at S3's per-connection throughput costs about the same time as the round
    # trip and nothing extra (see docs/BENCHMARKS.md, section "S3 (moto on loopback)"), so a
    # column-sharded load does a few large GETs instead of one GET per row. Storage option
    # ``coalesce_gap`` (0: fetch only the needed bytes).
    coalesce_gap = DEFAULT_COALESCE_GAP
    # ...but never more unneeded bytes than 10% of what a merge joins (bytes requested <= ~1.1x
    # needed), and small whole-tensor reads share GETs with their neighbours.
    coalesce_waste = 0.1
    merge_direct = True

    def __init__(self, url: str, **storage_options: Any):
        try:
            import s3fs
        except ImportError as e:
            raise ImportError(f"{INSTALL_HINT} ({e})") from e
        self.bucket, self.prefix = split_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        opts = dict(storage_options)
        try:
            self.retry = RetryPolicy.from_options(opts)
            self.part_size = int(opts.pop("part_size", DEFAULT_PART))
            self.upload_workers = max(1, int(opts.pop("upload_workers", 4)))
            self.read_workers = max(1, int(opts.pop("read_workers", 8)))
            self.coalesce_gap = max(0, int(opts.pop("coalesce_gap", DEFAULT_COALESCE_GAP)))
            self.coalesce_waste = float(opts.pop("coalesce_waste", 0.1))
        except (TypeError, ValueError) as e:
            raise StorageError(f"{self.url}: invalid storage option ({e})") from e
        self.upload_checksums = opts.pop("upload_checksums", True)
        if not isinstance(self.upload_checksums, bool):
            raise StorageError(f"{self.url}: invalid storage option upload_checksums={self.upload_checksums!r}; "
                               "expected true or false")
        if not MIN_PART <= self.part_size <= MAX_PART:
            raise StorageError(f"{self.url}: part_size={self.part_size} is outside S3's limits "
                               f"[{MIN_PART}, {MAX_PART}] bytes")
        client_kwargs = dict(opts.pop("client_kwargs", None) or {})
        config_kwargs = dict(opts.pop("config_kwargs", None) or {})
        region = opts.pop("region", None) or opts.pop("region_name", None)
        if region is None and "region_name" not in client_kwargs and not os.environ.get("AWS_DEFAULT_REGION"):
            region = os.environ.get("AWS_REGION") or None
        if region:
            client_kwargs.setdefault("region_name", region)
        if not opts.get("endpoint_url") and "endpoint_url" not in client_kwargs:
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                opts["endpoint_url"] = endpoint
        config_kwargs.setdefault("connect_timeout", float(opts.pop("connect_timeout", 5)))
        config_kwargs.setdefault("read_timeout", float(opts.pop("read_timeout", 30)))
        config_kwargs.setdefault("retries", {"total_max_attempts": 1})  # ours count, not botocore's
        try:
            # fsspec caches the instance per option set (and per process): its client and connection
            # pool are reused by the next save/load with the same options.
            self.fs = s3fs.S3FileSystem(client_kwargs=client_kwargs, config_kwargs=config_kwargs, **opts)
        except Exception as e:
            raise StorageError(f"{self.url}: cannot configure the S3 client ({e})") from e
        # s3fs's own retry loop: one try, ours wraps it. The instance is ours alone in practice: its
        # cache key includes config_kwargs["retries"], which no plain s3fs user sets this way.
        self.fs.retries = 1
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------------

    def key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix and path else (self.prefix or path)

    def what(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    async def call(self, method: str, **kwargs: Any) -> Any:
        """One try of one S3 API call on s3fs's client, without s3fs's retry loop (which sleeps
        even on its last try and turns botocore's errors into OSErrors); runs on s3fs's loop."""
        await self.fs.set_session()
        client = await self.fs.get_s3(kwargs.get("Bucket"))
        fn = getattr(client, method)
        helper = getattr(self.fs, "_get_s3_method_kwargs", None)  # s3_additional_kwargs, requester pays
        return await fn(**(helper(fn, **kwargs) if helper is not None else kwargs))

    def run(self, key: str, op: str, coro: Callable[[], Awaitable[T]],
            not_found: Callable[[BaseException], T] | None = None,
            retryable: Callable[[BaseException], bool] = is_retryable) -> T:
        """Run the coroutine factory ``coro`` on s3fs's loop under the retry policy."""
        from fsspec.asyn import sync

        return self.retry.call(lambda: sync(self.fs.loop, coro), what=self.what(key), op=op, not_found=not_found,
                               retryable=retryable)

    def request(self, key: str, op: str, method: str, not_found: Callable[[BaseException], Any] | None = None,
                retryable: Callable[[BaseException], bool] = is_retryable, **kwargs: Any) -> Any:
        """One S3 API call (``method`` of the aiobotocore client), retried."""
        return self.run(key, op, lambda: self.call(method, **kwargs), not_found=not_found, retryable=retryable)

    def checksum_args(self, crc: int) -> dict[str, Any]:
        """Arguments of an upload whose body has CRC32 ``crc``: S3 recomputes it and refuses the
        upload on a mismatch. Given explicitly, so that botocore neither hashes the body again nor
        depends on its version or ``request_checksum_calculation`` to send one."""
        if not self.upload_checksums:
            return {}
        return {"ChecksumAlgorithm": "CRC32", "ChecksumCRC32": crc32_b64(crc)}

    def _get(self, key: str, start: int | None = None, length: int | None = None) -> bytes:
        head = {} if start is None else {"Range": f"bytes={start}-{start + (length or 0) - 1}"}
        what = self.what(key)

        async def get() -> bytes:
            try:
                resp = await self.call("get_object", Bucket=self.bucket, Key=key, **head)
            except Exception as e:
                status, code = http_error(e)
                if status == 416 or code == "InvalidRange":
                    raise StorageError(f"{what}: file ends before byte {(start or 0) + (length or 0)} "
                                       f"({describe(e)}); the file is truncated") from e
                raise
            body = resp["Body"]
            try:
                return bytes(await body.read())
            finally:
                body.close()

        op = "read" if start is None else f"ranged read of {length} bytes at {start}"
        return self.run(key, op, get)

    # -- the Storage protocol ---------------------------------------------------------------------

    def open_writer(self, path: str) -> S3Writer:
        return S3Writer(self, self.key(path))

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        mv = memoryview(buf).cast("B")
        if not len(mv):
            return
        data = self._get(self.key(path), offset, len(mv))
        if len(data) != len(mv):
            raise StorageError(f"{self.what(self.key(path))}: file ends before byte {offset + len(mv)} "
                               f"(read {len(data)} of {len(mv)} bytes at offset {offset}); the file is truncated")
        mv[:] = data

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Bytes of each ``(offset, length)`` range of ``path``, fetched in parallel (bounded pool)."""
        key = self.key(path)

        def one(r: tuple[int, int]) -> bytes:
            offset, length = r
            if length <= 0:
                return b""
            data = self._get(key, offset, length)
            if len(data) != length:
                raise StorageError(f"{self.what(key)}: file ends before byte {offset + length}; it is truncated")
            return data

        if len(ranges) <= 1:
            return [one(r) for r in ranges]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.read_workers, thread_name_prefix="ckpt-s3-get")
            pool = self._pool
        return list(pool.map(one, ranges))

    def read_file(self, path: str) -> bytes:
        return self._get(self.key(path))

    def size(self, path: str) -> int | None:
        out = self.request(self.key(path), "head", "head_object", not_found=lambda e: None,
                           Bucket=self.bucket, Key=self.key(path))
        return None if out is None else int(out["ContentLength"])

    def exists(self, path: str) -> bool:
        return self.size(path) is not None

    def list(self, prefix: str = "") -> list[str]:
        base = self.key(prefix.strip("/"))
        base = f"{base}/" if base else ""
        out: list[str] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base}
            if token:
                kw["ContinuationToken"] = token
            page = self.request(base, "list", "list_objects_v2", **kw)
            root = f"{self.prefix}/" if self.prefix else ""
            out += [o["Key"][len(root):] for o in page.get("Contents", []) if not o["Key"].endswith("/")]
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return sorted(out)

    def delete(self, path: str) -> None:
        self.request(self.key(path), "delete", "delete_object", not_found=lambda e: None,
                     Bucket=self.bucket, Key=self.key(path))

    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """One whole-object PUT (atomic for readers; object stores have no rename).

        ``exclusive``: a conditional PUT (``If-None-Match: *``); when the object exists the store
        answers 412 and this raises CheckpointExistsError, unless the object holds exactly ``data``
        (our own earlier try of this PUT succeeded and its reply was lost). A store that does not
        implement conditional writes (501) gets a check-then-PUT, which a concurrent writer can race.
        """
        key = self.key(path)
        body = bytes(data)
        cond: dict[str, Any] = {"IfNoneMatch": "*"} if exclusive else {}
        try:
            self.request(key, "commit (PUT)", "put_object", retryable=upload_retryable, Bucket=self.bucket, Key=key,
                         Body=body, **cond, **self.checksum_args(crc32(body)))
        except StorageError as e:
            status, code = http_error(e.__cause__ or e)
            if exclusive and (status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict")):
                if self.size(path) == len(data) and self.read_file(path) == bytes(data):
                    return
                raise CheckpointExistsError(f"{self.what(key)}: another writer committed here first; nothing of "
                                            "this save was committed (pass overwrite=True to replace it)") from None
            if exclusive and (status == 501 or code == "NotImplemented"):
                if self.size(path) is not None:
                    raise CheckpointExistsError(f"{self.what(key)}: already exists; nothing of this save was "
                                                "committed (pass overwrite=True to replace it)") from None
                self.commit(path, data)
                return
            raise StorageError(f"{e}; the checkpoint is not committed") from e.__cause__

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


BACKEND = S3Storage  # ckpt.storage.get_storage finds the backend of s3:// (and s3a://) here

__all__ = ["S3Storage", "S3Writer", "split_url", "crc32_b64", "INSTALL_HINT", "BACKEND"]
