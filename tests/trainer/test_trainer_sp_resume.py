"""Checkpoints under sequence parallelism: a killed sp run resumes bitwise (torchrun, ``ckpt train
--sp``); resume across sp changes (sp=2 -> sp=1, tp=2 -> sp=2) within the tolerance of other layout
changes; the layout is rejected before any process starts when sp does not cut the sequence."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.errors import LayoutError
from ckpt.layout import Layout
from ckpt.manager import step_dir
from ckpt.trainer.checkpoint import load_full_model
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.launch import launch
from tests.trainer.trainer_utils import (
    losses_close,
    run_training,
)

CFG = TrainConfig(steps=10, save_every=3)
CUT = 6
SP = Layout(sp=2, zero=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """sp=2 for 10 steps, the same stopped after step 6, and a tp=2 run stopped after step 6."""
    root = tmp_path_factory.mktemp("sp-resume")
    full = run_training(dataclasses.replace(CFG, ckpt_dir=str(root / "full")), SP)
    run_training(dataclasses.replace(CFG, ckpt_dir=str(root / "cut"), stop_after=CUT), SP)
    run_training(dataclasses.replace(CFG, ckpt_dir=str(root / "tp"), stop_after=CUT), Layout(tp=2, zero=1))
    return {"root": root, "full": full["losses"]}


@pytest.mark.slow
@pytest.mark.multiproc
def test_sp_checkpoint_is_a_global_one(runs: dict[str, object]) -> None:
    url = str(Path(str(runs["root"])) / "cut" / step_dir(CUT))
    m = ckpt.inspect(url)
    assert m.layout == SP.to_dict() and m.layout["sp"] == 2
    # parameters are replicated over sp: one whole copy of each stored
    q = m.tensors["model.model.layers.0.self_attn.q_proj.weight"]
    assert [s.region.offsets for s in q.shards] == [(0, 0)]  # type: ignore[union-attr]
    # ZeRO-1 ranges over the sp replicas: two halves of the optimizer state
    qa = m.tensors["optim.exp_avg.model.layers.0.self_attn.q_proj.weight"]
    assert sorted(s.region.start for s in qa.shards) == [0, 2048]  # type: ignore[union-attr]
    assert ckpt.verify(url, deep=True).ok


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("source,target", [("cut", "single"), ("cut", "sp=4,zero=0"), ("tp", "sp=2,zero=1")])
def test_resume_across_sp(runs: dict[str, object], tmp_path: Path, source: str, target: str) -> None:
    root = Path(str(runs["root"]))
    shutil.copytree(root / source / step_dir(CUT), tmp_path / "run" / step_dir(CUT))
    resumed = run_training(dataclasses.replace(CFG, ckpt_dir=str(tmp_path / "run")), Layout.parse(target))
    assert resumed["start"] == CUT and resumed["resharded"] is True
    full = runs["full"]
    assert isinstance(full, dict)
    losses_close(resumed["losses"], {k: v for k, v in full.items() if k > CUT})
    model = load_full_model(str(tmp_path / "run" / step_dir(10)))
    ref = load_full_model(str(root / "full" / step_dir(10)))
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=5e-4, msg=lambda m, n=n: f"{n}: {m}")


# A killed sp rank's restart and bitwise resume: tests/trainer/test_trainer_hybrid.py (the hybrid model has
# softmax and linear-attention layers under sp=2: one run covers both; a second run here cost ~20 s).


def test_sp_not_cutting_the_sequence_is_rejected_before_processes_start(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match=r"sp=3 does not cut seq_len=32 into 2\*sp=6 equal zigzag chunks; "
                                          r"choose sp in \[1, 2, 4, 8, 16\]"):
        TrainConfig().check_layout(Layout(sp=3))
    with pytest.raises(LayoutError, match=r"sp=4 does not cut seq_len=20"):
        launch(TrainConfig(seq_len=20, device="cpu"), Layout(sp=4), log=str(tmp_path / "never.log"))
    assert not (tmp_path / "never.log").exists()
    result = CliRunner().invoke(app, ["train", "--sp", "3", "--steps", "2"])
    assert result.exit_code == 5 and "sp=3 does not cut seq_len=32" in result.output
