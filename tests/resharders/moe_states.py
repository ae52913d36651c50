"""Test checkpoints of the embedded MoE: a random tiny model state plus fake AdamW moments."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import ckpt
from ckpt.layout import Layout
from ckpt.trainer.model import CONFIGS, ModelConfig, MoEForCausalLM

TINY = CONFIGS["tiny"]


def full_state(cfg: ModelConfig = TINY, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``model.<param>`` for every parameter of MoEForCausalLM, ``optim.exp_avg/exp_avg_sq.<param>``,
    and a global ``optim.step`` tensor; flat keys, global tensors."""
    model = MoEForCausalLM(cfg)
    model.init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        out[f"model.{k}"] = v.detach().to(dtype).clone()
    for k, v in model.state_dict().items():
        out[f"optim.exp_avg.{k}"] = torch.randn(v.shape, generator=g)
        out[f"optim.exp_avg_sq.{k}"] = torch.rand(v.shape, generator=g)
    out["optim.step"] = torch.tensor(10, dtype=torch.int64)
    return out


def objects() -> dict[str, Any]:
    return {"step": 10, "data": {"position": 1234, "seed": 7}, "rng": ckpt.PerRank([0, "state"])}


def metadata(cfg: ModelConfig, layout: Layout) -> dict[str, Any]:
    return {"model_config": cfg.to_dict(), "layout": layout.to_dict(), "rules": "embedded-moe"}


def save_single(url: str, cfg: ModelConfig = TINY, seed: int = 0, dtype: torch.dtype = torch.float32) \
        -> dict[str, torch.Tensor]:
    """Save the full state from one process (layout: single); returns the global tensors."""
    full = full_state(cfg, seed, dtype)
    ckpt.save({**full, **objects()}, url, step=10, user_metadata=metadata(cfg, Layout()),
              layout=Layout().to_dict())
    return full


def config(**kw: Any) -> ModelConfig:
    return dataclasses.replace(TINY, **kw)
