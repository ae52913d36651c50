"""The hybrid linear-attention family (``ckpt.trainer.hybrid``) and LASP-2 (``ckpt.trainer.lasp``).

- a checkpoint of the hybrid model, exported by ``ckpt export-hf``, loads in transformers'
  ``MiniMaxForCausalLM`` with no missing or unexpected keys and gives the same logits (fp32, max
  abs difference <= 1e-5; bitwise on this machine), and imports back to the same weights, bitwise;
- LASP-2 on 2 and 4 forked gloo ranks, contiguous and zigzag chunks: forward and the gradients of
  q, k, v equal the single-process lightning attention within fp32 rounding (atol 2e-5); under sp=2 a
  whole model of linear layers, and the hybrid model (softmax layers on the same zigzag chunks over
  gathered K/V, global RoPE positions), give the unsplit model's logits;
- the AllGather moves exactly ranks x chunks x (batch x heads x d_k x d_v) floats per layer, the same
  at every sequence length, and the backward one reduce-scatter of the same size;
- tensor parallelism of a lightning layer (weights sliced by the ``hf-decoder`` rules, tp=2): output
  and gradients equal the unsplit layer's;
- bad input: typed errors naming the values that would work.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import ckpt
from ckpt.errors import LayoutError, MismatchError
from ckpt.trainer.hybrid import (
    HYBRID_CONFIGS,
    HybridConfig,
    HybridForCausalLM,
    LightningAttention,
    lightning_attention,
    slope_rates,
)
from ckpt.trainer.hybrid_parallel import check_hybrid_layout, shard_linear_attention, use_lasp2
from ckpt.trainer.lasp import (
    CommStats,
    check_sequence,
    chunk_ids,
    gather_sequence,
    lasp2_linear_attention,
    shard_sequence,
)
from tests.dist_utils import run_ranks

# large enough init that every sub-layer moves the logits (0.02 leaves the linear layers near zero)
CFG = dataclasses.replace(HYBRID_CONFIGS["hybrid-tiny"], initializer_range=0.1)


def _hybrid(cfg: HybridConfig = CFG, seed: int = 0) -> HybridForCausalLM:
    m = HybridForCausalLM(cfg).eval()
    m.init_weights(seed)
    return m


def _ids(n: int = 64, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_export_hf_output_loads_in_minimax_and_reproduces_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from typer.testing import CliRunner

    from ckpt.cli.app import app
    from ckpt.hf.convert import import_hf

    model = _hybrid()
    src = tmp_path / "ck"
    ckpt.save({"model." + n: p.detach() for n, p in model.named_parameters()}, str(src),
              user_metadata=CFG.checkpoint_metadata())
    out = tmp_path / "hf"
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["export-hf", str(src), str(out), "--check", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["check"]["max_abs_logits_diff"] == 0.0  # export vs source, both in transformers
    assert json.loads((out / "config.json").read_text())["model_type"] == "minimax"
    hf, info = transformers.MiniMaxForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = _ids(80)  # 5 blocks of 16: several blocks per linear layer, one partial block-free
    with torch.no_grad():
        ours, theirs = model(ids), hf.eval()(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5
    assert theirs.std() > 0.1  # not a degenerate comparison
    # and back: import-hf -> the same weights, bitwise, loaded by name into a fresh model
    import_hf(str(out), str(tmp_path / "back"))
    meta = ckpt.inspect(str(tmp_path / "back")).user_metadata
    cfg = HybridConfig.from_hf_config(meta["hf_config"])
    assert cfg == CFG
    again = HybridForCausalLM(cfg)
    got = ckpt.load({"model." + n: torch.empty_like(p) for n, p in again.named_parameters()}, str(tmp_path / "back"))
    assert all(torch.equal(got["model." + n], p) for n, p in model.named_parameters())


def test_hybrid_config_refuses_what_the_model_does_not_implement():
    with pytest.raises(ValueError, match="layer_types has 3 entries"):
        dataclasses.replace(CFG, layer_types=("linear_attention",) * 3)
    with pytest.raises(ValueError, match="'mamba'"):
        dataclasses.replace(CFG, layer_types=("mamba",) * 4)
    with pytest.raises(ValueError, match="sliding_window=64"):
        HybridConfig.from_hf_config(CFG.to_hf_config() | {"sliding_window": 64})


# ---------------------------------------------------------------------------------------------
# LASP-2
# ---------------------------------------------------------------------------------------------

B, H, D = 2, 4, 8
BLOCK = 8


@dataclass
class _Group:  # the Group fields LASP-2 reads
    pg: Any
    size: int
    index: int

    @property
    def trivial(self) -> bool:
        return self.pg is None


def _qkvw(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(B, H, n, D, generator=g) * 0.5 for _ in range(4)]


def _reference(n: int, slopes: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v, w = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_qkvw(n)))
    out, _ = lightning_attention(q, k, v, slopes, BLOCK)
    (out * w).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]  # type: ignore[misc]


def _sp_ranks(rank: int, world: int) -> None:
    import torch.distributed as dist

    group = _Group(dist.group.WORLD, world, rank)
    slopes = slope_rates(H, 1, 4)
    for layout in ("contiguous", "zigzag"):
        n = 2 * world * BLOCK * 2  # two blocks per zigzag chunk
        ref, ref_grads = _reference(n, slopes)
        q, k, v, w = (shard_sequence(t, 2, rank, world, layout).clone().requires_grad_(i < 3)
                      for i, t in enumerate(_qkvw(n)))
        out = lasp2_linear_attention(q, k, v, slopes, group, block_size=BLOCK, layout=layout)
        (out * w).sum().backward()
        torch.testing.assert_close(out, shard_sequence(ref, 2, rank, world, layout), rtol=0, atol=2e-5)
        for name, t, g in zip("qkv", (q, k, v), ref_grads, strict=True):
            torch.testing.assert_close(t.grad, shard_sequence(g, 2, rank, world, layout), rtol=0, atol=2e-5,
                                       msg=lambda m, name=name, layout=layout: f"d{name} ({layout}): {m}")
    if world == 2:  # the hybrid model on zigzag chunks: LASP-2 linear layers, softmax layers over gathered K/V
        _hybrid_model_on_zigzag_chunks(rank, world, group)
    if world == 2:  # a whole model of linear layers, each one's core swapped for LASP-2 on zigzag chunks
        cfg = dataclasses.replace(CFG, layer_types=("linear_attention",) * 4)
        model = _hybrid(cfg)
        ids = _ids(64)
        with torch.no_grad():
            ref_logits = model(ids)
            assert use_lasp2(model, group, layout="zigzag") == 4
            local = model(shard_sequence(ids, 1, rank, world, "zigzag"))
        torch.testing.assert_close(local, shard_sequence(ref_logits, 1, rank, world, "zigzag"), rtol=0, atol=2e-5)


def _hybrid_model_on_zigzag_chunks(rank: int, world: int, group: _Group) -> None:
    """Linear and softmax layers alternate on the same zigzag chunks, no re-arrangement between them.

    The softmax layers stand in for LASP-2H (another module's job) with the plainest sp attention:
    all-gather K and V, put them in global order, mask by global positions."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from ckpt.trainer.model import apply_rotary_pos_emb

    def gathered(t: torch.Tensor) -> torch.Tensor:  # (b, h, local, d) -> (b, h, seq, d) in global order
        pieces = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(pieces, t.contiguous())
        return gather_sequence(pieces, 2, "zigzag")

    def sp_softmax(attn: Any, x: torch.Tensor, pe: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, n, _ = x.shape
        shape = (b, n, -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *pe)
        k, v = (gathered(t).repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        pos = shard_sequence(torch.arange(k.shape[2]), 0, rank, world, "zigzag")
        mask = pos[:, None] >= torch.arange(k.shape[2])[None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    model = _hybrid()
    ids = _ids(128)
    with torch.no_grad():
        ref = model(ids)
        use_lasp2(model, group, layout="zigzag")
        for layer in model.model.layers:
            if layer.layer_type == "full_attention":
                layer.self_attn.forward = lambda x, pe, attn=layer.self_attn: sp_softmax(attn, x, pe)
        positions = shard_sequence(torch.arange(128), 0, rank, world, "zigzag")[None]
        assert model.lm_head is not None
        local = model.lm_head(model.model(shard_sequence(ids, 1, rank, world, "zigzag"), position_ids=positions))
    torch.testing.assert_close(local, shard_sequence(ref, 1, rank, world, "zigzag"), rtol=0, atol=2e-5)


@pytest.mark.multiproc
@pytest.mark.parametrize("sp", [2, 4])
def test_lasp2_forward_and_grads_equal_single_process(sp):
    run_ranks(sp, _sp_ranks)


def _bytes_ranks(rank: int, world: int) -> None:
    import torch.distributed as dist

    group = _Group(dist.group.WORLD, world, rank)
    slopes = slope_rates(H, 0, 2)
    state = B * H * D * D * 4  # one fp32 memory state
    for layout in ("contiguous", "zigzag"):
        per_rank = len(chunk_ids(layout, rank, world))
        for n in (2 * world * BLOCK, 16 * world * BLOCK):  # 8x longer sequence
            stats = CommStats()
            q, k, v = (shard_sequence(t, 2, rank, world, layout).requires_grad_() for t in _qkvw(n)[:3])
            out = lasp2_linear_attention(q, k, v, slopes, group, block_size=BLOCK, layout=layout, stats=stats)
            out.sum().backward()
            assert stats.all_gather_calls == 1 and stats.reduce_scatter_calls == 1
            assert stats.all_gather_sent == per_rank * state, (layout, n)
            assert stats.all_gather_received == world * per_rank * state, (layout, n)
            assert stats.reduce_scatter_bytes == world * per_rank * state, (layout, n)


@pytest.mark.multiproc
def test_allgather_bytes_per_layer_do_not_depend_on_sequence_length():
    run_ranks(2, _bytes_ranks)


def test_sequence_sharding_round_trips_and_one_rank_is_the_reference():
    x = torch.arange(48).view(1, 48)
    for layout in ("contiguous", "zigzag"):
        pieces = [shard_sequence(x, 1, r, 3, layout) for r in range(3)]
        assert torch.equal(gather_sequence(pieces, 1, layout), x)
    assert shard_sequence(x, 1, 0, 3, "zigzag")[0, :8].tolist() == list(range(8))
    assert shard_sequence(x, 1, 0, 3, "zigzag")[0, 8:].tolist() == list(range(40, 48))
    q, k, v, _ = _qkvw(32)
    slopes = slope_rates(H, 0, 2)
    for layout in ("contiguous", "zigzag"):  # sp=1: no communication, same result
        got = lasp2_linear_attention(q, k, v, slopes, _Group(None, 1, 0), block_size=BLOCK, layout=layout)
        torch.testing.assert_close(got, lightning_attention(q, k, v, slopes, BLOCK)[0], rtol=0, atol=2e-5)


def test_bad_sequence_input_is_a_typed_error_naming_what_works():
    with pytest.raises(LayoutError, match=r"use a multiple of 64 \(e.g. 64 or 128\)"):
        check_sequence(100, 2, 16, "zigzag")
    with pytest.raises(LayoutError, match="multiple of 32"):
        check_sequence(48, 2, 16, "contiguous")
    assert check_sequence(128, 4, 16, "zigzag") == 16
    with pytest.raises(LayoutError, match="'ring'"):
        check_sequence(128, 2, 16, "ring")
    q, k, v, _ = _qkvw(24)
    slopes = slope_rates(H, 0, 2)
    two = _Group(object(), 2, 0)  # refused before any collective is issued
    with pytest.raises(LayoutError, match="24 local tokens .* whole 8-token blocks"):
        lasp2_linear_attention(q, k, v, slopes, two, block_size=BLOCK, layout="zigzag")
    with pytest.raises(LayoutError, match="whole 16-token blocks"):  # block size the chunks do not hold
        lasp2_linear_attention(q, k, v, slopes, two, block_size=16, layout="contiguous")
    with pytest.raises(MismatchError, match="one rate per local head"):
        lasp2_linear_attention(q, k, v, slopes[:2], _Group(None, 1, 0), block_size=BLOCK)
    with pytest.raises(MismatchError, match="same batch, heads and tokens"):
        lasp2_linear_attention(q, k[:, :, :16], v, slopes, _Group(None, 1, 0), block_size=BLOCK)


def _tp_ranks(rank: int, world: int) -> None:
    import torch.distributed as dist

    from ckpt.hf.adapters import HF_RULES
    from ckpt.trainer.model import initial_value
    from ckpt.trainer.parallel import Group

    full, local = LightningAttention(CFG, 2), LightningAttention(CFG, 2)
    with torch.no_grad():
        for name, p in full.named_parameters():
            p.copy_(initial_value(name, tuple(p.shape), 0.1) + (1.0 if name == "norm.weight" else 0.0))
        for name, p in local.named_parameters():  # this rank's block, as the checkpoint rules place it
            dim = HF_RULES.placement(f"model.layers.2.self_attn.{name}").tp_dim
            assert dim is not None, name
            p.data = full.get_parameter(name).detach().chunk(world, dim=dim)[rank].clone()
    shard_linear_attention(local, Group(list(range(world)), rank, dist.group.WORLD))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 32, CFG.hidden_size, generator=g), torch.randn(2, 32, CFG.hidden_size, generator=g)
    x_full, x_local = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = full(x_full)
    (ref * w).sum().backward()
    out = local(x_local)
    (out * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(x_local.grad, x_full.grad, rtol=0, atol=2e-5)
    for name, p in local.named_parameters():
        dim = HF_RULES.placement(f"model.layers.2.self_attn.{name}").tp_dim
        want = full.get_parameter(name).grad.chunk(world, dim=dim)[rank]  # type: ignore[union-attr]
        torch.testing.assert_close(p.grad, want, rtol=0, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.multiproc
def test_tensor_parallel_lightning_layer_equals_the_unsplit_one():
    run_ranks(2, _tp_ranks)


def test_layouts_the_hybrid_model_cannot_run_are_refused_before_starting():
    check_hybrid_layout(CFG, tp=2, ep=4, sp=4, seq_len=128)
    with pytest.raises(LayoutError, match=r"tp can be \[1, 2\]"):
        check_hybrid_layout(CFG, tp=4)  # 4 query heads but 2 key/value heads in the softmax layers
    with pytest.raises(LayoutError, match=r"ep can be \[1, 2, 4\]"):
        check_hybrid_layout(CFG, ep=3)
    with pytest.raises(LayoutError, match="multiple of 128"):
        check_hybrid_layout(CFG, sp=4, seq_len=96)
    check_hybrid_layout(dataclasses.replace(CFG, layer_types=("full_attention",) * 4), sp=4, seq_len=96)
