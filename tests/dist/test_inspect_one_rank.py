"""``ckpt.inspect`` is not collective: one rank of a running group may call it alone (it waited for
the others in the manifest broadcast, and a ``if rank == 0: print(ckpt.inspect(url))`` hung)."""

from __future__ import annotations

import pytest
import torch

import ckpt
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.multiproc


def _only_one_rank_inspects(rank: int, world: int, path: str) -> None:
    if rank == world - 1:
        m = ckpt.inspect(path)
        assert m.step == 3 and set(m.tensors) == {"w"}


def test_one_rank_alone_may_inspect(tmp_path) -> None:
    ckpt.save({"w": torch.arange(6.0)}, str(tmp_path / "c"), step=3)
    run_ranks(2, _only_one_rank_inspects, str(tmp_path / "c"), timeout=60)
