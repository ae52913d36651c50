"""The trainer's mixture-of-experts language model: a plain ``nn.Module``, no parallelism inside.

The architecture is Hugging Face's ``Qwen3MoeForCausalLM`` (transformers 5.x) with every layer a
sparse MoE layer: RMSNorm, default RoPE, grouped-query attention with per-head q/k RMSNorm and no
biases, a top-k softmax router, SwiGLU experts, untied embeddings. Parameter names equal the
Hugging Face checkpoint names except that each layer's experts are stored fused, one 3-D tensor per
projection (``mlp.experts.gate_proj`` (E, I, H), ``up_proj`` (E, I, H), ``down_proj`` (E, H, I)),
so that expert parallelism is a slice of dim 0 and export is a renaming plus a split
(:mod:`ckpt.trainer.model_config`: the config and its ``config.json``; :mod:`ckpt.trainer.hf_adapters`:
the state-dict conversions and the registered Hugging Face adapter, kept out of this module).

Parallelism is applied from outside (``parallelize.py``), so the pieces here are built to be sliced:

- :class:`Attention` reads its number of local heads from its weight shapes, so a tensor-parallel
  wrapper may keep a contiguous slice of q/k/v rows and o_proj columns;
- :class:`Experts` computes with whatever slice of experts it holds, offset by ``expert_offset``,
  through the free function :func:`experts_forward` that an expert-parallel dispatcher can call;
- :class:`MoEModel` skips ``embed_tokens`` / ``norm`` when a pipeline stage sets them to ``None``,
  and :class:`MoEForCausalLM` skips ``lm_head`` likewise.

Example::

    model = MoEForCausalLM(CONFIGS["tiny"])
    model.init_weights(seed=0)
    logits, loss = model(input_ids, labels=input_ids)
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ckpt.trainer.model_config import CONFIGS, ModelConfig

__all__ = [
    "CONFIGS",
    "Attention",
    "DecoderLayer",
    "Experts",
    "MoEBlock",
    "MoEForCausalLM",
    "MoEModel",
    "ModelConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "Router",
    "apply_rotary_pos_emb",
    "causal_attention",
    "causal_lm_loss",
    "experts_forward",
    "initial_value",
    "repeat_kv",
    "route",
]

# Labels equal to this value do not count in the loss (same convention as PyTorch and transformers).
IGNORE_INDEX = -100


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 as Qwen3MoeRMSNorm does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalize ``x`` (..., size); the result has ``x``'s dtype promoted with the weight's."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight multiply, as transformers does, so bf16 results match.
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE tables: ``cos``/``sin`` of shape (..., seq, head_dim) for given positions.

    The inverse frequencies are recomputed in every call instead of kept in a buffer: a buffer
    would be cast by ``model.to(torch.bfloat16)`` and left uninitialized by a meta-device build,
    and the computation is ``head_dim / 2`` numbers. On CPU the values are bitwise those of
    transformers' ``Qwen3MoeRotaryEmbedding``.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``(cos, sin)`` in ``x``'s dtype for integer ``position_ids`` (batch or 1, seq)."""
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=x.device)
        inv_freq = 1.0 / (self.theta ** (steps / self.head_dim))
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate ``q`` and ``k`` (batch, heads, seq, head_dim) by ``cos``/``sin`` (batch, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with per-head q/k RMSNorm and RoPE; no biases.

    The number of heads is read from the projection weights at every call, so a tensor-parallel
    wrapper can keep a contiguous slice of heads: rows of ``q_proj``/``k_proj``/``v_proj`` and
    the matching columns of ``o_proj`` (whose partial outputs then need a sum over ranks).
    A slice must keep whole key/value groups, i.e. the TP degree divides ``num_key_value_heads``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        # Over head_dim only (not the whole projection), so they are unaffected by head slicing.
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        # The attention proper, ``(q, k, v) -> out`` after RoPE (None: :func:`causal_attention`). A
        # sequence-parallel wrapper sets it to attend over the keys of the whole sequence.
        self.attention_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None

    def forward(self, x: Tensor, position_embeddings: tuple[Tensor, Tensor]) -> Tensor:
        """Attend causally over ``x`` (batch, seq, hidden) given RoPE ``(cos, sin)``."""
        batch, seq, _ = x.shape
        heads_shape = (batch, seq, -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(heads_shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(heads_shape)).transpose(1, 2)
        v = self.v_proj(x).view(heads_shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        attend = self.attention_fn if self.attention_fn is not None else causal_attention
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def repeat_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Repeat key/value heads (batch, kv heads, seq, head_dim) to ``q``'s head count (grouped-query
    attention: key/value head j serves query heads j*group .. (j+1)*group - 1, as in transformers).

    Raises ValueError when the query heads are not a multiple of the key/value heads.
    """
    group = q.shape[1] // k.shape[1]
    if group * k.shape[1] != q.shape[1]:
        raise ValueError(
            f"{q.shape[1]} local query heads do not split evenly over {k.shape[1]} local key/value "
            "heads; slice heads so that every rank keeps whole key/value groups"
        )
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return k, v


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal grouped-query attention of ``q`` (batch, heads, seq, head_dim) over ``k``/``v`` (batch,
    kv heads, seq, head_dim) of the same tokens; returns ``q``'s shape."""
    k, v = repeat_kv(q, k, v)
    # Default scale 1/sqrt(head_dim) is Qwen3's scaling; no dropout (attention_dropout=0).
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Router(nn.Module):
    """Top-k softmax router; its weight (E, H) is Hugging Face's ``mlp.gate.weight``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Route tokens ``x`` (tokens, hidden).

        Returns:
            ``(router_logits, routing_weights, selected_experts)``: logits (tokens, E), the top-k
            probabilities (tokens, k) in the logits' dtype, and global expert ids (tokens, k).
        """
        return route(x, self.weight, self.top_k, self.norm_topk_prob)


def route(x: Tensor, weight: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor, Tensor]:
    """:class:`Router`'s computation with an explicit ``weight`` (E, H), so that a parallel wrapper
    can route with a wrapped weight (e.g. one whose gradient is summed over a group).

    Returns ``(router_logits, routing_weights, selected_experts)`` as :meth:`Router.forward`.
    """
    logits = F.linear(x, weight)
    # Softmax in float32 as transformers does; top-k then renormalize the kept probabilities.
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, selected = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), selected


def experts_forward(
    hidden_states: Tensor,
    routing_weights: Tensor,
    selected_experts: Tensor,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
    expert_offset: int = 0,
) -> Tensor:
    """Weighted sum of SwiGLU expert outputs for a contiguous slice of experts.

    Each token ``t`` gets ``sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` over the slots
    ``j`` whose expert ``e = selected_experts[t, j]`` is held here, i.e. ``expert_offset <= e <
    expert_offset + gate_proj.shape[0]``; slots routed to other experts contribute nothing, so an
    expert-parallel caller can sum the results of all slices (or compute only on tokens it was
    sent).

    Args:
        hidden_states: (tokens, H) flattened token states.
        routing_weights: (tokens, k) weight of each routing slot.
        selected_experts: (tokens, k) global expert id of each slot.
        gate_proj: (E_local, I, H) gate projections of the local experts.
        up_proj: (E_local, I, H) up projections.
        down_proj: (E_local, H, I) down projections.
        expert_offset: global id of local expert 0.

    Returns:
        (tokens, H) tensor in ``hidden_states``' dtype.
    """
    out = torch.zeros_like(hidden_states)
    # Every local expert runs, even on zero tokens: its weights then get zero (not None)
    # gradients, which keeps gradient reductions and optimizers uniform across ranks and steps.
    for local in range(gate_proj.shape[0]):
        token_idx, slot = torch.where(selected_experts == expert_offset + local)
        x = hidden_states[token_idx]
        y = F.linear(F.silu(F.linear(x, gate_proj[local])) * F.linear(x, up_proj[local]), down_proj[local])
        y = y * routing_weights[token_idx, slot, None]
        # Experts are visited in increasing id order, so each token's sum is accumulated in the
        # same order as in transformers' loop.
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


class Experts(nn.Module):
    """SwiGLU experts stored fused: ``gate_proj`` (E, I, H), ``up_proj`` (E, I, H), ``down_proj`` (E, H, I).

    Gate and up are kept apart (transformers fuses them into one ``gate_up_proj``) so that every
    tensor shards over dim 0 by expert and over I for tensor parallelism without interleaving.
    An expert-parallel wrapper replaces the parameters with a slice of experts and sets
    ``expert_offset`` to the global id of the first one.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, h))
        self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.expert_offset = 0

    def forward(self, hidden_states: Tensor, routing_weights: Tensor, selected_experts: Tensor) -> Tensor:
        """See :func:`experts_forward`; uses this module's weights and ``expert_offset``."""
        return experts_forward(
            hidden_states,
            routing_weights,
            selected_experts,
            self.gate_proj,
            self.up_proj,
            self.down_proj,
            self.expert_offset,
        )


class MoEBlock(nn.Module):
    """Sparse MoE feed-forward: router ``gate`` then ``experts``, like Qwen3MoeSparseMoeBlock."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)

    def forward(self, x: Tensor) -> Tensor:
        """Apply to ``x`` (batch, seq, hidden)."""
        flat = x.reshape(-1, x.shape[-1])
        _, weights, selected = self.gate(flat)
        return self.experts(flat, weights, selected).view_as(x)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + moe(norm(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoEBlock(config)

    def forward(self, x: Tensor, position_embeddings: tuple[Tensor, Tensor]) -> Tensor:
        """Apply to ``x`` (batch, seq, hidden) given RoPE ``(cos, sin)``."""
        x = x + self.self_attn(self.input_layernorm(x), position_embeddings)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoEModel(nn.Module):
    """The decoder stack (Hugging Face's ``model.`` prefix): embeddings, layers, final norm.

    A pipeline stage may set ``embed_tokens`` to ``None`` (it then takes hidden states, not token
    ids) and ``norm`` to ``None`` (it then returns un-normalized hidden states), and may replace
    ``layers`` by an ``nn.ModuleDict`` of its layers keyed by global layer index.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers: nn.ModuleList | nn.ModuleDict = nn.ModuleList(
            DecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        # ``(local seq, device) -> (1, local seq)`` global positions of this module's tokens (None:
        # 0 .. seq-1). A sequence-parallel wrapper sets it: a rank holds a slice of each sequence.
        self.position_fn: Callable[[int, torch.device], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        """Map token ids (batch, seq), or hidden states (batch, seq, hidden) when there is no
        ``embed_tokens``, to hidden states (batch, seq, hidden). Positions are 0 .. seq-1 unless
        ``position_fn`` says otherwise."""
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        if self.position_fn is not None:
            positions = self.position_fn(h.shape[1], h.device)
        else:
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, positions)
        # A pipeline stage keeps its layers in an nn.ModuleDict keyed by global index, so that
        # parameter names stay global ("layers.5." on the stage that holds layers 4..7).
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in layers:
            h = layer(h, position_embeddings)
        return self.norm(h) if self.norm is not None else h


def causal_lm_loss(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean next-token cross-entropy: position t predicts ``labels[:, t + 1]``.

    ``labels`` has the shape of the input ids (it is shifted here, as transformers does); entries
    equal to ``ignore_index`` do not count. Computed in float32 whatever the logits' dtype.
    """
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=ignore_index)


class CausalLM(nn.Module):
    """What every model family's causal LM shares: ``self.model`` (a decoder returning hidden states,
    set by the subclass with ``self.config`` and an untied ``self.lm_head``), the forward with an
    optional loss, and the deterministic init. A pipeline stage may set ``lm_head`` to ``None`` to
    return hidden states."""

    config: Any
    model: nn.Module
    lm_head: nn.Linear | None

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Return logits (batch, seq, vocab), or ``(logits, loss)`` when ``labels`` is given.

        ``labels`` are unshifted (usually the input ids themselves); see :func:`causal_lm_loss`.
        """
        h = self.model(input_ids)
        logits = self.lm_head(h) if self.lm_head is not None else h
        if labels is None:
            return logits
        return logits, causal_lm_loss(logits, labels)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init: every matrix ~ N(0, initializer_range), every norm weight 1.

        Each parameter draws from its own CPU generator seeded by ``seed`` and the parameter's
        name (as this module names it), so the values do not depend on the device or on the
        parameter order; they are copied into the parameters in place. Parallel wrappers should
        call it on the full model before slicing, or keep global names.
        """
        std = self.config.initializer_range
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if isinstance(module, RMSNorm):
                    param.fill_(1.0)
                    continue
                name = f"{module_name}.{param_name}" if module_name else param_name
                param.copy_(initial_value(name, tuple(param.shape), std, seed))


class MoEForCausalLM(CausalLM):
    """Causal language model: :class:`MoEModel` plus an untied ``lm_head``.

    Parameters are created uninitialized (``torch.empty``); call :meth:`init_weights` (also after
    building on the meta device and ``to_empty``). A pipeline stage may set ``lm_head`` to ``None``
    to return hidden states.

    Example::

        model = MoEForCausalLM(CONFIGS["tiny"])
        model.init_weights(seed=0)
        logits, loss = model(ids, labels=ids)
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model: MoEModel = MoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def initial_value(name: str, shape: tuple[int, ...], std: float, seed: int = 0) -> Tensor:
    """The initial values :meth:`MoEForCausalLM.init_weights` gives matrix parameter ``name``.

    A float32 CPU tensor ~ N(0, ``std``) drawn from a generator seeded by ``seed`` and the name, so a
    parallel wrapper can build any slice of a parameter (by drawing the whole and slicing) without
    building the model. Norm weights are not drawn: they start at one.
    """
    generator = torch.Generator().manual_seed(_param_seed(seed, name))
    values = torch.empty(shape, dtype=torch.float32)
    values.normal_(0.0, std, generator=generator)
    return values


def _param_seed(seed: int, name: str) -> int:
    # crc32 (not hash()) because Python's str hash is salted per process.
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)
