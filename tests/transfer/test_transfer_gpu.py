"""Replays on GPUs (NCCL), where the recorded batches of copies run as CUDA graphs
(``ckpt._transfer_net.Batch``): bitwise over calls whose values change, in place or committed, every
batch captured; and the same run on gloo ranks, where batches are plain launches (CI). The NCCL
variant needs two GPUs and is skipped elsewhere; it runs with NCCL's messages posted through the
group's own coalescing and through ``batch_isend_irecv``."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import ckpt
from ckpt import _transfer_exec as EX  # noqa: N812
from ckpt import _transfer_net as net
from ckpt.testing.ranks import gpu_count, launch


def test_a_batch_without_gpus_runs_its_copies_as_launches() -> None:
    before = torch.cuda.is_initialized()  # (False unless an earlier test in this process used CUDA)
    src = torch.arange(48, dtype=torch.bfloat16).view(6, 8)
    out = torch.zeros(6, 4, dtype=torch.bfloat16)
    b = net.Batch(*map(list, zip(net.wide(out, src[:, 2:6]), strict=True)))
    for step in range(3):
        src.add_(1)
        b.run()
        assert torch.equal(out, src[:, 2:6]), step
    assert b.graph is None and b.tried  # (no capture on CPU tensors; tried once)
    # nor any CUDA call: on a GPU machine a CPU transfer must leave CUDA alone (ranks forked later)
    assert torch.cuda.is_initialized() == before


def _moe_like(rank: int, world: int, device: str, in_place: bool, public: bool = False) -> None:
    import torch.distributed as dist

    dev = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        if public:  # NCCL's messages posted through batch_isend_irecv (a torch without the group's own coalescing)
            net._coalesces = lambda group, device: False
        # posted through the group's own coalescing, unless told not to
        assert net.NcclTransport(dist.group.WORLD).direct == (not public)
    captured: list[bool] = []
    capture = net._capture

    def counting(outs: list[torch.Tensor], datas: list[torch.Tensor]) -> object:
        g = capture(outs, datas)
        captured.append(g is not None)
        return g

    net._capture = counting
    importlib.import_module("ckpt._transfer_coord").PLANS.clear()  # (this test's plan is the only one then)
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = {"w13": (8, 256, 128), "w2": (8, 128, 96), "wo": (128, 128), "norm": (128,)}
    full = {k: torch.randn(s, generator=g, device=dev, dtype=torch.bfloat16) for k, s in shapes.items()}

    def piece(k: str, dim: int, zero: bool) -> ckpt.Shard:
        t = full[k]
        if t.dim() <= dim:
            return ckpt.Shard(torch.zeros_like(t) if zero else t.clone(), tuple(t.shape), (0,) * t.dim())
        n = t.shape[dim]
        a, b = n * rank // world, n * (rank + 1) // world
        local = t.narrow(dim, a, b - a)
        off = [0] * t.dim()
        off[dim] = a
        return ckpt.Shard(torch.zeros_like(local) if zero else local.contiguous(), tuple(t.shape), tuple(off))

    # experts split by expert -> by hidden rows / columns (strided both ways), wo by rows -> columns
    src_dims = {"w13": 0, "w2": 0, "wo": 0, "norm": 0}
    dst_dims = {"w13": 1, "w2": 2, "wo": 1, "norm": 9}  # (9: whole, on every rank)
    src = {k: piece(k, d, zero=False) for k, d in src_dims.items()}
    dst = {k: piece(k, d, zero=True) for k, d in dst_dims.items()}
    for step in range(5):
        if step:  # new values in the same tensors (a replay needs the same addresses)
            for t in full.values():
                t.normal_(generator=g)
            for k, d in src_dims.items():
                src[k].local.copy_(piece(k, d, zero=False).local)
        r = ckpt.transfer(src, dst, in_place=in_place, bucket_bytes=64 << 10, window=4, timeout=60)
        if device == "cuda":
            torch.cuda.synchronize()
        for k, d in dst.items():
            want = full[k][tuple(slice(o, o + n) for o, n in zip(d.offsets, d.local.shape, strict=True))]
            assert torch.equal(d.local, want), (step, k)
            d.local.fill_(-1)
        assert r.replayed == (step > 0), step
    # over NCCL a pair's packed buckets of a round travel joined (one message); over gloo each alone
    sends = next(iter(importlib.import_module("ckpt._transfer_coord").PLANS.values())).sched.sends
    assert any(b.join for b in sends) == (device == "cuda"), [(b.round, b.receiver, b.join) for b in sends]
    # on GPUs every recorded batch became a graph; on CPU none is tried (gloo: no replayed batch is on a GPU)
    assert (captured and all(captured)) if device == "cuda" else not any(captured), captured

    def fault(event: str, info: dict) -> None:
        if event == "pack" and rank == 1:
            raise RuntimeError("simulated sender failure")

    EX.FAULT = fault  # a failing rank after replayed calls: every rank raises its error; the next call works
    try:
        with pytest.raises(ckpt.CollectiveError, match=r"rank 1: RuntimeError: simulated sender failure"):
            ckpt.transfer(src, dst, in_place=in_place, bucket_bytes=64 << 10, window=4, timeout=60)
    finally:
        EX.FAULT = None
    r = ckpt.transfer(src, dst, in_place=in_place, bucket_bytes=64 << 10, window=4, timeout=60)
    if device == "cuda":
        torch.cuda.synchronize()
    for k, d in dst.items():
        want = full[k][tuple(slice(o, o + n) for o, n in zip(d.offsets, d.local.shape, strict=True))]
        assert torch.equal(d.local, want), ("after the failure", k)


@pytest.mark.multiproc
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda-public"])
def test_replays_stay_bitwise_and_on_nccl_run_their_copies_as_graphs(device: str, in_place: bool) -> None:
    if device.startswith("cuda") and gpu_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL)")
    launch(2, _moe_like, in_place, device.endswith("public"), device=device.split("-")[0], pass_device=True)


def _mixed_init(device: str) -> torch.device:
    """Join a group of one backend per device, as ``init_process_group()`` without a backend makes on
    a GPU machine."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method="env://", rank=rank, world_size=world)
    return torch.device("cuda", rank)


def _mixed(rank: int, world: int, device: torch.device) -> None:
    import torch.distributed as dist

    from ckpt._comm import Comm

    tr = importlib.import_module("ckpt.transfer")
    co = importlib.import_module("ckpt._transfer_coord")
    assert str(dist.get_backend()) == "cpu:gloo,cuda:nccl"
    assert co.nccl_data(Comm(None), True)  # the CUDA tensors go over NCCL, not ckpt's gloo side group
    assert net.NcclTransport(dist.group.WORLD).direct  # (posted through the group's own coalescing)
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(64, 48, generator=g, device=device)  # the same on both ranks
    src = {"w": ckpt.Shard(w[rank * 32: rank * 32 + 32].clone(), (64, 48), (rank * 32, 0))}
    dst = {"w": ckpt.Shard(torch.zeros(64, 24, device=device), (64, 48), (0, rank * 24))}
    for step in range(3):
        src["w"].local.add_(1)
        w.add_(1)
        ckpt.transfer(src, dst, timeout=60)
        torch.cuda.synchronize()
        assert torch.equal(dst["w"].local, w[:, rank * 24: rank * 24 + 24]), step
    _, keep = tr._BUFFERS[("world", world)]
    assert keep.pools and keep.pools[0].device.type == "cuda"  # NCCL's buffers, on the GPU


@pytest.mark.multiproc
def test_a_group_with_a_backend_per_device_sends_cuda_tensors_over_nccl() -> None:
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL)")
    launch(2, _mixed, device="cuda", pass_device=True, init=_mixed_init)
