"""Data, config, LR schedule, vocab-parallel cross-entropy, metrics: the trainer's small pieces."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ckpt.errors import LayoutError
from ckpt.layout import Layout
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.data import SampleSource, corpus, rank_batch
from ckpt.trainer.metrics import MetricsLog, plot_loss, read_metrics
from ckpt.trainer.model import CONFIGS
from ckpt.trainer.parallel import ParallelContext
from ckpt.trainer.tp import vocab_parallel_cross_entropy
from ckpt.trainer.zero import LRSchedule
from tests.dist_utils import run_ranks


def test_corpus_and_samples_are_deterministic_bytes() -> None:
    text = corpus(0)
    assert text == corpus(0) and text != corpus(1) and len(text) == 1 << 18
    assert max(text) < 128  # byte-level ids of ASCII text: any vocabulary >= 128 holds them
    src = SampleSource(seq_len=32, seed=0)
    a = src.batch(100, 6)
    assert a.shape == (6, 32) and a.dtype == torch.int64
    assert torch.equal(a, SampleSource(32, 0).batch(100, 6))  # a pure function of the index
    assert torch.equal(src.batch(103, 3), a[3:])
    # past the end of an epoch a new permutation starts; samples stay windows of the corpus
    late = src.batch(src.windows * 3 + 5, 2)
    assert bytes(late[0].tolist()) in text


def test_data_position_is_independent_of_data_parallel_size() -> None:
    src = SampleSource(32, 0)
    whole = rank_batch(src, 64, 8, 0, 1)
    for world in (2, 4, 8):
        parts = [rank_batch(src, 64, 8, r, world) for r in range(world)]
        assert torch.equal(torch.cat(parts), whole)


def test_config_validation_names_the_fix() -> None:
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(schedule="zb")
    with pytest.raises(ValueError, match="ckpt_dir"):
        TrainConfig(fail_at_step=3)
    with pytest.raises(ValueError, match="stop_after"):
        TrainConfig(steps=10, stop_after=11)
    cfg = TrainConfig(global_batch=6, microbatches=2)
    with pytest.raises(LayoutError, match="dp x ep = 4"):
        cfg.check_layout(Layout(dp=2, ep=2))
    with pytest.raises(LayoutError, match="num_key_value_heads=2"):
        cfg.check_layout(Layout(tp=4))
    with pytest.raises(LayoutError, match="1F1B schedule needs at least pp=4"):
        TrainConfig(global_batch=8, microbatches=2).check_layout(Layout(pp=4))
    TrainConfig(global_batch=8, microbatches=4).check_layout(Layout(pp=4))
    back = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg


def test_lr_schedule_warmup_cosine_and_state_round_trip() -> None:
    s = LRSchedule(base_lr=1.0, warmup=4, total=14, min_ratio=0.1)
    assert [s.lr(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr(9) == pytest.approx(0.55) and s.lr(14) == pytest.approx(0.1) and s.lr(40) == pytest.approx(0.1)
    s.last_step = 7
    t = LRSchedule(0.5, 1, 2)
    t.load_state_dict(s.state_dict())
    assert t == s
    with pytest.raises(ValueError, match="unknown schedule kind"):
        t.load_state_dict({"kind": "step"})


def _vocab_ce(rank: int, world: int, vocab: int) -> None:
    ctx = ParallelContext.create(Layout(tp=world))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, vocab, generator=g)
    target = torch.randint(0, vocab, (10,), generator=g)
    target[3] = -100  # ignored
    chunk = -(-vocab // world)
    start, real = min(rank * chunk, vocab), max(0, min(chunk, vocab - rank * chunk))
    local = torch.zeros(10, chunk)
    local[:, :real] = logits[:, start:start + real]
    local[:, real:] = 1e4  # padding columns must not count, whatever they hold
    local.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, start, real, ctx.tp)
    loss.backward()
    ref_logits = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, target)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    assert local.grad is not None and ref_logits.grad is not None
    torch.testing.assert_close(local.grad[:, :real], ref_logits.grad[:, start:start + real])
    assert torch.all(local.grad[:, real:] == 0)


@pytest.mark.multiproc
@pytest.mark.parametrize("vocab", [12, 11])
def test_vocab_parallel_cross_entropy_equals_cross_entropy(vocab: int) -> None:
    run_ranks(2, _vocab_ce, vocab)


def test_metrics_log_and_plot(tmp_path) -> None:
    path = str(tmp_path / "m.jsonl")
    log = MetricsLog(path)
    log.write({"event": "start", "layout_text": "dp=1"})
    for step in (1, 2):
        log.write({"step": step, "loss": 3.0 - step, "tokens_per_s": 1.0, "ckpt_stall_ms": 0.0})
    MetricsLog(path, enabled=False).write({"step": 9})
    with open(path, "a") as f:
        f.write('{"torn')  # a line cut by a SIGKILL
    records = read_metrics(path)
    assert [r.get("step") for r in records] == [None, 1, 2] and all("time" in r for r in records)
    png = plot_loss(path, str(tmp_path / "loss.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert png is None  # optional extra: skipped, not an error
    else:
        assert png is not None and (tmp_path / "loss.png").stat().st_size > 0


def test_trainer_config_for_the_100m_model_accepts_its_layouts() -> None:
    cfg = TrainConfig(model=CONFIGS["100m"], global_batch=64, microbatches=8)
    for layout in (Layout(tp=4, ep=8, pp=8), Layout(dp=2, tp=2, ep=2, pp=2)):
        cfg.check_layout(layout)
    with pytest.raises(LayoutError, match="ep=3"):
        dataclasses.replace(cfg, global_batch=12).check_layout(Layout(ep=3))


def test_a_failing_rank_waits_for_lower_ranks_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher names the lowest rank's deterministic error; a faster higher rank must not exit
    (and get the others killed by torchrun) before rank 0's record exists."""
    from ckpt.trainer import launch as launch_mod

    monkeypatch.setenv(launch_mod.FATAL_ENV, str(tmp_path))
    monkeypatch.setattr(launch_mod, "LOWER_RANK_WAIT_S", 120.0)  # rank 1 waits for rank 0 however loaded the box
    done: list[float] = []

    def rank1() -> None:
        launch_mod.record_final_error(1, ValueError("late"))
        done.append(time.monotonic())

    t = threading.Thread(target=rank1)
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not done  # still waiting for rank 0
    written = time.monotonic()
    launch_mod.record_final_error(0, ValueError("first"))
    t.join(60)
    assert done and done[0] >= written
    records = launch_mod.final_errors(str(tmp_path))
    assert [(r["rank"], r["message"]) for r in records] == [(0, "first"), (1, "late")]
    # a lower rank that never fails: the wait is bounded
    monkeypatch.setattr(launch_mod, "LOWER_RANK_WAIT_S", 0.2)
    start = time.monotonic()
    launch_mod.record_final_error(3, ValueError("alone"))
    assert 0.2 <= time.monotonic() - start < 60  # the patched 0.2 s, not the 120 s above: bounds a hang only
