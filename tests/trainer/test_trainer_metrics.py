"""The trainer's metrics carry checkpoint figures: a ``checkpoint`` record per committed save (rank 0's
phase durations and bytes, the manifest's aggregate over ranks) and the load's phases on resume."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

import ckpt
from ckpt.async_save import SaveHandle
from ckpt.errors import StorageError
from ckpt.layout import Layout
from ckpt.manager import step_dir
from ckpt.manifest import Manifest
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.metrics import MetricsLog, load_fields, rank_bytes, read_metrics, save_record
from ckpt.trainer.train import _log_finished
from tests.trainer.trainer_utils import run_training

LAYOUT = Layout(dp=2, zero=1)  # two ranks that both write (ZeRO-1 splits the optimizer state)


def _rank0_file_bytes(url: str) -> int:
    data = Path(url) / "data"
    return sum(os.path.getsize(data / f) for f in os.listdir(data) if f.startswith("00000-"))


def _check_checkpoint(r: dict[str, Any], root: Path) -> None:
    url = str(root / step_dir(r["step"]))
    assert r["url"] == url and r["rank"] == 0
    m = ckpt.inspect(url)
    assert r["checkpoint_bytes"] == sum(m.files.values()) == sum(os.path.getsize(Path(url) / f) for f in m.files)
    assert 0 < r["bytes_written"] == _rank0_file_bytes(url) < r["checkpoint_bytes"]  # rank 1 wrote the rest
    assert r["ranks"] == 2
    assert set(r["across_ranks"]) == {"plan", "stage", "persist"}
    for a in r["across_ranks"].values():
        assert 0 <= a["min_ms"] <= a["median_ms"] <= a["max_ms"] and a["slowest_rank"] in (0, 1)


@pytest.mark.multiproc
def test_metrics_log_save_and_load_figures(tmp_path: Path) -> None:
    root = tmp_path / "run"
    cfg = TrainConfig(steps=3, save_every=1, ckpt_dir=str(root), device="cpu")
    run_training(dataclasses.replace(cfg, stop_after=2), LAYOUT)  # async saves of steps 1 and 2
    run_training(dataclasses.replace(cfg, async_save=False), LAYOUT)  # resumes at 2, saves 3 synchronously
    records = read_metrics(str(root / "metrics.jsonl"))

    done = [r for r in records if r.get("event") == "checkpoint"]
    assert [(r["step"], r["async"]) for r in done] == [(1, True), (2, True), (3, False)]
    for r in done:  # each after its save started, once
        assert records.index(r) > records.index(next(s for s in records if s.get("event") == "save"
                                                     and s["step"] == r["step"]))
        _check_checkpoint(r, root)
    for r in done:  # async and sync: this rank's own phases
        assert all(r[f"{p}_ms"] >= 0 for p in ("plan", "stage", "persist", "commit")) and r["persist_ms"] > 0
    assert done[2]["save_ms"] >= done[2]["persist_ms"]  # sync: the blocking call holds every phase

    resume = next(r for r in records if r.get("event") == "resume")
    assert resume["step"] == 2 and resume["resharded"] is False
    assert all(resume[f"{p}_ms"] >= 0 for p in ("manifest", "plan", "read", "copy"))
    assert resume["restore_ms"] >= resume["read_ms"] and resume["read_ops"] > 0
    assert 0 < resume["bytes_read"] <= sum(ckpt.inspect(str(root / step_dir(2))).files.values())
    # per-step lines are unchanged: one per step, no checkpoint fields mixed in
    steps = [r for r in records if "loss" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all("persist_ms" not in r for r in steps)


def test_record_helpers_without_processes() -> None:
    full = Manifest(files={"data/00000-aa.safetensors": 100, "data/00001-bb.safetensors": 50}, world_size=2,
                    stats={"ranks": 2, "persist": {"min": 0.001, "median": 0.0015, "max": 0.002, "slowest_rank": 1},
                           "sent": {"min": 10, "median": 15, "max": 20, "slowest_rank": 0}, "commit_s": 0.01})
    part = Manifest(files={"data/00001-bb.safetensors": 50}, partial=True)
    assert rank_bytes(full, 0) == 100 and rank_bytes(full, 1) == 50 and rank_bytes(part, 1) == 50
    r = save_record(4, "u", 0, full, {"plan": 0.5, "stage": 0.0, "persist": 1.25, "commit": 0.002},
                    async_save=True)
    assert (r["plan_ms"], r["persist_ms"], r["commit_ms"], r["bytes_written"], r["checkpoint_bytes"]) == (
        500.0, 1250.0, 2.0, 100, 150)
    assert r["across_ranks"] == {"persist": {"min_ms": 1.0, "median_ms": 1.5, "max_ms": 2.0, "slowest_rank": 1}}
    r = save_record(4, "u", 1, part, None, async_save=False, save_s=0.1)
    assert r["save_ms"] == 100.0 and r["bytes_written"] == 50 and "checkpoint_bytes" not in r
    assert load_fields({"manifest": 0.001, "plan": 0.002, "read": 0.5, "copy": 0.0, "bytes_read": 7, "ops": 3}) == {
        "manifest_ms": 1.0, "plan_ms": 2.0, "read_ms": 500.0, "copy_ms": 0.0, "bytes_read": 7, "read_ops": 3}


def test_a_finished_handle_is_logged_once_and_a_running_one_is_kept(tmp_path: Path) -> None:
    log = MetricsLog(str(tmp_path / "m.jsonl"))
    running = SaveHandle("u/step-5", 5)
    assert _log_finished(log, running, 0) is running  # not done: nothing written, tried again later
    failed = SaveHandle("u/step-5", 5)
    failed.error = StorageError("disk full")
    failed._done.set()
    assert _log_finished(log, failed, 0) is None
    assert _log_finished(log, SaveHandle("u/step-6", 6, skipped=True), 0) is None  # skipped: no record
    records = read_metrics(log.path or "")
    assert [(r["event"], r["step"], r["error"]) for r in records] == [("save_failed", 5, "StorageError: disk full")]
