"""The embedded MoE's configuration (:class:`ModelConfig`, the named sizes :data:`CONFIGS`) and its
Hugging Face ``config.json`` (a Qwen3-MoE config) both ways.

A field a ``config.json`` leaves out means what transformers reads it as (:data:`HF_DEFAULTS`), never
this class's default. The model itself is :mod:`ckpt.trainer.model`; its Hugging Face adapter
:mod:`ckpt.trainer.hf_adapters`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CONFIGS", "HF_DEFAULTS", "ModelConfig", "config_from_hf", "hf_config", "hf_default"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of :class:`MoEForCausalLM`; field names follow ``transformers.Qwen3MoeConfig``.

    Args:
        vocab_size: number of token ids.
        hidden_size: model width H.
        intermediate_size: width of a dense MLP. Unused (every layer is MoE) but kept so the
            Hugging Face config round-trips.
        moe_intermediate_size: width I of each expert's SwiGLU MLP.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention); divides the query heads.
        head_dim: width of one attention head (even, for RoPE).
        num_experts: experts per layer E.
        num_experts_per_tok: experts each token is routed to (top-k).
        norm_topk_prob: renormalize the top-k router probabilities to sum to one.
        rms_norm_eps: epsilon inside every RMSNorm.
        rope_theta: RoPE base frequency.
        max_position_embeddings: longest sequence the model is meant for (recorded, not enforced).
        router_aux_loss_coef: load-balancing loss weight, recorded for the Hugging Face config;
            this model does not compute that loss.
        initializer_range: standard deviation of the normal init of every matrix.
        tie_word_embeddings: must be False; kept so the Hugging Face config round-trips.

    Raises:
        ValueError: on an inconsistent architecture, with the fix in the message.

    Example::

        cfg = dataclasses.replace(CONFIGS["tiny"], num_hidden_layers=4)
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            # bool is an int subclass; True as a layer count is a bug, not a 1.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}: grouped-query attention shares each "
                "key/value head among the same number of query heads; pick a divisor"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim={self.head_dim} is odd: rotary embeddings rotate pairs of "
                "channels; use an even head_dim"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}: a token cannot visit more experts than exist; "
                "lower the top-k or add experts"
            )
        if self.tie_word_embeddings:
            raise ValueError(
                "ModelConfig.tie_word_embeddings=True is not supported: lm_head and embed_tokens are "
                "separate parameters (they shard differently); set it to False"
            )

    def num_parameters(self, *, active: bool = False) -> int:
        """Count the model's parameters without building it.

        Args:
            active: count only what one token uses: its top-k experts instead of all experts.

        Example::

            CONFIGS["100m"].num_parameters()  # 102_016_512
        """
        h, d = self.hidden_size, self.head_dim
        q_width, kv_width = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = h * q_width + 2 * h * kv_width + q_width * h + 2 * d  # + q_norm, k_norm
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = self.num_experts * h + experts * 3 * self.moe_intermediate_size * h  # router + experts
        layer = attention + moe + 2 * h  # + the two layer norms
        return 2 * self.vocab_size * h + self.num_hidden_layers * layer + h  # + final norm

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form, e.g. for checkpoint metadata; inverse of :meth:`from_dict`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Build from :meth:`to_dict`'s output.

        Raises:
            ValueError: on a key that is not a field (likely a typo or a newer version's field).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"ModelConfig has no fields {unknown}; known fields: {sorted(names)}")
        return cls(**data)

    def to_hf_config_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` body (:func:`hf_config`)."""
        return hf_config(self)

    @classmethod
    def from_hf_config_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face ``config.json`` body (:func:`config_from_hf`).

        Raises ValueError for a config this model does not implement.
        """
        return config_from_hf(d)


CONFIGS: dict[str, ModelConfig] = {
    # Byte-level vocabulary; 181,952 parameters (132,800 active); a train step on CPU takes
    # milliseconds.
    # 4 layers so that pipeline tests can use up to 4 stages; 2 kv heads allow TP 2; 4 experts
    # allow EP up to 4.
    "tiny": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
    ),
    # 102,016,512 parameters in all (32.8M in embeddings + lm_head, 8 layers x 8.66M), 54.8M active
    # per token with top-2 of 8 experts. 8 heads / 4 kv heads allow TP up to 4, 8 experts EP up
    # to 8, 8 layers PP up to 8.
    "100m": ModelConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=2048,
        moe_intermediate_size=640,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    ),
    # 782,985,728 parameters (65.5M in embeddings + lm_head, 12 layers x 59.8M), 145M active per
    # token with top-2 of 16 experts: sized for the memory-tier bench (``python -m bench
    # memtier-gpu``): under dp=4 without ZeRO every GPU holds 12.5 GB of fp32 weights, gradients and
    # AdamW moments and checkpoints 9.4 GB of them. 16 heads / 8 kv heads allow TP up to 8, 16
    # experts EP up to 16.
    "800m": ModelConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        moe_intermediate_size=1152,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    ),
}


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
