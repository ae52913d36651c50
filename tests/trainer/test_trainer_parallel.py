"""TP / EP / PP / DP + ZeRO-1 on real gloo groups (forked ranks) against the single-process model.

Two levels of evidence:

- after one forward/backward, every rank's reduced gradient (its ZeRO range of its block) equals the
  same range of the gradient of the plain, unsplit ``MoEForCausalLM`` on the whole global batch
  (~1e-7 relative);
- over 10 optimizer steps the per-step loss equals the single-process run (see LOSS_TOL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from ckpt.layout import Layout
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.data import SampleSource, rank_batch
from ckpt.trainer.model import CONFIGS, MoEForCausalLM
from ckpt.trainer.pp import ForwardBackward
from ckpt.trainer.train import build, train
from ckpt.trainer.zero import LRSchedule
from tests.dist_utils import run_ranks
from tests.trainer.trainer_utils import assert_slots_match, losses_close, run_training

CFG = TrainConfig(steps=10)
PADDED = dataclasses.replace(CFG, model=dataclasses.replace(CONFIGS["tiny"], vocab_size=255))  # 128 + 127 rows


def _grad_check(rank: int, world: int, cfg: TrainConfig, layout: Layout) -> None:
    ctx, pm, opt, _ = build(cfg, layout)
    src = SampleSource(cfg.seq_len, cfg.seed)
    ForwardBackward(pm, cfg.microbatches, cfg.schedule)(
        rank_batch(src, 0, cfg.global_batch, ctx.data_rank, ctx.data_world))
    opt.reduce_tp_partial()
    grads = {kind: opt.reduce(kind) for kind in opt.slots}

    ref = MoEForCausalLM(cfg.model)
    ref.init_weights(cfg.seed)
    ids = src.batch(0, cfg.global_batch)
    ref(ids, labels=ids)[1].backward()  # type: ignore[index]
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    seen = assert_slots_match(opt, grads, ref_grads)
    # the rank holds exactly its pipeline stage's parameters
    per_stage = {n for n in ref_grads if _stage(n, cfg, layout) == ctx.coord.pp}
    assert seen == per_stage


def _stage(name: str, cfg: TrainConfig, layout: Layout) -> int:
    from ckpt.resharders.rules import MOE_RULES

    return MOE_RULES.stage_of(name, cfg.model.num_hidden_layers, layout.pp)


@pytest.mark.parametrize("layout,cfg", [
    ("dp=2,zero=1", CFG),
    ("tp=2", CFG),
    ("tp=2", PADDED),
    ("ep=2", CFG),
    ("pp=2", dataclasses.replace(CFG, schedule="gpipe")),
    ("pp=2", CFG),
    ("tp=2,ep=2,zero=1", CFG),
    ("dp=2,pp=2,zero=1", CFG),
], ids=["dp2", "tp2", "tp2-padded-vocab", "ep2", "pp2-gpipe", "pp2-1f1b", "tp2-ep2", "dp2-pp2"])
@pytest.mark.slow
@pytest.mark.multiproc
def test_gradients_equal_single_process_blocks(layout: str, cfg: TrainConfig) -> None:
    lay = Layout.parse(layout)
    run_ranks(lay.world_size, _grad_check, cfg, lay)


@pytest.fixture
def one_thread() -> Iterator[None]:
    # In-process compute: two OpenMP threads on two busy cores cost 10x (the forked ranks use one).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
def test_single_process_trainer_equals_plain_torch_loop() -> None:
    """The trainer's one-rank path is an ordinary AdamW loop (torch.optim.AdamW + clip_grad_norm_)."""
    cfg = CFG
    mine = train(cfg, Layout())
    model = MoEForCausalLM(cfg.model)
    model.init_weights(cfg.seed)
    params = dict(model.named_parameters())
    groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    schedule = LRSchedule(cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
    src = SampleSource(cfg.seq_len, cfg.seed)
    losses = {}
    for step in range(cfg.steps):
        ids = src.batch(step * cfg.global_batch, cfg.global_batch)
        loss = model(ids, labels=ids)[1]  # type: ignore[index]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=False)
        for g in opt.param_groups:
            g["lr"] = schedule.lr(step)
        opt.step()
        opt.zero_grad()
        losses[step + 1] = float(loss.detach())
    torch.testing.assert_close(list(mine.losses.values()), list(losses.values()), rtol=1e-6, atol=1e-6)
    assert mine.pm is not None
    for spec in mine.pm.specs:
        torch.testing.assert_close(spec.param.data, params[spec.name].data, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def single() -> dict[int, float]:
    return run_training(CFG, Layout())["losses"]


@pytest.mark.parametrize("layout", [
    "dp=2,zero=1", "dp=2,zero=0", "tp=2", "ep=2", "pp=2", "tp=2,ep=2,zero=1", "dp=2,pp=2,zero=1", "ep=2,pp=2",
    "tp=2,ep=2,pp=2,zero=1",
])
@pytest.mark.slow
@pytest.mark.multiproc
def test_losses_match_single_process(layout: str, single: dict[int, float]) -> None:
    lay = Layout.parse(layout)
    cfg = dataclasses.replace(CFG, schedule="gpipe") if layout == "ep=2,pp=2" else CFG
    losses_close(run_training(cfg, lay)["losses"], single)


@pytest.mark.slow
@pytest.mark.multiproc
def test_padded_vocab_losses_match_single_process() -> None:
    losses_close(run_training(PADDED, Layout(tp=2, dp=2, zero=1))["losses"],
                 run_training(PADDED, Layout())["losses"])
