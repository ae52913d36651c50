"""Smoke test of ``python -m bench tier-reshard`` on CPU: a tiny tier saved on 4 forked ranks and
restored on 2 (one per simulated host) three ways, every restore checked bitwise in its ranks; the
shards path receives exactly the other host's row blocks of its stage's layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.__main__ as bench_main
from bench import tier_reshard


@pytest.mark.slow
@pytest.mark.multiproc
def test_tier_reshard_bench_moves_only_the_wanted_shards(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert bench_main.main(["tier-reshard", "--size-mb", "0.25", "--repeats", "1", "--dir", str(tmp_path),
                            "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows, cols, _flat = tier_reshard.geometry(0.25)
    assert res["verified"] and set(res["methods"]) == set(tier_reshard.METHODS)
    stage = tier_reshard.LAYERS // tier_reshard.NEW
    # each rank: the 2 remote old ranks' row blocks of its stage's layers, nothing of the flat range
    shards = res["methods"]["shards"]
    assert shards["received_per_rank"] == [2 * stage * rows * cols * 4] * 2
    assert shards["peers"] == [[1], [0]]
    whole = res["methods"]["whole copies"]["received_per_rank"]
    assert whole[0] == whole[1] > 2 * shards["received_per_rank"][0]  # both remote copies, every file
    assert res["methods"]["storage"]["received_per_rank"] == [0, 0]
    assert all(r["seconds"] > 0 for r in res["methods"].values()) and res["raw_gloo_seconds"] > 0
    assert res["raw_gloo_bytes_per_rank"] == shards["received_per_rank"]
