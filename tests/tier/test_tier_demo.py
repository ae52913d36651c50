"""`ckpt demo --node-loss`: the main job with node 1 lost and recovered from a peer replica (torchrun:
one run of about a minute on this box, like tests/trainer/test_trainer_torchrun.py::test_demo_main_job)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.manager import step_dir
from ckpt.trainer.metrics import read_metrics

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_node_loss_recovers_from_a_peer_replica(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ckpt.cli.app", "demo", "--out", str(tmp_path / "demo"),
                           "--steps", "20", "--node-loss"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "node 1 (ranks 2-3) lost at step 7" in out
    assert "node 1 lost at step 7: its shared memory deleted, ranks 2, 3 killed (SIGKILL)" in out
    assert "resumed at step 7 from the memory tier, 0 step(s) lost (ranks 2, 3 fetched" in out
    assert "resumed at step 12 under dp=1,tp=1,pp=2,ep=1,zero=1 (resharded from another layout)" in out
    assert f"final checkpoint: {tmp_path / 'demo' / 'checkpoints' / step_dir(20)} (verified" in out
    assert "Traceback" not in out + proc.stderr and proc.stderr.strip() == ""
    assert len(out.splitlines()) <= 16, out  # the same console budget as the plain demo
    records = read_metrics(str(tmp_path / "demo" / "checkpoints" / "metrics.jsonl"))
    (rec,) = [r for r in records if r.get("event") == "recovery" and r["tier"] != "storage"]
    assert rec["tier"] == "memory-peer" and rec["peer_ranks"] == [2, 3] and rec["steps_lost"] == 0
    assert {r["step"] for r in records if "loss" in r} == set(range(1, 21))
    resume = next(r for r in records if r.get("event") == "resume")
    assert not Path(resume["from"]).parents[2].exists()  # the run gave its shared memory back at the end
