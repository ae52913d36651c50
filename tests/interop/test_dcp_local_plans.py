"""Megatron-Core 0.16's ``torch_dist`` checkpoints keep every rank's local save plan in DCP's
``.metadata`` (``Metadata.all_local_plans``: ``SavePlan`` of ``WriteItem`` / ``TensorWriteData`` /
``ChunkStorageMetadata`` / ``TensorProperties``). ckpt must decode those as inert data (issue 30,
item 1): inspect, verify, import and load such a checkpoint bitwise, with no Megatron installed.

The fixture is made the way Megatron makes it: a real ``torch.distributed.checkpoint.save`` whose
planner's ``create_global_plan`` attaches the gathered local plans to the metadata it returns.
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.convert import import_checkpoint
from tests.helpers import random_state

runner = CliRunner()


class _MegatronLikePlanner(DefaultSavePlanner):
    """What megatron.core.dist_checkpointing.strategies.torch does: keep ``all_local_plans``."""

    def create_global_plan(self, all_plans: list[SavePlan]):  # type: ignore[no-untyped-def]
        global_plans, metadata = super().create_global_plan(all_plans)
        metadata.all_local_plans = all_plans
        return global_plans, metadata


def _save(path) -> dict[str, object]:
    state = {**random_state(0, {"decoder.layers.self_attention.linear_qkv.weight": (2, 6, 4),
                                "embedding.word_embeddings.weight": ((8, 4), torch.bfloat16)}),
             "optimizer.step": torch.tensor(7), "iteration": 12}
    dcp.save(state, checkpoint_id=str(path), planner=_MegatronLikePlanner(), no_dist=True)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    return state


def test_the_fixture_holds_real_local_plans(tmp_path):
    _save(tmp_path / "m")
    with open(tmp_path / "m" / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own file: torch's classes, as Megatron writes them
    plans = md.all_local_plans
    assert len(plans) == 1 and isinstance(plans[0], SavePlan)
    items = plans[0].items
    assert {type(i) for i in items} == {WriteItem}
    assert {i.type for i in items} >= {WriteItemType.TENSOR, WriteItemType.BYTE_IO}
    assert any(isinstance(i.tensor_data, TensorWriteData) for i in items)


def test_inspect_verify_load_and_import_read_local_plans(tmp_path):
    state = _save(tmp_path / "m")
    url = str(tmp_path / "m")
    m = ckpt.inspect(url)
    assert m.user_metadata["source"]["format"] == "megatron-torch_dist"
    assert set(m.tensors) == {k for k, v in state.items() if isinstance(v, torch.Tensor)}
    for args in (["inspect", url], ["verify", url]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        assert "allowlist" not in r.output
    want = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    for src in (url, str(tmp_path / "c")):
        if src != url:
            out = import_checkpoint(url, src)
            assert set(want) <= set(out.tensors)
        got = ckpt.load({k: torch.zeros_like(v) for k, v in want.items()}, src, strict=False)
        for k, v in want.items():  # bitwise, bf16 included
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(-1).view(torch.uint8),
                                                           v.view(-1).view(torch.uint8)), (src, k)


def test_plan_classes_are_built_inert(tmp_path):
    """Built from the file by NEWOBJ + BUILD only; a BUILD aimed at the allowed class itself is refused
    (nothing from the file changes torch's SavePlan for the process)."""
    from ckpt.formats import torch_pickle as tp

    hostile = b"ctorch.distributed.checkpoint.planner\nSavePlan\n(dS'usable'\nI00\nsb."
    with pytest.raises(ckpt.IntegrityError, match="^evil: "):
        tp.loads(hostile, what="evil", extra=tp.DCP_GLOBALS)
    assert SavePlan([]).usable is True
