"""Checkpoint contents and resume: same layout (bitwise), another layout (resharded at load), and
starting from a weights-only checkpoint (``--init-from``). Forked gloo ranks throughout."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import MismatchError
from ckpt.layout import Layout
from ckpt.manager import list_checkpoints, step_dir
from ckpt.shards import Flat
from ckpt.trainer.checkpoint import load_full_model
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.data import SampleSource
from ckpt.trainer.model import CONFIGS, MoEForCausalLM
from ckpt.trainer.train import train
from tests.trainer.trainer_utils import checkpoint_tensors, losses_close, run_training

SAVED = Layout(tp=2, ep=2, zero=1)
CFG = TrainConfig(steps=10, save_every=3)
CUT = 6  # the interrupted run stops (and checkpoints) here


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """An uninterrupted tp2 x ep2 run of 10 steps, and the same run stopped after step 6."""
    root = tmp_path_factory.mktemp("resume")
    full = run_training(dataclasses.replace(CFG, ckpt_dir=str(root / "full")), SAVED)
    cut = run_training(dataclasses.replace(CFG, ckpt_dir=str(root / "cut"), stop_after=CUT), SAVED)
    return {"root": root, "full": full["losses"], "cut": cut["losses"]}


@pytest.mark.slow
@pytest.mark.multiproc
def test_checkpoint_keys_regions_and_metadata(runs: dict[str, object]) -> None:
    url = str(Path(str(runs["root"])) / "cut" / step_dir(CUT))
    m = ckpt.inspect(url)
    model = MoEForCausalLM(CFG.model)
    names = [n for n, _ in model.named_parameters()]
    assert {k for k in m.tensors if k.startswith("model.")} == {f"model.{n}" for n in names}
    assert {k for k in m.tensors if k.startswith("optim.")} == {
        f"optim.{s}.{n}" for s in ("exp_avg", "exp_avg_sq") for n in names}
    for n, p in model.named_parameters():
        assert m.tensors[f"model.{n}"].shape == tuple(p.shape)
        assert m.tensors[f"optim.exp_avg.{n}"].dtype == "float32"
    # q_proj: column-parallel rows over tp=2, replicated over ep (one copy stored)
    q = m.tensors["model.model.layers.0.self_attn.q_proj.weight"]
    assert sorted(s.region.offsets for s in q.shards) == [(0, 0), (32, 0)]  # type: ignore[union-attr]
    # experts: EP over dim 0 x TP over the width; ZeRO-1 over the dense replica group (ep) of q's blocks
    e = m.tensors["model.model.layers.1.mlp.experts.down_proj"]
    assert sorted(s.region.offsets for s in e.shards) == [  # type: ignore[union-attr]
        (0, 0, 0), (0, 0, 16), (2, 0, 0), (2, 0, 16)]
    qa = m.tensors["optim.exp_avg.model.layers.0.self_attn.q_proj.weight"]
    assert all(isinstance(s.region, Flat) and s.region.box is not None for s in qa.shards)
    assert sorted((s.region.box.offsets, s.region.start) for s in qa.shards) == [  # type: ignore[union-attr]
        ((0, 0), 0), ((0, 0), 1024), ((32, 0), 0), ((32, 0), 1024)]
    norm = m.tensors["optim.exp_avg_sq.model.norm.weight"]  # whole-tensor block: flat, no box
    assert sorted(s.region.start for s in norm.shards) == [0, 32]  # type: ignore[union-attr]
    assert all(s.region.box is None for s in norm.shards)  # type: ignore[union-attr]
    assert set(m.objects) >= {"optim.step", "train.step", "train.sample_index", "rng"}
    assert m.objects["rng"].per_rank is not None and sorted(m.objects["rng"].per_rank) == [0, 1, 2, 3]
    out = ckpt.load({"optim": {"step": None}, "train": {"step": None, "sample_index": None, "lr_scheduler": None}},
                    url, strict=False)
    assert out["optim"]["step"] == CUT and out["train"]["step"] == CUT
    assert out["train"]["sample_index"] == CUT * CFG.global_batch
    assert out["train"]["lr_scheduler"]["kind"] == "warmup_cosine"
    assert out["train"]["lr_scheduler"]["last_step"] == CUT
    assert m.user_metadata["model_config"] == CFG.model.to_dict()
    assert m.user_metadata["layout"] == SAVED.to_dict() == m.layout
    assert m.user_metadata["rules"] == "embedded-moe"
    assert ckpt.verify(url, deep=True).ok


@pytest.mark.slow
@pytest.mark.multiproc
def test_same_layout_resume_is_bitwise(runs: dict[str, object], tmp_path: Path) -> None:
    root = Path(str(runs["root"]))
    shutil.copytree(root / "cut", tmp_path / "run")
    resumed = run_training(dataclasses.replace(CFG, ckpt_dir=str(tmp_path / "run")), SAVED)
    assert resumed["start"] == CUT and resumed["resharded"] is False
    full = runs["full"]
    assert isinstance(full, dict)
    assert resumed["losses"] == {k: v for k, v in full.items() if k > CUT}  # bitwise: same floats
    a = checkpoint_tensors(str(root / "full" / step_dir(10)))
    b = checkpoint_tensors(str(tmp_path / "run" / step_dir(10)))
    assert a.keys() == b.keys()
    for k in a:  # model and optimizer state, every bit
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("target", ["ep=2,zero=1", "dp=2,zero=1", "single", "pp=2,dp=2,zero=0"])
def test_resume_under_another_layout(runs: dict[str, object], tmp_path: Path, target: str) -> None:
    root = Path(str(runs["root"]))
    shutil.copytree(root / "cut" / step_dir(CUT), tmp_path / "run" / step_dir(CUT))
    layout = Layout.parse(target)
    resumed = run_training(dataclasses.replace(CFG, ckpt_dir=str(tmp_path / "run")), layout)
    assert resumed["start"] == CUT and resumed["resharded"] is True
    full = runs["full"]
    assert isinstance(full, dict)
    losses_close(resumed["losses"], {k: v for k, v in full.items() if k > CUT})
    # the checkpoint it writes is again a complete global one, loadable as one model
    model = load_full_model(str(tmp_path / "run" / step_dir(10)))
    ref = load_full_model(str(root / "full" / step_dir(10)))
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=5e-4, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.multiproc
def test_init_from_weights_only_checkpoint(tmp_path: Path) -> None:
    """A checkpoint with only model.* keys (as an import from Hugging Face writes), resharded to tp2."""
    source = MoEForCausalLM(CONFIGS["tiny"])
    source.init_weights(seed=7)  # not the trainer's seed-0 init: the weights must come from the file
    url = str(tmp_path / "weights")
    ckpt.save({"model": {n: p.detach() for n, p in source.named_parameters()}}, url)
    cfg = TrainConfig(steps=2, init_from=url, ckpt_dir=str(tmp_path / "run"), save_every=1, async_save=False)
    got = run_training(cfg, Layout(tp=2))["losses"]
    assert [c.step for c in list_checkpoints(cfg.ckpt_dir or "") if c.committed] == [1, 2]  # synchronous saves
    ids = SampleSource(cfg.seq_len, cfg.seed).batch(0, cfg.global_batch)
    with torch.no_grad():
        first = float(source(ids, labels=ids)[1])  # type: ignore[index]
    assert got[1] == pytest.approx(first, rel=1e-6)


@pytest.mark.multiproc
def test_init_from_a_bf16_export_imported_back_casts_the_weights(tmp_path: Path) -> None:
    """export-hf --dtype bf16 -> import-hf -> train --init-from: the bf16 weights are cast to the
    model's float32 (a resume would refuse the dtype; a weights-only init casts)."""
    pytest.importorskip("transformers")
    from ckpt.hf.convert import export_hf, import_hf

    source = MoEForCausalLM(CONFIGS["tiny"])
    source.init_weights(seed=7)
    url = str(tmp_path / "weights")
    ckpt.save({"model": {n: p.detach() for n, p in source.named_parameters()}}, url,
              user_metadata={"model_config": CONFIGS["tiny"].to_dict(), "layout": Layout().to_dict(),
                             "rules": "embedded-moe"})
    export_hf(url, str(tmp_path / "hf"), dtype="bf16")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))
    assert {e.dtype for e in ckpt.inspect(str(tmp_path / "imported")).tensors.values()} == {"bfloat16"}
    cfg = TrainConfig(steps=1, init_from=str(tmp_path / "imported"), async_save=False)
    got = run_training(cfg, Layout(tp=2))["losses"]
    rounded = MoEForCausalLM(CONFIGS["tiny"])
    with torch.no_grad():
        for p, q in zip(rounded.parameters(), source.parameters(), strict=True):
            p.copy_(q.bfloat16())
    ids = SampleSource(cfg.seq_len, cfg.seed).batch(0, cfg.global_batch)
    with torch.no_grad():
        first = float(rounded(ids, labels=ids)[1])  # type: ignore[index]
    assert got[1] == pytest.approx(first, rel=1e-6)
    # evaluating the imported checkpoint in one process casts the same way
    full = load_full_model(str(tmp_path / "imported"))
    for (n, p), q in zip(full.named_parameters(), rounded.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q), n


def test_init_from_refuses_a_non_float_dtype_change(tmp_path: Path) -> None:
    source = MoEForCausalLM(CONFIGS["tiny"])
    url = str(tmp_path / "ints")
    ckpt.save({"model": {n: p.detach().to(torch.int32) for n, p in source.named_parameters()}}, url)
    with pytest.raises(MismatchError, match="stored as int32.*only floating-point weights are cast"):
        load_full_model(url, CONFIGS["tiny"])


@pytest.mark.multiproc
def test_restore_refuses_another_model_and_init_from_needs_every_weight(runs: dict[str, object],
                                                                         tmp_path: Path) -> None:
    root = Path(str(runs["root"]))
    shutil.copytree(root / "cut" / step_dir(CUT), tmp_path / "run" / step_dir(CUT))
    other = dataclasses.replace(CFG, ckpt_dir=str(tmp_path / "run"),
                                model=dataclasses.replace(CONFIGS["tiny"], num_hidden_layers=2))
    with pytest.raises(MismatchError, match="num_hidden_layers: checkpoint 4 vs run 2"):
        train(other, Layout())
    partial = str(tmp_path / "partial")
    ckpt.save({"model": {"lm_head.weight": torch.zeros(256, 64)}}, partial)
    with pytest.raises(MismatchError, match="missing tensors"):
        train(TrainConfig(steps=1, init_from=partial), Layout())


@pytest.mark.slow
@pytest.mark.multiproc
def test_checkpoint_every_step_leaves_only_complete_checkpoints(tmp_path: Path) -> None:
    """Back-to-back async saves with retention: the previous save's gc never eats the next one."""
    cfg = TrainConfig(steps=12, save_every=1, keep_last=4, ckpt_dir=str(tmp_path / "run"))
    run_training(cfg, Layout(dp=2, zero=1))
    infos = list_checkpoints(str(tmp_path / "run"))
    assert [c.step for c in infos] == [9, 10, 11, 12] and all(c.committed for c in infos)
    for c in infos:
        report = ckpt.verify(c.url, deep=True)
        assert report.ok, (c.url, report.problems)
