"""End to end through ``ckpt train`` and torchrun: a rank SIGKILLs itself right after the step-6 async
save started (so that checkpoint may or may not have committed), the launcher restarts the group, the run
resumes from the newest committed checkpoint and ends bitwise where an uninterrupted run ends.

torchrun spawns fresh interpreters (~5 s of imports each on this box), so this file stays small.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.layout import Layout
from ckpt.manager import list_checkpoints, step_dir
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.launch import FINAL_EXIT_CODE, TrainingFailed, launch
from ckpt.trainer.metrics import read_metrics
from tests.trainer.trainer_utils import checkpoint_tensors, run_training

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multiproc
def test_killed_rank_restarts_and_resumes_bitwise(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # the console script, as a user runs it (``python -m`` would itself import a cwd ckpt/ folder)
    cmd = [os.path.join(os.path.dirname(sys.executable), "ckpt"), "train", "--config", "tiny", "--tp", "1", "--ep", "2",
           "--pp", "1", "--dp", "1", "--steps", "8", "--save-every", "3", "--ckpt-dir", str(run_dir),
           "--fail-at-step", "6", "--fail-rank", "1", "--max-restarts", "1", "--device", "cpu"]
    # A folder named ckpt in the working directory must not shadow the package in the workers
    # (torchrun's ``-m`` would put the cwd first on their sys.path).
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "__init__.py").write_text("raise ImportError('the cwd ckpt/ folder was imported')\n")
    # One thread per rank, as in forked test ranks, so that the two runs do bitwise the same math.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"newest {run_dir / step_dir(8)}" in proc.stdout

    records = read_metrics(str(run_dir / "metrics.jsonl"))
    events = [(r["event"], r.get("step")) for r in records if "event" in r]
    assert ("fail", 6) in events
    resumed = next(r["step"] for r in records if r.get("event") == "resume")
    assert resumed in (3, 6)  # 6 when the in-flight save committed before the kill, else 3
    assert [r["restart"] for r in records if r.get("event") == "start"] == [0, 1]
    fail = next(r for r in records if r.get("event") == "fail")
    assert fail["rank"] == 1
    steps = [r for r in records if "loss" in r]
    assert {r["step"] for r in steps} == set(range(1, 9))
    assert all({"loss", "tokens_per_s", "ckpt_stall_ms"} <= r.keys() for r in steps)
    # nothing half-written is left: the restart's garbage collection removed an uncommitted step-6
    assert all(c.committed for c in list_checkpoints(str(run_dir)))

    # The same run without the failure, on forked ranks: every tensor of step 8 is bitwise equal.
    clean = tmp_path / "clean"
    cfg = TrainConfig(steps=8, save_every=3, ckpt_dir=str(clean), device="cpu")
    run_training(cfg, Layout(ep=2, zero=1))
    a, b = checkpoint_tensors(str(run_dir / step_dir(8))), checkpoint_tensors(str(clean / step_dir(8)))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the second attempt redoes the steps after its checkpoint: the same losses, bit for bit
    second = next(i for i, r in enumerate(records) if r.get("event") == "start" and r["restart"] == 1)
    first = {r["step"]: r["loss"] for r in records[:second] if "loss" in r}
    again = {r["step"]: r["loss"] for r in records[second:] if "loss" in r and r["step"] in first}
    assert sorted(again) == list(range(resumed + 1, 7)) and all(first[s] == v for s, v in again.items())


def test_train_cli_rejects_a_layout_before_starting_processes() -> None:
    result = CliRunner().invoke(app, ["train", "--tp", "3", "--steps", "2"])
    assert result.exit_code == 5
    assert "tp=3 must divide num_key_value_heads=2" in result.output
    result = CliRunner().invoke(app, ["train", "--ep", "2", "--fail-at-step", "1", "--fail-rank", "2",
                                      "--ckpt-dir", "x"])
    assert result.exit_code == 5 and "--fail-rank 2 is outside the 2 ranks" in result.output


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_deterministic_error_stops_the_job_without_restarts(tmp_path: Path) -> None:
    """A worker's MismatchError (an --init-from checkpoint missing weights) would recur on every
    restart: the worker exits with FINAL_EXIT_CODE, the launcher stops after one attempt."""
    partial = str(tmp_path / "partial")
    ckpt.save({"model": {"lm_head.weight": torch.zeros(256, 64)}}, partial)
    cfg = TrainConfig(steps=2, init_from=partial, device="cpu")
    log = tmp_path / "run.log"
    with pytest.raises(TrainingFailed, match=r"rank 0: MismatchError: .*missing tensors.*not retried") as err:
        launch(cfg, Layout(ep=2), max_restarts=3, log=str(log))
    assert err.value.final and err.value.attempts == 1
    text = log.read_text()
    assert text.count("==== attempt") == 1 and f"exiting with code {FINAL_EXIT_CODE}" in text
    # through the CLI: checked before any rank starts (tests/cli/test_train_quiet.py): one line, exit 5
    result = CliRunner().invoke(app, ["train", "--ep", "2", "--steps", "2", "--init-from", partial,
                                      "--ckpt-dir", str(tmp_path / "run")])
    assert result.exit_code == 5 and f"error: --init-from {partial}: missing tensors" in result.output
    assert not (tmp_path / "run").exists()  # no rank started, no log written


@pytest.mark.slow
@pytest.mark.multiproc
def test_demo_main_job(tmp_path: Path) -> None:
    """`ckpt demo` (shortened): 4 ranks, a kill, a same-layout resume, 2 ranks resharded, verify."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ckpt.cli.app", "demo", "--out", str(tmp_path / "demo"),
                           "--steps", "20"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "rank 3 killed itself (SIGKILL) at step 7" in out
    assert "resumed at step 6 under dp=1,tp=2,pp=1,ep=2,zero=1 (same layout)" in out
    assert "resumed at step 12 under dp=1,tp=1,pp=2,ep=1,zero=1 (resharded from another layout)" in out
    assert f"final checkpoint: {tmp_path / 'demo' / 'checkpoints' / step_dir(20)} (verified" in out
    assert "plot: " in out and "hugging face: " in out
    # the console tells the story only: the workers' output and torchrun's warnings went to the logs
    assert "Traceback" not in out + proc.stderr and "OMP_NUM_THREADS" not in out + proc.stderr
    assert proc.stderr.strip() == "" and len(out.splitlines()) <= 16, out + proc.stderr
    phase1 = (tmp_path / "demo" / "logs" / "phase-1.log").read_text()
    assert "==== attempt 0:" in phase1 and "==== attempt 1:" in phase1  # the kill, then the restart
    assert (tmp_path / "demo" / "logs" / "phase-2.log").read_text().count("==== attempt") == 1
    records = read_metrics(str(tmp_path / "demo" / "checkpoints" / "metrics.jsonl"))
    assert {r["step"] for r in records if "loss" in r} == set(range(1, 21))
    first, last = (next(r["loss"] for r in records if r.get("step") == s and "loss" in r) for s in (1, 20))
    assert last < first - 1.0  # it learns
