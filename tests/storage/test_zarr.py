"""The zarr v3 layout: saved by ckpt on any backend, resharded by ckpt.load, read by plain zarr."""

from __future__ import annotations

import pytest
import torch
import zarr

import ckpt
from ckpt._zarr_layout import tree_of
from tests.dist_utils import run_ranks


def _grid_state(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 6, generator=g)
    b = torch.randn(4, 8, generator=g).to(torch.bfloat16)
    r, c = divmod(rank, 2)  # a 2 x 2 grid of (4, 3) blocks; b split in rows
    return {"w": ckpt.Shard(w[4 * r : 4 * r + 4, 3 * c : 3 * c + 3].clone(), (8, 6), (4 * r, 3 * c)),
            "b": ckpt.Shard(b[rank : rank + 1].clone(), (4, 8), (rank, 0)),
            "i": torch.arange(5, dtype=torch.int64), "step": 4}


def _save(rank: int, world: int, url: str) -> None:
    ckpt.save(_grid_state(rank, world), url, data_format="zarr", step=4)


@pytest.mark.multiproc
def test_zarr_from_four_ranks_reshards_and_reads_with_plain_zarr(tmp_path):
    url = str(tmp_path / "z")
    run_ranks(4, _save, url)
    m = ckpt.inspect(url)
    assert m.data_format == "zarr" and len(m.tensors["w"].shards) == 4
    assert ckpt.verify(url, deep=True).ok
    full = {k: _grid_state(0, 4)[k] for k in ("i", "step")}
    ref_w = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    w = ckpt.Shard(torch.zeros(8, 2), (8, 6), (0, 2))  # columns across the chunk grid
    out = ckpt.load({"w": w, "b": torch.zeros(4, 8, dtype=torch.bfloat16), "i": torch.zeros(5, dtype=torch.int64),
                     "step": None}, url)
    assert torch.equal(w.local, ref_w[:, 2:4]) and out["step"] == 4
    assert torch.equal(out["i"], full["i"])
    # plain zarr, no ckpt: the arrays are there with the right values (bf16 as uint16 + attribute), in
    # this save's own tree (zarr-<random>/, named by the manifest)
    tree = tree_of(m.files)
    assert tree is not None and tree.startswith("zarr-")
    arr = zarr.open_array(str(tmp_path / "z" / tree / "w"), mode="r")
    assert arr.shape == (8, 6) and arr.chunks == (4, 3)
    assert torch.equal(torch.from_numpy(arr[:]), ref_w)
    barr = zarr.open_array(str(tmp_path / "z" / tree / "b"), mode="r")
    assert barr.attrs["ckpt_dtype"] == "bfloat16" and str(barr.dtype) == "uint16"
    assert torch.equal(torch.from_numpy(barr[1:3].view("uint16").astype("int32")).to(torch.int32),
                       out["b"][1:3].view(torch.int16).to(torch.int32) & 0xFFFF)


def test_zarr_on_every_backend(backend):
    url, opts = backend
    src = {"w": torch.randn(6, 4), "h": torch.randn(3).half(), "e": torch.zeros(0, 3)}
    m = ckpt.save(src, url, data_format="zarr", storage_options=opts)
    dst = {"w": ckpt.Shard(torch.zeros(6, 2), (6, 4), (0, 2)), "h": torch.zeros(3).half(), "e": torch.zeros(0, 3)}
    ckpt.load(dst, url, storage_options=opts)
    assert torch.equal(dst["w"].local, src["w"][:, 2:]) and torch.equal(dst["h"], src["h"])
    assert ckpt.verify(url, deep=True, storage_options=opts).ok
    if url.startswith("s3://"):
        store = zarr.storage.FsspecStore.from_url(f"{url}/{tree_of(m.files)}/w", storage_options={
            "key": opts["key"], "secret": opts["secret"], "endpoint_url": opts["endpoint_url"]}, read_only=True)
        assert torch.equal(torch.from_numpy(zarr.open_array(store, mode="r")[:]), src["w"])


def _uneven(rank: int, world: int, url: str) -> None:
    rows = [(0, 3), (3, 2)][rank]  # 5 rows as 3 + 2: no uniform chunk grid
    t = torch.zeros(rows[1], 4)
    with pytest.raises(ckpt.LayoutError, match="safetensors"):
        ckpt.save({"w": ckpt.Shard(t, (5, 4), (rows[0], 0))}, url, data_format="zarr")


@pytest.mark.multiproc
def test_irregular_and_flat_shardings_are_refused(tmp_path):
    run_ranks(2, _uneven, str(tmp_path / "u"))
    with pytest.raises(ckpt.LayoutError, match="flat"):
        ckpt.save({"w": ckpt.FlatShard(torch.zeros(20), (5, 4), 0)}, str(tmp_path / "f"), data_format="zarr")
    with pytest.raises(ckpt.StateError, match="data_format"):
        ckpt.save({"w": torch.zeros(2)}, str(tmp_path / "x"), data_format="hdf5")
    assert not (tmp_path / "f" / "manifest.msgpack").exists()
