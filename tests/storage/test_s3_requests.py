"""S3 requests on a real moto server (loopback, port 0): how many GETs a load issues and how many
bytes they fetch, and the CRC32 checksums that uploads carry.

The server runs moto's own WSGI app behind a small recording layer (no client is mocked): it logs
every request (method, path, query, Range, checksum headers, body CRC32, reply status and bytes).

moto 5.x stores whatever ``x-amz-checksum-crc32`` a client sends without checking it against the
body (``test_moto_does_not_check_crc32`` pins that down), so S3's own check (refuse the upload
with ``400 BadDigest``) is done by the recording layer when a test turns it on, exactly as S3
documents it; the corruption tests flip a byte of the body as it arrives, like a bad network path.
"""

from __future__ import annotations

import base64
import io
import logging
import re
import threading
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import ckpt
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage.s3 import crc32_b64
from tests.helpers import random_state

MiB = 1024 * 1024
CREDS = {"key": "testing", "secret": "testing"}
FAST = {"retry_base_delay": 0.002, "retry_max_delay": 0.02}
BAD_DIGEST = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>BadDigest</Code>'
              b"<Message>The CRC32 you specified did not match the calculated checksum.</Message>"
              b"<RequestId>ckpt-test</RequestId></Error>")


@dataclass
class Req:
    method: str
    path: str
    query: str
    range: str | None
    headers: dict[str, str]  # x-amz-checksum-* and x-amz-sdk-checksum-algorithm, lower-case names
    body: bytes | None  # PUT/POST bodies as the server got them (after any corruption)
    status: int = 0
    sent: int = 0  # reply body bytes

    @property
    def data(self) -> bool:
        return "/data/" in self.path


@dataclass
class Recorder:
    """WSGI layer in front of moto's app (see the module docstring)."""

    app: Any
    log: list[Req] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    check_crc32: bool = False
    # (request) -> whether to flip one byte of its body before the checksum check and moto see it
    corrupt: Callable[[Req], bool] | None = None

    def reset(self) -> None:
        with self.lock:
            self.log = []
        self.check_crc32, self.corrupt = False, None

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        hdrs = {k[5:].lower().replace("_", "-"): str(v) for k, v in environ.items()
                if k.startswith("HTTP_X_AMZ_") and "CHECKSUM" in k}
        req = Req(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", ""),
                  environ.get("HTTP_RANGE"), hdrs, None)
        if req.method in ("PUT", "POST"):
            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            req.body = body
            if self.corrupt is not None and body and self.corrupt(req):
                flipped = bytearray(body)
                flipped[len(flipped) // 2] ^= 0x01
                req.body = body = bytes(flipped)
            environ["wsgi.input"] = io.BytesIO(body)
        with self.lock:
            self.log.append(req)
        want = hdrs.get("x-amz-checksum-crc32")
        if self.check_crc32 and want is not None and req.body is not None \
                and crc32_b64(zlib.crc32(req.body)) != want:
            req.status, req.sent = 400, len(BAD_DIGEST)
            start_response("400 Bad Request", [("Content-Type", "application/xml"),
                                               ("Content-Length", str(len(BAD_DIGEST)))])
            return [BAD_DIGEST]

        def start(status: str, headers: Any, *exc: Any) -> Any:
            req.status = int(status.split()[0])
            return start_response(status, headers, *exc)

        return self._count(self.app(environ, start), req)

    @staticmethod
    def _count(result: Iterable[bytes], req: Req) -> Iterator[bytes]:
        try:
            for chunk in result:
                req.sent += len(chunk)
                yield chunk
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Recorder]]:
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    try:
        # werkzeug looks the app up on its server for every request: wrap moto's in place
        rec = Recorder(srv._server.app)
        srv._server.app = rec
        host, port = srv.get_host_and_port()
        yield f"http://{host}:{port}", rec
    finally:
        srv.stop()


S3 = tuple[str, dict[str, Any], Recorder, Any]


@pytest.fixture
def s3(server: tuple[str, Recorder], monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """``(s3://fresh-bucket, storage_options, recorder, admin client)``."""
    import botocore.session

    endpoint, rec = server
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    admin = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing")
    name = f"ckpt-req-{uuid.uuid4().hex[:16]}"
    admin.create_bucket(Bucket=name)
    rec.reset()
    yield f"s3://{name}", {**CREDS, "endpoint_url": endpoint, **FAST}, rec, admin
    rec.reset()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def many_small(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` small tensors of mixed dtypes and odd sizes (norms, biases, small matrices, scalars)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        kind = i % 4
        if kind == 0:
            t = torch.randn(8 + i % 13, 4 + i % 7, generator=g)
        elif kind == 1:
            t = torch.randn(3 + i % 29, generator=g).to(torch.bfloat16)
        elif kind == 2:
            t = torch.randint(-1000, 1000, (5 + i % 11,), generator=g, dtype=torch.int64)
        else:
            t = torch.randn((), generator=g)
        out[f"m.{i:04d}"] = t
    return out


def data_gets(rec: Recorder) -> list[Req]:
    return [r for r in rec.log if r.method == "GET" and r.data]


def data_files(admin: Any, url: str) -> list[str]:
    bucket, _, prefix = url[len("s3://"):].partition("/")
    objs = admin.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/data/").get("Contents", [])
    return [o["Key"] for o in objs]


# -- reads -------------------------------------------------------------------------------------------


def test_many_small_tensors_load_in_one_get_per_file(s3: S3) -> None:
    """Hundreds of small whole-tensor reads of one file go out as one ranged GET of it, not one each."""
    bucket, opts, rec, admin = s3
    url = f"{bucket}/small"
    state = many_small(600)
    ckpt.save(state, url, storage_options=opts)
    files = data_files(admin, url)
    assert len(files) == 1
    rec.reset()
    dest = {k: torch.zeros_like(t) for k, t in state.items()}
    ckpt.load(dest, url, storage_options=opts)
    gets = data_gets(rec)
    needed = sum(nbytes(t) for t in state.values())
    fetched = sum(r.sent for r in gets)
    assert 1 <= len(gets) <= len(files), [(r.range, r.sent) for r in gets]
    assert fetched <= 1.1 * needed, (fetched, needed)
    assert all(r.range is not None for r in gets)  # ranged: the header is never fetched again
    assert all(same(dest[k], t) for k, t in state.items())


def test_merged_gets_stay_under_max_read(s3: S3) -> None:
    """Merging is bounded: no GET is longer than ``max_read`` (the per-reader buffer budget)."""
    bucket, opts, rec, _ = s3
    url = f"{bucket}/capped"
    state = many_small(400, seed=1)
    big = {f"w.{i}": torch.randn(50, 512) for i in range(8)}  # 100 KiB each: two fit in one GET
    state.update(big)
    ckpt.save(state, url, storage_options=opts)
    rec.reset()
    cap = 256 * 1024
    dest = {k: torch.zeros_like(t) for k, t in state.items()}
    ckpt.load(dest, url, storage_options=opts, max_read=cap)
    gets = data_gets(rec)
    needed = sum(nbytes(t) for t in state.values())
    assert all(r.sent <= cap for r in gets), max(r.sent for r in gets)
    # packed greedily in file order: a few more GETs than needed / cap, never one per tensor
    assert len(gets) <= -(-needed // cap) + 2, [(r.range, r.sent) for r in gets]
    assert sum(r.sent for r in gets) <= 1.1 * needed
    assert all(same(dest[k], t) for k, t in state.items())


def test_skipped_small_neighbours_are_read_through(s3: S3) -> None:
    """Loading only the weights of (weight, bias) pairs: each bias is a gap under 10% of the next
    weight, so the reads merge across it (within the waste cap) instead of one GET per weight."""
    bucket, opts, rec, _ = s3
    url = f"{bucket}/weights"
    g = torch.Generator().manual_seed(2)
    state = {f"l.{i:03d}.{n}": torch.randn(*s, generator=g) for i in range(200)
             for n, s in (("bias", (32,)), ("weight", (32, 32)))}
    ckpt.save(state, url, storage_options=opts)
    rec.reset()
    dest = {k: torch.zeros_like(t) for k, t in state.items() if k.endswith("weight")}
    ckpt.load(dest, url, storage_options=opts)
    gets = data_gets(rec)
    needed = sum(nbytes(t) for t in dest.values())
    assert len(gets) == 1, len(gets)
    assert sum(r.sent for r in gets) <= 1.1 * needed
    assert all(same(dest[k], state[k]) for k in dest)


def test_row_quarters_respect_the_waste_cap(s3: S3) -> None:
    """A quarter of every small tensor's rows: the three quarters between two needed ranges are 3x
    what either brings, so the 10% cap keeps them apart (one GET per tensor, at most) and the
    bytes fetched stay within 1.1x; ``coalesce_waste=inf`` trades that for a single GET."""
    bucket, opts, rec, _ = s3
    url = f"{bucket}/rows"
    g = torch.Generator().manual_seed(3)
    state = {f"t.{i:03d}": torch.randn(8, 64, generator=g) for i in range(64)}
    ckpt.save(state, url, storage_options=opts)
    needed = sum(nbytes(t) for t in state.values()) // 4
    for extra, most, ratio in [({}, len(state), 1.1), ({"coalesce_waste": float("inf")}, 1, 4.0)]:
        rec.reset()
        dest = {k: ckpt.Shard(torch.zeros(2, 64), (8, 64), (2, 0)) for k in state}
        ckpt.load(dest, url, storage_options={**opts, **extra})
        gets = data_gets(rec)
        assert len(gets) <= most, (extra, len(gets))
        assert sum(r.sent for r in gets) <= ratio * needed, extra
        assert all(same(dest[k].local, t[2:4]) for k, t in state.items())


# -- checksums on uploads -------------------------------------------------------------------------


def test_moto_does_not_check_crc32(s3: S3) -> None:
    """Why the corruption tests below turn on the recorder's check: moto keeps a wrong CRC32.
    If this fails, moto validates checksums itself and the recorder's check can go."""
    bucket, _, _, admin = s3
    body = b"x" * 1000
    wrong = crc32_b64(zlib.crc32(body) ^ 1)
    admin.put_object(Bucket=bucket[len("s3://"):], Key="wrong", Body=body, ChecksumAlgorithm="CRC32",
                     ChecksumCRC32=wrong)
    head = admin.head_object(Bucket=bucket[len("s3://"):], Key="wrong", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32") == wrong


def test_crc32_b64_is_s3s_encoding() -> None:
    # AWS documents CRC32 checksums as base64 of the big-endian value; zlib.crc32(b"hello") = 0x3610a686
    assert crc32_b64(zlib.crc32(b"hello")) == base64.b64encode(bytes.fromhex("3610a686")).decode()
    assert crc32_b64(0) == "AAAAAA=="


def test_every_upload_carries_the_crc32_of_its_body(s3: S3) -> None:
    """Single PUTs, multipart parts (algorithm declared at creation, part checksums listed at
    completion) and the manifest PUT all send ``x-amz-checksum-crc32`` = CRC32 of the body."""
    bucket, opts, rec, admin = s3
    mp = {**opts, "part_size": 5 * MiB}
    big = {"w": torch.randn(3 * MiB + 1234)}  # ~12 MiB: three parts
    small = many_small(50)
    ckpt.save(big, f"{bucket}/big", storage_options=mp)
    ckpt.save(small, f"{bucket}/small", storage_options=mp)
    puts = [r for r in rec.log if r.method == "PUT" and r.body is not None and "/" in r.path.lstrip("/")]
    parts = [r for r in puts if "partNumber=" in r.query]
    singles = [r for r in puts if "partNumber=" not in r.query]
    assert len(parts) == 3 and len(singles) >= 3  # parts of big; small's data file; both manifests
    for r in puts:
        assert r.status == 200
        assert r.headers.get("x-amz-sdk-checksum-algorithm") == "CRC32", r.headers
        assert r.headers.get("x-amz-checksum-crc32") == crc32_b64(zlib.crc32(r.body or b"")), r.path
    creates = [r for r in rec.log if r.method == "POST" and re.search(r"(^|&)uploads(=|&|$)", r.query)]
    assert len(creates) == 1 and creates[0].headers.get("x-amz-checksum-algorithm") == "CRC32"
    completes = [r for r in rec.log if r.method == "POST" and "uploadId=" in r.query]
    assert len(completes) == 1
    listed = re.findall(rb"<ChecksumCRC32>([^<]+)</ChecksumCRC32>", completes[0].body or b"")
    assert [x.decode() for x in listed] == [r.headers["x-amz-checksum-crc32"] for r in
                                           sorted(parts, key=lambda r: int(re.search(r"partNumber=(\d+)", r.query)[1]))]
    # the store keeps them: the manifest's CRC32 is the one of its bytes
    name = bucket[len("s3://"):]
    head = admin.head_object(Bucket=name, Key=f"small/{MANIFEST_NAME}", ChecksumMode="ENABLED")
    body = admin.get_object(Bucket=name, Key=f"small/{MANIFEST_NAME}")["Body"].read()
    assert head["ChecksumCRC32"] == crc32_b64(zlib.crc32(body))


def test_upload_checksums_can_be_turned_off(s3: S3) -> None:
    bucket, opts, rec, _ = s3
    ckpt.save({"w": torch.randn(3 * MiB)}, f"{bucket}/off",
              storage_options={**opts, "part_size": 5 * MiB, "upload_checksums": False})
    posts = [r for r in rec.log if r.method == "POST"]
    assert posts and not any("x-amz-checksum-algorithm" in r.headers for r in posts)
    assert not any(b"ChecksumCRC32" in (r.body or b"") for r in posts)
    with pytest.raises(ckpt.StorageError, match="upload_checksums"):
        ckpt.save({"w": torch.zeros(1)}, f"{bucket}/bad", storage_options={**opts, "upload_checksums": "yes"})


def _state(seed: int, numel: int) -> dict[str, torch.Tensor]:
    return random_state(seed, {"w": (numel,), "b": ((100,), torch.bfloat16)})


def test_a_part_corrupted_on_the_way_is_refused_and_sent_again(
        s3: S3) -> None:
    bucket, opts, rec, _ = s3
    url = f"{bucket}/transient"
    state = _state(4, 3 * MiB)  # ~12 MiB: three 5 MiB parts
    hit: list[Req] = []

    def once(r: Req) -> bool:  # part 2's first try only
        if "partNumber=2" in r.query and not hit:
            hit.append(r)
            return True
        return False

    rec.check_crc32, rec.corrupt = True, once
    ckpt.save(state, url, storage_options={**opts, "part_size": 5 * MiB})
    part2 = [r.status for r in rec.log if r.method == "PUT" and "partNumber=2" in r.query]
    assert part2 == [400, 200]  # refused as BadDigest, then accepted from our intact buffer
    rec.reset()
    dest = {k: torch.zeros_like(t) for k, t in state.items()}
    ckpt.load(dest, url, storage_options=opts)
    assert all(same(dest[k], t) for k, t in state.items())
    assert ckpt.verify(url, deep=True, storage_options=opts).ok


@pytest.mark.parametrize("which", ["part", "put", "manifest"])
def test_a_persistently_corrupted_upload_fails_typed_and_the_committed_checkpoint_stays(
        s3: S3, which: str) -> None:
    """Every try of one upload arrives corrupted (a multipart part, a single-PUT data file, or the
    manifest): the save raises StorageError naming BadDigest after its tries, and the checkpoint
    committed before at the same URL still loads bitwise and verifies."""
    bucket, opts, rec, admin = s3
    url = f"{bucket}/keep"
    so = {**opts, "part_size": 5 * MiB, "retries": 3}
    numel = 3 * MiB if which == "part" else 1000  # multipart, or one PUT per data file
    old = _state(5, numel)
    ckpt.save(old, url, storage_options=so)
    old_files = sorted(data_files(admin, url))
    new = _state(6, numel)
    match = {"part": lambda r: "partNumber=2" in r.query,
             "put": lambda r: r.data and r.method == "PUT" and "partNumber=" not in r.query,
             "manifest": lambda r: r.path.endswith(MANIFEST_NAME)}[which]
    rec.reset()
    rec.check_crc32, rec.corrupt = True, match
    with pytest.raises(ckpt.StorageError, match=r"after 3 tries.*BadDigest") as ei:
        ckpt.save(new, url, storage_options=so, overwrite=True)
    assert f"{url}/" in str(ei.value)
    assert [r.status for r in rec.log if r.body is not None and match(r)] == [400] * 3
    rec.reset()
    dest = {k: torch.zeros_like(t) for k, t in old.items()}
    ckpt.load(dest, url, storage_options=opts)
    assert all(same(dest[k], t) for k, t in old.items())
    assert ckpt.verify(url, deep=True, storage_options=opts).ok
    assert sorted(data_files(admin, url)) == old_files or which == "manifest"
    name = bucket[len("s3://"):]
    assert not admin.list_multipart_uploads(Bucket=name).get("Uploads")  # the failed one was aborted
