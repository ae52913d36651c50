"""Reshard plans as pure functions: many source/target layout pairs, no processes, no I/O."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ckpt._chunks import split_region
from ckpt._dtypes import dtype_from_name, itemsize
from ckpt._regions import check_tiling
from ckpt._save_plan import PieceDecl, RankDecl, plan_save
from ckpt.errors import LayoutError
from ckpt.layout import Layout
from ckpt.manifest import Manifest
from ckpt.resharders.placement import (
    GLOBAL,
    OPTIM,
    PARAM,
    STAGED,
    classify,
    infer_num_layers,
    regions_for_ranks,
)
from ckpt.resharders.plan import parse_stages, plan, rules_for
from ckpt.resharders.rules import MOE_RULES, RuleSet, load_rules, optim_region, param_box
from ckpt.shards import Box, Flat
from ckpt.trainer.model import ModelConfig, MoEForCausalLM
from tests.resharders.moe_states import TINY, config

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def specs_for(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The trainer's checkpoint keys and shapes for ``cfg`` (built on the meta device: no data)."""
    return dict(_specs(cfg))


@functools.lru_cache(maxsize=8)
def _specs(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in MoEForCausalLM(cfg).state_dict().items()}
    specs = {f"model.{k}": ("bfloat16", s) for k, s in shapes.items()}
    for k, s in shapes.items():
        specs[f"optim.exp_avg.{k}"] = ("float32", s)
        specs[f"optim.exp_avg_sq.{k}"] = ("float32", s)
    specs["optim.step"] = ("int64", ())
    return specs


def source_manifest(cfg: ModelConfig, layout: Layout, *, with_config: bool = True,
                    stages: list[int] | None = None) -> Manifest:
    """The manifest the trainer's ranks would commit under ``layout`` (pure: the save planner only)."""
    specs = specs_for(cfg)
    per_rank = regions_for_ranks(specs, layout, MOE_RULES, cfg.num_hidden_layers, stages)
    decls = [RankDecl([PieceDecl(k, specs[k][0], specs[k][1], r) for k, r in regs.items()]) for regs in per_rank]
    user = {"layout": layout.to_dict(), "rules": "embedded-moe"}
    if with_config:
        user["model_config"] = cfg.to_dict()
    return plan_save(decls, save_id="src", user_metadata=user, layout=layout.to_dict()).manifest


def check_plan(src: Manifest, target: Layout, cfg: ModelConfig) -> None:
    p = plan(src, target)
    m = p.manifest
    assert set(m.tensors) == set(src.tensors) and m.world_size == target.world_size
    total = 0
    for key, t in m.tensors.items():
        check_tiling(key, t.shape, [s.region for s in t.shards])  # each element stored exactly once
        total += t.numel * itemsize(dtype_from_name(t.dtype))
    assert p.tensor_bytes == total == p.bytes_read  # every source byte read once, nothing else
    assert p.bytes_written == sum(m.files.values())
    assert sorted(p.target_files) == sorted(m.files)
    for mv in p.moves:
        assert sum(n for _, _, n in mv.reads) == mv.nbytes
        assert mv.writer in mv.holders
        for f, off, n in mv.reads:
            assert f in src.files and off >= 0 and off + n <= src.files[f]
    # Each rank holds exactly what the rules say, and its unreplicated pieces are in its own file.
    for r in p.ranks:
        c = target.coord(r.rank)
        box = param_box("lm_head.weight", tuple(src.tensors["model.lm_head.weight"].shape), target, c, MOE_RULES)
        last = c.pp == target.pp - 1
        assert ("model.lm_head.weight" in r.holds) == last
        if last:
            assert r.holds["model.lm_head.weight"] == box
        key = "model.model.layers.0.mlp.experts.gate_proj"
        if c.pp == 0:
            shape = tuple(src.tensors[key].shape)
            assert r.holds[key] == param_box(key[6:], shape, target, c, MOE_RULES)
            assert r.holds["optim.exp_avg." + key[6:]] == optim_region(key[6:], shape, target, c, MOE_RULES)
        for mv in p.moves:
            if mv.holders == (r.rank,):
                assert mv.file == r.file
        assert r.layers is not None and r.layers[0] < r.layers[1]
    assert p.largest_read == max(n for mv in p.moves for _, _, n in mv.reads)
    json.dumps(p.to_dict())  # plain data


PAIRS = [
    ("single", "tp=2,ep=2"),
    ("tp=2,ep=2", "tp=1,ep=4,pp=2"),
    ("tp=1,ep=4,pp=2", "dp=2,zero=1"),
    ("dp=2,zero=1", "single"),
    ("tp=2,ep=2,pp=2,dp=2,zero=1", "tp=2,pp=4"),
    ("dp=3,ep=2,zero=1", "dp=2,tp=2,ep=4,zero=1"),
    ("pp=4", "pp=3"),
    ("tp=2,dp=2,zero=1", "tp=2,dp=2,zero=0"),  # ZeRO-1 flat -> box
    ("ep=4,dp=2", "ep=2,dp=3,zero=1"),  # box -> ZeRO-1 flat over a different group
    ("tp=2,ep=2,zero=1", "sp=2,tp=2,ep=2,zero=1"),  # sp: more replicas, ZeRO over dp x ep x sp
    ("sp=4,zero=1", "tp=2,sp=2,pp=2,zero=0"),
    ("sp=2,dp=2,ep=2,zero=1", "single"),
]


@pytest.mark.parametrize("src,dst", PAIRS)
def test_plans_between_layouts(src, dst):
    check_plan(source_manifest(TINY, Layout.parse(src)), Layout.parse(dst), TINY)


@st.composite
def layouts(draw):
    lay = Layout(dp=draw(st.sampled_from([1, 2, 3])), tp=draw(st.sampled_from([1, 2])),
                 pp=draw(st.sampled_from([1, 2, 3, 4])), ep=draw(st.sampled_from([1, 2, 4])),
                 zero=draw(st.sampled_from([0, 1])))
    assume(lay.world_size <= 24)
    return lay


@SETTINGS
@given(layouts(), layouts())
def test_plans_random_layout_pairs(src, dst):
    check_plan(source_manifest(TINY, src), dst, TINY)


def test_zero_flat_and_box_pieces():
    src = source_manifest(TINY, Layout.parse("dp=2,ep=2,tp=2,zero=1"))
    key = "optim.exp_avg.model.layers.1.mlp.experts.up_proj"
    assert all(isinstance(s.region, Flat) and s.region.box is not None for s in src.tensors[key].shards)
    p = plan(src, Layout.parse("tp=2"))
    assert all(isinstance(s.region, Box) for s in p.manifest.tensors[key].shards)
    back = plan(p.manifest, Layout.parse("dp=4,zero=1"))
    regions = [s.region for s in back.manifest.tensors[key].shards]
    assert len(regions) == 4 and all(isinstance(r, Flat) and r.box is None for r in regions)
    # a dense parameter's state is flat over the whole dp x ep group; experts' over dp only
    dense = "optim.exp_avg_sq.model.norm.weight"
    assert len(plan(src, Layout.parse("dp=2,ep=2,zero=1")).manifest.tensors[dense].shards) == 4


def test_vocab_padding_changes():
    cfg = config(vocab_size=255, num_key_value_heads=4)
    src = source_manifest(cfg, Layout.parse("tp=2"))
    lens = sorted(s.region.lengths[0] for s in src.tensors["model.model.embed_tokens.weight"].shards)
    assert lens == [127, 128]
    p = plan(src, Layout.parse("tp=4"))
    assert [p.ranks[r].holds["model.lm_head.weight"].lengths[0] for r in range(4)] == [64, 64, 64, 63]
    check_plan(src, Layout.parse("tp=4,pp=2"), cfg)
    check_plan(source_manifest(cfg, Layout.parse("tp=4,dp=2,zero=1")), Layout.parse("tp=2"), cfg)


def test_uneven_experts_are_refused_with_the_fix():
    cfg = config(num_experts=6)
    src = source_manifest(cfg, Layout.parse("ep=2"))
    with pytest.raises(LayoutError, match=r"ep=4 does not divide the model's 6 experts.*choose ep in \[1, 2, 3, 6\]"):
        plan(src, Layout.parse("ep=4"))
    # Without the model config, the tensor-level check names the tensor and the rank.
    bare = source_manifest(cfg, Layout.parse("ep=2"), with_config=False)
    with pytest.raises(LayoutError, match=r"tensor 'model\.model\.layers\.0\.mlp\.experts\..*target rank \d+ "
                                          r".*6 experts.*ep=4.*choose ep dividing"):
        plan(bare, Layout.parse("ep=4"))
    check_plan(src, Layout.parse("ep=3"), cfg)
    check_plan(src, Layout.parse("ep=6,pp=2"), cfg)


def test_layouts_the_trainer_cannot_run():
    src = source_manifest(TINY, Layout())
    with pytest.raises(LayoutError, match=r"tp=4 does not divide.*2 key/value heads.*choose tp in \[1, 2\]"):
        plan(src, Layout.parse("tp=4"))
    with pytest.raises(LayoutError, match="pp=5 needs at least 5 layers"):
        plan(src, Layout.parse("pp=5"))
    bare = source_manifest(TINY, Layout(), with_config=False)
    with pytest.raises(LayoutError, match=r"tensor 'model\.model\.layers\.0\..*tp=3.*choose tp"):
        plan(bare, Layout.parse("tp=3"))


def test_explicit_stages():
    src = source_manifest(TINY, Layout.parse("pp=2"))
    p = plan(src, Layout.parse("pp=2,ep=2"), stages=[3, 1])
    assert p.ranks[0].layers == (0, 3) and p.ranks[2].layers == (3, 4)
    assert "model.model.layers.2.mlp.gate.weight" in p.ranks[0].holds
    assert "model.model.layers.2.mlp.gate.weight" not in p.ranks[2].holds
    assert "model.model.embed_tokens.weight" in p.ranks[1].holds and "model.lm_head.weight" in p.ranks[3].holds
    assert p.manifest.user_metadata["pp_stages"] == [3, 1]
    check_plan(p.manifest, Layout.parse("pp=4"), TINY)
    assert "pp_stages" not in plan(p.manifest, Layout.parse("pp=4")).manifest.user_metadata
    with pytest.raises(LayoutError, match=r"explicit stage sizes \[2, 1\]"):
        plan(src, Layout.parse("pp=2"), stages=[2, 1])
    assert parse_stages("3, 1") == [3, 1] and parse_stages(None) is None
    with pytest.raises(LayoutError, match="--stages"):
        parse_stages("3;1")


def test_plan_is_deterministic_and_names_files_by_plan_id():
    src = source_manifest(TINY, Layout.parse("tp=2"))
    a, b = plan(src, Layout.parse("ep=2")), plan(src, Layout.parse("ep=2"))
    assert a.plan_id == b.plan_id and a.target_files == b.target_files
    assert all(a.plan_id in f for f in a.target_files)
    assert plan(src, Layout.parse("ep=4")).plan_id != a.plan_id
    assert plan(src, Layout.parse("ep=2"), salt="x").plan_id != a.plan_id


def test_key_classification():
    specs = specs_for(TINY)
    specs["optim.step.lm_head.weight"] = ("int64", ())
    r = MOE_RULES
    assert classify("model.lm_head.weight", (256, 64), specs, r).kind == PARAM
    assert classify("optim.exp_avg.lm_head.weight", (256, 64), specs, r) == classify(
        "optim.exp_avg.lm_head.weight", (256, 64), specs, r)
    assert classify("optim.exp_avg.lm_head.weight", (256, 64), specs, r).kind == OPTIM
    assert classify("optim.step.lm_head.weight", (), specs, r).kind == STAGED
    assert classify("optim.step", (), specs, r).kind == GLOBAL
    assert classify("data.position", (3,), specs, r).kind == GLOBAL
    assert infer_num_layers(specs, r) == TINY.num_hidden_layers
    # a staged scalar sits whole on the parameter's stage only
    per_rank = regions_for_ranks(specs, Layout(pp=2), r, 4)
    assert "optim.step.lm_head.weight" in per_rank[1] and "optim.step.lm_head.weight" not in per_rank[0]
    assert "optim.step" in per_rank[0] and "optim.step" in per_rank[1]


def test_num_layers_inferred_without_config():
    src = source_manifest(TINY, Layout.parse("pp=2"), with_config=False)
    p = plan(src, Layout.parse("pp=4"))
    assert p.num_layers == 4 and [r.layers for r in p.ranks] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_recorded_builtin_rules_need_no_file():
    """An ``import-hf`` checkpoint (or the trainer's hybrid family) records ``rules = "hf-decoder"``:
    resharding it picks that table by name, no ``--rules FILE``."""
    from ckpt.hf.adapters import HF_RULES

    shapes = {"model.model.embed_tokens.weight": (10, 4), "model.model.layers.0.self_attn.q_proj.weight": (8, 4),
              "model.model.layers.0.self_attn.o_proj.weight": (4, 8),
              "model.model.layers.0.self_attn.qkv_proj.weight": (12, 4), "model.lm_head.weight": (10, 4)}
    decls = [RankDecl([PieceDecl(k, "float32", s, Box((0,) * len(s), s)) for k, s in shapes.items()])]
    src = plan_save(decls, save_id="s", user_metadata={"rules": HF_RULES.name}).manifest
    assert rules_for(src) is HF_RULES
    p = plan(src, Layout.parse("tp=2"), rules_for(src))
    assert p.rules == HF_RULES.name
    assert p.ranks[1].holds["model.model.layers.0.self_attn.q_proj.weight"] == Box((4, 0), (4, 4))
    assert p.ranks[1].holds["model.model.layers.0.self_attn.o_proj.weight"] == Box((0, 4), (4, 4))
    assert p.ranks[1].holds["model.model.layers.0.self_attn.qkv_proj.weight"] == Box((6, 0), (6, 4))
    assert rules_for(plan_save(decls, save_id="s").manifest) is MOE_RULES  # none recorded: the embedded MoE's


def test_custom_rules_file(tmp_path):
    f = tmp_path / "enc.toml"
    f.write_text('name = "enc"\n[keys]\nparam_prefix = "net."\n'
                 '[[rule]]\npattern = "blocks.*.wq"\ntp_dim = 0\n[[rule]]\npattern = "blocks.*.wo"\ntp_dim = 1\n'
                 '[[rule]]\npattern = "head"\ntp_dim = 0\npad = true\n'
                 '[pipeline]\nlayer_regex = "^blocks\\\\.(\\\\d+)\\\\."\nlast = ["head"]\n')
    rules = load_rules(str(f))
    assert rules.param_prefix == "net." and rules.name == "enc"
    shapes = {"net.blocks.0.wq": (8, 4), "net.blocks.0.wo": (4, 8), "net.blocks.1.wq": (8, 4),
              "net.blocks.1.wo": (4, 8), "net.head": (7, 4)}
    specs = {k: ("float32", s) for k, s in shapes.items()}
    specs.update({f"optim.m.{k[4:]}": ("float32", s) for k, s in shapes.items()})
    decls = [RankDecl([PieceDecl(k, *specs[k], Box((0,) * len(specs[k][1]), specs[k][1])) for k in specs])]
    src = plan_save(decls, save_id="s", user_metadata={"rules": "enc"}).manifest
    with pytest.raises(LayoutError, match="--rules FILE"):
        rules_for(src)
    assert rules_for(src, str(f)).name == "enc"
    p = plan(src, Layout.parse("tp=2,pp=2,dp=2,zero=1"), rules)
    r3 = p.ranks[3]  # tp=1, dp=1, pp=0: blocks.0 only
    assert r3.holds["net.blocks.0.wq"] == Box((4, 0), (4, 4)) and "net.head" not in r3.holds
    assert p.ranks[7].holds["net.head"] == Box((4, 0), (3, 4))  # 7 rows padded over tp=2: 4 + 3
    assert isinstance(p.ranks[7].holds["optim.m.head"], Flat)
    assert p.num_layers == 2
    for t in p.manifest.tensors.values():
        check_tiling("k", t.shape, [s.region for s in t.shards])
    with pytest.raises(LayoutError, match="unknown entries"):
        RuleSet.from_dict({"keys": {"prefix": "x"}})
    with pytest.raises(LayoutError, match="exactly one group"):
        RuleSet.from_dict({"pipeline": {"layer_regex": "layers"}})
    assert RuleSet.from_dict(MOE_RULES.to_dict()).to_dict() == MOE_RULES.to_dict()


@SETTINGS
@given(st.lists(st.integers(0, 5), min_size=0, max_size=4), st.integers(1, 40), st.data())
def test_split_region_covers_bytes_in_order(lengths, max_elems, data):
    shape = tuple(n + 1 for n in lengths)
    full = torch.arange(math.prod(shape)).reshape(shape)
    offs = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    box = Box(offs, tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offs, strict=True)))
    want = full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))].reshape(-1)
    parts = list(split_region(box, max_elems))
    assert all(p.numel <= max_elems for p in parts)
    got = torch.cat([full[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.lengths, strict=True))].reshape(-1)
                     for p in parts if isinstance(p, Box)])
    assert torch.equal(got, want)
    flat = Flat(3, 3 + box.numel, box)
    fparts = list(split_region(flat, max_elems))
    assert [p.start for p in fparts] == list(range(3, 3 + box.numel, max_elems))
    assert sum(p.numel for p in fparts) == box.numel and all(p.box == box for p in fparts)
