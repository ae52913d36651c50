"""Checkpoints saved by real ranks (forked gloo groups) under a layout, resharded offline."""

from __future__ import annotations

import os

import pytest
import torch

import ckpt
from ckpt.formats.msgpack_codec import decode_object
from ckpt.layout import Layout
from ckpt.resharders.diff import diff
from ckpt.resharders.placement import shard_state
from ckpt.resharders.plan import plan
from ckpt.resharders.reshard import reshard
from ckpt.resharders.rules import MOE_RULES
from tests.dist_utils import run_ranks
from tests.layouts import assert_bitwise
from tests.resharders.moe_states import TINY, full_state, metadata, save_single

pytestmark = pytest.mark.multiproc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _save_under(rank: int, world: int, url: str, text: str) -> None:
    # Each rank declares exactly its regions from the rules, as the trainer does.
    lay = Layout.parse(text)
    state = shard_state(full_state(TINY, dtype=torch.bfloat16), lay, rank, MOE_RULES)
    state.update(step=10, data={"position": 1234, "seed": 7}, rng=ckpt.PerRank([rank, "state"]))
    ckpt.save(state, url, step=10, user_metadata=metadata(TINY, lay), layout=lay.to_dict())


@pytest.mark.slow
@pytest.mark.parametrize("text", ["tp=2,ep=2", "dp=2,tp=2,zero=1"])
def test_multirank_save_reshards_bitwise(tmp_path, text):
    src = str(tmp_path / "ranks")
    run_ranks(4, _save_under, src, text)
    m = ckpt.inspect(src)
    assert m.world_size == 4 and len(m.files) == 4 and ckpt.verify(src, deep=True).ok
    # The shards on disk are exactly what the plan for that same layout predicts.
    p = plan(m, Layout.parse(text))
    for key, t in m.tensors.items():
        assert sorted(map(repr, (s.region for s in t.shards))) == \
            sorted(map(repr, (s.region for s in p.manifest.tensors[key].shards))), key
    ref = str(tmp_path / "single")
    full = save_single(ref, dtype=torch.bfloat16)
    prev = src
    for i, target in enumerate(["tp=1,ep=4,pp=2", "dp=2,zero=1", "single"]):
        dst = str(tmp_path / f"c{i}")
        reshard(prev, dst, Layout.parse(target))
        prev = dst
    report = diff(src, prev)
    assert report.ok, [t.to_dict() for t in report.problems]
    # per-rank objects: rank 0 keeps rank 0's, so only the tensors and global objects match the single save
    assert [t.key for t in diff(ref, prev).problems] == [], diff(ref, prev).to_dict()
    back = {k: torch.zeros_like(v) for k, v in full.items()}
    out = ckpt.load({**back, "rng": None, "step": None, "data": None}, prev)
    for k, v in full.items():
        assert_bitwise(back[k], v, k)
    assert out["step"] == 10 and out["rng"] == [0, "state"]
    mid = ckpt.inspect(str(tmp_path / "c0")).objects["rng"].per_rank  # 4 ranks -> 8 ranks
    assert mid is not None and sorted(mid) == list(range(8))
    assert [decode_object(mid[r]) for r in (1, 5)] == [[1, "state"], [1, "state"]]
    assert sorted(ckpt.inspect(prev).objects["rng"].per_rank or {}) == [0]


HAS_TRAINER = os.path.exists(os.path.join(REPO, "ckpt", "trainer", "train.py"))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRAINER, reason="ckpt/trainer/train.py does not exist: needs the trainer")
def test_trainer_checkpoint_chain_and_resume(tmp_path):
    """A checkpoint the trainer wrote on 4 ranks (tp=2, ep=2, ZeRO-1) goes through a chain of offline
    reshards bitwise, and training resumes from the rewritten checkpoint under its new layout."""
    import dataclasses

    from ckpt.manager import step_dir
    from ckpt.trainer.config import TrainConfig
    from tests.trainer.trainer_utils import losses_close, run_training

    cfg = TrainConfig(steps=6, device="cpu")
    run_training(dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "run"), stop_after=4), Layout(tp=2, ep=2, zero=1))
    orig = str(tmp_path / "run" / step_dir(4))
    prev = orig
    for i, target in enumerate(["tp=1,ep=4,pp=2", "dp=2,zero=1", "single"]):
        dst = str(tmp_path / f"c{i}" / step_dir(4))
        reshard(prev, dst, Layout.parse(target))
        report = diff(orig, dst)
        assert report.ok, [t.to_dict() for t in report.problems]
        assert ckpt.verify(dst, deep=True).ok
        prev = dst
    # Resume under the rewritten checkpoint's own layout: a same-layout (strict, RNG included) restore.
    resumed = run_training(dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "c1")), Layout(dp=2, zero=1))
    assert resumed["start"] == 4 and resumed["resharded"] is False
    reference = run_training(cfg, Layout())
    losses_close(resumed["losses"], {k: v for k, v in reference["losses"].items() if k > 4})
