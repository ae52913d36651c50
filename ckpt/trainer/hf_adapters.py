"""The trainer's models as Hugging Face models: the embedded MoE's adapter (:class:`EmbeddedMoE`,
exported as ``Qwen3MoeForCausalLM``), registered with :func:`ckpt.hf.register_adapter` the way any
model of one's own is, through the ``ckpt.hf_adapters`` entry point (:func:`register`) that
``pyproject.toml`` declares, so that ``ckpt export-hf`` / ``import-hf`` find it without the library
importing the trainer. The hybrid model needs no adapter of its own: its checkpoints name the
built-in ``minimax`` family (:meth:`ckpt.trainer.hybrid.HybridConfig.checkpoint_metadata`).

Checkpoint convention (the trainer's contract): model weights are the tensors ``model.<param>`` for
every ``<param>`` of ``MoEForCausalLM.named_parameters()``, global shapes, any layout; the model
config is ``user_metadata["model_config"]`` (``ModelConfig.to_dict()``), the rules ``embedded-moe``.
Also here: in-memory state dicts in Hugging Face names and back (per-expert keys vs the fused
``mlp.experts.{gate,up,down}_proj`` of shape (E, out, in)) and the parameter list from the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ckpt.errors import ManifestError
from ckpt.hf import register_adapter
from ckpt.hf.adapters import Adapter
from ckpt.hf.engine import FUSED_EXPERT, HF_GATE_UP, HF_PER_EXPERT, PREFIX
from ckpt.resharders.rules import MOE_RULES
from ckpt.trainer.model import MoEForCausalLM
from ckpt.trainer.model_config import HF_DEFAULTS, ModelConfig, config_from_hf, hf_config, hf_default

__all__ = ["FUSED_EXPERT", "HF_DEFAULTS", "HF_GATE_UP", "HF_PER_EXPERT", "PREFIX", "RULES_NAME", "EmbeddedMoE",
           "config_from_hf", "describe", "from_hf_state_dict", "hf_config", "hf_default", "model_config_of",
           "param_shapes", "register", "to_hf_state_dict"]

RULES_NAME = MOE_RULES.name  # user_metadata["rules"] of the embedded MoE's checkpoints: "embedded-moe"


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
    n_experts = config.num_experts
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in MoEForCausalLM(config).state_dict().items()}
    c = _Renamed()
    c.add_all(hf_state_dict, config)
    c.stack_experts(expected, n_experts)
    problems = c.problems(expected)
    if problems:
        raise ValueError(
            "Hugging Face state dict does not match ModelConfig("
            f"num_hidden_layers={config.num_hidden_layers}, num_experts={n_experts}, "
            f"hidden_size={config.hidden_size}, ...): " + "; ".join(problems)
        )
    return c.out


@dataclass(slots=True)
class _Renamed:
    """A Hugging Face state dict being renamed to this model's keys, and what is wrong with it."""

    out: dict[str, Tensor] = field(default_factory=dict)
    # Our fused key -> expert id -> (Hugging Face key, tensor), stacked once all are seen.
    per_expert: dict[str, dict[int, tuple[str, Tensor]]] = field(default_factory=dict)
    duplicates: list[str] = field(default_factory=list)
    bad_experts: list[str] = field(default_factory=list)
    mis_shaped: list[str] = field(default_factory=list)
    # Fused keys whose per-expert parts were already reported, so they are not "missing" too.
    reported: set[str] = field(default_factory=set)

    def put(self, key: str, tensor: Tensor) -> None:
        if key in self.out:
            self.duplicates.append(key)
        self.out[key] = tensor

    def add_all(self, hf_state_dict: Mapping[str, Tensor], config: ModelConfig) -> None:
        """Take every key: per-expert ones are set aside for stacking, transformers' fused
        ``gate_up_proj`` is split, the rest kept by name (``rotary_emb.inv_freq`` dropped)."""
        n_experts, inter = config.num_experts, config.moe_intermediate_size
        for key, tensor in hf_state_dict.items():
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if match := HF_PER_EXPERT.fullmatch(key):
                fused = f"{match['prefix']}.{match['proj']}_proj"
                self.per_expert.setdefault(fused, {})[int(match["expert"])] = (key, tensor)
            elif match := HF_GATE_UP.fullmatch(key):
                if tensor.dim() != 3 or tensor.shape[1] != 2 * inter:
                    fused_shape = (n_experts, 2 * inter, config.hidden_size)
                    self.mis_shaped.append(f"{key}: expected {fused_shape}, got {tuple(tensor.shape)}")
                    continue
                self.put(f"{match['prefix']}.gate_proj", tensor[:, :inter].contiguous())
                self.put(f"{match['prefix']}.up_proj", tensor[:, inter:].contiguous())
            else:
                self.put(key, tensor)

    def stack_experts(self, expected: dict[str, tuple[int, ...]], n_experts: int) -> None:
        """Stack each fused key's per-expert tensors, when all ``n_experts`` are there with one shape."""
        for fused, experts in self.per_expert.items():
            wrong_ids = sorted(set(experts) ^ set(range(n_experts)))
            if wrong_ids:
                self.bad_experts.append(f"{fused}: expert ids {wrong_ids} missing or out of range 0..{n_experts - 1}")
                self.reported.add(fused)
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
                self.mis_shaped.extend(wrong)
                self.reported.add(fused)
                continue
            self.put(fused, torch.stack([experts[e][1] for e in range(n_experts)]))

    def problems(self, expected: dict[str, tuple[int, ...]]) -> list[str]:
        """Every duplicated, incomplete, missing, unexpected and mis-shaped key, one item per kind."""
        out = self.out
        missing = sorted(set(expected) - set(out) - self.reported)
        unexpected = sorted(set(out) - set(expected))
        self.mis_shaped += [
            f"{k}: expected {expected[k]}, got {tuple(out[k].shape)}"
            for k in sorted(set(out) & set(expected))
            if tuple(out[k].shape) != expected[k]
        ]
        problems = []
        if self.duplicates:
            problems.append(f"given twice (fused and per-expert?): {sorted(self.duplicates)}")
        if self.bad_experts:
            problems.append(f"incomplete experts: {self.bad_experts}")
        if missing:
            problems.append(f"missing: {missing}")
        if unexpected:
            problems.append(f"unexpected: {unexpected}")
        if self.mis_shaped:
            problems.append(f"wrong shape: {self.mis_shaped}")
        return problems


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


def model_config_of(meta: Mapping[str, Any], *, url: str = "checkpoint") -> ModelConfig:
    """The embedded MoE's config stored in a checkpoint's ``user_metadata["model_config"]`` (``meta``).

    Raises ManifestError when it is missing, belongs to another architecture, or is invalid.
    """
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


class EmbeddedMoE(Adapter):
    """The embedded MoE as a Hugging Face ``Qwen3MoeForCausalLM``: its checkpoints hold the model's
    parameters whole (``by_params``) and record a :class:`ModelConfig`; it imports the Qwen3-MoE
    directories it can represent (every layer MoE, default RoPE, no biases), the ``qwen3_moe`` family
    adapter the others."""

    name = RULES_NAME  # checkpoints name it by their rules (they record no hf_adapter)
    model_types = ()  # a config.json given explicitly goes to the qwen3_moe family
    architecture = "Qwen3MoeForCausalLM"
    rules = MOE_RULES
    imports = ("qwen3_moe",)
    by_params = True

    def checkpoint_config(self, meta: dict[str, Any], *, url: str) -> ModelConfig:
        return model_config_of(meta, url=url)

    def accept(self, d: dict[str, Any], names: str, *, where: str) -> ModelConfig | None:
        if names != "ckpt":
            return None
        try:
            return config_from_hf(d)
        except (ValueError, TypeError):
            return None  # dense layers, biases...: the generic Qwen3-MoE adapter takes it

    def checkpoint_metadata(self, cfg: ModelConfig, names: str) -> dict[str, Any]:
        return {"model_config": cfg.to_dict(), "rules": RULES_NAME}

    def describe(self, cfg: ModelConfig) -> str:
        return describe(cfg)

    def hf_config(self, cfg: ModelConfig) -> dict[str, Any]:  # type: ignore[override]
        return hf_config(cfg)

    def params(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:  # type: ignore[override]
        return param_shapes(cfg)

    def reference_model(self, src_url: str) -> nn.Module:
        from ckpt.trainer.checkpoint import load_full_model

        return load_full_model(src_url)


def register() -> None:
    """The ``ckpt.hf_adapters`` entry point: register the trainer's adapters."""
    register_adapter(EmbeddedMoE())

