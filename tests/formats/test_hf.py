"""Hugging Face export/import of the embedded MoE: transformers loads the export with no missing keys
and the same logits; HF checkpoints round-trip bitwise through import and export; bad input fails
with a typed error before anything is written."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import ckpt
from ckpt.hf.convert import export_hf, import_hf, param_shapes, parse_size
from ckpt.layout import Layout
from ckpt.resharders.rules import MOE_RULES, param_box
from ckpt.trainer.hf_adapters import from_hf_state_dict, to_hf_state_dict
from ckpt.trainer.model import CONFIGS, ModelConfig, MoEForCausalLM
from ckpt.trainer.model_config import hf_config
from tests.dist_utils import run_ranks

TINY = CONFIGS["tiny"]
LAYOUT = Layout(tp=2, ep=2)
SEED = 3
RTOL = 1e-5


@pytest.fixture(scope="module")
def transformers() -> ModuleType:
    return pytest.importorskip("transformers")


def _meta(cfg: ModelConfig = TINY, layout: Layout = LAYOUT, **extra: Any) -> dict[str, Any]:
    return {"model_config": cfg.to_dict(), "layout": layout.to_dict(), "rules": "embedded-moe", **extra}


def _model(seed: int = SEED) -> MoEForCausalLM:
    model = MoEForCausalLM(TINY)
    model.init_weights(seed)
    return model.eval()


def _save_rank(rank: int, world: int, path: str) -> None:
    """One rank of a tp=2 x ep=2 trainer: its boxes of every parameter, a fake optimizer state, objects."""
    model = _model()
    coord = LAYOUT.coord(rank)
    state: dict[str, Any] = {"model": {}, "optim": {"exp_avg": {}}}
    for name, p in model.named_parameters():
        box = param_box(name, tuple(p.shape), LAYOUT, coord, MOE_RULES)
        local = p.detach()[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))].clone()
        state["model"][name] = ckpt.Shard(local, tuple(p.shape), box.offsets)
        state["optim"]["exp_avg"][name] = ckpt.Shard(local * 0.5, tuple(p.shape), box.offsets)
    state["train"] = {"step": 5, "tokens": 1234}
    state["rng"] = ckpt.PerRank([rank, "rng"])
    ckpt.save(state, path, step=5, user_metadata=_meta(), layout=LAYOUT.to_dict())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("sharded") / "step-5")
    run_ranks(LAYOUT.world_size, _save_rank, path)
    m = ckpt.inspect(path)
    assert m.world_size == 4 and len(m.files) == 4
    assert len(m.tensors["model.model.layers.0.mlp.experts.down_proj"].shards) == 4  # ep x tp boxes
    return path


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _assert_rel(a: torch.Tensor, b: torch.Tensor) -> None:
    rel = ((a - b).abs().max() / b.abs().max()).item()
    assert rel <= RTOL, f"max relative difference {rel:.3g} > {RTOL}"


def _hf_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors |= load_file(str(f))
    return tensors


def _from_pretrained(transformers: ModuleType, out: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager", experts_implementation="eager", dtype=dtype)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[kind], (kind, info[kind])
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    return hf.eval()


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiproc
def test_export_from_sharded_layout_loads_in_transformers(sharded: str, tmp_path: Path,
                                                          transformers: ModuleType) -> None:
    out = tmp_path / "hf"
    limit = 150_000  # the fp32 tiny model is ~728 KB: several files
    seen: list[tuple[int, int]] = []
    r = export_hf(sharded, str(out), max_shard_size=limit, progress=lambda d, t: seen.append((d, t)))

    # Files: model-0000k-of-0000n, each within the limit, the index exact.
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n >= 4 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)] == r.files
    assert all((out / f).stat().st_size <= limit for f in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = _hf_tensors(out)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == nbytes == r.total_size
    assert set(index["weight_map"]) == set(tensors)
    for key, f in index["weight_map"].items():
        with safe_open(str(out / f), "pt") as sf:
            names = sf.keys()
            assert key in names and sf.metadata() == {"format": "pt"}
    assert seen[-1] == (r.total_size, r.total_size)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"

    # Names and values: exactly what save_pretrained writes for the trainer's model (per expert).
    model = _model()
    expected = to_hf_state_dict(model)
    assert set(tensors) == set(expected)
    assert "model.layers.3.mlp.experts.3.down_proj.weight" in tensors
    for k, v in expected.items():
        assert torch.equal(tensors[k], v), k

    # The trainer's model loaded from the sharded checkpoint and transformers' model from the
    # export give the same logits.
    trainer = MoEForCausalLM(TINY).eval()
    ckpt.load({"model": trainer.state_dict()}, sharded, strict=False)
    hf = _from_pretrained(transformers, out)
    for seed in (0, 1):
        ids = _ids(seed)
        _assert_rel(_logits(hf, ids), _logits(trainer, ids))


@pytest.mark.multiproc
def test_export_bf16(sharded: str, tmp_path: Path, transformers: ModuleType) -> None:
    out = tmp_path / "hf"
    r = export_hf(sharded, str(out), dtype="bf16")
    assert r.files == ["model-00001-of-00001.safetensors"] and r.dtype == "bfloat16"
    tensors = _hf_tensors(out)
    for k, v in to_hf_state_dict(_model()).items():
        assert tensors[k].dtype == torch.bfloat16 and torch.equal(tensors[k], v.to(torch.bfloat16)), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = _from_pretrained(transformers, out, dtype=torch.bfloat16)
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_check_reloads_and_records_the_logits_difference(sharded: str, tmp_path: Path,
                                                                 transformers: ModuleType, dtype: str) -> None:
    from typer.testing import CliRunner

    from ckpt.cli.app import app

    out = tmp_path / "hf"
    r = CliRunner().invoke(app, ["export-hf", sharded, str(out), "--dtype", dtype, "--check", "--json"])
    assert r.exit_code == 0, r.output
    check = json.loads(r.output)["check"]
    assert check["max_abs_logits_diff"] < 1e-4  # the bf16 case compares against bf16-rounded source weights
    assert json.loads((out / "ckpt_check.json").read_text()) == check
    assert check["exported_dtype"] == ("bfloat16" if dtype == "bf16" else "float32")
    # a broken export is caught: flip one weight and check again
    from ckpt.hf.check import check_export

    f = out / "model-00001-of-00001.safetensors"
    tensors = safetensors.torch.load_file(str(f))
    key = "model.embed_tokens.weight"
    tensors[key] = tensors[key] + 1
    safetensors.torch.save_file(tensors, str(f), metadata={"format": "pt"})
    assert check_export(sharded, str(out))["max_abs_logits_diff"] > 1e-2


@pytest.mark.multiproc
def test_export_streams_within_memory_budget(sharded: str, tmp_path: Path) -> None:
    largest = TINY.vocab_size * TINY.hidden_size * 4  # embed_tokens / lm_head, fp32
    budget = 16 * 1024
    small = export_hf(sharded, str(tmp_path / "small"), memory_budget=budget, max_shard_size=300_000, workers=2)
    big = export_hf(sharded, str(tmp_path / "big"), max_shard_size=300_000)
    assert small.buffer_bytes <= budget + largest
    assert small.files == big.files
    for f in big.files:  # byte-identical whatever the budget
        assert (tmp_path / "small" / f).read_bytes() == (tmp_path / "big" / f).read_bytes(), f
    # fp16 adds a cast buffer per tensor and still fits.
    half = export_hf(sharded, str(tmp_path / "half"), dtype="fp16", memory_budget=budget)
    assert half.buffer_bytes <= budget + largest + largest // 2


def test_export_drops_vocab_padding(tmp_path: Path) -> None:
    model = _model()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        state[k] = torch.cat([state[k], torch.full((8, TINY.hidden_size), 7.0)])  # padded to 264 rows
    ckpt.save({"model": state}, str(tmp_path / "c"), user_metadata=_meta(layout=Layout()))
    export_hf(str(tmp_path / "c"), str(tmp_path / "hf"))
    tensors = _hf_tensors(tmp_path / "hf")
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(tensors[k], model.state_dict()[k]), k


def test_export_from_zarr_data_format(tmp_path: Path) -> None:
    model = _model()
    ckpt.save({"model": model.state_dict()}, str(tmp_path / "z"), user_metadata=_meta(layout=Layout()),
              data_format="zarr")
    assert ckpt.inspect(str(tmp_path / "z")).data_format == "zarr"
    export_hf(str(tmp_path / "z"), str(tmp_path / "hf"), max_shard_size="100KB")
    tensors = _hf_tensors(tmp_path / "hf")
    for k, v in to_hf_state_dict(model).items():
        assert torch.equal(tensors[k], v), k


@pytest.mark.multiproc
def test_export_and_import_through_fsspec(sharded: str, tmp_path: Path) -> None:
    url = f"memory://hf-{tmp_path.name}"
    r = export_hf(sharded, url, max_shard_size="300KB")
    assert len(r.files) >= 3
    import_hf(url, str(tmp_path / "c"))
    model = MoEForCausalLM(TINY)
    ckpt.load({"model": model.state_dict()}, str(tmp_path / "c"))
    for k, v in _model().state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------


def _hf_model(transformers: ModuleType, seed: int = 7) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**hf_config(TINY))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return transformers.Qwen3MoeForCausalLM(config).float().eval()


def _write_hf(hf: nn.Module, d: Path, form: str) -> None:
    if form == "index":
        hf.save_pretrained(d, max_shard_size="200KB")
        assert (d / "model.safetensors.index.json").exists()
    elif form == "single":
        hf.save_pretrained(d)
        assert (d / "model.safetensors").exists()
    else:  # transformers' in-memory fused experts (gate_up_proj, down_proj), written raw
        d.mkdir()
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert "model.layers.0.mlp.experts.gate_up_proj" in state
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        hf.config.to_json_file(str(d / "config.json"))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["index", "single", "fused"])
def test_import_train_zero_steps_export_is_bitwise(form: str, tmp_path: Path, transformers: ModuleType) -> None:
    hf = _hf_model(transformers)
    src = tmp_path / "hf"
    _write_hf(hf, src, form)
    original = _hf_tensors(src)
    if form == "fused":  # what save_pretrained would have written for these weights
        original = to_hf_state_dict(from_hf_state_dict(original, TINY))

    dst = str(tmp_path / "ckpt")
    r = import_hf(str(src), dst)
    assert r.layout == str(Layout()) and ckpt.verify(dst, deep=True).ok
    m = ckpt.inspect(dst)
    model = MoEForCausalLM(TINY).eval()
    # weights only: the one kind of object is the Hugging Face side files import-hf keeps (generation_config.json)
    assert set(m.tensors) == {f"model.{k}" for k in model.state_dict()}
    assert {k for k in m.objects if not k.startswith("hf.files.")} == set()
    assert ModelConfig.from_dict(m.user_metadata["model_config"]) == TINY
    assert m.user_metadata["rules"] == "embedded-moe" and m.user_metadata["layout"] == Layout().to_dict()

    # "Trained 0 steps": load the weights into the trainer's model, save, export again.
    ckpt.load({"model": model.state_dict()}, dst)
    for seed in (0, 1):
        ids = _ids(seed)
        _assert_rel(_logits(model, ids), _logits(hf, ids))
    again = str(tmp_path / "again")
    ckpt.save({"model": model.state_dict(), "train": {"step": 0}}, again,
              user_metadata=_meta(ModelConfig.from_dict(m.user_metadata["model_config"]), Layout()))
    export_hf(again, str(tmp_path / "out"))
    exported = _hf_tensors(tmp_path / "out")
    assert set(exported) == set(original)
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k].view(torch.uint8), v.view(torch.uint8)), k


def test_import_keeps_bf16_or_casts(tmp_path: Path, transformers: ModuleType) -> None:
    hf = _hf_model(transformers).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "keep"))
    assert {t.dtype for t in ckpt.inspect(str(tmp_path / "keep")).tensors.values()} == {"bfloat16"}
    import_hf(str(tmp_path / "hf"), str(tmp_path / "f32"), dtype="fp32")
    m = ckpt.inspect(str(tmp_path / "f32"))
    assert {t.dtype for t in m.tensors.values()} == {"float32"}
    model = MoEForCausalLM(TINY)
    ckpt.load({"model": model.state_dict()}, str(tmp_path / "f32"))
    want = hf.state_dict()["model.layers.1.mlp.experts.down_proj"].float()
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj.detach(), want)


def test_import_to_layout(hf_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "ckpt"
    r = import_hf(str(hf_dir), str(dst), to="tp=2,ep=2", memory_budget="4MiB")
    assert r.layout == str(Layout(tp=2, ep=2)) and ckpt.verify(str(dst), deep=True).ok
    m = ckpt.inspect(str(dst))
    assert len(m.tensors["model.model.layers.0.mlp.experts.down_proj"].shards) == 4  # ep x tp boxes
    assert ModelConfig.from_dict(m.user_metadata["model_config"]) == TINY
    assert {k for k in m.objects if not k.startswith("hf.files.")} == set()  # weights and side files only
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ckpt-import-")]  # the temporary is gone
    model = MoEForCausalLM(TINY).eval()
    ckpt.load({"model": model.state_dict()}, str(dst))
    for k, v in from_hf_state_dict(_hf_tensors(hf_dir), TINY).items():
        assert torch.equal(model.state_dict()[k], v), k
    with pytest.raises(ckpt.CheckpointExistsError):  # checked before any temporary is written
        import_hf(str(hf_dir), str(dst), to="tp=2")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ckpt-import-")]


def test_import_to_layout_without_reshard(hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ckpt.resharders.reshard", None)  # as in a ckpt without it
    with pytest.raises(ckpt.LayoutError, match="not available"):
        import_hf(str(hf_dir), str(tmp_path / "c"), to="tp=2,ep=2")
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Bad input: typed errors, nothing written
# ---------------------------------------------------------------------------------------------


def _single(tmp_path: Path, name: str, state: dict[str, torch.Tensor] | None = None,
            meta: dict[str, Any] | None = None) -> str:
    url = str(tmp_path / name)
    sd = state if state is not None else {k: v.detach().clone() for k, v in _model().state_dict().items()}
    ckpt.save({"model": sd, "optim": {"lr": 0.1}}, url, user_metadata=_meta(layout=Layout()) if meta is None else meta)
    return url


def _bad_export_cases(tmp_path: Path) -> list[tuple[str, str, dict[str, Any], type[Exception], str]]:
    sd = {k: v.detach().clone() for k, v in _model().state_dict().items()}
    no_head = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    ints = dict(sd, **{"model.norm.weight": torch.ones(TINY.hidden_size, dtype=torch.int32)})
    huge = dict(sd, **{"model.norm.weight": torch.full((TINY.hidden_size,), 1e6)})
    other = dataclasses.replace(TINY, num_experts=8).to_dict()
    return [
        ("no model config", _single(tmp_path, "a", meta={"layout": {}}), {}, ckpt.ManifestError, "model_config"),
        ("unknown architecture", _single(tmp_path, "b", meta=_meta(rules="llama-dense")), {}, ckpt.ManifestError,
         "llama-dense"),
        ("config not a MoE", _single(tmp_path, "c", meta={"model_config": {"model_type": "llama"}}), {},
         ckpt.ManifestError, "unknown architecture"),
        ("config vs tensors", _single(tmp_path, "d", meta=_meta(layout=Layout()) | {"model_config": other}), {},
         ckpt.MismatchError, "wrong shape"),
        ("missing tensor", _single(tmp_path, "e", state=no_head), {}, ckpt.MismatchError, "lm_head.weight"),
        ("int weights", _single(tmp_path, "f", state=ints), {}, ckpt.MismatchError, "non-float"),
        ("bad dtype", _single(tmp_path, "g"), {"dtype": "int8"}, ckpt.StateError, "bf16"),
        ("bad shard size", _single(tmp_path, "g2"), {"max_shard_size": "lots"}, ckpt.StateError, "5GB"),
        ("no checkpoint", str(tmp_path / "nothing"), {}, ckpt.ManifestError, "no committed"),
        ("fp16 overflow", _single(tmp_path, "h", state=huge), {"dtype": "fp16"}, ckpt.MismatchError, "overflow"),
    ]


def test_export_bad_input_fails_before_writing(tmp_path: Path) -> None:
    for what, src, kwargs, err, match in _bad_export_cases(tmp_path):
        out = tmp_path / f"out-{what.replace(' ', '-')}"
        with pytest.raises(err, match=match):
            export_hf(src, str(out), **kwargs)
        assert not out.exists(), what


@pytest.mark.multiproc
def test_export_refuses_existing_model(sharded: str, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export_hf(sharded, str(out), max_shard_size=200_000)
    (out / "tokenizer.json").write_text("{}")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(ckpt.CheckpointExistsError, match="overwrite"):
        export_hf(sharded, str(out))
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(ckpt.CheckpointExistsError, match="ckpt checkpoint"):
        export_hf(sharded, sharded, overwrite=True)
    r = export_hf(sharded, str(out), overwrite=True)  # one file now: the older shards go, the tokenizer stays
    assert sorted(p.name for p in out.iterdir()) == sorted([*r.files, "config.json", "model.safetensors.index.json",
                                                            "tokenizer.json"])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, transformers: ModuleType) -> Path:
    d = tmp_path_factory.mktemp("hfsrc") / "hf"
    _hf_model(transformers).save_pretrained(d, max_shard_size="200KB")
    return d


def _variant(hf_dir: Path, tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    for p in hf_dir.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    return d


def _edit_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_import_bad_input_fails_before_writing(hf_dir: Path, tmp_path: Path) -> None:
    cases: list[tuple[str, Path, dict[str, Any], type[Exception], str]] = []
    d = _variant(hf_dir, tmp_path, "unknown")  # gpt2 is served by the generic adapter (tests/hf/test_generic.py)
    _edit_config(d, model_type="not_a_model", architectures=["NotAModelForCausalLM"])
    cases.append(("unknown architecture", d, {}, ckpt.ManifestError, "model_type 'not_a_model' is not supported"))
    d = _variant(hf_dir, tmp_path, "llama")  # a supported family, but these are MoE weights
    _edit_config(d, model_type="llama", architectures=["LlamaForCausalLM"])
    cases.append(("another family's config", d, {}, ckpt.MismatchError, "unexpected: .*experts"))
    d = _variant(hf_dir, tmp_path, "dense")  # the generic Qwen3-MoE adapter: layer 0 must be dense
    _edit_config(d, mlp_only_layers=[0])
    cases.append(("dense layer", d, {}, ckpt.MismatchError, "missing: .*layers.0.mlp.down_proj"))
    d = _variant(hf_dir, tmp_path, "experts")
    _edit_config(d, num_experts=8, num_local_experts=8)
    cases.append(("config vs tensors (experts)", d, {}, ckpt.MismatchError, "experts \\[4, 5, 6, 7\\] missing"))
    d = _variant(hf_dir, tmp_path, "hidden")
    _edit_config(d, vocab_size=512)
    cases.append(("config vs tensors (vocab)", d, {}, ckpt.MismatchError, "wrong shape"))
    d = _variant(hf_dir, tmp_path, "missing-file")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    (d / sorted(set(index["weight_map"].values()))[-1]).unlink()
    cases.append(("missing shard file", d, {}, ckpt.IntegrityError, "names it"))
    d = _variant(hf_dir, tmp_path, "no-config")
    (d / "config.json").unlink()
    cases.append(("no config", d, {}, ckpt.ManifestError, "config.json"))
    d = _variant(hf_dir, tmp_path, "int8")
    (d / "model.safetensors.index.json").unlink()
    for p in d.glob("*.safetensors"):
        p.unlink()
    weights = {k: v.contiguous() for k, v in _hf_tensors(hf_dir).items()}
    weights["model.norm.weight"] = torch.ones(TINY.hidden_size, dtype=torch.int8)
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    cases.append(("int8 weights", d, {}, ckpt.MismatchError, "cannot hold"))
    cases.append(("bad dtype", hf_dir, {"dtype": "fp8"}, ckpt.StateError, "bf16"))
    cases.append(("bad layout", hf_dir, {"to": "tp=two"}, ckpt.LayoutError, "not an integer"))
    d = _variant(hf_dir, tmp_path, "escape")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "../../etc/passwd"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    cases.append(("hostile index path", d, {}, ckpt.ManifestError, "escapes"))
    for what, src, kwargs, err, match in cases:
        dst = tmp_path / f"dst-{what.replace(' ', '-')}"
        with pytest.raises(err, match=match):
            import_hf(str(src), str(dst), **kwargs)
        assert not dst.exists(), what


def test_import_refuses_committed_checkpoint(hf_dir: Path, tmp_path: Path) -> None:
    dst = str(tmp_path / "c")
    import_hf(str(hf_dir), dst)
    before = sorted(os.listdir(os.path.join(dst, "data")))
    with pytest.raises(ckpt.CheckpointExistsError, match="overwrite"):
        import_hf(str(hf_dir), dst)
    assert sorted(os.listdir(os.path.join(dst, "data"))) == before
    import_hf(str(hf_dir), dst, overwrite=True)
    after = os.listdir(os.path.join(dst, "data"))
    assert len(after) == 1 and after != before and ckpt.verify(dst, deep=True).ok


# ---------------------------------------------------------------------------------------------
# CLI and helpers
# ---------------------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_cli_export_and_import(sharded: str, hf_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckpt.cli.app import app

    runner = CliRunner(env={"COLUMNS": "200"})
    out = tmp_path / "hf"
    r = runner.invoke(app, ["export-hf", sharded, str(out), "--dtype", "bf16", "--max-shard-size", "200KB", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["dtype"] == "bfloat16" and len(res["files"]) >= 2 and (out / "config.json").exists()
    r = runner.invoke(app, ["import-hf", str(out), str(tmp_path / "c")])  # with the progress bar
    assert r.exit_code == 0, r.output
    assert "wrote" in r.stdout and ckpt.verify(str(tmp_path / "c")).ok
    r = runner.invoke(app, ["export-hf", sharded, str(tmp_path / "x"), "--dtype", "int4"])
    assert r.exit_code == 5 and "error:" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["import-hf", str(tmp_path / "nowhere"), str(tmp_path / "y")])
    assert r.exit_code == 2 and "no such file or directory" in r.output  # the same for every command
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1GiB") == 2**30 and parse_size(" 200 KB") == 200_000
    assert parse_size(4096) == 4096 and parse_size("1.5MB") == 1_500_000
    for bad in ("lots", "0", "-1KB", "5 parsecs"):
        with pytest.raises(ckpt.StateError):
            parse_size(bad)


@pytest.mark.parametrize("cfg", [TINY, CONFIGS["100m"], dataclasses.replace(TINY, num_hidden_layers=1, head_dim=8,
                                                                              num_experts=3, num_experts_per_tok=1)])
def test_param_shapes_match_the_module(cfg: ModelConfig) -> None:
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    assert param_shapes(cfg) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.multiproc
def test_tokenizer_and_generation_files_are_copied_to_the_export(sharded: str, tmp_path: Path) -> None:
    src = tmp_path / "ck"
    shutil.copytree(sharded, src)
    tok = b'{"model": {"type": "BPE"}, "note": "\\u00e9"}'
    (src / "tokenizer.json").write_bytes(tok)  # placed next to the checkpoint's manifest
    (src / "notes.txt").write_text("not a side file")
    r = export_hf(str(src), str(tmp_path / "out"))
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tok
    assert r.side_files == ["tokenizer.json"] and not (tmp_path / "out" / "notes.txt").exists()
    # --tokenizer DIR wins over what sits next to the checkpoint
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_bytes(b"{}")
    (other / "generation_config.json").write_bytes(b'{"do_sample": false}')
    r = export_hf(sharded, str(tmp_path / "out2"), tokenizer=str(other))
    assert (tmp_path / "out2" / "tokenizer.json").read_bytes() == b"{}"
    assert r.side_files == ["generation_config.json", "tokenizer.json"]
    with pytest.raises(ckpt.StateError, match="--tokenizer .*none of tokenizer.json"):
        export_hf(sharded, str(tmp_path / "out3"), tokenizer=str(tmp_path / "out3-none"))
    assert not (tmp_path / "out3" / "config.json").exists()
