"""DeepSpeed ZeRO-1/2/3 checkpoints, of fp32 and of bf16 training, and their universal conversions (made
by DeepSpeed itself on CPU: tests/fixtures/deepspeed/make_fixtures.py) read in place and imported: fp32
parameters bitwise equal to DeepSpeed's own zero_to_fp32 reconstruction, Adam moments consistent across
stages and formats (bitwise equal to DeepSpeed's gathered ones for bf16), hostile and damaged files
refused. DeepSpeed is not needed to run these tests."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ckpt
from ckpt.convert import import_checkpoint
from ckpt.errors import CheckpointError, IntegrityError, ManifestError
from ckpt.interop.deepspeed import deepspeed_manifest

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
    assert m.user_metadata["source"]["mixed_precision"] is None
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

    from ckpt.convert import export_dcp

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


UNIVERSAL = (2, 3)  # ds_to_universal of the ZeRO-2 and ZeRO-3 fixtures: zero<s>/global_step2_universal
UC = "global_step2_universal"


def _optim_objects(url: str) -> dict:
    return ckpt.load({"optim": {"step": None, "param_groups": None}}, url)["optim"]


@pytest.mark.parametrize("stage", UNIVERSAL)
def test_universal_checkpoint_loads_bitwise_equal(stage):
    """ZeRO-2's universal files hold ``{"param": tensor, "cat_dim": 0}``, ZeRO-3's bare flat tensors: both
    read as whole tensors, bitwise equal to the ground truth and to the ZeRO reader's reassembly of the
    checkpoint they were converted from (moments and buffer included), plain and resharded."""
    url = str(FIXTURES / f"zero{stage}" / UC)
    m = ckpt.inspect(url)
    src = m.user_metadata["source"]
    assert m.source_format == "deepspeed" and src["universal"] and src["zero_stage"] == stage and m.step == 2
    expected, got, zero = _expected(stage), _all(url), _all(str(FIXTURES / f"zero{stage}"))
    for name, shape in PARAMS.items():
        assert got[f"model.{name}"].shape == shape
        assert torch.equal(got[f"model.{name}"], expected[f"model.{name}"]), name
    assert got.keys() == zero.keys() and all(torch.equal(got[k], zero[k]) for k in zero)
    assert torch.equal(got["model.scale"], torch.tensor([0.5, 2.0, 1.5]))  # from the model file, not zero/scale
    out = ckpt.load({"model": {"a": {"weight": ckpt.Shard(torch.zeros(2, 7), (5, 7), (3, 0))},
                               "b": {"weight": ckpt.FlatShard(torch.zeros(9), (3, 5), 4)}},
                     "optim": {"state": {"a.bias": {"exp_avg_sq": ckpt.Shard(torch.zeros(3), (5,), (1,))}}}},
                    url, strict=False)
    assert torch.equal(out["model"]["a"]["weight"].local, expected["model.a.weight"][3:])
    assert torch.equal(out["model"]["b"]["weight"].local, expected["model.b.weight"].reshape(-1)[4:13])
    assert torch.equal(out["optim"]["state"]["a.bias"]["exp_avg_sq"].local, zero["optim.state.a.bias.exp_avg_sq"][1:4])
    assert _optim_objects(url) == _optim_objects(str(FIXTURES / f"zero{stage}"))
    assert _optim_objects(url)["step"] == 2.0
    for t in m.tensors.values():  # whole tensors, inside their files
        assert len(t.shards) == 1 and t.shards[0].length == t.numel * 4
        assert t.shards[0].offset + t.shards[0].length <= m.files[t.shards[0].file]


@pytest.mark.parametrize("stage", UNIVERSAL)
def test_universal_import_gives_an_equal_ckpt_checkpoint(tmp_path, stage):
    """``ckpt import`` (the CLI) of a universal checkpoint: a verified ckpt checkpoint, bitwise equal."""
    from typer.testing import CliRunner

    from ckpt.cli.app import app

    src = str(FIXTURES / f"zero{stage}" / UC)
    r = CliRunner().invoke(app, ["import", src, str(tmp_path / "c"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["source_format"] == "deepspeed" and json.loads(r.output)["tensors"] == 13
    m = ckpt.inspect(str(tmp_path / "c"))
    assert m.user_metadata["source"]["format"] == "deepspeed" and m.user_metadata["source"]["universal"]
    assert ckpt.verify(str(tmp_path / "c"), deep=True).ok
    got, ref = _all(str(tmp_path / "c")), _all(src)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    expected = _expected(stage)
    assert all(torch.equal(got[f"model.{n}"], expected[f"model.{n}"]) for n in PARAMS)
    assert _optim_objects(str(tmp_path / "c")) == _optim_objects(src)
    r = ckpt.verify(src)
    assert r.ok and r.source_format == "deepspeed"


def test_universal_found_through_latest_universal(tmp_path):
    """``ds_to_universal`` writes ``latest_universal`` beside the output; with ``latest`` there too, the
    ZeRO checkpoint it names is what the directory means (DeepSpeed's own ``load_checkpoint`` default)."""
    d = _copy(tmp_path, 2)
    assert "universal" not in deepspeed_manifest(str(d)).user_metadata["source"]
    os.remove(d / "latest")
    shutil.rmtree(d / "global_step2")
    m = deepspeed_manifest(str(d))
    assert m.user_metadata["source"]["universal"] and m.user_metadata["source"]["tag"] == UC
    assert all(s.file.startswith(f"{UC}/") for t in m.tensors.values() for s in t.shards)
    ref = deepspeed_manifest(str(FIXTURES / "zero2" / UC))
    assert {k: t.shape for k, t in m.tensors.items()} == {k: t.shape for k, t in ref.tensors.items()}
    assert ckpt.inspect(str(d)).user_metadata["source"]["tag"] == UC  # detection follows it too
    got, want = _all(str(d)), _all(str(FIXTURES / "zero2" / UC))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("stage", UNIVERSAL)
@pytest.mark.parametrize("victim", ["zero/a.weight/exp_avg.pt", "zero/b.bias/fp32.pt", "zero/optimizer_state.pt"])
def test_truncated_or_garbage_universal_file_is_named(tmp_path, stage, victim):
    d = _copy(tmp_path, stage) / UC
    data = (d / victim).read_bytes()
    for damaged in (data[:-200], data[: len(data) // 2], b"\x00" * len(data), b""):
        (d / victim).write_bytes(damaged)
        with pytest.raises(CheckpointError, match=re.escape(str(d / victim))) as e:
            ckpt.inspect(str(d))
        assert isinstance(e.value, (IntegrityError, ManifestError))


def test_incomplete_or_hostile_universal_checkpoint_is_refused(tmp_path):
    d = _copy(tmp_path, 2) / UC
    os.remove(d / "zero" / "a.bias" / "fp32.pt")
    with pytest.raises(ManifestError, match=r"zero/a\.bias/fp32\.pt is missing"):
        ckpt.inspect(str(d))
    os.remove(d / "zero" / "optimizer_state.pt")
    with pytest.raises(ManifestError, match=r"zero/optimizer_state\.pt is missing"):
        ckpt.inspect(str(d))
    d = _copy(tmp_path / "h", 2) / UC
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"param": Boom()}, d / "zero" / "b.weight" / "exp_avg_sq.pt")
    with pytest.raises(IntegrityError, match="refusing to unpickle global '(posix|os).system'"):
        ckpt.inspect(str(d))
    assert not marker.exists()
    torch.save({"param": torch.zeros(4, 4)}, d / "zero" / "b.weight" / "exp_avg_sq.pt")
    with pytest.raises(ManifestError, match=r"b\.weight/exp_avg_sq\.pt: exp_avg_sq is \[4, 4\], the parameter \[3, 5"):
        ckpt.inspect(str(d))


def test_universal_names_never_lead_out_of_the_checkpoint(tmp_path):
    d = _copy(tmp_path, 2)
    (tmp_path / "fp32.pt").write_bytes((d / UC / "zero" / "a.bias" / "fp32.pt").read_bytes())
    torch.save({"module": {}, "buffer_names": [], "param_shapes": [{"../../..": torch.Size([5])}]},
               d / UC / "mp_rank_00_model_states.pt")
    with pytest.raises(ManifestError, match=r"'\.\./\.\./\.\.' is not a plain file name"):
        ckpt.inspect(str(d / UC))
    os.remove(d / "latest")
    (d / "latest_universal").write_text("../zero3/global_step2_universal")
    with pytest.raises(ManifestError, match="latest_universal: .* is not a plain file name"):
        deepspeed_manifest(str(d))
    with pytest.raises(CheckpointError, match="latest_universal or zero/"):  # not detected: the formats listed
        ckpt.inspect(str(d))


# bf16 training (make_fixtures.py --bf16-only): the ZeRO-1/2/3 optimizers, DeepSpeed's BF16_Optimizer
# (ZeRO-1 with fp32 gradient accumulation) and ZeRO-2 keeping bf16 master weights and moments
BF16 = {"bf16_zero1": (1, "DeepSpeedZeroOptimizer"), "bf16_zero2": (2, "DeepSpeedZeroOptimizer"),
        "bf16_zero3": (3, "DeepSpeedZeroOptimizer_Stage3"), "bf16_zero1_fp32accum": (1, "BF16_Optimizer"),
        "bf16_zero2_bf16master": (2, "DeepSpeedZeroOptimizer")}
BF16_OPT = "bf16_zero1_fp32accum"


def _bf16_expected(name: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's own: ``model.*`` from zero_to_fp32 (the engine's gathered fp32 parameters for
    BF16_Optimizer, which zero_to_fp32 refuses), moments gathered by the engine (always float32)."""
    return safetensors.torch.load_file(str(FIXTURES / name / "expected.safetensors"))


@pytest.mark.parametrize("name", BF16)
def test_bf16_training_reads_master_weights_and_moments_bitwise(name):
    """The master weights (float32, or bf16 where DeepSpeed was told to keep them so) and Adam moments
    of bf16 training, read from the ``bf16_zero_pp_rank_*`` files in place: bitwise DeepSpeed's own,
    plain and resharded (a Shard and a FlatShard that cross the rank partitions)."""
    url = str(FIXTURES / name)
    stage, optimizer = BF16[name]
    m = ckpt.inspect(url)
    src = m.user_metadata["source"]
    assert m.source_format == "deepspeed" and m.step == 2
    assert (src["zero_stage"], src["mixed_precision"], src["optimizer"]) == (stage, "bf16", optimizer)
    master = torch.bfloat16 if name.endswith("bf16master") else torch.float32
    for key, t in m.tensors.items():
        if key == "model.scale":  # the buffer, from the model file
            continue
        assert t.dtype == str(master).removeprefix("torch."), key
        assert all(os.path.basename(s.file).startswith("bf16_zero_pp_rank_") for s in t.shards), key
        assert sum(s.length for s in t.shards) == t.numel * master.itemsize  # byte ranges, not whole files
    expected, got = _bf16_expected(name), _all(url)
    assert got.keys() == expected.keys() and len(got) == 13  # 4 parameters, the buffer, 8 moments
    for key, want in expected.items():
        if key.startswith("optim."):  # the engine gathers moments as float32; bf16 ones widen exactly
            assert got[key].dtype == master, key
            want = want.to(master)
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
    out = ckpt.load({"model": {"a": {"weight": ckpt.Shard(torch.zeros(2, 7, dtype=master), (5, 7), (3, 0))},
                               "b": {"weight": ckpt.FlatShard(torch.zeros(9, dtype=master), (3, 5), 4)}},
                     "optim": {"state": {"a.weight": {"exp_avg": ckpt.FlatShard(torch.zeros(12, dtype=master),
                                                                                 (5, 7), 20)}}}},
                    url, strict=False)
    assert torch.equal(out["model"]["a"]["weight"].local, expected["model.a.weight"][3:])
    assert torch.equal(out["model"]["b"]["weight"].local, expected["model.b.weight"].reshape(-1)[4:13])
    assert torch.equal(out["optim"]["state"]["a.weight"]["exp_avg"].local,
                       expected["optim.state.a.weight.exp_avg"].to(master).reshape(-1)[20:32])
    objects = _optim_objects(url)
    assert objects["step"] == 2.0 and objects["param_groups"][0]["lr"] == 0.01


def test_bf16_layouts_agree():
    """The same bf16 training, partitioned four ways (ZeRO-1/2 by group with alignment paddings,
    ZeRO-3 per parameter, BF16_Optimizer packed): equal reassemblies check the maps independently of
    the ground truth files."""
    runs = {n: _all(str(FIXTURES / n)) for n in BF16 if not n.endswith("bf16master")}
    ref = runs.pop("bf16_zero1")
    for n, got in runs.items():
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-8, msg=f"{n} {k}")


@pytest.mark.parametrize("name", [BF16_OPT, "bf16_zero3"])
def test_bf16_import_cli_round_trip(tmp_path, name):
    """``ckpt import`` (the CLI) of a bf16 training checkpoint: a verified ckpt checkpoint, bitwise
    equal to the source and to DeepSpeed's own fp32 master weights, its source recorded as bf16."""
    from typer.testing import CliRunner

    from ckpt.cli.app import app

    src = str(FIXTURES / name)
    r = CliRunner().invoke(app, ["import", src, str(tmp_path / "c"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["source_format"] == "deepspeed" and json.loads(r.output)["tensors"] == 13
    m = ckpt.inspect(str(tmp_path / "c"))
    source = m.user_metadata["source"]
    assert source["format"] == "deepspeed" and source["mixed_precision"] == "bf16"
    assert source["optimizer"] == BF16[name][1] and m.step == 2
    assert ckpt.verify(str(tmp_path / "c"), deep=True).ok
    got, ref, expected = _all(str(tmp_path / "c")), _all(src), _bf16_expected(name)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
    assert _optim_objects(str(tmp_path / "c")) == _optim_objects(src)
    r = ckpt.verify(src)
    assert r.ok and r.source_format == "deepspeed"


def _copy_bf16(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


@pytest.mark.parametrize("name", [BF16_OPT, "bf16_zero3"])
@pytest.mark.parametrize("rank", [0, 1])
def test_truncated_or_garbage_bf16_file_is_named(tmp_path, name, rank):
    d = _copy_bf16(tmp_path, name)
    victim = d / "global_step2" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    for damaged in (data[:-200], data[: len(data) // 2], b"\x00" * len(data), b""):
        victim.write_bytes(damaged)
        with pytest.raises(CheckpointError, match=re.escape(str(victim))) as e:
            ckpt.inspect(str(d))
        assert isinstance(e.value, (IntegrityError, ManifestError))


def test_missing_or_doubled_bf16_rank_file_is_named(tmp_path):
    d = _copy_bf16(tmp_path, "bf16_zero2")
    shutil.copy(FIXTURES / "zero2" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", d / "global_step2")
    with pytest.raises(ManifestError, match=r"both bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt and "
                                            r"zero_pp_rank_1_mp_rank_00_optim_states\.pt"):
        ckpt.inspect(str(d))
    os.remove(d / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(ManifestError, match=r"rank files of a bf16 and of a non-bf16 save mixed \("
                                            r"bf16_zero_pp_rank_0_mp_rank_00_optim_states\.pt, zero_pp_rank_1"):
        ckpt.inspect(str(d))
    os.remove(d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(ManifestError, match=r"rank file.*'bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt'.*missing"):
        ckpt.inspect(str(d))


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """A stand-in for the one DeepSpeed class a BF16_Optimizer rank file pickles (``fragment_address``,
    a dataclass), so that a test can rewrite such a file with torch.load / torch.save, without DeepSpeed."""
    mod = types.ModuleType("deepspeed.utils.tensor_fragment")

    @dataclasses.dataclass
    class fragment_address:  # noqa: N801 - DeepSpeed's name
        numel: int
        start: int

    fragment_address.__module__, fragment_address.__qualname__ = mod.__name__, "fragment_address"
    mod.fragment_address = fragment_address  # type: ignore[attr-defined]
    for name in ("deepspeed", "deepspeed.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)


def _rewrite(path: Path, change) -> None:
    sd = torch.load(path, weights_only=False)
    change(sd["optimizer_state_dict"], sd)
    torch.save(sd, path)


@pytest.mark.usefixtures("fake_deepspeed")
def test_bf16_optimizer_files_the_reader_cannot_map_are_refused(tmp_path):
    """BF16_Optimizer files: a parameter slice map that disagrees with the layout, a ds_config stage it
    is never used with, or ranks whose partitions differ in dtype: a ManifestError naming the file."""
    d = _copy_bf16(tmp_path, BF16_OPT)
    rank1 = d / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    original = rank1.read_bytes()
    _rewrite(rank1, lambda osd, _: setattr(osd["param_slice_mappings"][0]["b.bias"], "start", 24))
    with pytest.raises(ManifestError, match=re.escape(rank1.name) + r": group 0's parameter slices \("
                                            r"param_slice_mappings.*'b\.bias': \(24, 3\)"):
        ckpt.inspect(str(d))
    rank0 = d / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    rank1.write_bytes(original)
    _rewrite(rank0, lambda _, top: top["ds_config"]["zero_optimization"].update(stage=3))
    with pytest.raises(ManifestError, match=re.escape(rank0.name) + ": a BF16_Optimizer file .* stage 3"):
        ckpt.inspect(str(d))
    shutil.copy(FIXTURES / BF16_OPT / "global_step2" / rank0.name, rank0)

    def halve(osd, _):
        osd["single_partition_of_fp32_groups"] = [g.bfloat16() for g in osd["single_partition_of_fp32_groups"]]

    _rewrite(rank1, halve)
    with pytest.raises(ManifestError, match="partitioned in different dtypes across ranks"):
        ckpt.inspect(str(d))
    assert ckpt.inspect(str(FIXTURES / BF16_OPT)).user_metadata["source"]["optimizer"] == "BF16_Optimizer"


def _rewrite_model(path: Path, change) -> None:
    sd = torch.load(path, weights_only=False)
    change(sd)
    torch.save(sd, path)


def test_a_name_given_twice_is_refused_not_silently_replaced(tmp_path):
    """A parameter param_shapes names twice (in two groups), or a buffer named like a parameter: one
    would silently replace the other's bytes; a ManifestError naming the name instead."""
    import collections

    d = _copy(tmp_path, 3)
    model = d / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    _rewrite_model(model, lambda sd: sd["param_shapes"].append(collections.OrderedDict([("a.bias", torch.Size([5]))])))
    with pytest.raises(ManifestError, match=r"param_shapes names parameter 'a\.bias' twice"):
        ckpt.inspect(str(d))
    for stage, name in ((3, "zero_pp_rank_0_mp_rank_00_model_states.pt"), (2, "mp_rank_00_model_states.pt")):
        d = _copy(tmp_path / "buffer", stage)
        _rewrite_model(d / "global_step2" / name, lambda sd: sd["buffer_names"].append("a.weight"))
        with pytest.raises(ManifestError, match=r"'a\.weight' is both a parameter and a buffer"):
            ckpt.inspect(str(d))
