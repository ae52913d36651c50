"""``ckpt train``: quiet by default (a few lines of its own, torchrun's and the workers' output in a log
file whose path it prints once; ``--verbose`` streams it), and every argument that can be checked
without ranks checked before any rank starts, with the exit code of the CLI's table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.errors import MismatchError
from ckpt.manager import step_dir
from ckpt.trainer.config import CONFIGS
from ckpt.trainer.launch import check_init_from
from ckpt.trainer.model import MoEForCausalLM

ROOT = Path(__file__).resolve().parents[2]
TINY = CONFIGS["tiny"]


def _weights() -> dict[str, torch.Tensor]:
    model = MoEForCausalLM(TINY)
    model.init_weights(0)
    return {n: p.detach() for n, p in model.named_parameters()}


WEIGHTS = _weights()
NAMES = sorted(WEIGHTS)


def _invoke(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["train", *args])
    return result.exit_code, result.output


def _nothing_started(run: Path) -> None:
    assert not run.exists(), sorted(os.listdir(run))  # no checkpoint root, no logs folder


def test_missing_init_from_is_refused_before_any_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, out = _invoke(["--ep", "2", "--steps", "2", "--ckpt-dir", str(run), "--init-from", str(tmp_path / "nope")])
    assert code == 2 and f"error: --init-from {tmp_path / 'nope'}: no such file or directory" in out, out
    _nothing_started(run)
    (tmp_path / "empty").mkdir()
    code, out = _invoke(["--ckpt-dir", str(run), "--init-from", str(tmp_path / "empty")])
    assert code == 2 and "no committed checkpoint here" in out, out
    _nothing_started(run)


def test_init_from_of_another_model_config_is_refused_before_any_rank(tmp_path: Path) -> None:
    tiny = str(tmp_path / "tiny")
    ckpt.save({"model": WEIGHTS}, tiny)
    run = tmp_path / "run"
    code, out = _invoke(["--config", "hybrid-tiny", "--ckpt-dir", str(run), "--init-from", tiny])
    assert code == 5 and f"error: --init-from {tiny}: missing tensors ['model." in out, out
    _nothing_started(run)
    check_init_from(tiny, TINY)  # while it fits the config it was saved from


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(NAMES), fault=st.sampled_from(["missing", "shape", "int"]))
def test_check_init_from_names_the_weight_that_does_not_fit(tmp_path_factory: pytest.TempPathFactory, name: str,
                                                            fault: str) -> None:
    weights = dict(WEIGHTS)
    if fault == "missing":
        del weights[name]
    elif fault == "shape":
        weights[name] = torch.zeros(weights[name].numel() + 1)
    else:
        weights[name] = torch.zeros(weights[name].shape, dtype=torch.int32)
    url = str(tmp_path_factory.mktemp("c") / "ckpt")
    ckpt.save({"model": weights}, url)
    expected = {"missing": "missing tensors", "shape": "has shape", "int": "is stored as int32"}[fault]
    with pytest.raises(MismatchError, match=expected) as err:
        check_init_from(url, TINY)
    assert f"model.{name}" in str(err.value)


def test_a_finished_run_starts_nothing_and_says_so(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpt.save({"x": torch.zeros(2)}, str(run / step_dir(4)), step=4)
    code, out = _invoke(["--steps", "6", "--stop-after", "4", "--ckpt-dir", str(run)])
    assert code == 0, out
    assert out.strip() == (f"nothing to train: {run} already holds step 4, the run's last (--steps 6, "
                           "--stop-after 4); raise --steps (or --stop-after) to go on")
    assert sorted(os.listdir(run)) == [step_dir(4)]  # no log file: no rank started


def test_config_errors_name_the_flag(tmp_path: Path) -> None:
    code, out = _invoke(["--steps", "3", "--stop-after", "9"])
    assert code == 5 and "error: --stop-after 9 must lie in [0, steps=3]" in out, out
    code, out = _invoke(["--max-staging-bytes", "lots"])
    assert code == 5 and "error: --max-staging-bytes: size 'lots'" in out, out
    code, out = _invoke(["--config", "huge"])
    assert code == 5 and "unknown model config 'huge'" in out, out


def test_memory_tier_budget_and_staging_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpt.cli.train as cli_train
    from ckpt.trainer.config import TrainConfig

    code, out = _invoke(["--memory-max-gbps", "0"])
    assert code == 2 and "--memory-max-gbps" in out, out
    with pytest.raises(ValueError, match="memory_max_gbps=-1"):
        TrainConfig(memory_max_gbps=-1)
    code, out = _invoke(["--memory-max-overhead", "1"])
    assert code == 2 and "--memory-max-overhead" in out, out
    for bad in ({"memory_max_overhead": 0.05}, {"memory_max_overhead": 0.0, "memory_busy": "skip"}):
        with pytest.raises(ValueError, match="memory_max_overhead"):
            TrainConfig(**bad)  # type: ignore[arg-type]
    seen: list[TrainConfig] = []

    def stop(opts: dict[str, Any], layout: Any) -> TrainConfig:
        seen.append(real(opts, layout))
        raise SystemExit(0)

    real = cli_train._train_config
    monkeypatch.setattr(cli_train, "_train_config", stop)
    code, out = _invoke(["--memory-every", "1", "--memory-busy", "skip", "--memory-stage-on-device",
                         "--memory-max-gbps", "1.5", "--memory-max-overhead", "0.05", "--ckpt-dir", "r"])
    assert code == 0, out
    (cfg,) = seen
    assert cfg.memory_stage_on_device and cfg.memory_max_gbps == 1.5 and cfg.memory_busy == "skip"
    assert cfg.memory_max_overhead == 0.05


# torchrun says this on stderr when it starts several workers without OMP_NUM_THREADS set
TORCHRUN_SAYS = "Setting OMP_NUM_THREADS environment variable"


def _ckpt_train(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [os.path.join(os.path.dirname(sys.executable), "ckpt"), "train", "--device", "cpu", "--ep", "2", *args]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_is_quiet_with_worker_output_in_a_log_and_verbose_streams_it(tmp_path: Path) -> None:
    proc = _ckpt_train(["--steps", "3", "--stop-after", "2", "--save-every", "1", "--ckpt-dir", "run"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    logs = [ln.removeprefix("worker logs: ") for ln in lines if ln.startswith("worker logs: ")]
    assert len(logs) == 1 and Path(logs[0]).parent == Path("run/logs"), proc.stdout  # printed once
    assert proc.stderr == "" and len(lines) <= 8, proc.stdout + proc.stderr
    assert lines[0] == "training tiny under dp=1,tp=1,pp=1,ep=2,zero=1 on 2 process(es) via torchrun"
    assert any(ln.startswith("  loss ") and ln.endswith("(step 2)") for ln in lines), proc.stdout
    assert lines[-2:] == [f"checkpoints: run (newest run/{step_dir(2)})", "metrics: run/metrics.jsonl"]
    text = (tmp_path / logs[0]).read_text()
    assert text.startswith("==== attempt 0: ") and TORCHRUN_SAYS in text  # torchrun's output went there
    assert os.listdir(tmp_path / "run" / "logs") == [Path(logs[0]).name]

    proc = _ckpt_train(["--steps", "3", "--ckpt-dir", "run", "--verbose"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert TORCHRUN_SAYS in proc.stderr and "worker logs: " not in proc.stdout
    assert os.listdir(tmp_path / "run" / "logs") == [Path(logs[0]).name]
    assert "resumed at step 2" in proc.stdout and f"newest run/{step_dir(3)}" in proc.stdout


def test_the_summary_tells_only_this_runs_records(tmp_path: Path) -> None:
    """A run continuing in the same --ckpt-dir appends to the metrics file: what ``ckpt train`` prints
    comes from the records its own run wrote, not from the earlier runs' kill and resume."""
    from ckpt.cli.train import _records_since
    from ckpt.trainer.demo import summarize_records

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"event": "fail", "step": 3, "rank": 1}\n{"step": 3, "loss": 5.0, "ckpt_stall_ms": 0}\n')
    seen = metrics.stat().st_size
    with metrics.open("a") as f:
        f.write('{"event": "init_from", "step": 0, "from": "hf-import"}\n{"step": 4, "loss": 4.5, "ckpt_stall_ms": 0}\n'
                '{"step": 5, "loss": 4.25, "ckpt_stall_ms": 2.0}\n{"torn')
    assert summarize_records(_records_since(str(metrics), seen)) == [
        "started from the weights of hf-import", "loss 4.500 (step 4) -> 4.250 (step 5)",
        "checkpoint stall per save: median 2.0 ms, max 2.0 ms over 1 saves"]
