"""Smoke test of ``python -m bench scaling`` (the benchmark itself is never part of the suite's
pass/fail): a tiny state on a few forked gloo ranks, the structure of its result, and the bitwise
check of every load it makes (a rank whose loaded tensors differ from the saved ones fails the run)."""

from __future__ import annotations

import datetime
import math
import threading
import time

import pytest
import torch

from bench import scaling


def test_geometry_and_values_are_exact() -> None:
    rows, cols = scaling.geometry(64, 4.0, 16)
    assert cols % 64 == 0 and rows * cols * 4 * 16 <= 4 * (1 << 20)
    v = scaling.expected(3, 0, 4, 0, cols, cols)
    assert v.dtype == torch.float32 and bool((v < 2**24).all()) and bool((v == v.round()).all())
    # a sub-block is the same values as the block it is cut from (what the load check relies on)
    assert torch.equal(scaling.expected(3, 1, 3, 8, 16, cols), v[1:3, 8:16])
    assert not torch.equal(scaling.expected(4, 0, 4, 0, cols, cols), v)


def test_config_refuses_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="even number of ranks"):
        scaling.Config(3, load_layout="2d")
    scaling.Config(3, load_layout="cols")
    with pytest.raises(ValueError, match="at least 2"):
        scaling.Config(1)


def test_store_port_is_published_by_rank_0_and_waited_for(tmp_path) -> None:
    """The ranks' store lives in rank 0, not in the forking parent; a rank whose rank 0 never
    publishes its port stops at the deadline with the file it waited for."""
    wait = datetime.timedelta(seconds=0.2)
    with pytest.raises(TimeoutError, match=r"rank 1: rank 0 published no store port in .*store-port"):
        scaling._join_store(1, 2, str(tmp_path), wait)
    got: list[object] = []
    ten = datetime.timedelta(seconds=10)
    t = threading.Thread(target=lambda: got.append(scaling._join_store(1, 2, str(tmp_path), ten)))
    t.start()
    time.sleep(0.05)  # the client is waiting for the file when rank 0 writes it
    master = scaling._join_store(0, 2, str(tmp_path), ten)
    t.join(10)
    assert got and not t.is_alive()
    got[0].set("k", b"v")  # type: ignore[attr-defined]
    assert master.get("k") == b"v"


def test_growth_per_doubling() -> None:
    runs = [{"ranks": 4, "v": 1.0}, {"ranks": 8, "v": 2.0}, {"ranks": 32, "v": 32.0}]
    g = scaling.growth(runs, lambda r: r["v"])
    assert g[0] == pytest.approx(2.0) and g[1] == pytest.approx(4.0)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout,fanin", [("2d", None), ("cols", 1)])  # fan-in 1: ckpt's exchange is a chain
def test_scaling_bench_runs_on_two_rank_counts(tmp_path, layout: str, fanin: int | None) -> None:
    res = scaling.run([2, 4], mb_per_rank=0.05, tensors=3, repeats=1, warmup=0, load_layout=layout,
                      exchange_iters=2, timeout=60.0, fanin=fanin, root=str(tmp_path))
    assert [r["ranks"] for r in res["runs"]] == [2, 4] and not res["skipped"]
    assert res["fanin"] == (8 if fanin is None else fanin)
    for r in res["runs"]:
        assert r["verified"]  # every rank compared every loaded tensor bitwise with what was saved
        assert set(r["ops"]) == {f"{op}/{lib}" for op in scaling.OPS for lib in ("ckpt", "dcp")}
        for key, e in r["ops"].items():
            assert e["wall"] > 0 and e["coord_bytes"] > 0, key
        assert r["ops"]["async/ckpt"]["blocking"] <= r["ops"]["async/ckpt"]["done"]
        for op in ("save", "load"):
            for lib in ("ckpt", "dcp"):
                phases = r["ops"][f"{op}/{lib}"]["phases"]
                assert all(not math.isnan(v) for v in phases.values()), (op, lib, phases)
        assert r["sizes"]["manifest"] > 0 and r["sizes"]["dcp_metadata"] > 0
    assert set(res["growth"]) and all(len(v) == 1 for v in res["growth"].values())
    # rendering works on the result (what main prints)
    assert scaling.time_rows(res) and scaling.phase_rows(res) and scaling.growth_rows(res)[1]


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_wrong_load_fails_the_bench(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpt

    real = ckpt.load

    def off_by_one(state, url, **kw):  # the forked ranks inherit this: ckpt's load returns a wrong value
        out = real(state, url, **kw)
        state["w1"].to_local()[0, 0] += 1
        return out

    monkeypatch.setattr(ckpt, "load", off_by_one)
    with pytest.raises(RuntimeError, match="ckpt load of w1 differs from what was saved in 1 elements"):
        scaling.run([2], mb_per_rank=0.02, tensors=2, repeats=1, warmup=0, exchange_iters=1, timeout=60.0,
                    root=str(tmp_path))
