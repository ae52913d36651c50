"""``ckpt.layout``: the axes, the rank order, parse / str / to_dict, groups, and the sp axis."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.errors import LayoutError
from ckpt.layout import AXES, RANK_ORDER, Coord, Layout
from ckpt.resharders.rules import DENSE_REPLICAS, EXPERT_REPLICAS, zero_range

layouts = st.builds(Layout, dp=st.integers(1, 3), tp=st.integers(1, 3), pp=st.integers(1, 3),
                    ep=st.integers(1, 3), sp=st.integers(1, 4), zero=st.integers(0, 1))


def test_one_list_of_axes() -> None:
    assert AXES == ("dp", "tp", "pp", "ep", "sp")
    assert RANK_ORDER == ("tp", "sp", "ep", "dp", "pp")
    assert tuple(f.name for f in dataclasses.fields(Coord)) == AXES
    # the old path ckpt.resharders.layout: tests/core/test_layers.py (every 0.1 path imports, warning)


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_coord_rank_round_trip_and_order(lay: Layout) -> None:
    coords = [lay.coord(r) for r in range(lay.world_size)]
    assert len(set(coords)) == lay.world_size
    assert [lay.rank(c) for c in coords] == list(range(lay.world_size))
    # the documented formula, tp fastest, then sp, ep, dp, pp
    for r, c in enumerate(coords):
        assert r == c.tp + lay.tp * (c.sp + lay.sp * (c.ep + lay.ep * (c.dp + lay.dp * c.pp)))
    assert Layout.parse(str(lay)) == lay == Layout.from_dict(lay.to_dict())


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(layouts)
def test_group_index_is_the_position_in_the_sorted_group(lay: Layout) -> None:
    for axes in (DENSE_REPLICAS, EXPERT_REPLICAS, ("sp",), ("tp",)):
        for r in range(lay.world_size):
            g = lay.group(r, axes)
            assert len(g) == lay.group_size(axes)
            assert g.index(r) == lay.group_index(lay.coord(r), axes)


def test_zero_ranges_partition_over_dp_ep_sp() -> None:
    lay = Layout(dp=2, ep=2, sp=2, zero=1)
    for expert, axes in ((False, DENSE_REPLICAS), (True, EXPERT_REPLICAS)):
        for group in lay.all_groups(axes):
            ranges = sorted(zero_range(10, lay, lay.coord(r), expert) for r in group)
            assert ranges[0][0] == 0 and ranges[-1][1] == 10
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_old_strings_and_dicts_without_sp() -> None:
    lay = Layout.parse("tp=2,ep=2,zero=1")
    assert lay.sp == 1 and str(lay) == "dp=1,tp=2,pp=1,ep=2,zero=1"  # sp=1 is not printed
    assert Layout.from_dict({"dp": 1, "tp": 2, "pp": 1, "ep": 2, "zero": 1}) == lay  # an old manifest's layout
    sp = Layout.parse("sp=2,tp=2,ep=2")
    assert str(sp) == "dp=1,tp=2,pp=1,ep=2,sp=2,zero=0" and sp.world_size == 8
    assert sp.to_dict() == {"dp": 1, "tp": 2, "pp": 1, "ep": 2, "sp": 2, "zero": 0}
    assert sp.coord_str(3) == "dp=0,tp=1,pp=0,ep=0,sp=1" and lay.coord_str(3) == "dp=0,tp=1,pp=0,ep=1"
    # with sp=1 the rank order is the old tp, ep, dp, pp
    old = Layout(tp=2, ep=2, dp=2, pp=2)
    assert old.coord(5) == Coord(dp=1, tp=1, pp=0, ep=0) and old.coord(2) == Coord(ep=1)


@pytest.mark.parametrize("text,match", [
    ("sp=0", r"sp=0 must be a positive integer"),
    ("sp=x", r"sp='x' is not an integer"),
    ("cp=2", r"unknown axis 'cp' \(axes: dp, tp, pp, ep, sp, zero\)"),
    ("sp2", r"'sp2' is not axis=N \(axes: dp, tp, pp, ep, sp, zero\)"),
])
def test_bad_layouts_name_the_axes(text: str, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        Layout.parse(text)


def test_rank_outside_the_layout() -> None:
    with pytest.raises(LayoutError, match="rank 8 is outside world size 8"):
        Layout(sp=4, tp=2).coord(8)
