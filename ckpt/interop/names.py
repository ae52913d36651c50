"""Key-name schemes of other tools' checkpoints, told from the keys alone (no model config needed).

``ckpt`` (``model.`` + Hugging Face names), ``hf``, ``torchtitan`` (0.2 and 0.3 spellings) and
``megatron``. The per-model mapping of each scheme onto Hugging Face names (which needs the model's
adapter) is :mod:`ckpt.hf.names`; the resharder's rules for foreign checkpoints
(:mod:`ckpt.resharders.derive`) need only what is here.
"""

from __future__ import annotations

import re

NAMINGS = ("ckpt", "hf", "torchtitan", "megatron")
AUTO = "auto"

# Hugging Face name (inside a layer) -> torchtitan's
TITAN = [
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.q_proj.weight", "attention.wq.weight"),
    ("self_attn.k_proj.weight", "attention.wk.weight"),
    ("self_attn.v_proj.weight", "attention.wv.weight"),
    ("self_attn.o_proj.weight", "attention.wo.weight"),
    ("self_attn.q_norm.weight", "attention.q_norm.weight"),
    ("self_attn.k_norm.weight", "attention.k_norm.weight"),
    ("self_attn.q_a_proj.weight", "attention.wq_a.weight"),
    ("self_attn.q_a_layernorm.weight", "attention.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attention.wq_b.weight"),
    ("self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.weight"),
    ("self_attn.kv_a_layernorm.weight", "attention.kv_norm.weight"),
    ("self_attn.kv_b_proj.weight", "attention.wkv_b.weight"),
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("mlp.gate.weight", "moe.router.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "moe.expert_bias"),
    ("mlp.experts.gate_proj", "moe.experts.w1"),
    ("mlp.experts.down_proj", "moe.experts.w2"),
    ("mlp.experts.up_proj", "moe.experts.w3"),
    ("mlp.shared_experts.gate_proj.weight", "moe.shared_experts.w1.weight"),
    ("mlp.shared_experts.down_proj.weight", "moe.shared_experts.w2.weight"),
    ("mlp.shared_experts.up_proj.weight", "moe.shared_experts.w3.weight"),
]


# torchtitan 0.3 spells some tensors differently (same shapes, same row order): old -> new
TITAN_03 = {"attention.wq.weight": "attention.qkv_linear.wq.weight",
             "attention.wk.weight": "attention.qkv_linear.wk.weight",
             "attention.wv.weight": "attention.qkv_linear.wv.weight",
             "output.weight": "lm_head.weight"}


# What each scheme's keys look like (matched at the start of a key): detection's first pass, and
# the only one when no model config is known. HF and ckpt differ by ckpt's extra ``model.`` prefix.
PATTERNS = {
    "ckpt": re.compile(r"model\.(model\.(embed_tokens|norm|layers\.\d+)\.|lm_head\.weight$)"),
    "hf": re.compile(r"(model\.(embed_tokens|norm)\.weight$|model\.layers\.\d+\.(self_attn|mlp|input_layernorm|"
                     r"post_attention_layernorm)\.|lm_head\.weight$)"),
    "torchtitan": re.compile(r"(model\.)?(tok_embeddings\.weight$|output\.weight$|layers\.\d+\.(attention|"
                             r"attention_norm|feed_forward|ffn_norm|moe)\.)"),
    "megatron": re.compile(r"(model\.|module\.)?(embedding\.word_embeddings\.|decoder\.(layers|final_layernorm)\.|"
                           r"output_layer\.)"),
}


def key_schemes(keys: object) -> dict[str, int]:
    """Scheme -> how many of ``keys`` look like its names (schemes no key fits are left out)."""
    counts: dict[str, int] = {}
    for k in keys:  # type: ignore[attr-defined]
        for kind, rx in PATTERNS.items():
            if rx.match(k):
                counts[kind] = counts.get(kind, 0) + 1
    return counts


def scheme_of_keys(keys: object) -> str:
    """The scheme most of ``keys`` look like (``ckpt`` when none)."""
    seen = key_schemes(keys)
    return max(seen, key=lambda k: seen[k]) if seen else "ckpt"


__all__ = ["NAMINGS", "AUTO", "TITAN", "TITAN_03", "PATTERNS", "key_schemes", "scheme_of_keys"]
