"""Resuming verifies what it restores: a damaged newest checkpoint is skipped for the older good one
(every rank agrees), and when none is good the run stops with a CheckpointError instead of training
from scratch."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

import ckpt
from ckpt.layout import Layout
from ckpt.manager import step_dir
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.metrics import read_metrics
from tests.trainer.trainer_utils import run_training

pytestmark = pytest.mark.multiproc

LAYOUT = Layout(dp=2, zero=1)


def _flip_one_byte(url: str, rank: int) -> None:
    """Corrupt a byte of a shard written by ``rank`` (so only some ranks may read it)."""
    m = ckpt.inspect(url)
    key, s = next((k, s) for k, t in m.tensors.items() for s in t.shards
                  if s.file.startswith(f"data/{rank:05d}-") and s.length)
    with open(os.path.join(url, s.file), "r+b") as f:
        f.seek(s.offset)
        b = f.read(1)
        f.seek(s.offset)
        f.write(bytes([b[0] ^ 0x01]))
    assert not ckpt.verify(url, deep=True).ok


def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path) -> None:
    root = tmp_path / "run"
    cfg = TrainConfig(steps=4, save_every=1, keep_last=3, ckpt_dir=str(root), device="cpu", async_save=False)
    run_training(dataclasses.replace(cfg, stop_after=3), LAYOUT)
    _flip_one_byte(str(root / step_dir(3)), rank=1)
    run_training(cfg, LAYOUT)  # resumes from step 2 and trains on to 4
    records = read_metrics(str(root / "metrics.jsonl"))
    failed = [r for r in records if r.get("event") == "restore_failed"]
    assert len(failed) == 1 and failed[0]["from"] == str(root / step_dir(3)) and failed[0]["ranks_failed"] >= 1
    resume = next(r for r in records if r.get("event") == "resume")
    assert resume["step"] == 2 and resume["from"] == str(root / step_dir(2)) and resume["bytes_verified"] > 0
    assert ckpt.verify(str(root / step_dir(4)), deep=True).ok


@pytest.mark.slow
def test_when_no_checkpoint_restores_the_run_stops(tmp_path: Path) -> None:
    root = tmp_path / "run"
    cfg = TrainConfig(steps=3, save_every=1, keep_last=2, ckpt_dir=str(root), device="cpu", async_save=False)
    run_training(dataclasses.replace(cfg, stop_after=2), LAYOUT)
    for step in (1, 2):
        _flip_one_byte(str(root / step_dir(step)), rank=0)
    with pytest.raises(Exception, match="none of the 2 committed checkpoint"):
        run_training(cfg, LAYOUT)
    # without verification the bytes are loaded as they are (the user's explicit choice)
    run_training(dataclasses.replace(cfg, verify_restore=False), LAYOUT)
    assert ckpt.inspect(str(root / step_dir(3))).step == 3
