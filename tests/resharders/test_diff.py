"""``diff``: equal / close / different / missing / mismatch, whatever the two layouts."""

from __future__ import annotations

import math

import pytest
import torch

import ckpt
from ckpt.errors import ManifestError, StateError
from ckpt.layout import Layout
from ckpt.resharders.diff import CLOSE, DIFFERENT, EQUAL, MISMATCH, ONLY_A, ONLY_B, diff
from ckpt.resharders.reshard import reshard


def base() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model.lm_head.weight": torch.randn(10, 6, generator=g),
            "model.model.layers.0.mlp.experts.gate_proj": torch.randn(4, 6, 3, generator=g).bfloat16(),
            "ids": torch.arange(12), "mask": torch.ones(3, dtype=torch.bool), "step": 3}


def test_equal_across_layouts_and_in_small_parts(tmp_path):
    ckpt.save(base(), str(tmp_path / "a"))
    reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout.parse("tp=2,ep=4,dp=2,zero=1"))
    r = diff(str(tmp_path / "a"), str(tmp_path / "b"), chunk_bytes=1)  # parts of one element
    assert r.ok and r.counts() == {EQUAL: 4} and r.objects[0].status == EQUAL
    assert r.bytes_compared == 2 * sum(t.nbytes for t in ckpt.inspect(str(tmp_path / "a")).tensors.values())


def test_differences_are_named(tmp_path):
    a, b = base(), base()
    b["model.lm_head.weight"][2, 3] += 0.25
    b["model.model.layers.0.mlp.experts.gate_proj"][1, 0, 0] = float("nan")
    b["ids"] = torch.arange(12).reshape(3, 4)
    del b["mask"]
    b["extra"] = torch.zeros(2)
    b["step"] = 4
    ckpt.save(a, str(tmp_path / "a"))
    ckpt.save(b, str(tmp_path / "b"))
    r = diff(str(tmp_path / "a"), str(tmp_path / "b"))
    by = {t.key: t for t in r.tensors}
    assert not r.ok
    assert by["model.lm_head.weight"].status == DIFFERENT and by["model.lm_head.weight"].differing == 1
    assert by["model.lm_head.weight"].max_abs_diff == pytest.approx(0.25, abs=1e-6)
    nan = by["model.model.layers.0.mlp.experts.gate_proj"]
    assert nan.status == DIFFERENT and nan.max_abs_diff is not None and math.isnan(nan.max_abs_diff)
    assert by["ids"].status == MISMATCH and by["mask"].status == ONLY_A and by["extra"].status == ONLY_B
    assert r.objects[0].status == DIFFERENT
    d = r.to_dict()
    dn = next(t for t in d["tensors"] if t["key"] == nan.key)
    assert d["ok"] is False and dn["max_abs_diff"] is None and dn["max_abs_diff_is_nan"]
    # within a tolerance: close, not equal
    b2 = base()
    b2["model.lm_head.weight"][0, 0] += 1e-3
    ckpt.save(b2, str(tmp_path / "c"))
    r = diff(str(tmp_path / "a"), str(tmp_path / "c"), atol=1e-2)
    assert r.ok and {t.key: t.status for t in r.tensors}["model.lm_head.weight"] == CLOSE
    assert not diff(str(tmp_path / "a"), str(tmp_path / "c"), atol=1e-4).ok


def test_bad_input(tmp_path):
    ckpt.save(base(), str(tmp_path / "a"))
    with pytest.raises(ManifestError, match="no committed checkpoint"):
        diff(str(tmp_path / "a"), str(tmp_path / "missing"))
    with pytest.raises(StateError, match="atol"):
        diff(str(tmp_path / "a"), str(tmp_path / "a"), atol=-1)


def test_per_rank_objects_compare_on_common_ranks(tmp_path):
    ckpt.save({"w": torch.ones(4), "rng": ckpt.PerRank([1, 2])}, str(tmp_path / "a"))
    reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout.parse("dp=3"))  # rng now on ranks 0, 1, 2
    assert sorted(ckpt.inspect(str(tmp_path / "b")).objects["rng"].per_rank or {}) == [0, 1, 2]
    r = diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.ok and r.objects[0].b == "per-rank object (3 ranks)"
    ckpt.save({"w": torch.ones(4), "rng": ckpt.PerRank([1, 3])}, str(tmp_path / "c"))
    assert [o.status for o in diff(str(tmp_path / "b"), str(tmp_path / "c")).objects] == [DIFFERENT]
    ckpt.save({"w": torch.ones(4), "rng": [1, 2]}, str(tmp_path / "d"))
    assert [o.status for o in diff(str(tmp_path / "a"), str(tmp_path / "d")).objects] == [DIFFERENT]
