"""A storage backend of ckpt's own is one module, ``ckpt.storage.<protocol>``, naming its class in
``BACKEND``: ``get_storage`` finds it there with no list to edit; other protocols go to fsspec."""

from __future__ import annotations

import sys
import types

import pytest

from ckpt.storage import Storage, _native_backend, get_storage
from ckpt.storage.local import LocalStorage


class _Mine(LocalStorage):
    def __init__(self, url: str, **options: object) -> None:
        super().__init__(url.split("://", 1)[1])
        self.options = options


@pytest.fixture
def mine_module():
    module = types.ModuleType("ckpt.storage.mineproto")
    module.BACKEND = _Mine  # type: ignore[attr-defined]
    sys.modules["ckpt.storage.mineproto"] = module
    yield module
    del sys.modules["ckpt.storage.mineproto"]


def test_a_new_backend_is_found_by_its_module_alone(mine_module, tmp_path) -> None:
    st = get_storage(f"mineproto://{tmp_path}", flag=1)
    assert isinstance(st, _Mine) and st.options == {"flag": 1}
    st.commit("x", b"abc")
    assert (tmp_path / "x").read_bytes() == b"abc"


def test_s3_and_its_alias_resolve_to_the_s3_module() -> None:
    pytest.importorskip("s3fs")
    from ckpt.storage.s3 import S3Storage

    assert _native_backend("s3") is S3Storage and _native_backend("s3a") is S3Storage


@pytest.mark.parametrize("protocol", ["memory", "base", "retry", "local", "_private", "S3", "a-b", "x.y"])
def test_modules_without_a_backend_and_odd_names_go_to_fsspec(protocol: str) -> None:
    assert _native_backend(protocol) is None


def test_a_module_naming_something_else_is_not_a_backend(mine_module) -> None:
    mine_module.BACKEND = object  # not a Storage
    assert _native_backend("mineproto") is None
    mine_module.BACKEND = Storage
    assert _native_backend("mineproto") is Storage
