"""A Megatron-Core ``torch_dist`` checkpoint (made by megatron-core 0.19.2 itself on a GPU:
tests/fixtures/megatron/make_fixture.py) read in place and imported, layer-stacked tensors kept as
stored or split per layer, bitwise against the model's own state_dict."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

import ckpt
from ckpt.convert import import_checkpoint

URL = str(Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "gpt")
# Megatron's sharded keys (transformer-engine compatible) -> the local spec's module names, per layer
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


def _expected() -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(f"{URL}/expected.safetensors")


def _model_name(rest: str, layer: int) -> str:
    return f"decoder.layers.{layer}.{TE_NAMES.get(rest, rest)}"


def test_torch_dist_reads_in_place_with_layer_stacked_tensors():
    m = ckpt.inspect(URL)
    assert m.user_metadata["megatron"]["sharded_backend"] == "torch_dist"
    assert m.user_metadata["source"]["format"] == "megatron-torch_dist"
    exp = _expected()
    stacked = {k: t for k, t in m.tensors.items() if k.startswith("decoder.layers.")}
    assert stacked and all(t.shape[0] == 2 for t in stacked.values())
    got = ckpt.load({k: torch.zeros(t.shape) for k, t in m.tensors.items()}, URL)
    for k in stacked:
        rest = k[len("decoder.layers."):]
        for layer in range(2):
            assert torch.equal(got[k][layer], exp[_model_name(rest, layer)]), (k, layer)
    for k in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"):
        assert torch.equal(got[k], exp[k])
    r = ckpt.verify(URL)
    assert r.ok and "no checksums" in r.note


def test_import_splits_layers_per_layer(tmp_path):
    m = import_checkpoint(URL, str(tmp_path / "c"), unstack=True)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in m.tensors
    assert not any(k.startswith("decoder.layers.self") for k in m.tensors)
    assert ckpt.verify(str(tmp_path / "c"), deep=True).ok
    exp = _expected()
    got = ckpt.load({k: torch.zeros(t.shape) for k, t in m.tensors.items()}, str(tmp_path / "c"))
    n = 0
    for k, v in got.items():
        if k.startswith("decoder.layers."):
            layer, rest = k[len("decoder.layers."):].split(".", 1)
            assert torch.equal(v, exp[_model_name(rest, int(layer))]), k
            n += 1
    assert n == 2 * 12
    # kept as stored without the flag
    m2 = import_checkpoint(URL, str(tmp_path / "d"))
    assert m2.tensors["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 64, 16)


LLAMA = str(Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "llama")


def test_megatron_llama_exports_to_hf_and_transformers_reproduces_megatrons_logits(tmp_path):
    """A Llama-shaped GPTModel saved by megatron-core (RMSNorm, SwiGLU, GQA with 2 query groups, RoPE,
    untied head) exports from its torch_dist directory, read in place, with --source-names megatron;
    transformers' LlamaForCausalLM on the export computes Megatron's own logits (recorded by the
    fixture's maker on the GPU, fp32)."""
    transformers = __import__("pytest").importorskip("transformers")
    import json

    from ckpt.hf.convert import export_hf

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 32, "tie_word_embeddings": False,
           "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = ckpt.inspect(LLAMA)
    assert any(t.shape[0] == 2 for k, t in m.tensors.items() if k.startswith("decoder.layers."))  # layer-stacked
    export_hf(LLAMA, str(tmp_path / "hf"), config=str(tmp_path / "config.json"), source_names="megatron")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    ref = safetensors.torch.load_file(f"{LLAMA}/expected_logits.safetensors")
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    assert logits.shape == ref["logits"].shape
    assert (logits - ref["logits"]).abs().max().item() < 1e-4  # GPU (Megatron) vs CPU (transformers) fp32
    # and the weights are Megatron's, bitwise: the fused qkv of group 0 is [q0, q1, k0, v0]
    sd = model.state_dict()
    exp = safetensors.torch.load_file(f"{LLAMA}/expected.safetensors")
    qkv = exp["decoder.layers.0.self_attention.linear_qkv.weight"]
    d = 8
    assert torch.equal(qkv[: 2 * d], sd["model.layers.0.self_attn.q_proj.weight"][: 2 * d])
    assert torch.equal(qkv[2 * d: 3 * d], sd["model.layers.0.self_attn.k_proj.weight"][:d])
    assert torch.equal(exp["output_layer.weight"], sd["lm_head.weight"])
