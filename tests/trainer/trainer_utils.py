"""Helpers for the trainer tests: run :func:`ckpt.trainer.train.train` on forked gloo ranks and get
rank 0's per-step losses back; read a checkpoint's tensors whole."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import ckpt
from ckpt._dtypes import dtype_from_name
from ckpt.layout import Layout
from ckpt.manager import step_dir
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.metrics import read_metrics
from ckpt.trainer.train import train
from tests.dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[2]

# Loss parity with the single-process run. Forward and gradients agree to ~1e-7 relative (see
# test_parallel_grads); AdamW divides each element by its own gradient's magnitude, so an element
# whose gradient is ~eps (1e-8) turns fp32 summation-order noise into a visible update, and after
# ten steps losses of ~5 differ by up to ~1.5e-5 under TP. A real bug moves them by 1e-2 or more.
LOSS_TOL = {"rtol": 1e-5, "atol": 2e-5}


def _worker(rank: int, world: int, cfg: TrainConfig, layout: Layout, out: str) -> None:
    result = train(cfg, layout)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": result.losses, "start": result.start_step,
                       "resharded": result.resumed.resharded if result.resumed else None}, f)


def run_training(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    """Train on ``layout.world_size`` forked gloo ranks (also for one rank, so that every run has
    the same process and thread setup); rank 0's ``{"losses": {step: loss}, "start", "resharded"}``."""
    if cfg.device == "auto":  # forked ranks on gloo: CPU even on a GPU machine (CUDA does not survive a fork)
        cfg = dataclasses.replace(cfg, device="cpu")
    fd, out = tempfile.mkstemp(prefix="ckpt-train-", suffix=".json")
    os.close(fd)
    try:
        run_ranks(layout.world_size, _worker, cfg, layout, out)
        with open(out) as f:
            data = json.load(f)
    finally:
        os.unlink(out)
    data["losses"] = {int(k): v for k, v in data["losses"].items()}
    return data


def checkpoint_tensors(url: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, in this process."""
    manifest = ckpt.inspect(url)
    state = {k: torch.empty(t.shape, dtype=dtype_from_name(t.dtype)) for k, t in manifest.tensors.items()}
    ckpt.load(state, url, strict=False)
    return state


def losses_close(got: dict[int, float], want: dict[int, float]) -> None:
    """Same steps, losses within :data:`LOSS_TOL`."""
    assert sorted(got) == sorted(want)
    torch.testing.assert_close(torch.tensor([got[k] for k in sorted(got)], dtype=torch.float64),
                               torch.tensor([want[k] for k in sorted(want)], dtype=torch.float64), **LOSS_TOL)


GRAD_TOL = {"rtol": 1e-5, "atol": 1e-7}  # layout gradient checks: fp32, other summation orders


def assert_slots_match(opt: Any, grads: dict[str, list[torch.Tensor]], ref_grads: dict[str, torch.Tensor | None],
                       tol: dict[str, float] | None = None) -> set[str]:
    """Each optimizer slot's reduced gradient equals its block (and ZeRO range) of the one-process
    gradient ``ref_grads[name]``; returns the names seen (the caller checks they are this stage's)."""
    seen = set()
    for kind, slots in opt.slots.items():
        for s, got in zip(slots, grads[kind], strict=True):
            box = s.spec.box
            g = ref_grads[s.spec.name]
            assert g is not None, s.spec.name
            block = g[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))]
            want = block.reshape(-1)[s.start: s.stop]  # this rank's ZeRO range (the whole block without ZeRO)
            torch.testing.assert_close(got, want, **(tol or GRAD_TOL), msg=lambda m, n=s.spec.name: f"{n}: {m}")
            seen.add(s.spec.name)
    return seen


def assert_killed_cli_run_resumes_bitwise(tmp_path: Path, config_args: list[str], clean: TrainConfig, layout: Layout,
                                          *, fail_at: int) -> None:
    """``ckpt train CONFIG_ARGS`` (torchrun, CPU) with rank 1 killed at step ``fail_at`` restarts once,
    resumes from the persistent save at or just before the failure, and ends with its last checkpoint
    bitwise equal to an uninterrupted in-process run of ``clean`` under ``layout``."""
    run_dir = tmp_path / "run"
    steps, every = clean.steps, clean.save_every
    cmd = [os.path.join(os.path.dirname(sys.executable), "ckpt"), "train", *config_args, "--steps", str(steps),
           "--save-every", str(every), "--ckpt-dir", str(run_dir), "--fail-at-step", str(fail_at),
           "--fail-rank", "1", "--max-restarts", "1", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    assert ("fail", fail_at) in [(r["event"], r.get("step")) for r in records if "event" in r]
    assert next(r["step"] for r in records if r.get("event") == "resume") in (fail_at - every, fail_at)
    clean_dir = tmp_path / "clean"
    run_training(dataclasses.replace(clean, ckpt_dir=str(clean_dir)), layout)
    a, b = checkpoint_tensors(str(run_dir / step_dir(steps))), checkpoint_tensors(str(clean_dir / step_dir(steps)))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
