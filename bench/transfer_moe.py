"""Live resharding of a mixture-of-experts model: ``ckpt.transfer`` from ``tp=2,ep=2`` to ``tp=4``
(every rank sends and receives) and from ``tp=2`` on the first half of the ranks to ``ep=2`` on the
second half (a disjoint group), against ``ckpt.save`` + ``ckpt.load``, against gathering each tensor
whole on rank 0 and broadcasting it (the common baseline), and against the backend's own send/recv of
the same bytes between the same rank pairs. Medians of repeats; checked bitwise once.

    python -m bench transfer-moe [--ranks 4 (or 2)] [--size-gb 8] [--dtype bf16] [--repeats 3]
                                 [--device cpu|cuda] [--in-place] [--profile] [--bucket-mb M] [--window N]
                                 [--json F]

The model: ``layers`` blocks of attention (``wqkv`` [3d, d], split by rows under tp; ``wo`` [d, d],
by columns), experts (``w13`` [E, 2f, d] and ``w2`` [E, d, f]: experts split under ep, ``f`` under
tp) and a norm (replicated); attention is replicated across the ep groups of ``tp=2,ep=2``, so
``transfer`` picks one holder of each byte. ``--profile``: rank 0's Python profile of the timed
transfers (top functions by cumulative time) goes into the JSON, to see where the time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import ckpt
from bench.common import fmt, gbps, markdown_table, median, print_table, timed_collective
from bench.ranks import cuda_sync, fork_ranks, gloo_ranks
from bench.transfer import cut, raw_baselines, time_baselines

D, F, E = 2048, 1024, 16  # model width, expert hidden size, experts (at --size-gb 8: 34 layers)


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        out.update({f"l{i}.wqkv": (3 * D, D), f"l{i}.wo": (D, D), f"l{i}.w13": (E, 2 * F, D), f"l{i}.w2": (E, D, F),
                    f"l{i}.norm": (D,)})
    return out


def layers_for(size_gb: float, itemsize: int) -> int:
    per = sum(torch.Size(s).numel() for s in shapes(1).values()) * itemsize
    return max(1, round(size_gb * 1e9 / per))


def box(key: str, shape: tuple[int, ...], tp: tuple[int, int], ep: tuple[int, int]) -> tuple[tuple[int, ...], ...]:
    """(offsets, lengths) of a rank's piece of ``key`` at tp index/size ``tp`` and ep index/size ``ep``."""
    off, ln = [0] * len(shape), list(shape)
    dim = {"wqkv": 0, "wo": 1, "w13": 1, "w2": 2}.get(key.split(".")[1])
    if dim is not None and tp[1] > 1:
        off[dim], end = cut(shape[dim], tp[1], tp[0])
        ln[dim] = end - off[dim]
    if key.endswith((".w13", ".w2")) and ep[1] > 1:
        off[0], end = cut(shape[0], ep[1], ep[0])
        ln[0] = end - off[0]
    return tuple(off), tuple(ln)


def layouts(world: int) -> dict[str, dict[int, tuple[tuple[int, int], tuple[int, int]]]]:
    """Per mode and role, rank -> ((tp index, tp size), (ep index, ep size)). On 2 ranks ``same`` is
    ``tp=2`` -> ``ep=2`` (``tp=2,ep=1`` -> ``tp=2`` would move nothing) and ``disjoint`` the whole
    model from rank 0 to rank 1 (contiguous pieces: the data path alone)."""
    h = world // 2
    return {
        "same-src": {r: ((r % 2, 2), (r // 2, world // 2)) for r in range(world)},  # tp=2, ep=world/2
        # tp=world (2 ranks: ep=2)
        "same-dst": {r: ((r, world), (0, 1)) if world > 2 else ((0, 1), (r, 2)) for r in range(world)},
        "disjoint-src": {r: ((r, h), (0, 1)) for r in range(h)},  # tp=h on the first half
        "disjoint-dst": {r: ((0, 1), (r - h, h)) for r in range(h, world)},  # ep=h on the second half
    }


def _state(full: dict[str, torch.Tensor], place: tuple[tuple[int, int], tuple[int, int]] | None, device: torch.device,
           zero: bool) -> dict[str, Any] | None:
    if place is None:
        return None
    out = {}
    for k, t in full.items():
        off, ln = box(k, tuple(t.shape), *place)
        piece = t[tuple(slice(o, o + n) for o, n in zip(off, ln, strict=True))]
        local = torch.zeros(ln, dtype=t.dtype, device=device) if zero else piece.to(device).contiguous()
        out[k] = ckpt.Shard(local, tuple(t.shape), off)
    return out


def _pair_bytes(full: dict[str, torch.Tensor], src: dict[int, Any], dst: dict[int, Any], world: int
                ) -> list[list[int]]:
    """bytes[s][r] a sender sends a receiver: each distinct source piece once, none where the receiver
    holds it itself (as transfer does), else from its lowest-ranked holder."""
    out = [[0] * world for _ in range(world)]
    for k, t in full.items():
        holders: dict[tuple[tuple[int, ...], ...], list[int]] = {}
        for s in sorted(src):
            holders.setdefault(box(k, tuple(t.shape), *src[s]), []).append(s)
        for r, rp in dst.items():
            roff, rln = box(k, tuple(t.shape), *rp)
            for (soff, sln), hs in holders.items():
                if r in hs:
                    continue
                n = 1
                for a, la, b, lb in zip(soff, sln, roff, rln, strict=True):
                    n *= max(0, min(a + la, b + lb) - max(a, b))
                out[hs[0]][r] += n * t.element_size()
    return out


def _rank_main(rank: int, world: int, device: torch.device, mode: str, layers: int, dtype: str, root: str,
               repeats: int, out: str, in_place: bool, profile: bool, knobs: dict[str, int]) -> None:
    torch.set_num_threads(1)
    g = torch.Generator(device=device).manual_seed(0)  # the same values on every rank (same device kind)
    dt = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype])
    full = {k: torch.randn(s, generator=g, device=device, dtype=dt) for k, s in shapes(layers).items()}
    lay = layouts(world)
    sp, dp = lay[f"{mode}-src"], lay[f"{mode}-dst"]
    src = _state(full, sp.get(rank), device, zero=False)
    dst = _state(full, dp.get(rank), device, zero=True)

    def check(what: str) -> None:
        for k, s in (dst or {}).items():
            want = full[k][tuple(slice(o, o + n) for o, n in zip(s.offsets, s.local.shape, strict=True))]
            assert torch.equal(s.local, want), f"{what}: {k}"
            s.local.zero_()

    pairs = _pair_bytes(full, sp, dp, world)
    p2p = raw_baselines(rank, world, device, pairs)["send/recv"]

    # the common baseline: rank 0 gathers each tensor whole (each distinct piece from its first
    # holder), broadcasts it, and every receiver keeps its part
    firsts = {k: {box(k, tuple(t.shape), *sp[r]): r for r in sorted(sp, reverse=True)} for k, t in full.items()}

    def gather_broadcast() -> None:
        for k, t in full.items():
            whole = torch.empty(t.shape, dtype=t.dtype, device=device)
            for (off, ln), holder in firsts[k].items():
                part = whole[tuple(slice(o, o + n) for o, n in zip(off, ln, strict=True))]
                if holder == 0 and rank == 0:
                    part.copy_(src[k].local)  # type: ignore[index]
                elif rank == 0:
                    buf = torch.empty(ln, dtype=t.dtype, device=device)
                    dist.recv(buf, holder)
                    part.copy_(buf)
                elif rank == holder:
                    dist.send(src[k].local, 0)  # type: ignore[index]
            dist.broadcast(whole, 0)
            if dst is not None:
                d = dst[k]
                d.local.copy_(whole[tuple(slice(o, o + n) for o, n in zip(d.offsets, d.local.shape, strict=True))])

    def timed(fn: Any) -> float:
        def once() -> None:
            fn()
            cuda_sync(device)

        return timed_collective(once)

    times: dict[str, list[float]] = {"transfer": [], "save+load": [], "gather+broadcast": [], "send/recv": []}
    res: list[ckpt.TransferResult] = []
    prof = cProfile.Profile() if profile and rank == 0 else None
    bb, win = knobs.get("bucket_bytes"), knobs.get("window")  # (None: transfer's default for the data path)
    for _ in range(2):  # warm: the plan and NCCL's connections, then the recording's first replay (graph capture)
        ckpt.transfer(src, dst, in_place=in_place, bucket_bytes=bb, window=win)
        check("transfer (warm)")
    phases: dict[str, list[float]] = {}
    for r in range(repeats):
        res.clear()
        if prof is not None:
            prof.enable()
        times["transfer"].append(timed(lambda: res.append(ckpt.transfer(src, dst, in_place=in_place, bucket_bytes=bb,
                                                                       window=win))))
        if prof is not None:
            prof.disable()
        for k, v in res[0].phases.items():
            phases.setdefault(k, []).append(v)
        if r == 0:
            check("transfer")
        time_baselines(times, timed, check if r == 0 else None, rank, src, dst, os.path.join(root, f"{mode}-{r}"),
                       gather_broadcast, {"send/recv": p2p}, slow=not knobs.get("raw_only"))
    if rank == 0:
        info: dict[str, Any] = {"times": times, "bytes_sent": res[0].bytes_sent, "buckets": res[0].buckets,
                                "rounds": res[0].rounds, "cached_plan": res[0].cached_plan,
                                "replayed": res[0].replayed, "phases": phases,
                                "pair_bytes": pairs,
                                "gather_broadcast_bytes": sum(  # sent over the network: gathers + broadcasts
                                    torch.Size(ln).numel() * t.element_size()
                                    for k, t in full.items() for (_, ln), h in firsts[k].items() if h != 0)
                                + sum(t.numel() * t.element_size() for t in full.values()) * (world - 1)}
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
            info["profile"] = s.getvalue()
        with open(out, "w") as f:
            json.dump(info, f)


def _cpu_main(rank: int, world: int, *args: Any) -> None:
    _rank_main(rank, world, torch.device("cpu"), *args)


def run(ranks: int, size_gb: float, dtype: str, repeats: int, root: str, device: str = "cpu",
        in_place: bool = False, profile: bool = False, knobs: dict[str, int] | None = None) -> dict[str, Any]:
    layers = layers_for(size_gb, 2 if dtype == "bf16" else 4)
    nbytes = sum(torch.Size(s).numel() for s in shapes(layers).values()) * (2 if dtype == "bf16" else 4)
    out: dict[str, Any] = {"bytes": nbytes, "layers": layers, "ranks": ranks, "dtype": dtype, "repeats": repeats,
                           "device": device, "in_place": in_place, "knobs": knobs or {}}
    for mode in ("same", "disjoint"):
        path = os.path.join(root, f"{mode}.json")
        args = (mode, layers, dtype, root, repeats, path, in_place, profile, knobs or {})
        if device == "cpu":
            gloo_ranks(ranks, _cpu_main, *args)
        elif fork_ranks(ranks, _rank_main, *args, device=device):
            raise RuntimeError(f"a rank died in the {mode} run")
        with open(path) as f:
            out[mode] = json.load(f)
    return out


COLUMNS = ["layout", "method", "median s", "GB/s (model)", "vs transfer"]


def rows_for(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode in ("same", "disjoint"):
        t = res[mode]["times"]
        base = median(t["transfer"])
        for method in ("transfer", "save+load", "gather+broadcast", "send/recv"):
            if not t[method]:  # (--raw-only)
                continue
            m = median(t[method])
            rows.append([mode, method, fmt(m, 4), fmt(gbps(res["bytes"], m)), fmt(m / base, 2) + "x"])
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size-gb", type=float, default=0.25)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--in-place", action="store_true", help="transfer(in_place=True): no staging copy at commit")
    p.add_argument("--profile", action="store_true", help="rank 0's Python profile of the timed transfers")
    p.add_argument("--bucket-mb", type=float, default=None, help="transfer's bucket_bytes (default: its own)")
    p.add_argument("--window", type=int, default=None,
                   help="transfer's window: a round moves window x bucket bytes (default: its own)")
    p.add_argument("--raw-only", action="store_true",
                   help="compare with the backend's own send/recv only (no save + load, no gather + broadcast)")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int:
    if args.ranks < 2 or args.ranks % 2:
        raise SystemExit("transfer-moe needs an even number of ranks (tp=2 x ep=ranks/2)")
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-transfer-moe-")
    os.makedirs(root, exist_ok=True)
    knobs = {} if args.bucket_mb is None else {"bucket_bytes": int(args.bucket_mb * (1 << 20))}
    if args.window is not None:
        knobs["window"] = args.window
    if args.raw_only:
        knobs["raw_only"] = 1
    res = run(args.ranks, args.size_gb, args.dtype, args.repeats, root, args.device, args.in_place, args.profile,
              knobs)
    title = (f"{args.ranks} {args.device} ranks, {res['bytes'] / 1e9:.2f} GB {args.dtype} MoE ({res['layers']} layers)"
             f": same = tp=2,ep={args.ranks // 2} -> tp={args.ranks}; disjoint = tp={args.ranks // 2} on the first half"
             f" -> ep={args.ranks // 2} on the second" + (" (in place)" if args.in_place else ""))
    print_table(title, COLUMNS, rows_for(res))
    for mode in ("same", "disjoint"):
        print(f"{mode}: bytes sent {res[mode]['bytes_sent']} (gather + broadcast: "
              f"{res[mode]['gather_broadcast_bytes']}), buckets {res[mode]['buckets']}, "
              f"rounds {res[mode]['rounds']}, cached plan {res[mode]['cached_plan']}, "
              f"replayed {res[mode]['replayed']}; "
              "rank 0's median ms per phase: " + ", ".join(f"{k} {median(v) * 1e3:.2f}"
                                                        for k, v in res[mode]["phases"].items()))
        if "profile" in res[mode]:
            print(res[mode]["profile"])
    print("\n" + markdown_table(COLUMNS, rows_for(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
