"""Fused QKV (GQA) and gate/up: local fused tensors <-> shards of the logical tensors."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt.errors import StateError
from ckpt.resharders.fused import FusedPart, FusedSpec, join_fused, split_fused
from tests.dist_utils import run_ranks

NH, NKV, HD, H = 8, 2, 4, 12


def qkv() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.q_proj.weight": torch.randn(NH * HD, H, generator=g),
            "a.k_proj.weight": torch.randn(NKV * HD, H, generator=g),
            "a.v_proj.weight": torch.randn(NKV * HD, H, generator=g)}


def fused_local(full: dict[str, torch.Tensor], tp: int, t: int, interleaved: bool) -> torch.Tensor:
    """The trainer's fused tensor on TP rank t, built independently of the helper."""
    q, k, v = full["a.q_proj.weight"], full["a.k_proj.weight"], full["a.v_proj.weight"]
    if not interleaved:  # [q_t; k_t; v_t]
        return torch.cat([x.chunk(tp)[t] for x in (q, k, v)])
    per_group = torch.cat([q.view(NKV, -1, H), k.view(NKV, -1, H), v.view(NKV, -1, H)], dim=1)
    return per_group.chunk(tp)[t].reshape(-1, H).clone()  # Megatron: [q_g; k_g; v_g] per kv group


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_split_and_join(tp, interleaved):
    full = qkv()
    spec = FusedSpec.qkv("a", num_heads=NH, num_kv_heads=NKV, head_dim=HD, hidden=H, interleaved=interleaved)
    for t in range(tp):
        local = fused_local(full, tp, t, interleaved)
        shards = split_fused(local, spec, tp=tp, tp_rank=t)
        for key, s in shards.items():
            assert s.global_shape == tuple(full[key].shape)
            rows = slice(s.offsets[0], s.offsets[0] + s.local.shape[0])
            assert torch.equal(s.local, full[key][rows]), key
        if not interleaved:  # views: loading into them fills the fused tensor in place
            assert all(s.local.data_ptr() >= local.data_ptr() for s in shards.values())
        out = torch.zeros_like(local)
        assert join_fused(shards, spec, tp=tp, out=out) is out and torch.equal(out, local)
        assert torch.equal(join_fused({k: s.local for k, s in shards.items()}, spec, tp=tp), local)


def test_gate_up_experts_with_ep_offset():
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(4, 6, 5, generator=g), torch.randn(4, 6, 5, generator=g)
    spec = FusedSpec.gate_up("m.experts", intermediate=6, hidden=5, num_experts=4)
    # EP rank 1 of 2 holds experts 2..3; TP rank 1 of 2 holds I rows 3..5 of each: cat along dim 1
    local = torch.cat([gate[2:4, 3:6], up[2:4, 3:6]], dim=1)
    shards = split_fused(local, spec, tp=2, tp_rank=1, offsets=(2, 0, 0))
    assert shards["m.experts.gate_proj"].offsets == (2, 3, 0)
    assert torch.equal(shards["m.experts.up_proj"].local, up[2:4, 3:6])
    with pytest.raises(StateError, match="exceeds the global size"):
        split_fused(local, spec, tp=2, tp_rank=1, offsets=(3, 0, 0))


def test_errors_name_the_problem():
    spec = FusedSpec.qkv("a", num_heads=NH, num_kv_heads=NKV, head_dim=HD, hidden=H, interleaved=True)
    with pytest.raises(StateError, match="tp=4 does not divide the 2 groups"):
        split_fused(torch.zeros(12, H), spec, tp=4, tp_rank=0)
    with pytest.raises(StateError, match="not the sum"):
        split_fused(torch.zeros(13, H), spec, tp=2, tp_rank=0)
    with pytest.raises(StateError, match="no piece for 'a.v_proj.weight'"):
        join_fused({"a.q_proj.weight": torch.zeros(16, H), "a.k_proj.weight": torch.zeros(4, H)}, spec, tp=2)
    with pytest.raises(StateError, match="only dim 0 may differ"):
        FusedSpec((FusedPart("x", (4, 3)), FusedPart("y", (4, 5))))


def _save_fused(rank: int, world: int, url: str) -> None:
    spec = FusedSpec.qkv("a", num_heads=NH, num_kv_heads=NKV, head_dim=HD, hidden=H, interleaved=True)
    ckpt.save(split_fused(fused_local(qkv(), world, rank, True), spec, tp=world, tp_rank=rank), url)


@pytest.mark.multiproc
def test_saved_fused_on_two_ranks_loads_unfused(tmp_path):
    url = str(tmp_path / "c")
    run_ranks(2, _save_fused, url)
    full = qkv()
    back = {k: torch.zeros_like(v) for k, v in full.items()}
    ckpt.load(back, url)
    for k in full:
        assert torch.equal(back[k], full[k])
    # and into a single-rank fused tensor, non-interleaved
    spec = FusedSpec.qkv("a", num_heads=NH, num_kv_heads=NKV, head_dim=HD, hidden=H)
    local = torch.zeros((NH + 2 * NKV) * HD, H)
    shards = split_fused(local, spec)
    ckpt.load(shards, url)
    join_fused(shards, spec, out=local)
    assert torch.equal(local, fused_local(full, 1, 0, False))
