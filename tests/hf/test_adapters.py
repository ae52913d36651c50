"""Hugging Face adapters, per family: a tiny random model from transformers' own config class ->
``import-hf --to`` a TP x EP (x PP) layout -> ``export-hf`` -> ``from_pretrained``: logits bitwise equal
(fp32, and bf16 against ``.to(bf16)``), weights bitwise after a second round trip; torchtitan and
Megatron names checked against their published layouts; a real DCP checkpoint in torchtitan's names
exports; bad input refused before anything is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import ckpt
from ckpt.errors import ManifestError, MismatchError
from ckpt.hf.adapters import ADAPTERS, transformers_defaults
from ckpt.hf.convert import export_hf, import_hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=8),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, moe_intermediate_size=16, num_experts=4,
                                                     shared_expert_intermediate_size=24, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=16, num_experts=4,
                                                     num_experts_per_tok=2, mlp_only_layers=[0]),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**SMALL, "num_hidden_layers": 3, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1),
    # hybrid: lightning-attention layers (decay buffers written from the config) and softmax layers
    "minimax": lambda: transformers.MiniMaxConfig(**{**SMALL, "num_hidden_layers": 3}, head_dim=8, num_local_experts=4,
                                                  num_experts_per_tok=2, block_size=4),
}
LAYOUTS = {"llama": "tp=2,pp=2", "qwen2": "tp=2", "qwen3": "tp=2,pp=2", "mixtral": "tp=2,ep=2",
           "qwen2_moe": "tp=2,ep=2", "qwen3_moe": "tp=2,ep=2,pp=2", "deepseek_v3": "tp=2,ep=2",
           "minimax": "tp=2,ep=2"}
IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))


def _model(family: str, out: Path):
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    m.save_pretrained(out)
    return m


def _logits(path_or_model, dtype=torch.float32):
    m = path_or_model
    if isinstance(m, (str, Path)):
        m = transformers.AutoModelForCausalLM.from_pretrained(m, dtype=dtype)
    with torch.no_grad():
        return m.eval()(IDS).logits


def _weights(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in sorted(d.glob("*.safetensors")):
        out |= load_file(str(p))
    return out


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_family_round_trips_through_a_parallel_layout_bitwise(family, tmp_path):
    hf = tmp_path / "hf"
    model = _model(family, hf)
    ref = _logits(model)
    res = import_hf(str(hf), str(tmp_path / "ck"), to=LAYOUTS[family])
    assert res.layout != "single" and res.manifest.user_metadata["hf_adapter"] == family
    out = tmp_path / "out"
    export_hf(str(tmp_path / "ck"), str(out))
    assert torch.equal(_logits(out), ref), family
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["architectures"] == [type(model).__name__]
    # second round trip: the weights themselves, bitwise, and the same names as save_pretrained wrote
    import_hf(str(out), str(tmp_path / "ck2"))
    export_hf(str(tmp_path / "ck2"), str(tmp_path / "out2"))
    first, second, orig = _weights(out), _weights(tmp_path / "out2"), _weights(hf)
    assert sorted(first) == sorted(orig) == sorted(second)
    assert all(torch.equal(first[k], orig[k]) and torch.equal(second[k], orig[k]) for k in orig)
    # bf16: every weight bitwise the original cast to bf16 (bf16 logits depend on kernel choices that
    # from_pretrained and .to() make differently for some families, so the weights are the claim)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "bf16"), dtype="bf16")
    half = _weights(tmp_path / "bf16")
    assert all(torch.equal(half[k], orig[k].to(torch.bfloat16)) for k in orig)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def _titan_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's own conversion of wq/wk to Hugging Face's layout (its state_dict_adapter._permute)."""
    d1, d2 = w.shape
    return w.view(heads, d1 // heads // 2, 2, d2).transpose(1, 2).reshape(d1, d2)


def test_torchtitan_names_match_torchtitans_layout_and_a_real_dcp_checkpoint_exports(tmp_path):
    hf = tmp_path / "hf"
    model = _model("llama", hf)
    sd = model.state_dict()
    import_hf(str(hf), str(tmp_path / "titan"), names="torchtitan")
    m = ckpt.inspect(str(tmp_path / "titan"))
    assert "layers.0.attention.wq.weight" in m.tensors and "tok_embeddings.weight" in m.tensors
    got = ckpt.load({k: torch.empty(m.tensors[k].shape) for k in ("layers.1.attention.wq.weight",
                                                                  "layers.1.attention.wk.weight")},
                    str(tmp_path / "titan"))
    # what torchtitan's converter does to our stored tensors gives back Hugging Face's
    assert torch.equal(_titan_permute(got["layers.1.attention.wq.weight"], 4),
                       sd["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(_titan_permute(got["layers.1.attention.wk.weight"], 2),
                       sd["model.layers.1.self_attn.k_proj.weight"])
    # a DCP checkpoint written by torch itself in torchtitan's names (top-level model keys, as
    # torchtitan saves them) exports to Hugging Face directly with --config / --source-names
    state = ckpt.load({k: torch.empty(t.shape) for k, t in m.tensors.items()}, str(tmp_path / "titan"))
    state["train_state"] = {"step": 7}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    out = tmp_path / "out"
    export_hf(str(tmp_path / "dcp"), str(out), config=str(hf), source_names="torchtitan")
    assert torch.equal(_logits(out), _logits(model))
    from ckpt.hf.check import check_export

    rec = check_export(str(tmp_path / "dcp"), str(out), config=str(hf), source_names="torchtitan")
    assert rec["max_abs_logits_diff"] == 0.0


def test_megatron_names_interleave_qkv_per_query_group(tmp_path):
    hf = tmp_path / "hf"
    model = _model("qwen2", hf)  # q/k/v biases too
    sd = model.state_dict()
    import_hf(str(hf), str(tmp_path / "mg"), names="megatron")
    m = ckpt.inspect(str(tmp_path / "mg"))
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    got = ckpt.load({key: torch.empty(m.tensors[key].shape),
                     "decoder.layers.0.mlp.linear_fc1.weight": torch.empty(96, 32)}, str(tmp_path / "mg"))
    d, ng, qpg = 8, 2, 2
    q, k, v = (sd[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    expected = torch.cat([torch.cat([q[g * qpg * d:(g + 1) * qpg * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]])
                          for g in range(ng)])
    assert torch.equal(got[key], expected)
    assert torch.equal(got["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]]))
    # stacked the way torch_dist stores layers (leading layer dim) and exported from there
    flat = ckpt.load({k: torch.empty(t.shape) for k, t in m.tensors.items()}, str(tmp_path / "mg"))
    stacked: dict[str, torch.Tensor] = {}
    for name in list(flat):
        if name.startswith("decoder.layers.0."):
            rest = name[len("decoder.layers.0."):]
            stacked["decoder.layers." + rest] = torch.stack([flat.pop(f"decoder.layers.{n}.{rest}") for n in (0, 1)])
    ckpt.save(flat | stacked, str(tmp_path / "stacked"))
    export_hf(str(tmp_path / "stacked"), str(tmp_path / "out"), config=str(hf), source_names="megatron")
    assert torch.equal(_logits(tmp_path / "out"), _logits(model))


def test_defaults_the_adapters_rely_on_are_transformers_own():
    for name, a in ADAPTERS.items():
        theirs = transformers_defaults(name, tuple(a.defaults))
        assert theirs is not None
        import inspect

        params = inspect.signature(transformers.CONFIG_MAPPING[name].__init__).parameters
        for f, ours in a.defaults.items():
            if f in params:
                default = params[f].default
                assert ours == (list(default) if isinstance(default, tuple) else default), (name, f)


def test_a_missing_field_means_what_transformers_reads_it_as(tmp_path):
    hf = tmp_path / "hf"
    model = _model("qwen3", hf)
    cfg = json.loads((hf / "config.json").read_text())
    del cfg["attention_bias"]  # transformers: False
    (hf / "config.json").write_text(json.dumps(cfg))
    import_hf(str(hf), str(tmp_path / "ck"))
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert torch.equal(_logits(tmp_path / "out"), _logits(model))


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    hf = tmp_path / "hf"
    _model("llama", hf)  # tied embeddings: no lm_head in the files
    cases = []
    d = tmp_path / "quant"
    os.system(f"cp -r {hf} {d}")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "fp8"}}))
    cases.append((d, ManifestError, "quantization_config 'fp8'"))
    d = tmp_path / "tied"
    os.system(f"cp -r {hf} {d}")
    w = load_file(str(d / "model.safetensors"))
    from safetensors.torch import save_file

    save_file(w | {"lm_head.weight": w["model.embed_tokens.weight"].clone()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    cases.append((d, MismatchError, "tied head is not saved"))
    d = tmp_path / "short"
    os.system(f"cp -r {hf} {d}")
    (d / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 3}))
    cases.append((d, MismatchError, "missing: .*layers.2"))
    for src, err, match in cases:
        with pytest.raises(err, match=match):
            import_hf(str(src), str(tmp_path / f"dst-{src.name}"))
        assert not (tmp_path / f"dst-{src.name}").exists()
    # an export with names the checkpoint does not use: refused, OUT not created
    import_hf(str(hf), str(tmp_path / "ck"))
    with pytest.raises(MismatchError, match="does not hold the megatron names"):
        export_hf(str(tmp_path / "ck"), str(tmp_path / "never"), source_names="megatron")
    assert not (tmp_path / "never").exists()
    with pytest.raises(ManifestError, match="needs the model's Hugging Face config"):
        ckpt.save({"tok_embeddings.weight": torch.zeros(2, 2)}, str(tmp_path / "bare"))
        export_hf(str(tmp_path / "bare"), str(tmp_path / "never"), source_names="torchtitan")
    assert not (tmp_path / "never").exists()


def test_cli_export_with_config_and_source_names(tmp_path):
    from typer.testing import CliRunner

    from ckpt.cli.app import app

    hf = tmp_path / "hf"
    model = _model("mixtral", hf)
    import_hf(str(hf), str(tmp_path / "titan"), names="torchtitan")
    args = ["export-hf", str(tmp_path / "titan"), str(tmp_path / "out"), "--config", str(hf / "config.json"),
            "--source-names", "torchtitan", "--check", "--json"]
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["check"]["max_abs_logits_diff"] == 0.0
    assert torch.equal(_logits(tmp_path / "out"), _logits(model))


@pytest.mark.parametrize("family", ["llama", "minimax"])
def test_an_adapter_export_splits_files_at_max_shard_size_exactly(family, tmp_path):
    """Adapter families split files by the same rule as the embedded model: each file at most
    ``max_shard_size`` bytes, header included, unless one tensor alone is larger (and the index lists
    every tensor in the file that holds it)."""
    hf = tmp_path / "hf"
    ref = _logits(_model(family, hf))
    import_hf(str(hf), str(tmp_path / "ck"))
    limit = 20_000
    out = tmp_path / "out"
    export_hf(str(tmp_path / "ck"), str(out), max_shard_size=limit)
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 3
    for p in files:
        if p.stat().st_size > limit:
            assert len(load_file(str(p))) == 1, (p.name, p.stat().st_size)  # a tensor larger than the limit
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {k: f for p in files for k in load_file(str(p)) for f in [p.name]}.items() <= index["weight_map"].items()
    assert torch.equal(_logits(out), ref)
