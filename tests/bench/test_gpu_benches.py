"""Smoke tests of the 4-GPU benches on CPU gloo ranks at a tiny size (issue 20, parts 2 and 3): ``python
-m bench trainer-gpu`` and ``python -m bench memtier-gpu`` run end to end, their JSON has the figures
the GPU run reports, and the checks they make hold (kill + resume bitwise, recovery from peer copies)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import bench.__main__ as bench_main
from bench.trainer_gpu import case_layout, fit_longest, param_count
from ckpt.trainer.model import CONFIGS, MoEForCausalLM

# The bench skips cases once --time-budget-s (420 s) is spent: on a loaded machine that would
# change what these tests see, so they lift it (a hang is bounded by the rank launcher's deadline).
NO_TIME_BUDGET = ["--time-budget-s", "1e9"]


def test_case_layouts_and_parameter_count() -> None:
    assert case_layout("sp=1", 4) == ("dp=4,zero=1", "dedup")
    assert case_layout("sp=4", 4) == ("dp=1,sp=4,zero=1", "dedup")
    assert case_layout("ep=4 per-expert", 4) == ("dp=1,ep=4,zero=1", "per-expert")
    for name in ("tiny", "100m"):
        assert param_count(CONFIGS[name]) == sum(p.numel() for p in MoEForCausalLM(CONFIGS[name]).parameters())
    # the memory-tier config: >= 8 GB of fp32 weights + grads + AdamW per rank under dp=4 without ZeRO
    assert 16 * param_count(CONFIGS["800m"]) >= 8 * 2**30
    assert fit_longest([(1, 1), (2, 4), (3, 9)], 16, 2) == 4


@pytest.mark.slow
@pytest.mark.multiproc
def test_trainer_gpu_bench_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    rc = bench_main.main(["trainer-gpu", "--device", "cpu", "--quick", "--cases", "sp=2,ep=4 dedup",
                          "--resume-cases", "ep=4 dedup", "--warmup", "1", "--steps", "2", "--max-seq", "128",
                          "--sweep-steps", "1", *NO_TIME_BUDGET, "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    sp2, ep4 = res["cases"]
    assert sp2["throughput"]["lasp_bytes_per_rank"] > 0 and sp2["throughput"]["activation_bytes"] > 0
    assert [r["seq"] for r in sp2["sweep"]] == [64, 128] and sp2["longest_measured"] in (64, 128)
    t = ep4["throughput"]
    assert t["a2a_bytes_per_rank_max"] > 0 and t["a2a_s"] > 0 and math.isfinite(t["tokens_per_s"])
    r = ep4["resume"]
    assert r["attempt0_rc"] == -9 and r["attempt1_rc"] == 0 and r["resumed_from"] == 2
    assert r["bitwise"] and r["before_kill"]["bitwise"] and r["final"]["tensors"] > 0


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_out_of_memory_rank_ends_the_sweep_without_a_hang(tmp_path: Path) -> None:
    """One rank raising torch.OutOfMemoryError mid-sweep (its peers then wait in a collective with it):
    the group ends, the lengths measured before are kept, the failing length is named."""
    out = tmp_path / "o.json"
    rc = bench_main.main(["trainer-gpu", "--device", "cpu", "--quick", "--cases", "sp=2", "--resume-cases", "",
                          "--warmup", "0", "--steps", "1", "--max-seq", "512", "--sweep-steps", "1",
                          "--cpu-budget-mib", "100", "--fake-oom-seq", "256", *NO_TIME_BUDGET, "--json", str(out)])
    assert rc == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert case["exit"] == "out of memory" and case["out_of_memory_at"] == 256 == case["first_failed"]
    assert [r["seq"] for r in case["sweep"]] == [64, 128] and case["longest_measured"] == 128


@pytest.mark.slow
@pytest.mark.multiproc
def test_memtier_gpu_bench_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    rc = bench_main.main(["memtier-gpu", "--device", "cpu", "--quick", "--launcher", "fork", "--steps", "4",
                          "--save-every", "2", "--fail-at", "3", "--h2d-gib", "0.01", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    s, m = res["storage"], res["memory"]
    assert s["recovery"]["tier"] == "storage" and s["recovery"]["steps_lost"] == 1
    assert m["recovery"]["tier"] == "memory-peer" and m["recovery"]["steps_lost"] == 0
    assert m["memory_complete"] == m["memory_checkpoints"] > 0 and m["replica_bytes_per_step"] > 0
    assert res["slowdown"] > 0 and m["restore_gbps_per_rank"] > 0 and res["bandwidth"]["memcpy_gbps"] > 0
    assert m["step_ms_late"] > 0 and m["slowdown_late"] > 0
    assert s["evicted"]["how"] in ("drop_caches", "fadvise")


@pytest.mark.slow
@pytest.mark.multiproc
def test_memtier_gpu_bench_variants_reach_the_tier(tmp_path: Path) -> None:
    """``--tier-variants``: each variant is its own run, its settings reach every rank's tier (a budget
    of 0.001 GB/s makes each memory checkpoint take seconds: with busy=skip fewer complete than with
    the defaults), and ``--fail-at 0`` loses no node."""
    out = tmp_path / "m.json"
    rc = bench_main.main(["memtier-gpu", "--device", "cpu", "--quick", "--launcher", "fork", "--steps", "6",
                          "--save-every", "6", "--fail-at", "0", "--h2d-gib", "0.01", "--memory-busy", "skip",
                          "--tier-variants", "plain,stage@0.001", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["runs"] == ["storage", "memory-skip", "memory-skip+stage@0.001"]
    plain, paced = res["memory-skip"], res["memory-skip+stage@0.001"]
    assert not plain.get("recovery") and not paced.get("recovery")
    assert paced["memory_complete"] < plain["memory_complete"]


def test_the_interval_between_memory_checkpoints_is_the_training_time_between_them() -> None:
    from bench.memtier_gpu import interval_s

    steps = [[s, 100.0 * s] for s in range(1, 10)]  # step s took 100 * s ms
    assert interval_s([2, 4, 7], steps) == pytest.approx((300 + 400 + 500 + 600 + 700) / 1e3 / 2)
    assert interval_s([5], steps) is None and interval_s([], steps) is None


def test_tier_variants_parse_and_refuse_by_name() -> None:
    from bench.memtier_gpu import parse_variants

    assert parse_variants("plain,stage,@2,stage@0.5,stage%5,%2.5@4") == {
        "plain": (False, None, None), "stage": (True, None, None), "@2": (False, 2.0, None),
        "stage@0.5": (True, 0.5, None), "stage%5": (True, None, 0.05), "%2.5@4": (False, 4.0, 0.025)}
    assert parse_variants("") == {"plain": (False, None, None)}
    for bad in ("fast", "plain@2", "@", "stage@x", "@-1", "stage%100", "stage%5%6", "%", "stage@1@2", "plain%5"):
        with pytest.raises(SystemExit, match="--tier-variants"):
            parse_variants(bad)


@pytest.mark.multiproc
def test_transfer_moe_bench_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE live-transfer bench at a tiny width on 4 gloo ranks: every method checked bitwise (the
    bench asserts it), and the figures the GPU run reports are in its JSON."""
    import bench.transfer_moe as tm

    monkeypatch.setattr(tm, "D", 32)  # (forked ranks see the patched module)
    monkeypatch.setattr(tm, "F", 16)
    monkeypatch.setattr(tm, "E", 4)
    out = tmp_path / "t.json"
    assert bench_main.main(["transfer-moe", "--size-gb", "0.0003", "--repeats", "2", "--bucket-mb", "0.01",
                            "--dir", str(tmp_path / "w"), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["layers"] >= 2 and res["knobs"] == {"bucket_bytes": int(0.01 * (1 << 20))}
    for mode in ("same", "disjoint"):
        r = res[mode]
        assert set(r["times"]) == {"transfer", "save+load", "gather+broadcast", "send/recv"}
        assert all(len(v) == 2 for v in r["times"].values()) and r["cached_plan"]
        # the network bytes: the pairs' sum, fewer than gathering and broadcasting whole tensors
        assert r["bytes_sent"] == sum(map(sum, r["pair_bytes"])) < r["gather_broadcast_bytes"]


@pytest.mark.multiproc
def test_transfer_delta_bench_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delta refit bench at a tiny width on 2 gloo ranks: its refits are checked bitwise (the bench
    asserts it), the last delta refit sent only the changed tensors, and every row is in the JSON."""
    import bench.transfer_moe as tm

    monkeypatch.setattr(tm, "D", 32)
    monkeypatch.setattr(tm, "F", 16)
    monkeypatch.setattr(tm, "E", 4)
    out = tmp_path / "d.json"
    assert bench_main.main(["transfer-delta", "--size-gb", "0.0003", "--repeats", "2", "--changed-pct", "20",
                            "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"full", "delta, 20% changed", "stream, delta, 20% changed", "digests (rank 0 alone)"} <= set(res["rows"])
    assert all(len(v) == 2 for v in res["rows"].values())
    assert res["sent_last"] == res["changed_bytes"] and res["skipped_last"] == res["total_bytes"] - res["changed_bytes"]
