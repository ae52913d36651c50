"""The embedded MoE (:mod:`ckpt.trainer.model`, the Qwen3-MoE architecture) as a Hugging Face model.

What ``export-hf`` / ``import-hf`` and the trainer need to know about it, kept out of the model
module: the ``config.json`` of a :class:`~ckpt.trainer.model.ModelConfig` and back (a field a
``config.json`` leaves out means what transformers reads it as: :data:`HF_DEFAULTS`), in-memory state
dicts in Hugging Face names and back (per-expert keys vs our fused ``mlp.experts.{gate,up,down}_proj``
of shape (E, out, in)), the parameter list computed from the config, and the model config a
checkpoint records.

Checkpoint convention (the trainer's contract): model weights are the tensors ``model.<param>`` for
every ``<param>`` of ``MoEForCausalLM.named_parameters()``, global shapes, any layout; the model
config is ``user_metadata["model_config"]`` (``ModelConfig.to_dict()``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ckpt.errors import ManifestError
from ckpt.manifest import Manifest
from ckpt.trainer.model import ModelConfig, MoEForCausalLM

__all__ = ["HF_DEFAULTS", "PREFIX", "RULES_NAME", "config_from_hf", "describe", "from_hf_state_dict", "hf_config",
           "hf_default", "model_config_of", "param_shapes", "to_hf_state_dict"]

RULES_NAME = "embedded-moe"  # user_metadata["rules"] of the embedded MoE's checkpoints
PREFIX = "model."  # checkpoint key = PREFIX + parameter name


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` body for ``transformers.Qwen3MoeForCausalLM`` of the model ``cfg`` describes.

    ``transformers.Qwen3MoeConfig(**d)`` accepts it, and written as ``config.json`` next to the
    weights from :func:`to_hf_state_dict` it loads with ``AutoModelForCausalLM.from_pretrained``.
    Both the transformers 4.x spellings (``rope_theta``, ``torch_dtype``) and the 5.x ones
    (``rope_parameters``, ``dtype``) are written so that either major version reads it.
    """
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "torch_dtype": "float32",
        "dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "initializer_range": cfg.initializer_range,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        # Every layer sparse: layer i is MoE iff (i + 1) % decoder_sparse_step == 0 and i is
        # not in mlp_only_layers.
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "use_cache": True,
    }


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    """Build from a Hugging Face Qwen3-MoE ``config.json`` body (transformers 4.x or 5.x).

    Raises:
        ValueError: when the config describes something this model does not implement (another
            model type, dense layers, sliding windows, biases, a non-default RoPE, tied
            embeddings) or lacks a required field.
    """
    model_type = d.get("model_type", "qwen3_moe")
    if model_type != "qwen3_moe":
        raise ValueError(f"model_type is {model_type!r}; only 'qwen3_moe' configs can be imported")
    required = {
        "hidden_act": ("silu", d.get("hidden_act", "silu")),
        "attention_bias": (False, d.get("attention_bias", False)),
        "use_sliding_window": (False, d.get("use_sliding_window", False)),
        "decoder_sparse_step": (1, d.get("decoder_sparse_step", 1)),
        "mlp_only_layers": ([], _as_list(d.get("mlp_only_layers"))),
    }
    for key, (wanted, found) in required.items():
        if found != wanted:
            raise ValueError(
                f"Hugging Face config has {key}={found!r}; this model supports only {key}={wanted!r} "
                "(all layers MoE, SiLU, no attention bias, full attention)"
            )
    # transformers 5 writes rope_parameters = {"rope_type", "rope_theta", ...}; 4.x writes
    # rope_theta plus an optional rope_scaling. Only the default (unscaled) RoPE is implemented.
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"Hugging Face config has rope_parameters / rope_scaling {rope!r:.60}; it must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"Hugging Face config has rope_type={rope_type!r}; only 'default' RoPE is supported"
        )
    rope_theta = rope.get("rope_theta", d.get("rope_theta"))

    values: dict[str, Any] = {}
    for field in dataclasses.fields(ModelConfig):
        if field.name in d:
            values[field.name] = d[field.name]
        elif field.name in HF_DEFAULTS:
            # a field the file leaves out means what transformers reads it as, never our default
            # (norm_topk_prob: transformers False, ours True: logits differed by 0.64)
            values[field.name] = hf_default(field.name)
    # transformers 5 serializes num_experts under its attribute_map alias.
    if "num_experts" not in values and "num_local_experts" in d:
        values["num_experts"] = d["num_local_experts"]
    if rope_theta is not None:
        values["rope_theta"] = rope_theta
    if values.get("head_dim") is None:
        values.pop("head_dim", None)
        heads, hidden = d.get("num_attention_heads"), d.get("hidden_size")
        if type(heads) is int and type(hidden) is int and heads > 0:
            # Same fallback as Qwen3MoeAttention when the config has no head_dim (other values: refused
            # by ModelConfig below, naming the field).
            values["head_dim"] = hidden // heads
    missing = [
        f.name
        for f in dataclasses.fields(ModelConfig)
        if f.default is dataclasses.MISSING and f.name not in values
    ]
    if missing:
        raise ValueError(f"Hugging Face config lacks required fields {missing}")
    return ModelConfig(**values)


def _as_list(v: Any) -> Any:
    """A list for a list / tuple / null (compared with the supported value), else ``v`` itself (refused)."""
    return [] if v is None else list(v) if isinstance(v, list | tuple) else v


# What transformers' Qwen3MoeConfig assumes for each optional field a config.json may leave out
# (transformers 5.23; tests/trainer/test_model.py compares every entry with the installed class).
HF_DEFAULTS: dict[str, Any] = {
    "norm_topk_prob": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
    "router_aux_loss_coef": 0.001, "initializer_range": 0.02, "tie_word_embeddings": False,
}


def hf_default(name: str) -> Any:
    """transformers' own default for a Qwen3-MoE config field when transformers is installed (so a
    newer transformers wins), else the recorded one."""
    try:
        import transformers

        cfg = transformers.Qwen3MoeConfig()
    except Exception:  # noqa: BLE001 - no (usable) transformers: the recorded defaults
        return HF_DEFAULTS[name]
    if name == "rope_theta":
        rope = getattr(cfg, "rope_parameters", None) or {}
        return rope.get("rope_theta", getattr(cfg, "rope_theta", HF_DEFAULTS[name]))
    return getattr(cfg, name, HF_DEFAULTS[name])


# Our fused expert tensors: model.layers.N.mlp.experts.{gate,up,down}_proj, 3-D.
FUSED_EXPERT = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate|up|down)_proj")
# Hugging Face per-expert keys, as save_pretrained writes them.
HF_PER_EXPERT = re.compile(
    r"(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight"
)
# transformers' in-memory fusion of gate and up: (E, 2I, H) = cat(gate, up) along dim 1.
HF_GATE_UP = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.gate_up_proj")


def to_hf_state_dict(model_or_state_dict: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face checkpoint keys for a full (unsharded) model or its state dict.

    Fused experts become per-expert keys ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``
    (``gate_proj[E]`` etc., copied so that ``safetensors.torch.save_file`` sees no shared
    storage); every other tensor keeps its name and is returned as is.

    Example::

        safetensors.torch.save_file(to_hf_state_dict(model), "out/model.safetensors")
    """
    if isinstance(model_or_state_dict, nn.Module):
        state: Mapping[str, Tensor] = model_or_state_dict.state_dict()
    else:
        state = model_or_state_dict
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        match = FUSED_EXPERT.fullmatch(key)
        if match is None:
            out[key] = tensor
            continue
        if tensor.dim() != 3:
            raise ValueError(
                f"{key}: fused expert tensor must be 3-D (experts, out, in), got {tuple(tensor.shape)}"
            )
        prefix, proj = match["prefix"], match["proj"]
        for expert in range(tensor.shape[0]):
            out[f"{prefix}.{expert}.{proj}_proj.weight"] = tensor[expert].detach().clone()
    return out


def from_hf_state_dict(hf_state_dict: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Convert a Hugging Face Qwen3-MoE state dict to this model's names, ready for
    ``model.load_state_dict(..., strict=True)``.

    Accepts per-expert keys (``...mlp.experts.E.{gate,up,down}_proj.weight``, the on-disk format),
    transformers' in-memory fused keys (``...mlp.experts.gate_up_proj`` (E, 2I, H) and
    ``...mlp.experts.down_proj`` (E, H, I)), or this model's own fused keys. The non-persistent
    ``rotary_emb.inv_freq`` some older checkpoints carry is dropped.

    Raises:
        ValueError: naming every missing, unexpected, duplicated or mis-shaped key.
    """
    n_experts, inter = config.num_experts, config.moe_intermediate_size
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in MoEForCausalLM(config).state_dict().items()}
    out: dict[str, Tensor] = {}
    # Our fused key -> expert id -> (Hugging Face key, tensor), stacked once all are seen.
    per_expert: dict[str, dict[int, tuple[str, Tensor]]] = {}
    duplicates: list[str] = []
    bad_experts: list[str] = []
    mis_shaped: list[str] = []
    # Fused keys whose per-expert parts were already reported, so they are not "missing" too.
    reported: set[str] = set()

    def put(key: str, tensor: Tensor) -> None:
        if key in out:
            duplicates.append(key)
        out[key] = tensor

    for key, tensor in hf_state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if match := HF_PER_EXPERT.fullmatch(key):
            fused = f"{match['prefix']}.{match['proj']}_proj"
            per_expert.setdefault(fused, {})[int(match["expert"])] = (key, tensor)
        elif match := HF_GATE_UP.fullmatch(key):
            if tensor.dim() != 3 or tensor.shape[1] != 2 * inter:
                fused_shape = (n_experts, 2 * inter, config.hidden_size)
                mis_shaped.append(f"{key}: expected {fused_shape}, got {tuple(tensor.shape)}")
                continue
            put(f"{match['prefix']}.gate_proj", tensor[:, :inter].contiguous())
            put(f"{match['prefix']}.up_proj", tensor[:, inter:].contiguous())
        else:
            put(key, tensor)

    for fused, experts in per_expert.items():
        wrong_ids = sorted(set(experts) ^ set(range(n_experts)))
        if wrong_ids:
            bad_experts.append(f"{fused}: expert ids {wrong_ids} missing or out of range 0..{n_experts - 1}")
            reported.add(fused)
            continue
        # An unknown layer has no expected shape: hold its experts to expert 0's shape so that the
        # stack below cannot fail; the key is then reported as unexpected.
        want = expected[fused][1:] if fused in expected else tuple(experts[0][1].shape)
        wrong = [
            f"{key}: expected {want}, got {tuple(tensor.shape)}"
            for key, tensor in experts.values()
            if tuple(tensor.shape) != want
        ]
        if wrong:
            mis_shaped.extend(wrong)
            reported.add(fused)
            continue
        put(fused, torch.stack([experts[e][1] for e in range(n_experts)]))

    missing = sorted(set(expected) - set(out) - reported)
    unexpected = sorted(set(out) - set(expected))
    mis_shaped += [
        f"{k}: expected {expected[k]}, got {tuple(out[k].shape)}"
        for k in sorted(set(out) & set(expected))
        if tuple(out[k].shape) != expected[k]
    ]
    problems = []
    if duplicates:
        problems.append(f"given twice (fused and per-expert?): {sorted(duplicates)}")
    if bad_experts:
        problems.append(f"incomplete experts: {bad_experts}")
    if missing:
        problems.append(f"missing: {missing}")
    if unexpected:
        problems.append(f"unexpected: {unexpected}")
    if mis_shaped:
        problems.append(f"wrong shape: {mis_shaped}")
    if problems:
        raise ValueError(
            "Hugging Face state dict does not match ModelConfig("
            f"num_hidden_layers={config.num_hidden_layers}, num_experts={n_experts}, "
            f"hidden_size={config.hidden_size}, ...): " + "; ".join(problems)
        )
    return out


def param_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """``MoEForCausalLM(cfg).named_parameters()`` names and shapes, in module order, without building it.

    Computed from the config because a meta-device build costs seconds in a fresh process (its
    embedding init imports torch's reference kernels); a test checks it against the module.
    """
    h, d, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                (p + "post_attention_layernorm.weight", (h,)), (p + "mlp.gate.weight", (e, h)),
                (p + "mlp.experts.gate_proj", (e, i, h)), (p + "mlp.experts.up_proj", (e, i, h)),
                (p + "mlp.experts.down_proj", (e, h, i))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab_size, h))]


def describe(cfg: ModelConfig) -> str:
    """A short ``ModelConfig(...)`` for error messages."""
    return (f"ModelConfig(num_hidden_layers={cfg.num_hidden_layers}, hidden_size={cfg.hidden_size}, "
            f"num_experts={cfg.num_experts}, moe_intermediate_size={cfg.moe_intermediate_size}, "
            f"vocab_size={cfg.vocab_size}, ...)")


def model_config_of(manifest: Manifest, *, url: str = "checkpoint") -> ModelConfig:
    """The embedded MoE's config stored in a checkpoint's ``user_metadata["model_config"]``.

    Raises ManifestError when it is missing, belongs to another architecture, or is invalid.
    """
    meta = manifest.user_metadata
    rules = meta.get("rules")
    if rules is not None and rules != RULES_NAME:
        raise ManifestError(f"{url}: saved for the architecture/rules {rules!r}; Hugging Face export knows only "
                            f"the embedded MoE ({RULES_NAME!r}, exported as Qwen3MoeForCausalLM)")
    raw = meta.get("model_config")
    if raw is None:
        raise ManifestError(f"{url}: no user_metadata['model_config']; Hugging Face export needs a checkpoint of "
                            "the embedded MoE written by the ckpt trainer or by `ckpt import-hf`")
    if not isinstance(raw, dict):
        raise ManifestError(f"{url}: user_metadata['model_config'] is a {type(raw).__name__}, not a map")
    try:
        return ModelConfig.from_dict(raw)
    except (ValueError, TypeError) as e:
        raise ManifestError(f"{url}: user_metadata['model_config'] does not describe the embedded MoE "
                            f"(unknown architecture?): {e}") from None
