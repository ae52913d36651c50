"""Suite-wide set-up: a fixed seed, the ``gpu`` marker's skip where there is no CUDA device, and S3: a
loopback moto server (one per session, ``moto_endpoint``), a client on it (``s3_admin``) and a fresh
bucket per test (``s3_bucket``).

Markers (registered in pyproject.toml): ``slow`` (over ~5 s on a 2-core machine), ``multiproc``
(forks ranks or runs subprocesses), ``gpu`` (needs CUDA). The fast tier is
``scripts/test.sh -m "not slow and not multiproc"``; CI runs everything. Nothing here calls CUDA
(GPUs are counted by ``nvidia-smi``): once pytest's process has used CUDA, no CUDA rank forked from
it can start, so on GPU machines ``-m gpu`` runs in a process of its own.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckpt.testing.ranks import gpu_count

torch.manual_seed(0)
CREDS = {"key": "testing", "secret": "testing"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the ``slow`` tests first (in their order), so that parallel workers (``scripts/test.sh``:
    pytest-xdist) do not end on a few long ones; skip every ``gpu`` test without CUDA (one place,
    instead of a skipif on each). GPUs are counted without CUDA (``torch.cuda.is_available()`` here
    would break every CUDA rank a test forks)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a moto S3 server running in this process."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_admin(moto_endpoint: str) -> Any:
    """A plain (synchronous) botocore client on the moto server, for setup and inspection."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=moto_endpoint, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing")


@pytest.fixture
def s3_bucket(s3_admin: Any, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, Any]]:
    """``(s3://bucket, storage_options)`` for a bucket created for this test alone."""
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    name = f"ckpt-test-{uuid.uuid4().hex[:16]}"
    s3_admin.create_bucket(Bucket=name)
    return f"s3://{name}", {**CREDS, "endpoint_url": moto_endpoint, "retry_base_delay": 0.01}
