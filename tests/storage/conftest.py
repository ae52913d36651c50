"""Storage fixtures: ``backend``, the same checkpoint URL contract over local, ``memory://`` and ``s3://``
(the loopback moto S3 server and its buckets are the suite's: tests/conftest.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest


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
