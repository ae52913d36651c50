"""Layouts (rank order, groups, parsing) and the shared sharding rules."""

from __future__ import annotations

import pytest

from ckpt.errors import LayoutError
from ckpt.layout import Coord, Layout
from ckpt.resharders.rules import MOE_RULES, RuleSet, optim_region, param_box, stage_bounds
from ckpt.shards import Box, Flat


def test_parse_and_rank_order():
    lay = Layout.parse("tp=2,ep=2,pp=2,dp=3,zero=1")
    assert (lay.dp, lay.tp, lay.pp, lay.ep, lay.zero, lay.world_size) == (3, 2, 2, 2, 1, 24)
    assert Layout.parse(str(lay)) == lay and Layout.parse("single").world_size == 1
    assert lay.coord(0) == Coord(0, 0, 0, 0)
    assert lay.coord(1) == Coord(dp=0, tp=1, pp=0, ep=0)  # tp fastest
    assert lay.coord(2) == Coord(dp=0, tp=0, pp=0, ep=1)
    assert lay.coord(4) == Coord(dp=1, tp=0, pp=0, ep=0)
    assert lay.coord(12) == Coord(dp=0, tp=0, pp=1, ep=0)
    assert all(lay.rank(lay.coord(r)) == r for r in range(lay.world_size))
    assert lay.group(0, ("tp",)) == [0, 1]
    assert lay.group(0, ("dp", "ep")) == [0, 2, 4, 6, 8, 10]
    assert len(lay.all_groups(("pp",))) == 12


@pytest.mark.parametrize("bad", ["tp=0", "xx=2", "tp=two", "tp2", "zero=3"])
def test_parse_errors(bad):
    with pytest.raises(LayoutError):
        Layout.parse(bad)


def test_moe_rules_boxes():
    lay = Layout(tp=2, ep=2)
    c = lay.coord(3)  # tp=1, ep=1
    assert param_box("model.layers.3.mlp.experts.gate_proj", (4, 32, 64), lay, c, MOE_RULES) == \
        Box((2, 16, 0), (2, 16, 64))
    assert param_box("model.layers.0.self_attn.o_proj.weight", (64, 64), lay, c, MOE_RULES) == \
        Box((0, 32), (64, 32))
    # vocab-parallel with padding: 255 rows over tp=2 -> 128 + 127
    assert param_box("lm_head.weight", (255, 64), lay, c, MOE_RULES) == Box((128, 0), (127, 64))
    assert param_box("model.norm.weight", (64,), lay, c, MOE_RULES) == Box((0,), (64,))
    with pytest.raises(LayoutError, match="6 experts.*ep=4"):
        param_box("model.layers.0.mlp.experts.up_proj", (6, 32, 64), Layout(ep=4), Coord(0, 0, 0, 1), MOE_RULES)
    with pytest.raises(LayoutError, match="tp=3"):
        param_box("model.layers.0.self_attn.q_proj.weight", (64, 64), Layout(tp=3), Coord(0, 0, 0, 0), MOE_RULES)


def test_zero_regions():
    lay = Layout(dp=2, ep=2, zero=1)
    # dense, unsharded param: flat over the dp x ep group (4 ranks) of the whole tensor
    assert optim_region("model.norm.weight", (10,), lay, lay.coord(3), MOE_RULES) == Flat(9, 10)
    # expert param: EP block, flat over dp (2 ranks)
    r = optim_region("model.layers.0.mlp.experts.gate_proj", (4, 2, 3), lay, lay.coord(1), MOE_RULES)
    assert r == Flat(0, 6, Box((2, 0, 0), (2, 2, 3)))


def test_stages_and_toml(tmp_path):
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)] and stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    assert MOE_RULES.stage_of("model.layers.3.mlp.gate.weight", 4, 2) == 1
    assert MOE_RULES.stage_of("lm_head.weight", 4, 2) == 1
    assert MOE_RULES.stage_of("model.embed_tokens.weight", 4, 2) == 0
    f = tmp_path / "r.toml"
    f.write_text('[[rule]]\npattern = "enc.*.wq"\ntp_dim = 0\n[pipeline]\nlast = ["head.*"]\n')
    from ckpt.resharders.rules import load_rules

    rs = load_rules(str(f))
    assert rs.placement("enc.1.wq").tp_dim == 0 and rs.stage_of("head.w", 2, 2) == 1
    with pytest.raises(LayoutError, match="unknown keys"):
        RuleSet.from_dict({"rule": [{"pattern": "x", "tp": 0}]})
