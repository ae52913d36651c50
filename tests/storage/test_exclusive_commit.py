"""Exclusive creation on every backend: a second writer of the same manifest loses, nothing changes."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt.errors import CheckpointExistsError
from ckpt.storage import get_storage


def test_exclusive_commit_never_replaces(backend):
    url, opts = backend
    st = get_storage(url, **opts)
    try:
        st.commit("manifest.msgpack", b"first", exclusive=True)
        with pytest.raises(CheckpointExistsError):
            st.commit("manifest.msgpack", b"second", exclusive=True)
        assert st.read_file("manifest.msgpack") == b"first"
        st.commit("manifest.msgpack", b"third")  # overwrite replaces
        assert st.read_file("manifest.msgpack") == b"third"
    finally:
        st.close()


def test_s3_exclusive_retry_of_our_own_put_is_success(s3_bucket):
    """A conditional PUT whose reply was lost is retried and answered 412: if the object holds our
    bytes, the commit succeeded (the save must not delete its files as if it had lost)."""
    bucket, opts = s3_bucket
    st = get_storage(f"{bucket}/c", **opts)
    try:
        st.commit("manifest.msgpack", b"ours", exclusive=True)
        st.commit("manifest.msgpack", b"ours", exclusive=True)  # same bytes: ours already
        with pytest.raises(CheckpointExistsError):
            st.commit("manifest.msgpack", b"theirs", exclusive=True)
    finally:
        st.close()


def test_second_save_without_overwrite_loses_and_leaves_nothing(backend, monkeypatch):
    """The winner commits between the loser's early check and its commit: the loser's exclusive
    commit refuses, and the loser removes its own data files."""
    url, opts = backend
    import ckpt._transaction as txn

    real_begin = txn.begin

    def late_winner(storage, *, overwrite):
        prev = real_begin(storage, overwrite=overwrite)
        monkeypatch.setattr(txn, "begin", real_begin)
        ckpt.save({"w": torch.ones(3)}, url, storage_options=opts)  # commits first
        return prev

    monkeypatch.setattr(txn, "begin", late_winner)
    with pytest.raises(CheckpointExistsError):
        ckpt.save({"w": torch.zeros(3)}, url, storage_options=opts)
    got = ckpt.load({"w": torch.empty(3)}, url, storage_options=opts, verify=True)
    assert torch.equal(got["w"], torch.ones(3))
    st = get_storage(url, **opts)
    try:
        m = ckpt.inspect(url, storage_options=opts)
        assert {f for f in st.list() if f != "manifest.msgpack"} == set(m.files)
    finally:
        st.close()
