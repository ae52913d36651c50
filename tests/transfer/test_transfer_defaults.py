"""``ckpt.transfer``'s bucket size and window when the caller names none: 64 MiB x 4 over gloo,
512 MiB x 1 over NCCL (fewer messages and rounds where posting them costs most; docs/TRANSFER.md),
decided by the coordinator from the same question every rank's transport asks
(``ckpt._transfer_coord.nccl_data``). The plan is checked without processes, from the ranks' real
declarations (300 MiB declared from ``torch.empty``: no page is touched)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

import ckpt
from tests.dist_utils import run_ranks

tr = importlib.import_module("ckpt.transfer")  # (the module: ``ckpt.transfer`` is also the function)
co = importlib.import_module("ckpt._transfer_coord")

MiB = 1 << 20


def test_sizes_are_the_callers_else_the_data_paths() -> None:
    assert tr.sizes(None, None, nccl=False) == (64 * MiB, 4)
    assert tr.sizes(None, None, nccl=True) == (512 * MiB, 1)
    assert tr.sizes(8 * MiB, None, nccl=True) == (8 * MiB, 1)
    assert tr.sizes(None, 7, nccl=False) == (64 * MiB, 7)


def _got(gpu: bool) -> list[dict]:
    """Two ranks' declarations: rank 0 holds a 300 MiB tensor, rank 1 wants it."""
    w = torch.empty(300 * MiB // 4)
    out = []
    for src, dst in (({"w": w}, None), (None, {"w": torch.empty_like(w)})):
        srcs, dsts = tr.declared(src, dst, None)
        decl = tr._declaration(srcs, dsts, tr.Options(), None, [], [])
        decl["nccl"] = gpu  # (as if the tensors were on GPUs)
        out.append(decl)
    return out


@pytest.mark.parametrize(("nccl", "buckets", "rounds"), [(False, 5, 2), (True, 1, 1)])
def test_the_coordinator_plans_with_the_data_paths_defaults(monkeypatch: pytest.MonkeyPatch, nccl: bool,
                                                            buckets: int, rounds: int) -> None:
    monkeypatch.setattr(co, "nccl_data", lambda comm, gpu: gpu)
    comm = SimpleNamespace(world=2)
    replies = co.plan_reply(_got(nccl), comm, bucket_bytes=None, window=None, strict=True, cast=False,  # type: ignore[arg-type]
                             delta=False, min_part=tr.MIN_PART, group=None)
    assert replies[0]["buckets"] == buckets and replies[0]["rounds"] == rounds  # 300 MiB in 64 / 512 MiB buckets
    assert replies[0]["nccl"] is nccl
    # the caller's own values win over either default
    replies = co.plan_reply(_got(nccl), comm, bucket_bytes=100 * MiB, window=1, strict=True, cast=False,  # type: ignore[arg-type]
                             delta=False, min_part=tr.MIN_PART, group=None)
    assert replies[0]["buckets"] == 3 and replies[0]["rounds"] == 3


def _gloo(rank: int, world: int) -> None:
    """On a gloo group the data path is gloo whatever the tensors (so are the defaults); the
    transfer with default knobs is bitwise."""
    from ckpt._comm import Comm

    assert not co.nccl_data(Comm(None), gpu=True)
    w = torch.arange(64, dtype=torch.float32).view(8, 8)
    src = {"w": ckpt.Shard(w[rank * 4: rank * 4 + 4].clone(), (8, 8), (rank * 4, 0))}
    dst = {"w": ckpt.Shard(torch.zeros(8, 4), (8, 8), (0, rank * 4))}
    r = ckpt.transfer(src, dst, timeout=60)
    assert torch.equal(dst["w"].local, w[:, rank * 4: rank * 4 + 4]) and r.buckets == 2


@pytest.mark.multiproc
def test_on_gloo_the_data_path_is_gloo_and_the_defaults_move_bitwise() -> None:
    run_ranks(2, _gloo)


@pytest.mark.parametrize(("name", "nccl"), [("nccl", True), ("gloo", False), ("cpu:gloo,cuda:nccl", True),
                                            ("cuda:nccl,cpu:gloo", True), ("cpu:gloo,cuda:gloo", False),
                                            ("cpu:gloo", False), ("NCCL", True), ("ucc", False)])
def test_the_nccl_data_path_is_taken_on_any_group_that_sends_cuda_tensors_over_nccl(name: str, nccl: bool) -> None:
    assert tr.nccl_backend(name) is nccl
