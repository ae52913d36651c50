"""The hybrid MiniMax family (``--config hybrid-tiny``) in the trainer, on real gloo groups (forked ranks).

- after one forward/backward, every rank's reduced gradient (its ZeRO range of its block) equals the
  same range of the unsplit :class:`~ckpt.trainer.hybrid.HybridForCausalLM`'s gradient on the whole
  batch within fp32 tolerance, under sp (LASP-2 linear layers, LASP-2H softmax layers, zigzag
  chunks), tp (lightning heads split), ep, pp and combinations;
- 10 optimizer steps: losses within ``LOSS_TOL`` of one process;
- a rank killed under sp=2 (``ckpt train`` through torchrun) restarts, resumes and ends bitwise
  equal to an uninterrupted run;
- a checkpoint saved under sp=2 resumes under tp=2 (resharded on load) within tolerance, reshards
  with ``ckpt reshard`` without ``--rules`` (its rules are recorded), and exports with ``ckpt
  export-hf`` to a directory that transformers' ``MiniMaxForCausalLM`` loads and whose logits equal
  the trainer's model's; imported back (``import-hf``), ``--init-from`` starts from those weights;
- the trainer's zigzag split (``sp.split_batch``) and LASP-2's zigzag chunks are the same cut;
- layouts the hybrid model cannot run fail with a LayoutError before any process starts.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.errors import LayoutError, MismatchError
from ckpt.layout import Layout
from ckpt.manager import step_dir
from ckpt.trainer.checkpoint import _check_model_config, load_full_model
from ckpt.trainer.config import TrainConfig, model_config
from ckpt.trainer.data import SampleSource, rank_batch
from ckpt.trainer.hybrid import HYBRID_CONFIGS, HybridForCausalLM
from ckpt.trainer.launch import launch
from ckpt.trainer.pp import ForwardBackward
from ckpt.trainer.sp import split_batch
from ckpt.trainer.train import build
from tests.dist_utils import run_ranks
from tests.trainer.trainer_utils import (
    assert_killed_cli_run_resumes_bitwise,
    assert_slots_match,
    checkpoint_tensors,
    losses_close,
    run_training,
)

TINY = HYBRID_CONFIGS["hybrid-tiny"]
# 128 tokens: 8 lightning blocks of 16, so sp=4 gets zigzag chunks of one block and sp=2 of two. A
# larger init than the default 0.02 makes every sub-layer (the linear layers too) move the loss.
GRAD_CFG = TrainConfig(model=dataclasses.replace(TINY, initializer_range=0.1), seq_len=128, steps=10)
# ``ckpt train --config hybrid-tiny --seq-len 64``: the smallest sequence sp=2 accepts.
CFG = TrainConfig(model=TINY, seq_len=64, steps=10)


def _grad_check(rank: int, world: int, cfg: TrainConfig, layout: Layout) -> None:
    ctx, pm, opt, _ = build(cfg, layout)
    src = SampleSource(cfg.seq_len, cfg.seed)
    ids = rank_batch(src, 0, cfg.global_batch, ctx.data_rank, ctx.data_world)
    fb = ForwardBackward(pm, cfg.microbatches, cfg.schedule)
    fb(*split_batch(ids, ctx.sp)) if layout.sp > 1 else fb(ids)
    opt.reduce_tp_partial()
    grads = {kind: opt.reduce(kind) for kind in opt.slots}

    ref = HybridForCausalLM(cfg.model)  # type: ignore[arg-type]
    ref.init_weights(cfg.seed)
    full = src.batch(0, cfg.global_batch)
    ref(full, labels=full)[1].backward()  # type: ignore[index]
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    seen = assert_slots_match(opt, grads, ref_grads)
    assert seen == {n for n in ref_grads
                    if pm.rules.stage_of(n, cfg.model.num_hidden_layers, layout.pp) == ctx.coord.pp}
    # not a vacuous comparison: the linear layers' weights get real gradients
    qkv = ref_grads["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv is not None and float(qkv.abs().max()) > 1e-4


@pytest.mark.parametrize("layout", [
    "sp=2", "sp=4,zero=1", "tp=2", "ep=2,zero=1", "pp=2", "sp=2,tp=2,zero=1", "sp=2,ep=2,zero=1",
    "sp=2,pp=2,zero=1", "sp=2,dp=2,zero=0",
])
@pytest.mark.slow
@pytest.mark.multiproc
def test_gradients_equal_single_process_blocks(layout: str) -> None:
    lay = Layout.parse(layout)
    run_ranks(lay.world_size, _grad_check, GRAD_CFG, lay)


@pytest.mark.multiproc
def test_gradients_with_sequence_sharded_moe_under_sp_and_tp() -> None:
    cfg = dataclasses.replace(GRAD_CFG, moe_sequence_shard=True)
    run_ranks(4, _grad_check, cfg, Layout(sp=2, tp=2, zero=1))


@pytest.fixture(scope="module")
def single() -> dict[int, float]:
    return run_training(CFG, Layout())["losses"]


@pytest.mark.parametrize("layout", ["sp=2,zero=1", "tp=2,zero=1", "ep=2,zero=1", "sp=2,tp=2,zero=1",
                                    "sp=2,pp=2,zero=1"])
@pytest.mark.slow
@pytest.mark.multiproc
def test_losses_match_single_process(layout: str, single: dict[int, float]) -> None:
    losses_close(run_training(CFG, Layout.parse(layout))["losses"], single)


SP = Layout(sp=2, zero=1)
CUT = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Under sp=2: 8 steps saved every 4, and the same run stopped after step 4."""
    root = tmp_path_factory.mktemp("hybrid")
    cfg = dataclasses.replace(CFG, steps=8, save_every=CUT)
    run_training(dataclasses.replace(cfg, ckpt_dir=str(root / "full")), SP)
    run_training(dataclasses.replace(cfg, ckpt_dir=str(root / "cut"), stop_after=CUT), SP)
    return root


@pytest.mark.multiproc
def test_checkpoint_records_the_hybrid_rules_and_adapter(runs: Path) -> None:
    meta = ckpt.inspect(str(runs / "cut" / step_dir(CUT))).user_metadata
    assert meta["rules"] == "hf-decoder" and meta["hf_adapter"] == "minimax" and meta["names"] == "ckpt"
    assert meta["model_config"] == TINY.to_dict() and meta["hf_config"] == TINY.to_hf_config()


@pytest.mark.multiproc
def test_resume_under_another_layout(runs: Path, tmp_path: Path) -> None:
    shutil.copytree(runs / "cut" / step_dir(CUT), tmp_path / "run" / step_dir(CUT))
    cfg = dataclasses.replace(CFG, steps=8, save_every=CUT, ckpt_dir=str(tmp_path / "run"))
    resumed = run_training(cfg, Layout(tp=2, zero=1))
    assert resumed["start"] == CUT and resumed["resharded"] is True
    full = run_training(dataclasses.replace(cfg, ckpt_dir=None), SP)["losses"]
    losses_close(resumed["losses"], {k: v for k, v in full.items() if k > CUT})
    # the MoE model refuses it by name rather than by missing tensors
    with pytest.raises(MismatchError, match="a checkpoint of the hybrid family, this run trains the MoE model"):
        _check_model_config(ckpt.inspect(str(tmp_path / "run" / step_dir(CUT))), TrainConfig(), "run")


@pytest.mark.multiproc
def test_reshard_needs_no_rules_file(runs: Path, tmp_path: Path) -> None:
    src = str(runs / "cut" / step_dir(CUT))
    r = CliRunner().invoke(app, ["reshard", src, str(tmp_path / "tp2"), "--to", "tp=2,ep=2,zero=1", "--json"])
    assert r.exit_code == 0, r.output
    assert ckpt.inspect(str(tmp_path / "tp2")).layout == Layout(tp=2, ep=2, zero=1).to_dict()
    a, b = checkpoint_tensors(src), checkpoint_tensors(str(tmp_path / "tp2"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the layout check knows the hybrid model: 4 heads and 2 kv heads
    r = CliRunner().invoke(app, ["plan", src, "--to", "tp=4"])
    assert r.exit_code != 0 and "choose tp in [1, 2]" in r.output


@pytest.mark.multiproc
def test_export_hf_reproduces_the_trainers_logits(runs: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    url = str(runs / "full" / step_dir(8))
    r = CliRunner().invoke(app, ["export-hf", url, str(tmp_path / "hf")])
    assert r.exit_code == 0, r.output
    hf, info = transformers.MiniMaxForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    model = load_full_model(url)
    assert isinstance(model, HybridForCausalLM)
    ids = SampleSource(CFG.seq_len, seed=7).batch(0, 2)
    with torch.no_grad():
        ours, theirs = model.eval()(ids), hf.eval()(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5
    assert theirs.std() > 0.05  # trained logits, not a degenerate comparison
    # and back: import-hf, then --init-from it: the first step's loss is the exported model's loss
    r = CliRunner().invoke(app, ["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")])
    assert r.exit_code == 0, r.output
    first = run_training(dataclasses.replace(CFG, steps=1, init_from=str(tmp_path / "back")), SP)["losses"][1]
    batch = SampleSource(CFG.seq_len, CFG.seed).batch(0, CFG.global_batch)
    with torch.no_grad():
        want = float(model(batch, labels=batch)[1])  # type: ignore[index]
    assert first == pytest.approx(want, rel=1e-6)


@pytest.mark.slow
@pytest.mark.multiproc
def test_killed_sp_rank_restarts_and_resumes_bitwise(tmp_path: Path) -> None:
    assert_killed_cli_run_resumes_bitwise(
        tmp_path, ["--config", "hybrid-tiny", "--sp", "2", "--seq-len", "64"],
        TrainConfig(model=TINY, seq_len=64, steps=6, save_every=2, device="cpu"), Layout(sp=2, zero=1), fail_at=4)


def test_trainer_and_lasp2_cut_the_sequence_the_same_way() -> None:
    """sp.split_batch's zigzag slices (what the trainer feeds, LASP-2H's positions) are the chunks
    lasp.chunk_ids("zigzag") gives each rank, in the same order: linear and softmax layers agree."""
    from ckpt.trainer.lasp import shard_sequence as lasp_shard
    from ckpt.trainer.sp import zigzag_positions, zigzag_split

    x = torch.arange(2 * 64).view(2, 64)
    for size in (2, 4):
        for i in range(size):
            assert torch.equal(zigzag_split(x, size, i), lasp_shard(x, 1, i, size, "zigzag"))
            assert torch.equal(zigzag_positions(64, size, i), lasp_shard(torch.arange(64), 0, i, size, "zigzag"))


def test_layouts_the_hybrid_cannot_run_are_rejected_before_processes_start(tmp_path: Path) -> None:
    hybrid = TrainConfig(model=model_config("hybrid-tiny"))  # seq_len 32: two 16-token blocks
    with pytest.raises(LayoutError, match=r"sequence length 32 does not split into 4 zigzag chunks of whole "
                                          r"16-token blocks \(sp=2\); use a multiple of 64"):
        hybrid.check_layout(Layout(sp=2))
    with pytest.raises(LayoutError, match=r"tp=4 does not split the hybrid model's heads .* tp can be \[1, 2\]"):
        hybrid.check_layout(Layout(tp=4))
    with pytest.raises(LayoutError, match=r"ep=3 does not divide num_local_experts=4"):
        dataclasses.replace(hybrid, global_batch=6).check_layout(Layout(ep=3))
    with pytest.raises(LayoutError, match="sequence length 96 does not split"):
        launch(dataclasses.replace(hybrid, seq_len=96, device="cpu"), Layout(sp=2),
               log=str(tmp_path / "never.log"))
    assert not (tmp_path / "never.log").exists()
    result = CliRunner().invoke(app, ["train", "--config", "hybrid-tiny", "--sp", "2", "--steps", "2"])
    assert result.exit_code == 5 and "sequence length 32 does not split" in result.output
    result = CliRunner().invoke(app, ["train", "--config", "hybrid-huge", "--steps", "2"])
    assert result.exit_code == 5 and "'hybrid-tiny'" in result.output
