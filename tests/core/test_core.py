"""Single-process save/load round trips, objects, and every error path of the foundation."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
import torch

import ckpt
from ckpt.formats.msgpack_codec import decode_manifest, encode_manifest
from ckpt.manifest import MANIFEST_NAME
from tests.helpers import fail_local_writes
from tests.layouts import assert_bitwise

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.complex64, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32]


def _rand(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                        generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape) if shape else raw.view(dtype).reshape(())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_every_dtype(tmp_path, dtype):
    src = {"a": _rand(dtype, (5, 3)), "s": _rand(dtype, ()), "e": torch.empty((0, 4), dtype=dtype)}
    ckpt.save(src, str(tmp_path / "c"))
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    ckpt.load(dst, str(tmp_path / "c"))
    for k in src:
        assert_bitwise(dst[k], src[k], k)
    assert ckpt.verify(str(tmp_path / "c"), deep=True).ok


def test_data_files_are_valid_safetensors(tmp_path):
    from safetensors.torch import load_file

    src = {"a": torch.randn(4, 4), "b": torch.randn(3).bfloat16(), "c": torch.arange(5, dtype=torch.int8)}
    m = ckpt.save(src, str(tmp_path / "c"))
    (f,) = m.files
    loaded = load_file(str(tmp_path / "c" / f))
    assert {k.split("@")[0] for k in loaded} == set(src)
    for k, v in loaded.items():
        assert torch.equal(v, src[k.split("@")[0]])
    # byte offsets in the manifest point at the raw bytes, usable without parsing the header
    raw = (tmp_path / "c" / f).read_bytes()
    s = m.tensors["a"].shards[0]
    assert raw[s.offset : s.offset + s.length] == src["a"].numpy().tobytes()
    assert m.files[f] == len(raw)


def test_objects_roundtrip(tmp_path):
    objs = {"step": 3, "lr": 1e-3, "name": "run", "blob": b"\x00\x01", "lst": [1, [2, 3]], "tup": (1, "a"),
            "np": np.float32(1.5), "npi": np.int64(-4), "nested": {"a": {"b": None, "c": True}}}
    ckpt.save({**objs, "w": torch.ones(2)}, str(tmp_path / "c"))
    target = {k: None for k in objs} | {"w": torch.zeros(2)}
    out = ckpt.load(target, str(tmp_path / "c"))
    for k, v in objs.items():
        assert out[k] == v, k
        assert type(out[k]) is type(v), k
    assert torch.equal(out["w"], torch.ones(2))


def test_unsupported_object_is_a_clear_error(tmp_path):
    with pytest.raises(ckpt.StateError, match="object 'o'"):
        ckpt.save({"o": object()}, str(tmp_path / "c"))
    assert not (tmp_path / "c" / MANIFEST_NAME).exists()


def test_nested_keys_and_lists(tmp_path):
    src = {"opt": {"state": {"0": {"exp_avg": torch.randn(3)}}, "groups": [{"lr": 0.1}]},
           "bufs": [torch.randn(2), torch.randn(2)]}
    m = ckpt.save(src, str(tmp_path / "c"))
    assert set(m.tensors) == {"opt.state.0.exp_avg", "bufs.0", "bufs.1"}
    dst = {"opt": {"state": {"0": {"exp_avg": torch.zeros(3)}}, "groups": None}, "bufs": [torch.zeros(2)] * 2}
    dst["bufs"] = [torch.zeros(2), torch.zeros(2)]
    out = ckpt.load(dst, str(tmp_path / "c"))
    assert out["opt"]["groups"] == [{"lr": 0.1}]
    assert torch.equal(out["bufs"][1], src["bufs"][1])


def test_load_fills_noncontiguous_target(tmp_path):
    src = torch.randn(6, 4)
    ckpt.save({"w": src}, str(tmp_path / "c"))
    base = torch.zeros(4, 6)
    ckpt.load({"w": base.t()}, str(tmp_path / "c"))
    assert torch.equal(base.t(), src)


def test_resharded_loads_within_one_process(tmp_path):
    g = torch.randn(10, 8)
    url = str(tmp_path / "c")
    ckpt.save({"a": g, "b": ckpt.FlatShard(g.reshape(-1).clone(), (10, 8), 0)}, url)
    for target in [ckpt.Shard(torch.zeros(4, 3), (10, 8), (5, 2)), ckpt.FlatShard(torch.zeros(13), (10, 8), 29)]:
        ckpt.load({"a": target, "b": target}, url)
        if isinstance(target, ckpt.Shard):
            assert torch.equal(target.local, g[5:9, 2:5])
        else:
            assert torch.equal(target.local, g.reshape(-1)[29:42])


def test_incomplete_tensor_is_refused(tmp_path):
    with pytest.raises(ckpt.LayoutError, match="cover 24 of 80"):
        ckpt.save({"a": ckpt.Shard(torch.zeros(3, 8), (10, 8), (0, 0))}, str(tmp_path / "c"))
    assert not (tmp_path / "c" / MANIFEST_NAME).exists()


def test_out_of_bounds_shard(tmp_path):
    with pytest.raises(ckpt.StateError, match="outside the global shape"):
        ckpt.save({"a": ckpt.Shard(torch.zeros(3, 8), (10, 8), (8, 0))}, str(tmp_path / "c"))
    with pytest.raises(ckpt.StateError, match="outside"):
        ckpt.save({"a": ckpt.FlatShard(torch.zeros(5), (2, 2), 0)}, str(tmp_path / "c"))


def test_refuses_to_overwrite_committed_checkpoint(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save({"a": torch.ones(3)}, url, step=1)
    with pytest.raises(ckpt.CheckpointExistsError, match="overwrite=True"):
        ckpt.save({"a": torch.zeros(3)}, url, step=2)
    dst = {"a": torch.zeros(3)}
    ckpt.load(dst, url)
    assert torch.equal(dst["a"], torch.ones(3))
    ckpt.save({"a": torch.full((3,), 5.0)}, url, step=2, overwrite=True)
    assert ckpt.inspect(url).step == 2
    ckpt.load(dst, url)
    assert torch.equal(dst["a"], torch.full((3,), 5.0))
    assert len(os.listdir(tmp_path / "c" / "data")) == 1  # the old data file is gone
    assert ckpt.verify(url, deep=True).ok


def test_load_errors_name_the_key(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save({"a": torch.ones(3), "b": torch.ones(2, dtype=torch.int32)}, url)
    with pytest.raises(ckpt.MismatchError, match="'a'.*global shape"):
        ckpt.load({"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int32)}, url)
    with pytest.raises(ckpt.MismatchError, match="'b'.*dtype int32"):
        ckpt.load({"a": torch.zeros(3), "b": torch.zeros(2)}, url)
    with pytest.raises(ckpt.MismatchError, match="missing from the checkpoint: 'c'"):
        ckpt.load({"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.int32), "c": torch.zeros(1)}, url)
    part = {"a": torch.zeros(3)}  # a partial load: stored keys not requested are fine (as in DCP)
    ckpt.load(part, url)
    assert torch.equal(part["a"], torch.ones(3))
    dst = {"a": torch.zeros(3), "c": torch.zeros(1)}
    ckpt.load(dst, url, strict=False)
    assert torch.equal(dst["a"], torch.ones(3))


def test_missing_checkpoint(tmp_path):
    with pytest.raises(ckpt.ManifestError, match="no committed checkpoint"):
        ckpt.load({"a": torch.zeros(1)}, str(tmp_path / "nope"))


def _rewrite_manifest(url: str, edit) -> None:
    from tests.manifest_edit import edit_manifest

    edit_manifest(url, edit)


def test_unsupported_major_version(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save({"a": torch.ones(3)}, url)
    _rewrite_manifest(url, lambda d: d.__setitem__("version", [3, 0]))
    with pytest.raises(ckpt.FormatVersionError, match="version 3.0 is not supported"):
        ckpt.inspect(url)
    url = str(tmp_path / "d")
    ckpt.save({"a": torch.ones(3)}, url)
    _rewrite_manifest(url, lambda d: d.update(version=[1, 7], future_field={"x": 1}))
    assert ckpt.inspect(url).version == (1, 7)  # newer minor + unknown optional field: readable


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x.safetensors", "data/../../x", "data/./x", "c:/x", ""])
def test_manifest_path_escape_is_rejected_before_io(tmp_path, bad):
    url = str(tmp_path / "c")
    ckpt.save({"a": torch.ones(3)}, url)

    def edit(d):
        (f,) = list(d["files"])
        d["files"] = {bad: d["files"][f]}
        d["tensors"]["a"]["shards"][0]["file"] = bad

    _rewrite_manifest(url, edit)
    with pytest.raises(ckpt.ManifestError, match="escapes|not a non-empty"):
        ckpt.load({"a": torch.zeros(3)}, url)


def test_symlink_escape_is_rejected(tmp_path):
    url = str(tmp_path / "c")
    m = ckpt.save({"a": torch.ones(3)}, url)
    (f,) = m.files
    outside = tmp_path / "outside.safetensors"
    os.replace(os.path.join(url, f), outside)
    os.symlink(outside, os.path.join(url, f))
    with pytest.raises(ckpt.ManifestError, match="outside the checkpoint"):
        ckpt.load({"a": torch.zeros(3)}, url)


def test_failed_save_leaves_no_manifest_and_other_checkpoints_intact(tmp_path, monkeypatch):
    good = str(tmp_path / "good")
    ckpt.save({"a": torch.ones(1000)}, good)
    fail_local_writes(monkeypatch, over=100)
    with pytest.raises(ckpt.StorageError, match="injected"):
        ckpt.save({"a": torch.ones(1000)}, str(tmp_path / "bad"))
    monkeypatch.undo()
    assert not (tmp_path / "bad" / MANIFEST_NAME).exists()
    assert not list((tmp_path / "bad" / "data").iterdir())  # partial file removed
    assert ckpt.verify(good, deep=True).ok


def test_manifest_roundtrip(tmp_path):
    m = ckpt.save({"a": ckpt.FlatShard(torch.randn(6), (2, 3), 0), "o": {"x": 1}}, str(tmp_path / "c"),
                  step=9, user_metadata={"model": "tiny"})
    again = decode_manifest(encode_manifest(m))
    assert again.to_dict() == m.to_dict()
    assert again.user_metadata == {"model": "tiny"} and again.step == 9


def test_garbage_manifest_is_a_manifest_error(tmp_path):
    url = tmp_path / "c"
    url.mkdir()
    (url / MANIFEST_NAME).write_bytes(b"\xc1\xff garbage")
    with pytest.raises(ckpt.ManifestError):
        ckpt.inspect(str(url))
    (url / MANIFEST_NAME).write_bytes(msgpack.packb({"format": "ckpt", "version": [1, 0], "files": {},
                                                     "tensors": {"a": {"dtype": "float32"}}, "objects": {}}))
    with pytest.raises(ckpt.ManifestError, match="'shape' is missing"):
        ckpt.inspect(str(url))


def test_load_verify_detects_corruption_and_fills_nothing(tmp_path):
    url = str(tmp_path / "c")
    src = {"a": torch.randn(64, 16), "b": torch.randn(32)}
    m = ckpt.save(src, url)
    dst = {"a": torch.zeros(64, 16), "b": torch.zeros(32)}
    ckpt.load(dst, url, verify=True)
    assert torch.equal(dst["a"], src["a"])
    s = m.tensors["a"].shards[0]
    path = os.path.join(url, s.file)
    with open(path, "r+b") as f:
        f.seek(s.offset + 1000)
        byte = f.read(1)
        f.seek(s.offset + 1000)
        f.write(bytes([byte[0] ^ 0x80]))
    dst = {"a": torch.zeros(64, 16), "b": torch.zeros(32)}
    with pytest.raises(ckpt.IntegrityError, match=r"'a' shard 0: checksum mismatch in data/.*bytes \["):
        ckpt.load(dst, url, verify=True)
    assert not dst["a"].any() and not dst["b"].any()  # nothing filled with unverified bytes
    # a request that does not touch the corrupted shard still loads with verification
    only_b = {"b": torch.zeros(32)}
    ckpt.load(only_b, url, verify=True, strict=False)
    assert torch.equal(only_b["b"], src["b"])
