"""S3 under faults: throttling, 5xx, reset connections (a loopback proxy in front of moto), a dead
endpoint, and multipart uploads."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from faultproxy import FaultProxy

import ckpt
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage import get_storage

MiB = 1024 * 1024
FAST = {"retry_base_delay": 0.002, "retry_max_delay": 0.02}


@pytest.fixture
def proxies(moto_endpoint: str) -> Iterator[list[FaultProxy]]:
    made: list[FaultProxy] = []
    yield made
    for p in made:
        p.close()


def through(proxies: list[FaultProxy], moto_endpoint: str, opts: dict[str, Any], **kw: Any
            ) -> tuple[FaultProxy, dict[str, Any]]:
    p = FaultProxy(moto_endpoint, **kw)
    proxies.append(p)
    return p, {**opts, "endpoint_url": p.url}


def state_of(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers": {f"l{i}": {"w": torch.randn(96, 64, generator=g), "b": torch.randn(64, generator=g)}
                   for i in range(3)},
        "emb": torch.randn(200, 64, generator=g).to(torch.bfloat16),
        "step": seed,
    }


def empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"layers": {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in state["layers"].items()},
            "emb": torch.empty_like(state["emb"]), "step": 0}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


@pytest.mark.slow
def test_save_and_load_survive_20_percent_faults(s3_bucket: tuple[str, dict[str, Any]], moto_endpoint: str,
                                                 proxies: list[FaultProxy]) -> None:
    bucket, opts = s3_bucket
    proxy, faulty = through(proxies, moto_endpoint, opts, rate=0.2, seed=1234)
    faulty = {**faulty, **FAST, "retries": 10}
    url = f"{bucket}/faulty"
    state = state_of(5)
    ckpt.save(state, url, storage_options=faulty)
    out = empty_like(state)
    got = ckpt.load(out, url, storage_options=faulty, workers=4)
    assert got["step"] == 5
    assert same(out["emb"], state["emb"])
    for k, v in state["layers"].items():
        assert same(out["layers"][k]["w"], v["w"]) and same(out["layers"][k]["b"], v["b"])
    # a resharded load with coalesce_gap=0 issues one small ranged GET per row (~300): each one
    # must survive the faults too
    half: dict[str, Any] = {"layers": {k: {"w": ckpt.Shard(torch.empty(96, 32), global_shape=(96, 64), offsets=(0, 32)),
                           "b": torch.empty(64)} for k in state["layers"]},
            "emb": ckpt.FlatShard(torch.empty(999, dtype=torch.bfloat16), global_shape=(200, 64), start=4321),
            "step": 0}
    before = len(proxy.log)
    ckpt.load(half, url, storage_options={**faulty, "coalesce_gap": 0})
    assert len(proxy.log) - before > 3 * 96
    for k, v in state["layers"].items():
        assert same(half["layers"][k]["w"].local, v["w"][:, 32:].contiguous())
    assert same(half["emb"].local, state["emb"].reshape(-1)[4321:5320])
    assert ckpt.verify(url, deep=True, storage_options=faulty).ok
    # the faults did happen, and the checkpoint seen directly (no proxy) is intact
    assert proxy.failures() >= 5, proxy.log
    assert {f for _, _, f in proxy.log} >= {500, 503, "reset", "reset-after"}
    assert ckpt.verify(url, deep=True, storage_options=opts).ok


def test_dead_endpoint_fails_fast_and_commits_nothing(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = s3_bucket
    dead = {**opts, **FAST, "retries": 4, "endpoint_url": f"http://127.0.0.1:{closed_port()}"}
    url = f"{bucket}/dead"
    t0 = time.monotonic()
    with pytest.raises(ckpt.StorageError) as ei:
        ckpt.save(state_of(1), url, storage_options=dead)
    assert time.monotonic() - t0 < 30
    msg = str(ei.value)
    assert url in msg and "after 4 tries" in msg and "connect" in msg.lower(), msg
    st = get_storage(url, **opts)
    try:
        assert st.size(MANIFEST_NAME) is None and st.list() == []
    finally:
        st.close()


def test_data_writes_failing_leave_no_manifest(s3_bucket: tuple[str, dict[str, Any]], moto_endpoint: str,
                                                proxies: list[FaultProxy]) -> None:
    bucket, opts = s3_bucket
    proxy, faulty = through(proxies, moto_endpoint, opts,
                            rule=lambda m, p: 503 if m == "PUT" and "/data/" in p else None)
    url = f"{bucket}/slow"
    with pytest.raises(ckpt.StorageError, match=r"after 3 tries.*SlowDown"):
        ckpt.save(state_of(2), url, storage_options={**faulty, **FAST, "retries": 3})
    assert sum(m == "PUT" and "/data/" in p for m, p, _ in proxy.log) == 3
    st = get_storage(url, **opts)
    try:
        assert st.list() == []
    finally:
        st.close()
    with pytest.raises(ckpt.ManifestError):
        ckpt.load(empty_like(state_of(2)), url, storage_options=opts)


def test_non_retryable_errors_fail_at_once(s3_bucket: tuple[str, dict[str, Any]], moto_endpoint: str,
                                           proxies: list[FaultProxy]) -> None:
    bucket, opts = s3_bucket
    url = f"{bucket}/denied"
    ckpt.save(state_of(3), url, storage_options=opts)
    proxy, denied = through(proxies, moto_endpoint, opts,
                            rule=lambda m, p: 403 if m == "GET" and "/data/" in p else None)
    with pytest.raises(ckpt.StorageError, match="access denied"):
        ckpt.load(empty_like(state_of(3)), url, storage_options=denied, workers=1)
    data_gets = [p for m, p, _ in proxy.log if m == "GET" and "/data/" in p]
    assert len(data_gets) == 1  # not retried
    # a missing file is not retried either: counted at a clean proxy (not timed, which flakes on a loaded box)
    counter, plain = through(proxies, moto_endpoint, opts)
    st = get_storage(url, **{**plain, "retries": 5})
    try:
        with pytest.raises(ckpt.StorageError, match="does not exist"):
            st.read_file("data/nope.safetensors")
    finally:
        st.close()
    assert len([p for _, p, _ in counter.log if "nope" in p]) == 1, counter.log


def test_multipart_upload_with_faults(s3_bucket: tuple[str, dict[str, Any]], moto_endpoint: str,
                                      s3_admin: Any, proxies: list[FaultProxy]) -> None:
    """~12 MB through 5 MiB parts: part 2's first try is throttled, the complete's reply is lost."""
    bucket, opts = s3_bucket
    seen: dict[str, int] = {}

    def rule(method: str, path: str) -> Any:
        kind = "complete" if method == "POST" and "uploadId=" in path else (
            "part2" if method == "PUT" and "partNumber=2" in path else None)
        if kind is None:
            return None
        seen[kind] = seen.get(kind, 0) + 1
        return (503 if kind == "part2" else "reset-after") if seen[kind] == 1 else None

    _, faulty = through(proxies, moto_endpoint, opts, rule=rule)
    st = get_storage(f"{bucket}/mp", **{**faulty, **FAST, "part_size": 5 * MiB, "upload_workers": 2})
    data = os.urandom(12 * MiB + 12345)
    try:
        w = st.open_writer("data/big.bin")
        step = 3 * MiB + 7  # writes straddle part boundaries
        for i in range(0, len(data), step):
            w.write(memoryview(data)[i : i + step])
        assert w.close() == len(data)
        assert seen == {"part2": 2, "complete": 2}
        assert st.size("data/big.bin") == len(data)
    finally:
        st.close()
    name = bucket[len("s3://"):]
    head = s3_admin.head_object(Bucket=name, Key="mp/data/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: 5 MiB, 5 MiB, the rest
    assert s3_admin.get_object(Bucket=name, Key="mp/data/big.bin")["Body"].read() == data
    assert not s3_admin.list_multipart_uploads(Bucket=name).get("Uploads")


def test_multipart_abort(s3_bucket: tuple[str, dict[str, Any]], s3_admin: Any) -> None:
    bucket, opts = s3_bucket
    st = get_storage(f"{bucket}/ab", **{**opts, "part_size": 5 * MiB})
    try:
        w = st.open_writer("data/x.bin")
        w.write(b"z" * (5 * MiB + 10))  # ships part 1: the upload exists now
        name = bucket[len("s3://"):]
        assert len(s3_admin.list_multipart_uploads(Bucket=name).get("Uploads", [])) == 1
        w.abort()
        assert not s3_admin.list_multipart_uploads(Bucket=name).get("Uploads")
        assert not st.exists("data/x.bin")
    finally:
        st.close()


@pytest.mark.slow
def test_coalesce_gap_bounds_the_number_of_gets(s3_bucket: tuple[str, dict[str, Any]], moto_endpoint: str,
                                               proxies: list[FaultProxy]) -> None:
    """Column halves of a row-major tensor: by default only the needed bytes (unneeded bytes are
    capped at 10% of what a merge joins), one GET per row; without the cap, a single GET."""
    bucket, opts = s3_bucket
    url = f"{bucket}/gap"
    full = torch.randn(128, 64)
    ckpt.save({"w": full}, url, storage_options=opts)
    proxy, counted = through(proxies, moto_endpoint, opts)
    for extra, expected in [({}, 128), ({"coalesce_waste": float("inf")}, 1), ({"coalesce_gap": 0}, 128)]:
        out = {"w": ckpt.Shard(torch.empty(128, 32), global_shape=(128, 64), offsets=(0, 32))}
        so = {**counted, **extra}
        before = len(proxy.log)
        ckpt.load(out, url, storage_options=so, workers=1)
        gets = [p for m, p, _ in proxy.log[before:] if m == "GET" and "/data/" in p]
        assert len(gets) == expected, (extra, len(gets))
        assert same(out["w"].local, full[:, 32:].contiguous())
