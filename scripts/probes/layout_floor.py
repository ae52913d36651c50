"""Probe (issue 33): the floor of ``bench transfer-moe``'s layout change in place on 2 or 4 GPUs.

The MoE of ``bench transfer-moe`` moved from its ``same-src`` layout to ``same-dst`` (``tp=2 -> ep=2``
on 2 ranks, ``tp=2,ep=2 -> tp=4`` on 4), the data path alone, milliseconds, medians of 9:
- ``nccl``: one batch of one send and one receive per rank pair with the pair's bytes (what the bench
  compares with), eager; ``nccl_graph``: the same as a CUDA graph;
- ``floor_graph``: those messages with only the copies the layout change cannot avoid beside them
  (local copies; packing of sent pieces that are not contiguous in their source; unpacking of received
  pieces not contiguous in their destination), as one CUDA graph, the copies reading and writing
  scratch buffers so that nothing waits for anything: an optimistic floor for any transfer over NCCL.
Each byte comes from its lowest-ranked holder and none is sent to a rank that holds it (as transfer).

Run: python scripts/probes/layout_floor.py [size_gb=8]   (CUDA; every GPU of the host, 2 or 4)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from bench.transfer import raw_baselines
from bench.transfer_moe import box, layers_for, layouts, shapes
from ckpt.testing.ranks import gpu_count
from scripts.probes._gpu import beside, graphed, run_ranks, timeit


def _inter(a: tuple[tuple[int, ...], ...], b: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...] | None:
    (ao, al), (bo, bl) = a, b
    off = tuple(max(x, y) for x, y in zip(ao, bo, strict=True))
    end = tuple(min(x + n, y + m) for x, n, y, m in zip(ao, al, bo, bl, strict=True))
    if any(e <= o for o, e in zip(off, end, strict=True)):
        return None
    return off, tuple(e - o for o, e in zip(off, end, strict=True))


def _view(t: torch.Tensor, at: tuple[tuple[int, ...], ...], region: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    (to, _), (ro, rl) = at, region
    return t[tuple(slice(o - b, o - b + n) for o, b, n in zip(ro, to, rl, strict=True))]


def _main(rank: int, world: int, device: torch.device, size_gb: float) -> dict[str, float]:
    lay = layouts(world)
    sp, dp = lay["same-src"], lay["same-dst"]
    shp = shapes(layers_for(size_gb, 2))
    src: dict[str, torch.Tensor] = {}
    dst: dict[str, torch.Tensor] = {}
    for k, s in shp.items():
        src[k] = torch.ones(box(k, s, *sp[rank])[1], dtype=torch.bfloat16, device=device)
        dst[k] = torch.empty(box(k, s, *dp[rank])[1], dtype=torch.bfloat16, device=device)
    out_n, in_n = [0] * world, [0] * world
    local: list[tuple[torch.Tensor, torch.Tensor]] = []
    pack_n = unpack_n = 0  # elements that must be gathered from strided sources / scattered into strided targets
    packs: list[torch.Tensor] = []
    unpacks: list[torch.Tensor] = []
    for k, s in shp.items():
        holders: dict[Any, list[int]] = {}
        for r in range(world):
            holders.setdefault(box(k, s, *sp[r]), []).append(r)
        for r in range(world):
            want = box(k, s, *dp[r])
            for have, hs in holders.items():
                part = _inter(have, want)
                if part is None:
                    continue
                n = 1
                for x in part[1]:
                    n *= x
                if r in hs:
                    if r == rank:
                        local.append((_view(dst[k], want, part), _view(src[k], have, part)))
                    continue
                if hs[0] == rank:
                    out_n[r] += n
                    v = _view(src[k], have, part)
                    if not v.is_contiguous():
                        pack_n += n
                        packs.append(v)
                if r == rank:
                    in_n[hs[0]] += n
                    v = _view(dst[k], want, part)
                    if not v.is_contiguous():
                        unpack_n += n
                        unpacks.append(v)
    pairs = [[0] * world for _ in range(world)]  # bytes: this rank's row and column are all it reads
    for peer in range(world):
        pairs[rank][peer], pairs[peer][rank] = out_n[peer] * 2, in_n[peer] * 2
    nccl = raw_baselines(rank, world, device, pairs)["send/recv"]  # the bench's own baseline
    scratch = torch.ones(max(pack_n, unpack_n, 1), dtype=torch.bfloat16, device=device)
    sink = torch.empty_like(scratch)

    def flat(views: list[torch.Tensor], buf: torch.Tensor) -> list[torch.Tensor]:
        out, o = [], 0
        for v in views:
            out.append(buf[o:o + v.numel()].view(v.shape))
            o += v.numel()
        return out

    pack_to, unpack_from = flat(packs, sink), flat(unpacks, scratch)
    side = torch.cuda.Stream(device)

    def copies() -> None:
        if local:
            torch._foreach_copy_([d for d, _ in local], [s for _, s in local])
        if packs:
            torch._foreach_copy_(pack_to, packs)
        if unpacks:
            torch._foreach_copy_(unpacks, unpack_from)

    def floor() -> None:
        beside(side, copies, nccl)

    local_n = sum(d.numel() for d, _ in local)
    res = {"gb_out": sum(out_n) * 2 / 1e9, "gb_in": sum(in_n) * 2 / 1e9, "gb_local": local_n * 2 / 1e9,
           "gb_pack": pack_n * 2 / 1e9, "gb_unpack": unpack_n * 2 / 1e9}
    res["nccl"] = timeit(nccl, warm=True)
    res["nccl_graph"] = timeit(graphed(nccl, device), warm=True)
    res["floor_graph"] = timeit(graphed(floor, device), warm=True)
    res["nccl_again"] = timeit(nccl, warm=True)
    # the slowest rank decides: the max over ranks of each time
    t = torch.tensor([res[k] for k in ("nccl", "nccl_graph", "floor_graph", "nccl_again")], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    for k, v in zip(("nccl", "nccl_graph", "floor_graph", "nccl_again"), t.tolist(), strict=True):
        res[k] = v
    res["floor_x_nccl"] = res["nccl"] / res["floor_graph"]
    return res


def run() -> int:
    size = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    world = gpu_count()  # (nvidia-smi: CUDA stays uninitialised before the fork)
    return run_ranks(world, _main, size, label=f"{world} ranks, {size} GB: ")


if __name__ == "__main__":
    sys.exit(run())
