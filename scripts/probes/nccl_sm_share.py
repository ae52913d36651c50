"""Probe (issue 33): does a device copy slow NCCL's message because it takes every SM, or because
they share the memory? A 1 GiB copy beside a 1 GiB message each way, on 2 ranks, milliseconds,
medians of 9:
- ``nccl``: the message alone; ``copy_torch``: torch's copy alone; ``beside_torch``: the two at once;
- ``copy_gN`` / ``beside_gN``: the same with a copy kernel limited to N thread blocks (Triton, a
  grid-stride loop), so that NCCL keeps the other SMs.
- ``copy_greenN`` / ``beside_greenN``: torch's copy on a stream of a CUDA green context of N SMs.
If ``beside_gN`` is near ``nccl`` for an N whose copy still fits in the message's time, a layout
change's copies could hide behind its messages; if not, the memory is what they share.

Run: python scripts/probes/nccl_sm_share.py   (CUDA and Triton, 2 GPUs; prints one line)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from scripts.probes._gpu import beside, run_ranks, timeit


def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, step, BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr convention
        start = tl.program_id(0).to(tl.int64) * BLOCK
        for base in range(start, n, step):
            offs = base + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    return copy


def _main(rank: int, world: int, device: torch.device) -> dict[str, float]:
    n = 1 << 30
    send = torch.ones(n, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    a = torch.randint(0, 255, (n // 8,), dtype=torch.int64, device=device)
    b = torch.empty_like(a)
    side = torch.cuda.Stream(device)
    peer = 1 - rank
    kern = _kernel()
    block = 1024

    def nccl() -> None:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]):
            w.wait()

    def copier(grid: int | None) -> Any:
        if grid is None:
            return lambda: b.copy_(a)
        return lambda: kern[(grid,)](a, b, a.numel(), grid * block, BLOCK=block, num_warps=4)

    def on(stream: Any, cp: Any, with_message: bool = True) -> Any:
        """The copy ``cp`` on ``stream``, with the message beside it (or alone)."""
        return lambda: beside(stream, cp, nccl if with_message else None)

    res: dict[str, float] = {"sms": torch.cuda.get_device_properties(device).multi_processor_count}
    res["nccl"] = timeit(nccl, warm=True)
    for grid in (None, 8, 16, 32, 64, 132, 264):
        name = "torch" if grid is None else f"g{grid}"
        cp = copier(grid)
        b.zero_()
        res["copy_" + name] = timeit(cp, warm=True)
        assert torch.equal(a, b), name
        res["beside_" + name] = timeit(on(side, cp), warm=True)
    # the copy on a stream of a green context of N SMs (torch's copy kernel; N SMs at most)
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError:
        GreenContext = None  # noqa: N806
    for sms in (32, 48, 64, 80, 96) if GreenContext is not None else ():
        try:
            gc = GreenContext.create(num_sms=sms, device_id=device.index)
            if hasattr(gc, "Stream"):
                gs = gc.Stream()
            else:
                gc.set_context()
                gs = torch.cuda.Stream(device)
                gc.pop_context()
        except Exception as e:  # noqa: BLE001 - a probe: say what was refused
            res[f"green{sms}_error"] = str(e)[:120]  # type: ignore[assignment]
            break
        b.zero_()
        res[f"copy_green{sms}"] = timeit(on(gs, lambda: b.copy_(a), with_message=False), warm=True)
        assert torch.equal(a, b)
        res[f"beside_green{sms}"] = timeit(on(gs, lambda: b.copy_(a)), warm=True)
    res["nccl_again"] = timeit(nccl, warm=True)
    return res


def run() -> int:
    return run_ranks(2, _main)


if __name__ == "__main__":
    sys.exit(run())
