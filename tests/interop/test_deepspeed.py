"""DeepSpeed ZeRO-1/2/3 checkpoints (made by DeepSpeed itself on CPU: tests/fixtures/deepspeed/
make_fixtures.py) read in place and imported: fp32 parameters bitwise equal to DeepSpeed's own
zero_to_fp32 reconstruction, Adam moments consistent across stages, hostile and damaged files refused.
DeepSpeed is not needed to run these tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ckpt
from ckpt.errors import IntegrityError, ManifestError
from ckpt.formats.convert import import_checkpoint
from ckpt.formats.deepspeed import deepspeed_manifest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
STAGES = (1, 2, 3)
PARAMS = {"a.weight": (5, 7), "a.bias": (5,), "b.weight": (3, 5), "b.bias": (3,)}


def _expected(stage: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(FIXTURES / f"zero{stage}" / "expected.safetensors"))


def _all(url: str) -> dict[str, torch.Tensor]:
    m = ckpt.inspect(url)
    out = ckpt.load({k: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for k, t in m.tensors.items()}, url,
                    strict=False)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("stage", STAGES)
def test_fp32_parameters_equal_deepspeeds_own_reconstruction(stage):
    url = str(FIXTURES / f"zero{stage}")
    m = ckpt.inspect(url)
    assert m.source_format == "deepspeed" and m.user_metadata["source"]["zero_stage"] == stage
    assert m.step == 2
    expected = _expected(stage)
    got = _all(url)
    for name in PARAMS:
        assert torch.equal(got[f"model.{name}"], expected[f"model.{name}"]), name
    assert torch.equal(got["model.scale"], torch.tensor([0.5, 2.0, 1.5]))  # the buffer
    # a resharded read (rows of a.weight, a flat range of b.weight) reads only its ranges
    out = ckpt.load({"model": {"a": {"weight": ckpt.Shard(torch.zeros(2, 7), (5, 7), (3, 0))},
                               "b": {"weight": ckpt.FlatShard(torch.zeros(9), (3, 5), 4)}}}, url, strict=False)
    assert torch.equal(out["model"]["a"]["weight"].local, expected["model.a.weight"][3:])
    assert torch.equal(out["model"]["b"]["weight"].local, expected["model.b.weight"].reshape(-1)[4:13])
    assert ckpt.load({"optim": {"step": None}}, url)["optim"]["step"] == 2.0


def test_adam_moments_agree_across_stages():
    """The three fixtures trained the same model on the same data: ZeRO-1, -2 and -3 partition the
    moments differently (ZeRO-1/2 by group, ZeRO-3 per parameter, with different paddings), so equal
    moments after reassembly check the partition maps independently of the parameters."""
    runs = {s: _all(str(FIXTURES / f"zero{s}")) for s in STAGES}
    for name in PARAMS:
        for kind in ("exp_avg", "exp_avg_sq"):
            key = f"optim.state.{name}.{kind}"
            ref = runs[1][key]
            assert ref.shape == PARAMS[name] and ref.abs().sum() > 0
            for s in (2, 3):
                torch.testing.assert_close(runs[s][key], ref, rtol=1e-5, atol=1e-8, msg=f"zero{s} {key}")
        for s in (2, 3):
            torch.testing.assert_close(runs[s][f"model.{name}"], runs[1][f"model.{name}"], rtol=1e-5, atol=1e-7)
    assert all((runs[s][f"optim.state.{n}.exp_avg_sq"] >= 0).all() for s in STAGES for n in PARAMS)


@pytest.mark.parametrize("stage", STAGES)
def test_import_gives_a_verified_ckpt_checkpoint(tmp_path, stage):
    src = str(FIXTURES / f"zero{stage}")
    m = import_checkpoint(src, str(tmp_path / "c"))
    assert m.user_metadata["source"]["format"] == "deepspeed"
    assert ckpt.verify(str(tmp_path / "c"), deep=True).ok
    got, ref = _all(str(tmp_path / "c")), _all(src)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    r = ckpt.verify(src)
    assert r.ok and r.source_format == "deepspeed" and "no checksums" in r.note


def _copy(tmp_path: Path, stage: int) -> Path:
    dst = tmp_path / f"zero{stage}"
    shutil.copytree(FIXTURES / f"zero{stage}", dst)
    return dst


def test_missing_rank_file_is_named(tmp_path):
    d = _copy(tmp_path, 2)
    os.remove(d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(ManifestError, match="rank file.*zero_pp_rank_1_mp_rank_00_optim_states.pt.*missing"):
        ckpt.inspect(str(d))


def test_hostile_and_truncated_files_are_refused(tmp_path):
    d = _copy(tmp_path, 1)
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    target = d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"x": Boom()}}, target)
    with pytest.raises(IntegrityError, match="refusing to unpickle global '(posix|os).system'"):
        ckpt.inspect(str(d))
    assert not marker.exists()
    d3 = _copy(tmp_path, 3)
    f = d3 / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:-200])
    with pytest.raises((IntegrityError, ManifestError), match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        ckpt.inspect(str(d3))


def test_tag_directory_itself_is_accepted():
    m = ckpt.inspect(str(FIXTURES / "zero3" / "global_step2"))
    assert m.user_metadata["source"]["zero_stage"] == 3 and "model.a.weight" in m.tensors


def test_manifest_offsets_stay_inside_the_files():
    for stage in STAGES:
        m = deepspeed_manifest(str(FIXTURES / f"zero{stage}"))
        for t in m.tensors.values():
            assert sum(s.length for s in t.shards) == t.numel * 4 or t.dtype != "float32"
            for s in t.shards:
                assert s.offset + s.length <= m.files[s.file]


def test_deepspeed_to_dcp_loads_in_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckpt.formats.convert import export_dcp

    src = str(FIXTURES / "zero3")
    export_dcp(src, str(tmp_path / "d"))
    expected = _expected(3)
    sd = {"model": {n: torch.zeros(shape) for n, shape in PARAMS.items()}}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.load(sd, checkpoint_id=str(tmp_path / "d"))
    for n in PARAMS:
        assert torch.equal(sd["model"][n], expected[f"model.{n}"]), n


def test_a_fifo_in_place_of_a_rank_file_is_refused_not_opened(tmp_path):
    d = _copy(tmp_path, 1)
    f = d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(ckpt.StorageError, match="not a regular file"):
        ckpt.inspect(str(d))  # would block forever in open() otherwise
