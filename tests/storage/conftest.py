"""Storage fixtures: a loopback moto S3 server (one per session), a fresh bucket per test, and
``backend``: the same checkpoint URL contract over local, ``memory://`` and ``s3://``."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

CREDS = {"key": "testing", "secret": "testing"}


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


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
    """``(checkpoint url, storage_options)`` on each backend; every test gets a fresh location."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), {}
    if request.param == "memory":
        # memory:// is one global filesystem per process: a unique root per test.
        return f"memory://ckpt-tests/{uuid.uuid4().hex}/ckpt", {}
    bucket, options = request.getfixturevalue("s3_bucket")
    return f"{bucket}/runs/ckpt", options
