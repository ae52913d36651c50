"""S3 configuration: env vars, storage options, URL forms, the install hint."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import ckpt
from ckpt.storage import get_storage
from ckpt.storage.s3 import S3Storage, split_url


def test_env_vars_and_options(s3_bucket: tuple[str, dict[str, Any]], moto_endpoint: str,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, _ = s3_bucket
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    url = f"{bucket}/env"
    st = get_storage(url)
    assert isinstance(st, S3Storage)
    try:
        assert st.fs.endpoint_url == moto_endpoint
        assert st.fs.client_kwargs["region_name"] == "eu-west-1"
        assert st.coalesce_gap == 1024 * 1024
    finally:
        st.close()
    assert getattr(get_storage(url, coalesce_gap=0), "coalesce_gap", None) == 0
    state: dict[str, Any] = {"w": torch.randn(8, 8), "step": 4}
    ckpt.save(state, url)
    out: dict[str, Any] = {"w": torch.empty(8, 8), "step": 0}
    assert ckpt.load(out, url)["step"] == 4
    assert torch.equal(out["w"], state["w"])
    with pytest.raises(ckpt.StorageError, match="part_size"):
        get_storage(url, part_size=1024)
    with pytest.raises(ckpt.StorageError, match="retries"):
        get_storage(url, retries=0)


def test_url_forms(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = s3_bucket
    name = bucket[len("s3://"):]
    assert split_url("s3://b/a/b/") == ("b", "a/b")
    assert split_url("s3a://b") == ("b", "")
    with pytest.raises(ckpt.StorageError, match="bucket"):
        split_url("s3:///x")
    for url in (f"s3a://{name}/p/", f"s3://{name}"):
        st = get_storage(url, **opts)
        assert isinstance(st, S3Storage)
        w = st.open_writer("data/x")
        w.write(b"abc")
        w.close()
        assert st.list() == ["data/x"] and st.read_file("data/x") == b"abc"
        st.delete("data/x")
        st.close()
    assert get_storage(f"s3://{name}/p/", **opts).url == f"s3://{name}/p"


def test_missing_s3fs_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'ckpt\[s3\]'"):
        get_storage("s3://bucket/prefix")
