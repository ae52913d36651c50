"""Block constraints of the sharding rules (``RuleSet.blocks``, :class:`ckpt.resharders.rules.BlockRule`):
a tensor stored in blocks (an fp8 weight with one scale per block) is resharded with every block whole
on one rank, its per-block tensor split with it, or the target layout is refused with a LayoutError
naming the tensor, the dim and the block count, before anything is written."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import LayoutError
from ckpt.layout import Layout
from ckpt.resharders.plan import plan, rules_for
from ckpt.resharders.reshard import reshard
from ckpt.resharders.rules import BlockRule, Placement, Rule, RuleSet, load_rules, param_box
from ckpt.shards import Box


def _rules(lead: int, tp_dim: int, pad: bool, block: tuple[int, int] | None) -> RuleSet:
    pl = Placement(tp_dim=lead + tp_dim, ep_dim=0 if lead else None, pad=pad)
    return RuleSet([Rule("w", pl), Rule("w_scale", pl)], name="blocks-test",
                   blocks=[BlockRule("w", block)] if block else [])


def _cuts_a_block(p_holds: list[dict[str, object]], shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    """Whether some rank's box of ``w`` starts or ends inside a block of the last two dims."""
    for holds in p_holds:
        box = holds.get("model.w")
        if not isinstance(box, Box) or 0 in box.lengths:  # an empty box (a rank past the end) holds no block
            continue
        for d, b in zip((-2, -1), block, strict=True):
            o, n = box.offsets[d], box.lengths[d]
            if o % b or ((o + n) % b and o + n != shape[d]):
                return True
    return False


@settings(max_examples=25, deadline=None)
@given(rb=st.integers(1, 4), cb=st.integers(1, 4), cut=st.tuples(st.integers(0, 1), st.integers(0, 1)),
       block=st.sampled_from([(4, 1), (2, 3), (4, 4), (3, 2)]), tp=st.integers(2, 5),
       experts=st.sampled_from([0, 2]), ep=st.integers(1, 2), tp_dim=st.integers(0, 1),
       pad=st.sampled_from([True, True, True, False]), seed=st.integers(0, 2**16))
def test_reshard_keeps_every_block_whole_or_refuses(rb: int, cb: int, cut: tuple[int, int], block: tuple[int, int],
                                                    tp: int, experts: int, ep: int, tp_dim: int, pad: bool,
                                                    seed: int) -> None:
    """Over shapes (partial edge blocks, stacked experts), blocks and tp/ep sizes: a reshard either keeps
    every block whole with its scale on the same rank (bitwise round trip) or is refused, nothing written;
    and it is refused for the blocks only where the same layout without them would cut one."""
    lead = (experts,) if experts else ()
    ep = ep if experts else 1
    shape = (*lead, max(1, rb * block[0] - cut[0]), max(1, cb * block[1] - cut[1]))
    sshape = (*lead, -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 127, shape, generator=g, dtype=torch.int8)
    s = torch.rand(sshape, generator=g)
    rules = _rules(len(lead), tp_dim, pad, block)
    target = Layout(tp=tp, ep=ep)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "src"), os.path.join(tmp, "dst")
        ckpt.save({"model.w": w, "model.w_scale": s, "model.norm": torch.ones(3)}, src,
                  user_metadata={"rules": rules.name, "rules_table": rules.to_dict()})
        recorded = rules_for(ckpt.inspect(src))  # the table the checkpoint carries, blocks included
        assert recorded.blocks == [BlockRule("w", block)]
        try:
            free = plan(ckpt.inspect(src), target, _rules(len(lead), tp_dim, pad, None))  # no block constraint
        except LayoutError:
            free = None  # the layout is impossible anyway (a TP dim that does not divide)
        cuts = free is not None and _cuts_a_block([r.holds for r in free.ranks], shape, block)
        event("refused: cuts a block" if cuts else "refused: impossible layout" if free is None else "resharded")
        if free is None or cuts:
            with pytest.raises(LayoutError) as e:
                reshard(src, dst, target, rules=recorded)
            if cuts:
                d = len(lead) + tp_dim
                b = block[tp_dim]
                said = str(e.value)
                assert "tensor 'model.w'" in said and f"its {-(-shape[d] // b)} blocks of {b} on dim {d}" in said \
                    and f"tp={tp}" in said, said
            assert not os.path.exists(dst)
            return
        reshard(src, dst, target, rules=recorded)
        m = ckpt.inspect(dst)
        held = plan(ckpt.inspect(src), target, recorded)
        for r in held.ranks:  # each rank's scale is exactly the blocks of its weight
            wb, sb = r.holds["model.w"], r.holds["model.w_scale"]
            assert isinstance(wb, Box) and isinstance(sb, Box)
            assert wb.offsets[:-2] == sb.offsets[:-2] and wb.lengths[:-2] == sb.lengths[:-2]
            for k, b in ((-2, block[0]), (-1, block[1])):
                if wb.lengths[k] == 0:
                    continue
                assert wb.offsets[k] % b == 0 and sb.offsets[k] == wb.offsets[k] // b
                assert sb.lengths[k] == -(-(wb.offsets[k] + wb.lengths[k]) // b) - wb.offsets[k] // b
        assert len(m.tensors["model.w"].shards) == len({b for r in held.ranks if (b := r.holds["model.w"]).numel})
        got = ckpt.load({"model.w": torch.zeros(shape, dtype=torch.int8), "model.w_scale": torch.zeros(sshape)}, dst)
        assert torch.equal(got["model.w"], w) and torch.equal(got["model.w_scale"], s)


def test_param_box_refuses_a_cut_for_the_trainer_too() -> None:
    """The trainer's placement (param_box) applies the same constraint: 2 blocks of 128 over tp=4."""
    rules = RuleSet([Rule("w", Placement(tp_dim=1))], name="t", blocks=[BlockRule("w", (128, 128))])
    assert param_box("w", (256, 256), Layout(tp=2), Layout(tp=2).coord(1), rules) == Box((0, 128), (256, 128))
    with pytest.raises(LayoutError, match=r"'w' \[256, 256\]: its 2 blocks of 128 on dim 1 .* tp=4 .*"
                                          r"choose tp in \[1, 2\]"):
        param_box("w", (256, 256), Layout(tp=4), Layout(tp=4).coord(0), rules)
    free = RuleSet([Rule("w", Placement(tp_dim=1))], name="t")
    assert param_box("w", (256, 256), Layout(tp=4), Layout(tp=4).coord(1), free) == Box((0, 64), (256, 64))


def test_block_rules_round_trip_and_bad_tables(tmp_path: Path) -> None:
    """Blocks survive to_dict/from_dict and load from a TOML [[block]] table; a table without blocks
    records no 'blocks' key (its plan ids do not change); malformed block rules are refused by name."""
    rules = RuleSet([Rule("a.*", Placement(tp_dim=0))], name="t", blocks=[BlockRule("a.w", (128, 64))])
    assert RuleSet.from_dict(rules.to_dict()).blocks == rules.blocks
    assert "blocks" not in RuleSet([Rule("a.*", Placement(tp_dim=0))], name="t").to_dict()
    f = tmp_path / "r.toml"
    f.write_text('[[rule]]\npattern = "a.*"\ntp_dim = 0\n\n[[block]]\npattern = "a.w"\nblock = [128, 64]\n')
    assert load_rules(str(f)).blocks == [BlockRule("a.w", (128, 64))]
    assert load_rules(str(f)).block_of("a.w") == (128, 64) and load_rules(str(f)).block_of("a.b") is None
    for bad, msg in (({"pattern": "x", "block": [0, 4]}, "block sizes >= 1"), ({"pattern": "x"}, "exactly"),
                     ({"pattern": "x", "block": [4], "tp": 1}, "exactly"), ({"pattern": "x", "block": "4"}, "list")):
        with pytest.raises(LayoutError, match=f"r.toml: block rule 0 .*{msg}"):
            RuleSet.from_dict({"rule": [], "block": [bad]}, source="r.toml")
    with pytest.raises(LayoutError, match="'block' must be an array"):
        RuleSet.from_dict({"rule": [], "block": {"pattern": "x"}}, source="r.toml")
