"""The hybrid linear-attention model family: Hugging Face's ``MiniMaxForCausalLM`` as a plain ``nn.Module``.

Layers follow ``layer_types``: ``linear_attention`` layers are lightning attention (linear attention
with a per-head exponential decay, computed block by block exactly as transformers'
``MiniMaxLightningAttention`` does), ``full_attention`` layers are the trainer's grouped-query
softmax :class:`~ckpt.trainer.model.Attention` without the q/k norms (MiniMax has none); every
layer's feed-forward is the trainer's :class:`~ckpt.trainer.model.MoEBlock` (MiniMax's router
always renormalizes its top-k, i.e. ``norm_topk_prob=True``). The residual scalings are MiniMax's:
the residual is the *normalized* input, ``x' = alpha * norm(x) + beta * f(norm(x))``.

Parameter names equal the Hugging Face in-memory names (the ``mlp.`` that transformers renames to
``block_sparse_moe.`` on disk; experts stored stacked ``mlp.experts.{gate,up,down}_proj`` (E, out, in)
as in :mod:`ckpt.trainer.model`), so a checkpoint of this model exports through the ``minimax``
adapter of :mod:`ckpt.hf.adapters` with no special case (:meth:`HybridConfig.checkpoint_metadata`).

The decay rates are computed at every call instead of kept in buffers (transformers keeps four
persistent buffers per linear layer: functions of the config, which the export writes from it).
As in :mod:`ckpt.trainer.model`, nothing here imports ``torch.distributed``: sequence parallelism
replaces :attr:`LightningAttention.core` from outside (:func:`ckpt.trainer.lasp.lasp2_linear_attention`).

Example::

    model = HybridForCausalLM(HYBRID_CONFIGS["hybrid-tiny"])
    model.init_weights(seed=0)
    logits, loss = model(input_ids, labels=input_ids)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ckpt.hf.adapters import ADAPTER_KEY
from ckpt.hf.lightning import decay_tables, slope_rates  # transformers' formulas, shared with the export
from ckpt.resharders.rules import HF_RULES
from ckpt.trainer.model import Attention, CausalLM, ModelConfig, MoEBlock, RMSNorm, RotaryEmbedding

__all__ = ["HYBRID_CONFIGS", "LAYER_TYPES", "FullAttention", "HybridConfig", "HybridDecoderLayer",
           "HybridForCausalLM", "HybridModel", "LightningAttention", "decay_tables", "lightning_attention",
           "slope_rates"]

LAYER_TYPES = ("linear_attention", "full_attention")
# MiniMaxLightningAttention builds its output norm with MiniMaxRMSNorm's default epsilon, not the
# config's rms_norm_eps.
LIGHTNING_NORM_EPS = 1e-6

LinearCore = Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor]
"""``core(q, k, v, slopes, block_size) -> out``: the token mixing of a linear-attention layer."""


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """Architecture of :class:`HybridForCausalLM`; field names follow ``transformers.MiniMaxConfig``.

    Args:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
            head_dim: as in :class:`~ckpt.trainer.model.ModelConfig`. Linear layers use
            ``num_attention_heads`` heads of ``head_dim`` for q, k and v alike.
        intermediate_size: width I of each expert's SwiGLU MLP (MiniMax's name for it).
        num_local_experts: experts per layer E.
        num_experts_per_tok: top-k.
        layer_types: one of ``"linear_attention"`` / ``"full_attention"`` per layer.
        block_size: lightning attention's block length (tokens); sequence-parallel chunks must be
            whole blocks.
        rms_norm_eps, rope_theta, max_position_embeddings, initializer_range,
            router_aux_loss_coef: as in ModelConfig (MiniMax defaults).
        full_attn_alpha_factor, full_attn_beta_factor, linear_attn_alpha_factor,
            linear_attn_beta_factor, mlp_alpha_factor, mlp_beta_factor: residual scalings
            ``alpha * norm(x) + beta * f(norm(x))`` after each sub-layer.

    Raises:
        ValueError: on an inconsistent architecture, with the fix in the message.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    block_size: int = 256
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    full_attn_alpha_factor: float = 1.0
    full_attn_beta_factor: float = 1.0
    linear_attn_alpha_factor: float = 1.0
    linear_attn_beta_factor: float = 1.0
    mlp_alpha_factor: float = 1.0
    mlp_beta_factor: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in ("block_size",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"HybridConfig.{name} must be a positive int, got {value!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"HybridConfig.layer_types has {len(self.layer_types)} entries for "
                             f"num_hidden_layers={self.num_hidden_layers}; give one type per layer")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"HybridConfig.layer_types holds {bad}; each entry must be one of {list(LAYER_TYPES)}")
        self.moe_config()  # the shared fields are checked by ModelConfig

    def moe_config(self) -> ModelConfig:
        """The :class:`ModelConfig` view the shared modules (Attention, MoEBlock) are built from."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, num_experts=self.num_local_experts, num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=True, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, router_aux_loss_coef=self.router_aux_loss_coef,
            initializer_range=self.initializer_range)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``layer_types`` as a list); inverse of :meth:`from_dict`."""
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HybridConfig:
        """Build from :meth:`to_dict`'s output; ValueError naming unknown keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"HybridConfig has no fields {unknown}; known fields: {sorted(names)}")
        return cls(**data)

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` body that ``transformers.MiniMaxConfig`` reads as this architecture."""
        d = self.to_dict()
        num_experts = d.pop("num_local_experts")
        rope_theta = d.pop("rope_theta")
        return {**d, "model_type": "minimax", "architectures": ["MiniMaxForCausalLM"],
                "num_local_experts": num_experts, "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
                "hidden_act": "silu", "tie_word_embeddings": False, "sliding_window": None, "attention_dropout": 0.0,
                "router_jitter_noise": 0.0, "output_router_logits": False, "dtype": "float32"}

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> HybridConfig:
        """From a MiniMax ``config.json`` body (completed by the ``minimax`` adapter, so that absent
        fields mean what transformers reads them as).

        Raises:
            ValueError: for what this model does not implement (sliding windows, another
                activation, a non-default RoPE, tied embeddings), naming the field.
        """
        if d.get("model_type") != "minimax":
            raise ValueError(f"model_type is {d.get('model_type')!r}; the hybrid family reads 'minimax' configs")
        rope = d.get("rope_parameters") or {}
        unsupported = {"hidden_act": ("silu", d.get("hidden_act", "silu")),
                       "sliding_window": (None, d.get("sliding_window")),
                       "tie_word_embeddings": (False, bool(d.get("tie_word_embeddings", False))),
                       "rope_type": ("default", rope.get("rope_type", "default"))}
        for key, (wanted, found) in unsupported.items():
            if found != wanted:
                raise ValueError(f"MiniMax config has {key}={found!r}; the hybrid model implements only "
                                 f"{key}={wanted!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        if "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        if values.get("head_dim") is None:
            values["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        return cls(**values)

    def checkpoint_metadata(self) -> dict[str, Any]:
        """``user_metadata`` for a checkpoint of this model (keys ``model.<param>``): it names the
        ``minimax`` adapter and its config, so ``ckpt export-hf`` writes a MiniMax model directory."""
        return {ADAPTER_KEY: "minimax", "hf_config": self.to_hf_config(), "names": "ckpt", "rules": HF_RULES.name}


def _alternating(n: int) -> tuple[str, ...]:
    # transformers' MiniMaxConfig default: layer 0 full attention, then alternating.
    return tuple("full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n))


HYBRID_CONFIGS: dict[str, HybridConfig] = {
    # 4 layers (linear, full, linear, full); 4 heads / 2 kv heads allow TP 2, 4 experts EP up to 4;
    # block_size 16 so that sp=4 with zigzag chunks runs on 128-token sequences.
    "hybrid-tiny": HybridConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"), block_size=16,
        max_position_embeddings=2048),
}


def lightning_attention(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, block_size: int,
                        initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Causal linear attention with per-head decay, block by block as transformers computes it.

    ``out_i = sum_{t <= i} exp(-s_h (i - t)) (q_i . k_t) v_t`` (no softmax, no scaling), plus the
    decayed contribution ``(q_i exp(-s_h i)) @ initial_state`` of everything before the sequence.

    Args:
        q, k: (batch, heads, seq, d_k); v: (batch, heads, seq, d_v).
        slopes: (heads,) decay rates (:func:`slope_rates`).
        block_size: tokens per block; the last block may be shorter.
        initial_state: (batch, heads, d_k, d_v) memory state before token 0, or None (zeros).

    Returns:
        ``(out, state)``: out (batch, heads, seq, d_v); state (batch, heads, d_k, d_v), the memory
        ``initial_state * exp(-s_h seq) + sum_t exp(-s_h (seq - 1 - t)) k_t^T v_t`` after the last
        token, which a later chunk of the sequence starts from.
    """
    batch, heads, seq, _ = q.shape
    rate = slopes.to(device=q.device, dtype=torch.float32)[:, None, None]
    query_decay, key_decay, diagonal_decay = decay_tables(rate, block_size)
    state = initial_state if initial_state is not None else q.new_zeros(batch, heads, q.shape[-1], v.shape[-1])
    out = []
    for start in range(0, seq, block_size):
        end = min(start + block_size, seq)
        n = end - start
        qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diagonal_decay[:, :, :n, :n], vb)
        inter = torch.matmul(qb * query_decay[:, :n], state)
        out.append(inter + intra)
        state = state * torch.exp(-rate * n) + torch.matmul((kb * key_decay[:, -n:]).transpose(-1, -2), vb)
    return torch.cat(out, dim=-2), state


def _single_process(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, block_size: int) -> Tensor:
    return lightning_attention(q, k, v, slopes, block_size)[0]


class LightningAttention(nn.Module):
    """MiniMax's linear-attention layer: ``silu(qkv_proj)``, lightning attention, RMSNorm over all
    heads, a sigmoid ``output_gate`` of the layer input, ``out_proj``; no biases, no RoPE.

    ``qkv_proj`` rows hold, per head, that head's q, k and v (head h: rows ``3dh .. 3d(h+1)``), so a
    tensor-parallel slice of whole heads is a contiguous row block; the number of local heads is
    read from the weight and ``head_offset`` (global index of local head 0) picks their decay
    rates. ``core`` mixes the tokens: the single-process blocked algorithm by default; sequence
    parallelism sets it to a LASP-2 closure.
    """

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        h, d, n = config.hidden_size, config.head_dim, config.num_attention_heads
        self.head_dim = d
        self.block_size = config.block_size
        self.layer_idx = layer_idx
        self.num_layers = config.num_hidden_layers
        self.num_heads = n
        self.head_offset = 0
        self.qkv_proj = nn.Linear(h, 3 * n * d, bias=False)
        self.output_gate = nn.Linear(h, n * d, bias=False)
        self.out_proj = nn.Linear(n * d, h, bias=False)
        self.norm = RMSNorm(n * d, LIGHTNING_NORM_EPS)
        self.core: LinearCore = _single_process
        # Under tensor parallelism the output norm spans heads held by other ranks: this sums a
        # per-token statistic over the TP group (forward and backward); None: every head is here.
        self.sum_over_heads: Callable[[Tensor], Tensor] | None = None

    def slopes(self) -> Tensor:
        """Decay rates of the local heads, (local heads,) float32."""
        local = self.qkv_proj.weight.shape[0] // (3 * self.head_dim)
        rates = slope_rates(self.num_heads, self.layer_idx, self.num_layers)
        return rates[self.head_offset:self.head_offset + local]

    def forward(self, x: Tensor, position_embeddings: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Mix ``x`` (batch, seq, hidden); ``position_embeddings`` is ignored (no RoPE here)."""
        batch, seq, _ = x.shape
        qkv = F.silu(self.qkv_proj(x)).view(batch, seq, -1, 3 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, self.head_dim, dim=3))
        out = self.core(q, k, v, self.slopes(), self.block_size)
        out = self._norm(out.transpose(1, 2).reshape(batch, seq, -1))
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * out)

    def _norm(self, x: Tensor) -> Tensor:
        if self.sum_over_heads is None:
            return self.norm(x)
        # RMSNorm over all heads when this rank holds some: the mean of squares is the group's sum
        # of squares over the full width (float32, as RMSNorm computes).
        x32 = x.float()
        squares = self.sum_over_heads(x32.pow(2).sum(-1, keepdim=True))
        x32 = x32 * torch.rsqrt(squares / (self.num_heads * self.head_dim) + self.norm.eps)
        return self.norm.weight * x32.to(x.dtype)


class FullAttention(Attention):
    """MiniMax's softmax layers: the trainer's :class:`Attention` (GQA, RoPE, causal, 1/sqrt(d))
    without per-head q/k norms, so tensor and sequence parallelism of Attention apply unchanged."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = nn.Identity()  # type: ignore[assignment]
        self.k_norm = nn.Identity()  # type: ignore[assignment]


class HybridDecoderLayer(nn.Module):
    """``h = norm1(x); x = a1 h + b1 attn(h); h = norm2(x); x = a2 h + b2 moe(h)`` (MiniMax's order)."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        moe = config.moe_config()
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn: nn.Module
        if self.layer_type == "linear_attention":
            self.self_attn = LightningAttention(config, layer_idx)
            self.attn_alpha, self.attn_beta = config.linear_attn_alpha_factor, config.linear_attn_beta_factor
        else:
            self.self_attn = FullAttention(moe)
            self.attn_alpha, self.attn_beta = config.full_attn_alpha_factor, config.full_attn_beta_factor
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoEBlock(moe)
        self.mlp_alpha, self.mlp_beta = config.mlp_alpha_factor, config.mlp_beta_factor

    def forward(self, x: Tensor, position_embeddings: tuple[Tensor, Tensor]) -> Tensor:
        """Apply to ``x`` (batch, seq, hidden) given RoPE ``(cos, sin)`` (used by full attention)."""
        h = self.input_layernorm(x)
        x = h * self.attn_alpha + self.self_attn(h, position_embeddings) * self.attn_beta
        h = self.post_attention_layernorm(x)
        return h * self.mlp_alpha + self.mlp(h) * self.mlp_beta


class HybridModel(nn.Module):
    """The decoder stack (``model.`` prefix); pipeline stages may drop ``embed_tokens`` / ``norm`` and
    keep their layers in an ``nn.ModuleDict`` keyed by global index, as for :class:`MoEModel`."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers: nn.ModuleList | nn.ModuleDict = nn.ModuleList(
            HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        # ``(local seq, device) -> (1, local seq)`` global positions when no ``position_ids`` are
        # passed: the trainer's sequence parallelism sets it (:func:`ckpt.trainer.sp.shard_sequence`),
        # as for :class:`~ckpt.trainer.model.MoEModel`, since a pipeline stage is called with one input.
        self.position_fn: Callable[[int, torch.device], Tensor] | None = None

    def forward(self, x: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Token ids (batch, seq), or hidden states without ``embed_tokens``, to hidden states.

        ``position_ids`` (1 or batch, seq): the tokens' global positions (default ``position_fn``'s,
        else 0 .. seq-1), for a sequence-parallel rank that holds a slice of the sequence.
        """
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        if position_ids is None and self.position_fn is not None:
            position_ids = self.position_fn(h.shape[1], h.device)
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, position_ids)
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in layers:
            h = layer(h, position_embeddings)
        return self.norm(h) if self.norm is not None else h


class HybridForCausalLM(CausalLM):
    """:class:`HybridModel` plus an untied ``lm_head``; parameters start uninitialized
    (:meth:`init_weights`, shared with :class:`~ckpt.trainer.model.MoEForCausalLM`)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.model: HybridModel = HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
