"""Tiny models of every causal-LM architecture the installed transformers ships, for the generic
adapter's round trip (tests/hf/test_generic.py): each family's default config shrunk, built, saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ckpt
from ckpt.hf.convert import export_hf, import_hf

SHRINK = {  # field -> tiny value (only fields the default config has)
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "n_embed": 64, "dim": 64, "model_dim": 64, "embed_dim": 64,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "ffn_hidden_size": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64, "expert_ffn_hidden_size": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 16, "kv_channels": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_group": 1, "topk_group": 1,
    "vocab_size": 256, "max_position_embeddings": 64, "n_positions": 64,
    "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 16,
}


def tiny_config(model_type: str) -> Any:
    """The family's default config with every size field it has shrunk (layer lists cut to 2)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    base = cls()
    text = base.get_text_config() if hasattr(base, "get_text_config") else base
    import inspect

    takes = set(inspect.signature(type(text).__init__).parameters)
    kw: dict[str, Any] = {k: v for k, v in SHRINK.items()
                          if k in takes and hasattr(text, k) and getattr(text, k) is not None}
    if "qk_rope_head_dim" in kw and "head_dim" in kw:  # MLA: the rotary part is head_dim
        kw["head_dim"] = kw["qk_rope_head_dim"]
    for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        v = getattr(text, k, None)
        if k in takes and (isinstance(v, int) and v >= 200 or isinstance(v, list)):
            kw[k] = 1
    for k in ("layer_types", "layers_block_type", "mlp_only_layers", "attn_layer_indices"):
        v = getattr(text, k, None)
        if isinstance(v, list) and len(v) > 2 and k in ("layer_types", "layers_block_type"):
            kw[k] = v[:2]
    cfg = cls(**kw) if text is base else cls(**{**base.to_dict(), "text_config": {**text.to_dict(), **kw}})
    for k, v in kw.items():  # some configs derive sizes in __init__; force ours when they took
        if hasattr(cfg, k):
            try:
                setattr(cfg, k, v)
            except Exception:  # noqa: BLE001
                pass
    return cfg


def build(model_type: str, out: Path) -> tuple[Any, torch.Tensor] | None:
    """Save a tiny ``model_type`` model under ``out``; its logits on a fixed input. None when
    transformers itself cannot build it or run it forward on CPU at this size."""
    from transformers import AutoModelForCausalLM

    try:
        cfg = tiny_config(model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():  # every weight distinct: a misplaced element changes the logits
                p.copy_(torch.randn_like(p) * 0.05)
            ids = torch.arange(8).reshape(1, 8) % 200
            logits = model(input_ids=ids).logits
        model.save_pretrained(out)
    except Exception as e:  # noqa: BLE001 - not buildable at this size: outside the denominator
        build.last_error = f"{type(e).__name__}: {str(e)[:300]}"  # type: ignore[attr-defined]
        return None
    return model, logits


def round_trip(model_type: str, tmp: Path, model: Any, logits: torch.Tensor, to: str) -> None:
    """import (to ``to``), verify deep, export, from_pretrained: every weight bitwise, logits equal."""

    dst = str(tmp / "ckpt")
    import_hf(str(tmp / "hf"), dst, to=to)
    assert ckpt.verify(dst, deep=True).ok
    export_hf(dst, str(tmp / "out"))
    back = type(model).from_pretrained(tmp / "out").eval()  # its own class: *_text_model types have no Auto entry
    want = model.state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    with torch.no_grad():
        again = back(input_ids=torch.arange(8).reshape(1, 8) % 200).logits
    assert torch.equal(again, logits)
