"""Issue 30 (2, 4): peers' checkpoints as they ship today. torchtitan 0.3 writes
``layers.N.attention.qkv_linear.wq/wk/wv.weight`` and ``lm_head.weight`` (older releases:
``attention.wq`` and ``output.weight``), its model keys flat at the top level next to ``optimizer``,
``lr_scheduler``, ``train_state`` (a tensor ``step``) and ``dataloader``. Built here by hand in those
names and saved with real torch DCP: ``--source-names auto`` (the default) detects the scheme from the
keys, and the export equals the old-name export and Hugging Face's own weights bitwise."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.errors import ManifestError, MismatchError
from ckpt.hf.convert import export_hf, import_hf
from ckpt.hf.names import AmbiguousNamesError, detect, key_schemes

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)
RENAMES_03 = {"attention.wq.": "attention.qkv_linear.wq.", "attention.wk.": "attention.qkv_linear.wk.",
              "attention.wv.": "attention.qkv_linear.wv."}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (HF directory), its weights in old torchtitan names, and the reference export."""
    root = tmp_path_factory.mktemp("titan")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL))
    model.save_pretrained(root / "hf")
    import_hf(str(root / "hf"), str(root / "old"), names="torchtitan")
    return {"root": root, "hf": root / "hf", "old": root / "old"}


def _old_weights(d: dict[str, Path]) -> dict[str, torch.Tensor]:
    m = ckpt.inspect(str(d["old"]))
    return ckpt.load({k: torch.empty(t.shape) for k, t in m.tensors.items()}, str(d["old"]))


def _to_03(key: str) -> str:
    for a, b in RENAMES_03.items():
        key = key.replace(a, b)
    return "lm_head.weight" if key == "output.weight" else key


def _torchtitan_dcp(weights: dict[str, torch.Tensor], path: Path) -> None:
    """Save as torchtitan does: model keys flat at the top level, then its other states."""
    losses = io.BytesIO()
    torch.save([2.5, 2.25], losses)
    state = {**weights,
             "optimizer": {f"state.{k}.exp_avg": torch.zeros_like(v) for k, v in list(weights.items())[:2]},
             "lr_scheduler": {"last_epoch": 7},
             "train_state": {"step": torch.tensor(7, dtype=torch.int32)},
             "dataloader": {"dp_rank_0": losses}}
    dcp.save(state, checkpoint_id=str(path))


def _export(src: Path, out: Path, hf: Path, **kw: object) -> dict[str, torch.Tensor]:
    export_hf(str(src), str(out), config=str(hf), **kw)  # type: ignore[arg-type]
    return {k: v for p in sorted(out.glob("*.safetensors")) for k, v in load_file(str(p)).items()}


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_torchtitan_03_names_auto_detected_and_bitwise_equal_to_old_names(model_dirs, tmp_path):
    old = _old_weights(model_dirs)
    _torchtitan_dcp(old, tmp_path / "old-dcp")
    _torchtitan_dcp({_to_03(k): v for k, v in old.items()}, tmp_path / "new-dcp")
    m = ckpt.inspect(str(tmp_path / "new-dcp"))
    assert "layers.0.attention.qkv_linear.wq.weight" in m.tensors and "lm_head.weight" in m.tensors
    ref = _export(tmp_path / "old-dcp", tmp_path / "o-old", model_dirs["hf"], source_names="torchtitan")
    _bitwise(_export(tmp_path / "new-dcp", tmp_path / "o-auto", model_dirs["hf"]), ref)  # default: auto
    _bitwise(_export(tmp_path / "new-dcp", tmp_path / "o-named", model_dirs["hf"], source_names="torchtitan"), ref)
    _bitwise(ref, load_file(str(model_dirs["hf"] / "model.safetensors")))  # = Hugging Face's own weights
    # and from the command line, where 0.3 names used to exit 5
    r = CliRunner().invoke(app, ["export-hf", str(tmp_path / "new-dcp"), str(tmp_path / "o-cli"), "--config",
                                 str(model_dirs["hf"]), "--source-names", "torchtitan", "-q"])
    assert r.exit_code == 0, r.output


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(renamed=st.sets(st.sampled_from(sorted(RENAMES_03) + ["output."])), prefix=st.sampled_from(["", "model."]))
def test_any_mix_of_spellings_and_prefix_exports_the_same(model_dirs, tmp_path_factory, renamed, prefix):
    """Every mix of old and 0.3 spellings, flat or under ``model.``, is detected as torchtitan and exports
    the same bytes."""
    old = _old_weights(model_dirs)

    def name(k: str) -> str:
        for a in renamed:
            if a == "output." and k == "output.weight":
                k = "lm_head.weight"
            elif a in k:
                k = k.replace(a, RENAMES_03[a])
        return prefix + k

    tmp = tmp_path_factory.mktemp("mix")
    weights = {name(k): v for k, v in old.items()}
    dcp.save(weights, checkpoint_id=str(tmp / "dcp"))
    ref = load_file(str(model_dirs["hf"] / "model.safetensors"))
    _bitwise(_export(tmp / "dcp", tmp / "out", model_dirs["hf"]), ref)


def test_every_scheme_is_detected_from_its_keys(model_dirs, tmp_path):
    """ckpt, hf, torchtitan and megatron names, saved with DCP (so no recorded names), each export by
    ``auto`` to Hugging Face's own weights."""
    hf = model_dirs["hf"]
    ref = load_file(str(hf / "model.safetensors"))
    sources = {"hf": ref}
    for kind in ("ckpt", "torchtitan", "megatron"):
        import_hf(str(hf), str(tmp_path / kind), names=kind)
        m = ckpt.inspect(str(tmp_path / kind))
        sources[kind] = ckpt.load({k: torch.empty(t.shape) for k, t in m.tensors.items()}, str(tmp_path / kind))
    for kind, weights in sources.items():
        dcp.save(dict(weights), checkpoint_id=str(tmp_path / f"dcp-{kind}"))
        m = ckpt.inspect(str(tmp_path / f"dcp-{kind}"))
        assert max((c, k) for k, c in key_schemes(m.tensors).items())[1] == kind
        _bitwise(_export(tmp_path / f"dcp-{kind}", tmp_path / f"out-{kind}", hf, source_names="auto"), ref)


def test_ambiguous_or_unknown_names_are_typed_errors(model_dirs, tmp_path):
    hf = model_dirs["hf"]
    old = _old_weights(model_dirs)
    ref = load_file(str(hf / "model.safetensors"))
    dcp.save({**old, **ref}, checkpoint_id=str(tmp_path / "both"))  # torchtitan and HF names, both complete
    with pytest.raises(AmbiguousNamesError, match=r"hf, torchtitan.*--source-names hf"):
        export_hf(str(tmp_path / "both"), str(tmp_path / "never"), config=str(hf))
    assert not (tmp_path / "never").exists()
    r = CliRunner().invoke(app, ["export-hf", str(tmp_path / "both"), str(tmp_path / "never"), "--config", str(hf),
                                 "-q"])
    assert r.exit_code == 5 and r.output.startswith("error:") and "--source-names" in r.output
    # naming the scheme settles it, bitwise
    _bitwise(_export(tmp_path / "both", tmp_path / "o", hf, source_names="torchtitan"), ref)
    dcp.save({f"w{i}": torch.zeros(2) for i in range(3)}, checkpoint_id=str(tmp_path / "odd"))
    with pytest.raises(MismatchError, match="match none of ckpt, hf, torchtitan, megatron"):
        export_hf(str(tmp_path / "odd"), str(tmp_path / "never"), config=str(hf))
    # detected torchtitan names without a model config: say which config is needed
    dcp.save(old, checkpoint_id=str(tmp_path / "titan"))
    with pytest.raises(ManifestError, match=r"detected from its keys: torchtitan.*--config"):
        export_hf(str(tmp_path / "titan"), str(tmp_path / "never"))
    assert detect({"model.model.layers.0.mlp.down_proj.weight": (2, 2)}, where="x") == "ckpt"


def test_readme_torchtitan_example_loads_a_flat_torchtitan_checkpoint(model_dirs, tmp_path):
    """README / docs/INTEROP.md: ``ckpt.load({**model_sd, "optimizer": optim_sd, "train_state": {"step": ...}})``
    on torchtitan's flat layout."""
    old = _old_weights(model_dirs)
    _torchtitan_dcp(old, tmp_path / "step-1000")
    model_sd = {k: torch.empty_like(v) for k, v in old.items()}
    optim_sd = {f"state.{k}.exp_avg": torch.ones_like(v) for k, v in list(old.items())[:2]}
    state = ckpt.load({**model_sd, "optimizer": optim_sd,
                       "train_state": {"step": torch.zeros((), dtype=torch.int32)}}, str(tmp_path / "step-1000"))
    assert int(state["train_state"]["step"]) == 7
    assert all(torch.equal(state[k], v) for k, v in old.items())
    assert all(not v.any() for v in state["optimizer"].values())


def test_hugging_face_names_of_a_moe_model_are_detected(tmp_path):
    """A DCP of a transformers Mixtral's own ``state_dict()`` (per-expert tensors): detected as ``hf``, the
    stacked canonical experts read back from the per-expert keys, exported bitwise."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    ref = load_file(str(tmp_path / "hf" / "model.safetensors"))
    dcp.save(dict(ref), checkpoint_id=str(tmp_path / "dcp"))
    assert detect({k: tuple(v.shape) for k, v in ref.items()}, where="x") == "hf"
    _bitwise(_export(tmp_path / "dcp", tmp_path / "out", tmp_path / "hf"), ref)
