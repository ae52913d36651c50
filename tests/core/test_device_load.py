"""Loads into GPU tensors go through ckpt/_device_load.py's ring of pinned bounce buffers.

On a CPU-only machine the same code runs with host targets (``load.through_bounce`` patched to
send every tensor through it) and tiny slabs, so that tensors are cut into many batches, rows and
flat ranges span slabs, and rows larger than a slab get their own buffer. On a GPU the real path
is tested as well.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt import _device_load as device_load
from ckpt._load_plan import LoadRequest
from ckpt.shards import Box, Flat


@settings(max_examples=300, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=3), max_size=8),
       flats=st.lists(st.integers(0, 900), max_size=4), slab=st.integers(64, 2048), isz=st.sampled_from([1, 2, 4, 8]))
def test_generated_batches_tile_every_request(shapes, flats, slab, isz):
    reqs = [LoadRequest(f"b{i}", "float32", tuple(s), Box((0,) * len(s), tuple(s))) for i, s in enumerate(shapes)]
    reqs += [LoadRequest(f"f{i}", "float32", (n,), Flat(0, n)) for i, n in enumerate(flats)]
    sizes = [isz] * len(reqs)
    got: dict[int, list[tuple[int, int]]] = {}
    for b in device_load.batches(reqs, sizes, slab):
        assert b
        end = 0
        for p in b:
            assert p.offset >= end and p.offset % device_load.ALIGN == 0
            end = p.offset + p.count * isz
            got.setdefault(p.req, []).append((p.start, p.count))
            lengths = getattr(reqs[p.req].region, "lengths", None)
            unit = 1
            for n in (lengths or ())[1:]:
                unit *= n
            assert p.start % unit == 0 and p.count % unit == 0  # whole rows of a box
        assert end <= slab or (len(b) == 1 and b[0].count * isz > slab and b[0].count == max(unit, 1))
    for i, r in enumerate(reqs):
        parts = got.get(i, [])
        assert [s for s, _ in parts] == [sum(c for _, c in parts[:k]) for k in range(len(parts))]
        assert sum(c for _, c in parts) == r.region.numel


@pytest.fixture
def bounce_everything(monkeypatch):
    # importlib: ``ckpt.load`` is also the name of a function on the package
    monkeypatch.setattr(importlib.import_module("ckpt.load"), "through_bounce", lambda dst: True)
    monkeypatch.setattr(device_load, "BOUNCE", 1024)


def _state(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"big": torch.randn(64, 37, generator=g), "wide": torch.randn(3, 700, generator=g).bfloat16(),
            "vec": torch.randn(5000, generator=g).double(), "scalar": torch.tensor(3.5),
            "ints": torch.randint(0, 1 << 40, (17, 3), generator=g), "empty": torch.zeros(0, 4)}


def test_whole_tensors_load_bitwise_through_tiny_bounce_buffers(bounce_everything, tmp_path):
    g = torch.Generator().manual_seed(0)
    ref = _state(g)
    ckpt.save(ref, str(tmp_path / "c"))
    dst = {k: torch.full_like(v, 7) for k, v in ref.items()}
    dst["nc"] = torch.zeros(37, 64).t()  # a non-contiguous target is filled through the ring as well
    ckpt.save({**ref, "nc": ref["big"]}, str(tmp_path / "c"), overwrite=True)
    stats: dict = {}
    ckpt.load(dst, str(tmp_path / "c"), stats=stats, verify=True)
    for k, v in ref.items():
        assert torch.equal(dst[k], v), k
    assert torch.equal(dst["nc"], ref["big"])
    assert stats["bytes_read"] >= sum(v.numel() * v.element_size() for v in ref.values())


def test_resharded_and_flat_targets_load_bitwise_through_the_ring(bounce_everything, tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(60, 50, generator=g)
    m = torch.randn(3000, generator=g)
    ckpt.save({"w": w, "m": m}, str(tmp_path / "c"))
    dst = {"w": ckpt.Shard(torch.zeros(60, 20), (60, 50), (0, 30)),
           "m": ckpt.FlatShard(torch.zeros(1700), (3000,), 1300),
           "w2": ckpt.Shard(torch.zeros(41, 50), (60, 50), (19, 0))}
    ckpt.load({"w": dst["w"], "m": dst["m"]}, str(tmp_path / "c"))
    assert torch.equal(dst["w"].local, w[:, 30:]) and torch.equal(dst["m"].local, m[1300:])
    ckpt.load({"w": dst["w2"]}, str(tmp_path / "c"))
    assert torch.equal(dst["w2"].local, w[19:])


def test_a_read_failure_in_a_bounce_thread_is_raised_typed(bounce_everything, tmp_path):
    ref = _state(torch.Generator().manual_seed(2))
    ckpt.save(ref, str(tmp_path / "c"))
    data = next((tmp_path / "c" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    data.write_bytes(bytes(raw[: len(raw) // 2]))  # truncated: reads past the end fail
    dst = {k: torch.zeros_like(v) for k, v in ref.items()}
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(dst, str(tmp_path / "c"))


@pytest.mark.gpu
def test_cuda_targets_load_bitwise(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(3)
    ref = {f"t{i}": torch.randn(1 + i * 50_000, generator=g).bfloat16() for i in range(20)}
    ref["m"] = torch.randn(4096, 1024, generator=g)
    ckpt.save(ref, str(tmp_path / "c"))
    for slab in (device_load.BOUNCE, 1 << 20):
        monkeypatch.setattr(device_load, "BOUNCE", slab)
        dst = {k: torch.zeros_like(v, device="cuda") for k, v in ref.items()}
        ckpt.load(dst, str(tmp_path / "c"))
        for k, v in ref.items():
            assert torch.equal(dst[k].cpu(), v), (slab, k)
    cuda_state = {k: v.cuda() for k, v in ref.items()}
    ckpt.save(cuda_state, str(tmp_path / "g"))  # a synchronous save of GPU tensors, through the pinned ring
    back = {k: torch.zeros_like(v) for k, v in ref.items()}
    ckpt.load(back, str(tmp_path / "g"))
    assert all(torch.equal(back[k], v) for k, v in ref.items())
    assert ckpt.verify(str(tmp_path / "g"), deep=True).ok
