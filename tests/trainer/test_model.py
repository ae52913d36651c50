"""ckpt.trainer.model: names, init, training step, and exact equivalence with transformers' Qwen3-MoE."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ckpt.trainer.hf_adapters import from_hf_state_dict, to_hf_state_dict
from ckpt.trainer.model import CONFIGS, ModelConfig, MoEForCausalLM, experts_forward

TINY = CONFIGS["tiny"]
# Both sides run the same fp32 math; differences come only from matmul/attention kernel order.
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def transformers() -> ModuleType:
    return pytest.importorskip("transformers")


def _model(seed: int = 0, config: ModelConfig = TINY) -> MoEForCausalLM:
    model = MoEForCausalLM(config)
    model.init_weights(seed)
    return model.eval()


def _ids(batch: int = 2, seq: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _hf_model(transformers: ModuleType, config: ModelConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    hf_config = transformers.Qwen3MoeConfig(**config.to_hf_config_dict())
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"
    return transformers.Qwen3MoeForCausalLM(hf_config).float().eval()


def test_parameter_names_and_shapes() -> None:
    cfg = TINY
    e, h, i, d = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim
    expected = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}"
        expected |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
            f"{p}.self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
            f"{p}.self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
            f"{p}.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
            f"{p}.self_attn.q_norm.weight": (d,),
            f"{p}.self_attn.k_norm.weight": (d,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate.weight": (e, h),
            f"{p}.mlp.experts.gate_proj": (e, i, h),
            f"{p}.mlp.experts.up_proj": (e, i, h),
            f"{p}.mlp.experts.down_proj": (e, h, i),
        }
    state = MoEForCausalLM(cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_num_parameters_matches_module(name: str) -> None:
    cfg = CONFIGS[name]
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    active = cfg.num_parameters() - cfg.num_hidden_layers * (
        (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    )
    assert cfg.num_parameters(active=True) == active


def test_100m_is_about_100m() -> None:
    assert 90e6 < CONFIGS["100m"].num_parameters() < 110e6


def test_init_weights_is_deterministic_and_device_independent() -> None:
    a, b, c = _model(0), _model(0), _model(1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa)), name
        else:
            assert not torch.equal(pa, pc), name
            assert 0.01 < pa.std().item() < 0.03, name
    # Meta-device build, materialized afterwards: same weights and same outputs.
    with torch.device("meta"):
        meta = MoEForCausalLM(TINY)
    meta.to_empty(device="cpu")
    meta.init_weights(0)
    torch.testing.assert_close(meta.state_dict(), a.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(_logits(meta.eval(), _ids()), _logits(a, _ids()), rtol=0, atol=0)


def test_export_loads_in_transformers_with_same_logits(transformers: ModuleType, tmp_path: Path) -> None:
    model = _model(seed=3)
    save_file(to_hf_state_dict(model), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_config_dict()))

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        output_loading_info=True,
        attn_implementation="eager",
        experts_implementation="eager",
        dtype=torch.float32,
    )
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[kind], (kind, info[kind])
    hf.eval()

    ids = _ids()
    torch.testing.assert_close(_logits(model, ids), _logits(hf, ids), **TOL)
    with torch.no_grad():
        _, loss = model(ids, labels=ids)
        hf_loss = hf(ids, labels=ids).loss
    torch.testing.assert_close(loss, hf_loss, **TOL)


def test_import_fused_in_memory_state_dict(transformers: ModuleType) -> None:
    hf = _hf_model(transformers, TINY, seed=5)
    hf_state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_state  # transformers' fused layout

    model = MoEForCausalLM(TINY).eval()
    model.load_state_dict(from_hf_state_dict(hf_state, TINY), strict=True)
    ids = _ids(seed=1)
    torch.testing.assert_close(_logits(model, ids), _logits(hf, ids), **TOL)


def test_import_save_pretrained_checkpoint(transformers: ModuleType, tmp_path: Path) -> None:
    hf = _hf_model(transformers, TINY, seed=6)
    hf.save_pretrained(tmp_path)
    on_disk: dict[str, torch.Tensor] = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        on_disk |= load_file(str(path))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in on_disk  # per-expert layout

    model = MoEForCausalLM(TINY).eval()
    model.load_state_dict(from_hf_state_dict(on_disk, TINY), strict=True)
    ids = _ids(seed=2)
    torch.testing.assert_close(_logits(model, ids), _logits(hf, ids), **TOL)


def test_hf_state_dict_round_trip_is_bitwise() -> None:
    model = _model(seed=7)
    hf_state = to_hf_state_dict(model)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in hf_state
    assert torch.equal(
        hf_state["model.layers.1.mlp.experts.2.up_proj.weight"], model.model.layers[1].mlp.experts.up_proj[2]
    )
    torch.testing.assert_close(from_hf_state_dict(hf_state, TINY), model.state_dict(), rtol=0, atol=0)


def test_from_hf_state_dict_names_problems() -> None:
    hf_state = to_hf_state_dict(_model())
    del hf_state["model.layers.0.mlp.experts.1.gate_proj.weight"]
    del hf_state["model.norm.weight"]
    hf_state["model.layers.0.extra.weight"] = torch.zeros(1)
    hf_state["lm_head.weight"] = torch.zeros(3, 3)
    hf_state["model.layers.1.mlp.experts.2.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as error:
        from_hf_state_dict(hf_state, TINY)
    message = str(error.value)
    assert "model.layers.0.mlp.experts.gate_proj: expert ids [1] missing" in message
    assert "missing: ['model.norm.weight']" in message
    assert "unexpected: ['model.layers.0.extra.weight']" in message
    assert "model.layers.1.mlp.experts.2.up_proj.weight: expected (32, 64), got (1,)" in message
    assert "lm_head.weight: expected (256, 64), got (3, 3)" in message

    # Fused (transformers in-memory) and per-expert keys for the same tensor.
    hf_state = to_hf_state_dict(_model())
    gate = torch.stack([hf_state[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(4)])
    up = torch.stack([hf_state[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(4)])
    hf_state["model.layers.0.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    with pytest.raises(ValueError, match=r"given twice .*'model.layers.0.mlp.experts.gate_proj'"):
        from_hf_state_dict(hf_state, TINY)


def test_loss_backward_and_adamw_step() -> None:
    model = _model().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _ids(batch=4, seq=64)
    before = copy.deepcopy(model.state_dict())

    _, loss = model(ids, labels=ids)
    assert torch.isfinite(loss)
    # Random weights predict about uniformly over the byte vocabulary.
    assert abs(loss.item() - torch.log(torch.tensor(float(TINY.vocab_size))).item()) < 0.5
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
    optimizer.step()
    optimizer.zero_grad()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)

    _, loss_after = model(ids, labels=ids)
    assert loss_after.item() < loss.item()


def test_ignore_index_in_labels() -> None:
    model = _model()
    ids = _ids()
    labels = ids.clone()
    labels[:, 10:] = -100
    logits, loss = model(ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(
        logits[:, :9].reshape(-1, TINY.vocab_size), ids[:, 1:10].reshape(-1)
    )
    torch.testing.assert_close(loss, expected)


def test_expert_slices_sum_to_all_experts() -> None:
    """What an expert-parallel caller relies on: each slice adds only its own experts' share."""
    experts = _model().model.layers[0].mlp.experts
    tokens = torch.randn(32, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    selected = torch.stack([torch.randperm(TINY.num_experts)[: TINY.num_experts_per_tok] for _ in range(32)])
    weights = torch.rand(32, TINY.num_experts_per_tok)
    with torch.no_grad():
        full = experts(tokens, weights, selected)
        half = TINY.num_experts // 2
        parts = [
            experts_forward(
                tokens,
                weights,
                selected,
                experts.gate_proj[s],
                experts.up_proj[s],
                experts.down_proj[s],
                s.start,
            )
            for s in (slice(0, half), slice(half, TINY.num_experts))
        ]
    torch.testing.assert_close(parts[0] + parts[1], full)


def test_attention_head_slices_sum_to_full_attention() -> None:
    """What a tensor-parallel wrapper relies on: heads are read from the weight shapes."""
    model = _model()
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 12, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    rope = model.model.rotary_emb(x, torch.arange(12).unsqueeze(0))
    tp = 2
    q_rows = TINY.num_attention_heads * TINY.head_dim // tp
    kv_rows = TINY.num_key_value_heads * TINY.head_dim // tp
    with torch.no_grad():
        full = attn(x, rope)
        total = torch.zeros_like(full)
        for rank in range(tp):
            local = copy.deepcopy(attn)
            q, kv = slice(rank * q_rows, (rank + 1) * q_rows), slice(rank * kv_rows, (rank + 1) * kv_rows)
            local.q_proj.weight = nn.Parameter(attn.q_proj.weight[q])
            local.k_proj.weight = nn.Parameter(attn.k_proj.weight[kv])
            local.v_proj.weight = nn.Parameter(attn.v_proj.weight[kv])
            local.o_proj.weight = nn.Parameter(attn.o_proj.weight[:, q])
            total += local(x, rope)
    torch.testing.assert_close(total, full)


def test_pipeline_stages_compose() -> None:
    model = _model()
    ids = _ids()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.model.layers = first.model.layers[:2]
    first.model.norm = None
    first.lm_head = None
    last.model.layers = last.model.layers[2:]
    last.model.embed_tokens = None
    torch.testing.assert_close(_logits(last, _logits(first, ids)), _logits(model, ids), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_hf_dict_round_trip(name: str, transformers: ModuleType) -> None:
    cfg = CONFIGS[name]
    d = cfg.to_hf_config_dict()
    assert d["model_type"] == "qwen3_moe"
    assert d["architectures"] == ["Qwen3MoeForCausalLM"]
    assert ModelConfig.from_hf_config_dict(d) == cfg
    # What transformers itself writes (num_local_experts, rope_parameters, dtype) reads back too.
    hf_dict = transformers.Qwen3MoeConfig(**d).to_dict()
    assert ModelConfig.from_hf_config_dict(hf_dict) == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_recorded_hf_defaults_are_transformers_own(transformers: ModuleType) -> None:
    from ckpt.trainer.model_config import HF_DEFAULTS, hf_default

    cfg = transformers.Qwen3MoeConfig()
    for name, value in HF_DEFAULTS.items():
        theirs = (cfg.rope_parameters or {}).get("rope_theta") if name == "rope_theta" else getattr(cfg, name)
        assert theirs == value == hf_default(name), name


@pytest.mark.parametrize("left_out", ["norm_topk_prob", "max_position_embeddings", "rms_norm_eps"])
def test_a_field_left_out_of_config_json_means_what_transformers_reads(transformers: ModuleType,
                                                                        left_out: str) -> None:
    """A Qwen3-MoE config.json without norm_topk_prob was imported with our default (True) while
    transformers reads False: the exported model's logits differed by 0.64. Now both agree."""
    d = {k: v for k, v in dataclasses.replace(TINY, norm_topk_prob=False).to_hf_config_dict().items()
         if k != left_out}
    cfg = ModelConfig.from_hf_config_dict(d)
    hf_config = transformers.Qwen3MoeConfig(**d)
    assert getattr(cfg, left_out) == getattr(hf_config, left_out)
    torch.manual_seed(4)
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"
    hf = transformers.Qwen3MoeForCausalLM(hf_config).float().eval()
    model = MoEForCausalLM(cfg).eval()
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    torch.testing.assert_close(_logits(model, _ids()), _logits(hf, _ids()), **TOL)


def test_config_from_hf_rejects_unsupported() -> None:
    d = TINY.to_hf_config_dict()
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf_config_dict(d | {"mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        ModelConfig.from_hf_config_dict(d | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config_dict(d | {"model_type": "mixtral"})
    with pytest.raises(ValueError, match="no fields"):
        ModelConfig.from_dict(TINY.to_dict() | {"hiden_size": 3})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_experts=4"),
        ({"head_dim": 15}, "head_dim=15 is odd"),
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
        ({"num_experts": True}, "num_experts must be a positive int"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a positive number"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings=True is not supported"),
    ],
)
def test_config_validation(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **change)
