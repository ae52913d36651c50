"""Probe (issue 33): could a layout change's data path reach NCCL's own send/recv on H100?

The 4 GB MoE of ``bench transfer-moe`` moved ``tp=2 -> ep=2`` in place on 2 ranks (one GPU each), the
data path alone (no planning, no exchanges), milliseconds, medians of 9:
- ``nccl``: the 1.14 GB each way as one message (what the bench compares with);
- ``joined``: today's path: every crossing piece packed into one buffer, one message, unpacked, the
  local copies on a side stream (eager);
- ``joined_graph``: the same captured as one CUDA graph, NCCL's operations included;
- ``direct``: each source piece sent from where it lies (every one is contiguous here: no packing),
  received where the destination is contiguous (``wqkv``), else into a staging buffer then unpacked;
  ``direct_graph``: as one CUDA graph; ``direct_experts_graph``: ``w13``'s 4 MB expert runs received
  in place too (one receive each);
- ``sends_only_graph``: the direct path's messages alone (its staging, no copies) as a graph;
- ``floor_graph``: the least copying a layout change needs beside one message (the local copies and
  the unpacking of strided destinations, from another buffer so nothing waits), as a graph;
  ``pieces_local_graph``: the pieces as messages (no packing) with the local copies beside.
Every variant is checked bitwise against the full tensors.

Run: python scripts/probes/nccl_graph.py [layers=17]   (CUDA only, 2 GPUs; prints one line)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from scripts.probes._gpu import beside, graphed, run_ranks, timeit

D, F, E = 2048, 1024, 16


def _main(rank: int, world: int, device: torch.device, layers: int) -> dict[str, float]:
    peer = 1 - rank
    g = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16
    full = {}
    for i in range(layers):
        full[f"{i}.wqkv"] = torch.randn(3 * D, D, generator=g, device=device, dtype=bf)
        full[f"{i}.wo"] = torch.randn(D, D, generator=g, device=device, dtype=bf)
        full[f"{i}.w13"] = torch.randn(E, 2 * F, D, generator=g, device=device, dtype=bf)
        full[f"{i}.w2"] = torch.randn(E, D, F, generator=g, device=device, dtype=bf)
    h, e2 = 3 * D // 2, E // 2

    def tp(k: str, t: torch.Tensor, r: int) -> torch.Tensor:  # rank r's piece under tp=2
        kind = k.split(".")[1]
        if kind == "wqkv":
            return t[r * h:(r + 1) * h]
        if kind == "wo":
            return t[:, r * D // 2:(r + 1) * D // 2]
        if kind == "w13":
            return t[:, r * F:(r + 1) * F]
        return t[:, :, r * F // 2:(r + 1) * F // 2]

    def ep(k: str, t: torch.Tensor, r: int) -> torch.Tensor:  # rank r's piece under ep=2
        return t[r * e2:(r + 1) * e2] if k.split(".")[1] in ("w13", "w2") else t

    src = {k: tp(k, t, rank).contiguous() for k, t in full.items()}
    dst = {k: torch.zeros_like(ep(k, t, rank)) for k, t in full.items()}
    want = {k: ep(k, t, rank) for k, t in full.items()}
    del full

    # per key: what this rank sends (a view of its source), the destination view that receives the
    # peer's piece, and the local copy (source view -> destination view)
    sends, recvs, local = [], [], []
    for k, s in src.items():
        d = dst[k]
        kind = k.split(".")[1]
        if kind in ("wqkv", "wo"):
            sends.append(s)
            recvs.append(tp(k, d, peer))
            local.append((tp(k, d, rank), s))
        else:
            sends.append(s[peer * e2:(peer + 1) * e2])
            recvs.append(tp(k, d, peer))
            local.append((tp(k, d, rank), s[rank * e2:(rank + 1) * e2]))
    nbytes = sum(t.numel() for t in sends) * 2
    out_buf = torch.empty(nbytes // 2, dtype=bf, device=device)
    in_buf = torch.empty_like(out_buf)

    def cut(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        out, o = [], 0
        for t in like:
            out.append(buf[o:o + t.numel()].view(t.shape))
            o += t.numel()
        return out

    packs, unpacks = cut(out_buf, sends), cut(in_buf, recvs)
    side = torch.cuda.Stream(device)

    def p2p(ops: list[tuple[Any, torch.Tensor]]) -> None:
        for w in dist.batch_isend_irecv([dist.P2POp(f, t, peer) for f, t in ops]):
            w.wait()

    def locals_beside(fn: Any) -> None:
        beside(side, lambda: torch._foreach_copy_([d for d, _ in local], [s for _, s in local]), fn)

    def nccl() -> None:
        p2p([(dist.isend, out_buf), (dist.irecv, in_buf)])

    def joined() -> None:
        def msgs() -> None:
            torch._foreach_copy_(packs, sends)
            p2p([(dist.isend, out_buf), (dist.irecv, in_buf)])
            torch._foreach_copy_(recvs, unpacks)
        locals_beside(msgs)

    staged = [(r, u) for r, u in zip(recvs, unpacks, strict=True) if not r.is_contiguous()]
    direct_in = [r if r.is_contiguous() else u for r, u in zip(recvs, unpacks, strict=True)]

    def direct() -> None:
        def msgs() -> None:
            p2p([(dist.isend, s) for s in sends] + [(dist.irecv, t) for t in direct_in])
            torch._foreach_copy_([r for r, _ in staged], [u for _, u in staged])
        locals_beside(msgs)

    # w13's expert runs in place too: one receive per expert
    exp_in, exp_staged = [], []
    for r, u in zip(recvs, unpacks, strict=True):
        if r.is_contiguous():
            exp_in.append(r)
        elif r.dim() == 3 and r[0].is_contiguous() and r[0].numel() * 2 >= (1 << 20):
            exp_in.extend(r[i] for i in range(r.shape[0]))
        else:
            exp_in.append(u)
            exp_staged.append((r, u))

    # the peer sends w13 per expert too when the receiver takes it per expert
    send_exp = []
    for s, r in zip(sends, recvs, strict=True):
        if not r.is_contiguous() and r.dim() == 3 and r[0].is_contiguous() and r[0].numel() * 2 >= (1 << 20):
            send_exp.extend(s[i] for i in range(s.shape[0]))
        else:
            send_exp.append(s)

    def direct_experts_fixed() -> None:
        def msgs() -> None:
            p2p([(dist.isend, s) for s in send_exp] + [(dist.irecv, t) for t in exp_in])
            if exp_staged:
                torch._foreach_copy_([r for r, _ in exp_staged], [u for _, u in exp_staged])
        locals_beside(msgs)

    def sends_only() -> None:
        p2p([(dist.isend, s) for s in sends] + [(dist.irecv, u) for u in unpacks])

    scratch = torch.empty_like(in_buf)
    scratch_views = cut(scratch, recvs)
    staged_idx = [i for i, r in enumerate(recvs) if not r.is_contiguous()]

    def floor() -> None:  # the least copying beside one message: the local copies and the unpacking, both beside it
        # (the first form of this row unpacked on the message's stream, after it: not a floor; 2026-11-28)
        beside(side, lambda: (torch._foreach_copy_([d for d, _ in local], [s for _, s in local]),
                              torch._foreach_copy_([recvs[i] for i in staged_idx],
                                                   [scratch_views[i] for i in staged_idx])), nccl)

    def pieces_local() -> None:  # no packing: the pieces as messages, the local copies beside
        locals_beside(sends_only)

    def check(name: str) -> None:
        torch.cuda.synchronize()
        bad = [k for k in dst if not torch.equal(dst[k], want[k])]
        if bad:
            res[name + "_WRONG"] = ",".join(bad[:4])  # type: ignore[assignment]
        for t in dst.values():
            t.zero_()

    res: dict[str, float] = {"gb_each_way": nbytes / 1e9, "ops_direct": len(sends) + len(direct_in),
                             "ops_experts": len(send_exp) + len(exp_in)}
    variants = {"joined": joined, "direct": direct, "direct_experts": direct_experts_fixed}
    nccl()
    res["nccl"] = timeit(nccl)
    for name, fn in variants.items():
        fn()
        check(name)
        res[name] = timeit(fn)
        check(name + " timed")
    for name, fn in [("nccl", nccl), *variants.items(), ("sends_only", sends_only), ("floor", floor),
                     ("pieces_local", pieces_local)]:
        try:
            rep = graphed(fn, device)
        except Exception as e:  # noqa: BLE001 - a probe: report what capture refused
            res[name + "_graph_error"] = str(e)[:200]  # type: ignore[assignment]
            continue
        if name in variants:
            check(name + " warm")
            rep()
            check(name + "_graph")
        res[name + "_graph"] = timeit(rep)
    return res


def run() -> int:
    return run_ranks(2, _main, int(sys.argv[1]) if len(sys.argv) > 1 else 17)


if __name__ == "__main__":
    sys.exit(run())
