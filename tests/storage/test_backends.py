"""The Storage protocol and the public API, identically over local, memory:// and s3:// (moto)."""

from __future__ import annotations

import array
import os
from typing import Any

import pytest
import torch

import ckpt
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage import get_storage, read_ranges

Backend = tuple[str, dict[str, Any]]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def make_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "w": torch.randn(64, 48, generator=g),
            "b": torch.randn(48, generator=g).to(torch.bfloat16),
            "emb": torch.randint(-(2**40), 2**40, (33, 5), generator=g, dtype=torch.int64),
            "scale": torch.tensor(float("nan")),
        },
        "step": 12,
        "meta": {"lr": 3e-4, "name": "run-1"},
    }


def empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": 0, "meta": None}


# -- the Storage protocol ------------------------------------------------------------------------


@pytest.mark.slow
def test_write_read_list_delete_commit(backend: Backend) -> None:
    url, opts = backend
    st = get_storage(url, **opts)
    try:
        payload = os.urandom(70_000)
        w = st.open_writer("data/a.bin")
        w.write(payload[:10])
        w.write(memoryview(payload)[10:50_000])
        w.write(memoryview(bytearray(payload[50_000:])))
        assert w.close() == len(payload)
        ints = array.array("i", range(100))  # a non-byte memoryview is written as its raw bytes
        w = st.open_writer("data/sub/b.bin")
        w.write(memoryview(ints))
        assert w.close() == 400
        w = st.open_writer("empty.bin")
        assert w.close() == 0

        assert st.size("data/a.bin") == len(payload)
        assert st.size("empty.bin") == 0
        assert st.size("data/missing.bin") is None
        assert st.exists("data/a.bin") and not st.exists("nope")
        assert st.list() == ["data/a.bin", "data/sub/b.bin", "empty.bin"]
        assert st.list("data") == ["data/a.bin", "data/sub/b.bin"]
        assert st.list("nothing-here") == []

        for off, n in [(0, 1), (0, 8), (123, 4567), (len(payload) - 9, 9), (0, len(payload))]:
            buf = bytearray(n)
            st.read_into("data/a.bin", off, memoryview(buf))
            assert bytes(buf) == payload[off : off + n]
        st.read_into("data/a.bin", 5, memoryview(bytearray(0)))  # empty read is a no-op
        assert st.read_file("data/sub/b.bin") == ints.tobytes()
        assert read_ranges(st, "data/a.bin", [(0, 3), (1000, 10), (60_000, 10_000)]) == [
            payload[:3], payload[1000:1010], payload[60_000:70_000]]

        st.commit(MANIFEST_NAME, b"first")
        assert st.read_file(MANIFEST_NAME) == b"first"
        st.commit(MANIFEST_NAME, b"second, longer")
        assert st.read_file(MANIFEST_NAME) == b"second, longer"

        st.delete("data/a.bin")
        st.delete("data/a.bin")  # deleting a missing file is not an error
        assert not st.exists("data/a.bin")
        assert st.list() == ["data/sub/b.bin", "empty.bin", MANIFEST_NAME]
    finally:
        st.close()


def test_short_and_missing_reads_raise_storage_error(backend: Backend) -> None:
    url, opts = backend
    st = get_storage(url, **opts)
    try:
        w = st.open_writer("data/f.bin")
        w.write(b"x" * 100)
        w.close()
        with pytest.raises(ckpt.StorageError, match="f.bin"):  # runs past the end
            st.read_into("data/f.bin", 90, memoryview(bytearray(20)))
        with pytest.raises(ckpt.StorageError, match="f.bin"):  # starts past the end
            st.read_into("data/f.bin", 500, memoryview(bytearray(4)))
        with pytest.raises(ckpt.StorageError, match="missing.bin"):
            st.read_into("data/missing.bin", 0, memoryview(bytearray(4)))
        with pytest.raises(ckpt.StorageError, match="missing.bin"):
            st.read_file("data/missing.bin")
        with pytest.raises(ckpt.StorageError, match="f.bin"):
            read_ranges(st, "data/f.bin", [(0, 10), (95, 10)])
    finally:
        st.close()


def test_writer_abort_leaves_nothing(backend: Backend) -> None:
    url, opts = backend
    st = get_storage(url, **opts)
    try:
        w = st.open_writer("data/partial.bin")
        w.write(b"y" * 1000)
        w.abort()
        assert not st.exists("data/partial.bin")
        assert "data/partial.bin" not in st.list()
    finally:
        st.close()


def test_coalesce_gap(backend: Backend) -> None:
    url, opts = backend
    st = get_storage(url, **opts)
    try:
        gap = getattr(st, "coalesce_gap", 4096)
        assert gap == (1024 * 1024 if url.startswith("s3://") else 4096)
    finally:
        st.close()


# -- the public API over each backend -------------------------------------------------------------


def test_save_load_roundtrip(backend: Backend) -> None:
    url, opts = backend
    state = make_state()
    m = ckpt.save(state, url, step=12, storage_options=opts)
    assert m.step == 12
    out = empty_like_state(state)
    got = ckpt.load(out, url, storage_options=opts)
    for k, v in state["model"].items():
        assert bitwise_equal(out["model"][k], v), k
    assert got["step"] == 12
    assert got["meta"] == {"lr": 3e-4, "name": "run-1"}
    assert ckpt.inspect(url, storage_options=opts).step == 12


def test_resharded_load(backend: Backend) -> None:
    url, opts = backend
    state = make_state()
    ckpt.save(state, url, storage_options=opts)
    full = state["model"]["w"]  # (64, 48): load column halves, as a 2-way TP rank would
    for half in range(2):
        out = empty_like_state(state)
        out["model"]["w"] = ckpt.Shard(torch.empty(64, 24), global_shape=(64, 48), offsets=(0, 24 * half))
        ckpt.load(out, url, storage_options=opts)
        assert bitwise_equal(out["model"]["w"].local, full[:, 24 * half : 24 * (half + 1)].contiguous())
        assert bitwise_equal(out["model"]["emb"], state["model"]["emb"])
    out = empty_like_state(state)  # a ZeRO-style flat range straddling rows
    out["model"]["w"] = ckpt.FlatShard(torch.empty(1000), global_shape=(64, 48), start=517)
    out["model"]["emb"] = ckpt.FlatShard(torch.empty(50, dtype=torch.int64), global_shape=(33, 5), start=101)
    ckpt.load(out, url, storage_options=opts)
    assert bitwise_equal(out["model"]["w"].local, full.reshape(-1)[517:1517])
    assert bitwise_equal(out["model"]["emb"].local, state["model"]["emb"].reshape(-1)[101:151])


def test_verify_deep_and_detects_corruption(backend: Backend) -> None:
    url, opts = backend
    m = ckpt.save(make_state(), url, storage_options=opts)
    report = ckpt.verify(url, deep=True, storage_options=opts)
    assert report.ok, report.problems
    assert report.bytes_hashed > 0
    # overwrite a data file's tensor bytes with same-sized garbage: deep verify must notice
    path, size = next(iter(m.files.items()))
    st = get_storage(url, **opts)
    try:
        data = bytearray(st.read_file(path))
        data[-16:] = bytes(b ^ 0xFF for b in data[-16:])
        w = st.open_writer(path)
        w.write(bytes(data))
        assert w.close() == size
    finally:
        st.close()
    report = ckpt.verify(url, deep=True, storage_options=opts)
    assert not report.ok
    assert any(p.kind == "checksum" for p in report.problems)


def test_save_over_committed_checkpoint(backend: Backend) -> None:
    url, opts = backend
    first = ckpt.save(make_state(), url, step=1, storage_options=opts)
    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save(make_state(), url, step=2, storage_options=opts)
    assert ckpt.inspect(url, storage_options=opts).step == 1
    second = ckpt.save(make_state(), url, step=2, overwrite=True, storage_options=opts)
    assert ckpt.inspect(url, storage_options=opts).step == 2
    st = get_storage(url, **opts)
    try:  # the old checkpoint's data files are gone, the new ones and the manifest remain
        assert sorted(st.list()) == sorted([*second.files, MANIFEST_NAME])
        assert not (set(first.files) - set(second.files)) & set(st.list())
    finally:
        st.close()
    assert ckpt.verify(url, deep=True, storage_options=opts).ok


def test_load_without_checkpoint(backend: Backend) -> None:
    url, opts = backend
    with pytest.raises(ckpt.ManifestError):
        ckpt.load({"x": torch.empty(2)}, url, storage_options=opts)


def test_local_commit_makes_the_checkpoint_directory_entry_durable(tmp_path, monkeypatch):
    # A manager's step directory is created by the save; the commit fsyncs the checkpoint directory
    # and its parent (where the step directory's name lives), not only the manifest's directory.
    import ckpt.storage.local as local

    synced: list[str] = []
    real = local._fsync_dir
    monkeypatch.setattr(local, "_fsync_dir", lambda p: (synced.append(os.path.abspath(p)), real(p)))
    root = tmp_path / "run" / "step-0000000001"
    local.LocalStorage(str(root)).commit("manifest.msgpack", b"x")
    assert synced == [str(root), str(tmp_path / "run")]
    synced.clear()
    local.LocalStorage(str(root)).commit("data/sub/f", b"y")
    assert synced == [str(root / "data" / "sub"), str(root / "data"), str(root), str(tmp_path / "run")]
