"""Live resharding on CPU ranks: ``ckpt.transfer`` vs ``ckpt.save`` + ``ckpt.load`` through a
temporary directory vs gathering full tensors on rank 0 and broadcasting them, medians of repeats.

Two layouts, each on forked gloo ranks: ``same`` (every rank holds rows, wants columns) and
``disjoint`` (the first half of the ranks hold rows, the second half want columns). Every method is
checked bitwise once.

    python -m bench transfer [--ranks 4] [--size-mb 256] [--tensors 8] [--repeats 3] [--dir DIR] [--json F]
                             [--device cpu|cuda] [--bucket-mb 64] [--window 4]

``--device cuda``: one GPU per rank, an NCCL group (ckpt.transfer then sends over NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import ckpt
from bench.common import fmt, gbps, markdown_table, median, print_table, timed_collective
from bench.ranks import cuda_sync, fork_ranks, gloo_ranks


def cut(n: int, parts: int, i: int) -> tuple[int, int]:
    return n * i // parts, n * (i + 1) // parts


def _cpu_main(rank: int, world: int, *args: Any) -> None:
    _rank_main(rank, world, torch.device("cpu"), *args)


def _layout_state(rank: int, world: int, device: torch.device, mode: str, full: list[torch.Tensor]
                  ) -> tuple[list[int], list[int], dict[str, Any] | None, dict[str, Any] | None]:
    """Senders, receivers, and this rank's rows (``src``) and zeroed columns (``dst``) of every tensor."""
    senders = list(range(world)) if mode == "same" else list(range(world // 2))
    receivers = list(range(world)) if mode == "same" else list(range(world // 2, world))
    src: dict[str, Any] | None = None
    dst: dict[str, Any] | None = None
    if rank in senders:
        i, n = senders.index(rank), len(senders)
        src = {f"w{k}": ckpt.Shard(t[slice(*cut(t.shape[0], n, i))].clone(), tuple(t.shape),
                                   (cut(t.shape[0], n, i)[0], 0)) for k, t in enumerate(full)}
    if rank in receivers:
        i, n = receivers.index(rank), len(receivers)
        dst = {f"w{k}": ckpt.Shard(torch.zeros(t.shape[0], cut(t.shape[1], n, i)[1] - cut(t.shape[1], n, i)[0],
                                               device=device),
                                   tuple(t.shape), (0, cut(t.shape[1], n, i)[0])) for k, t in enumerate(full)}
    return senders, receivers, src, dst


def _rank_main(rank: int, world: int, device: torch.device, mode: str, shapes: list[tuple[int, int]], root: str,
               repeats: int, out: str, knobs: dict[str, int] | None = None) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g).to(device) for s in shapes]
    senders, receivers, src, dst = _layout_state(rank, world, device, mode, full)

    def check(what: str) -> None:
        if dst is not None:
            for k, t in enumerate(full):
                s = dst[f"w{k}"]
                assert torch.equal(s.local, t[:, s.offsets[1]: s.offsets[1] + s.local.shape[1]]), what
                s.local.zero_()

    def gather_broadcast() -> None:
        # rank 0 gathers every sender's rows (point to point), then broadcasts each full tensor
        for k, t in enumerate(full):
            whole = torch.empty(t.shape, device=device) if rank == 0 or dst is not None else None
            if rank == 0:
                assert whole is not None
                for j, s in enumerate(senders):
                    a, b = cut(t.shape[0], len(senders), j)
                    if s == 0:
                        assert src is not None
                        whole[a:b] = src[f"w{k}"].local
                    else:
                        dist.recv(whole[a:b], s)
            elif src is not None:
                dist.send(src[f"w{k}"].local, 0)
            buf = whole if whole is not None else torch.empty(t.shape, device=device)
            dist.broadcast(buf, 0)
            if dst is not None:
                s = dst[f"w{k}"]
                s.local.copy_(buf[:, s.offsets[1]: s.offsets[1] + s.local.shape[1]])

    def timed(fn: Any) -> float:
        def once() -> None:
            fn()
            cuda_sync(device)

        return timed_collective(once)

    raw = raw_baselines(rank, world, device, [[_pair_bytes(full, senders, receivers, a, b)
                                               if a in senders and b in receivers else 0 for b in range(world)]
                                              for a in range(world)])
    times: dict[str, list[float]] = {"transfer": [], "save+load": [], "gather+broadcast": [],
                                     **{k: [] for k in raw}}
    stats: dict[str, Any] = {}
    res: list[ckpt.TransferResult] = []
    bb = (knobs or {}).get("bucket_bytes")  # (None: transfer's default for the data path)
    win = (knobs or {}).get("window")
    for _ in range(2):  # warm: the plan and NCCL's connections, then the recording's first replay
        ckpt.transfer(src, dst, bucket_bytes=bb, window=win)
    check("transfer (warm)")
    for r in range(repeats):
        res.clear()
        times["transfer"].append(timed(lambda: res.append(ckpt.transfer(src, dst, bucket_bytes=bb, window=win))))
        stats = {"bytes_sent": res[0].bytes_sent, "bytes_local": res[0].bytes_local, "buckets": res[0].buckets,
                 "rounds": res[0].rounds, "cached_plan": res[0].cached_plan, "rank_packed": res[0].rank_packed,
                 "rank_direct": res[0].rank_direct}
        if r == 0:
            check("transfer")
        time_baselines(times, timed, check if r == 0 else None, rank, src, dst, os.path.join(root, f"{mode}-{r}"),
                       gather_broadcast, raw, slow=not (knobs or {}).get("raw_only"))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "transfer": stats}, f)


def _pair_bytes(full: list[torch.Tensor], senders: list[int], receivers: list[int], s: int, r: int) -> int:
    """Bytes transfer moves from sender ``s`` to receiver ``r`` (rows of s that are columns of r)."""
    if s == r:
        return 0  # held locally: transfer copies it without the network
    i, j = senders.index(s), receivers.index(r)
    total = 0
    for t in full:
        a, b = cut(t.shape[0], len(senders), i)
        c, d = cut(t.shape[1], len(receivers), j)
        total += (b - a) * (d - c) * t.element_size()
    return total


def raw_baselines(rank: int, world: int, device: torch.device, pairs: list[list[int]]) -> dict[str, Any]:
    """The backend's own bandwidth for transfer's traffic, ``pairs[s][r]`` bytes from rank s to rank r:
    ``send/recv`` (one batch of point-to-point messages per pair, preallocated contiguous buffers) and
    ``all_to_all`` (one all_to_all_single with the same per-pair byte counts); on GPUs these are
    NCCL's figures the goal compares against."""
    out_n = pairs[rank]
    in_n = [pairs[s][rank] for s in range(world)]
    send = torch.ones(max(sum(out_n), 1), dtype=torch.uint8, device=device)
    recv = torch.empty(max(sum(in_n), 1), dtype=torch.uint8, device=device)

    def p2p() -> None:
        ops, o, i = [], 0, 0
        for peer in range(world):
            if out_n[peer]:
                ops.append(dist.P2POp(dist.isend, send[o: o + out_n[peer]], peer))
            if in_n[peer]:
                ops.append(dist.P2POp(dist.irecv, recv[i: i + in_n[peer]], peer))
            o, i = o + out_n[peer], i + in_n[peer]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()

    def all_to_all() -> None:
        dist.all_to_all_single(recv[: sum(in_n)], send[: sum(out_n)], in_n, out_n)

    return {"send/recv": p2p, "all_to_all": all_to_all}


def timed_save_load(timed: Callable[[Callable[[], Any]], float], rank: int, src: dict[str, Any] | None,
                    dst: dict[str, Any] | None, d: str) -> float:
    """``timed`` ``ckpt.save`` of ``src`` + ``ckpt.load`` into ``dst`` through directory ``d``, which
    rank 0 removes afterwards (every rank past the barrier first)."""
    took = timed(lambda: (ckpt.save(src or {}, d), ckpt.load(dst or {}, d)))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(d, ignore_errors=True)
    return took


def time_baselines(times: dict[str, list[float]], timed: Callable[[Callable[[], Any]], float],
                   check: Callable[[str], None] | None, rank: int, src: dict[str, Any] | None,
                   dst: dict[str, Any] | None, d: str, gather_broadcast: Callable[[], None],
                   raw: dict[str, Callable[[], None]], slow: bool = True) -> None:
    """One repeat of the methods transfer is compared with, each appended to ``times``: save + load
    through ``d``, gather + broadcast (both left out unless ``slow``: ``--raw-only``), and the
    backend's ``raw`` baselines (the same bytes between the same pairs, contiguous, no planning);
    ``check`` (the first repeat) checks and resets ``dst`` after the first two."""
    if slow:
        times["save+load"].append(timed_save_load(timed, rank, src, dst, d))
        if check is not None:
            check("save+load")
        times["gather+broadcast"].append(timed(gather_broadcast))
        if check is not None:
            check("gather+broadcast")
    for name, fn in raw.items():
        times[name].append(timed(fn))


def run(ranks: int, size_mb: float, n: int, repeats: int, root: str, device: str = "cpu",
        knobs: dict[str, int] | None = None) -> dict[str, Any]:
    side = max(8, int((size_mb * 1e6 / 4 / n) ** 0.5))
    shapes = [(side + 8 * (i % 3), side - 4 * (i % 2)) for i in range(n)]
    nbytes = sum(a * b * 4 for a, b in shapes)
    out: dict[str, Any] = {"bytes": nbytes, "ranks": ranks, "tensors": n, "repeats": repeats, "device": device,
                           "knobs": knobs or {}}
    for mode in ("same", "disjoint"):
        path = os.path.join(root, f"{mode}.json")
        if device == "cpu":
            gloo_ranks(ranks, _cpu_main, mode, shapes, root, repeats, path, knobs)
        elif fork_ranks(ranks, _rank_main, mode, shapes, root, repeats, path, knobs, device=device):
            raise RuntimeError(f"a rank died in the {mode} run")
        with open(path) as f:
            out[mode] = json.load(f)
    return out


COLUMNS = ["layout", "method", "median s", "GB/s", "vs transfer"]  # GB/s: the model's bytes over the time


def rows_for(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode in ("same", "disjoint"):
        t = res[mode]["times"]
        base = median(t["transfer"])
        for method in ("transfer", "save+load", "gather+broadcast", "send/recv", "all_to_all"):
            if not t[method]:  # (--raw-only)
                continue
            m = median(t[method])
            rows.append([mode, method, fmt(m, 3), fmt(gbps(res["bytes"], m)), fmt(m / base, 2) + "x"])
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size-mb", type=float, default=256.0)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--bucket-mb", type=float, default=None, help="transfer's bucket_bytes (default: its own)")
    p.add_argument("--window", type=int, default=None,
                   help="transfer's window: a round moves window x bucket bytes (default: its own)")
    p.add_argument("--raw-only", action="store_true",
                   help="compare with the backend's own send/recv only (no save + load, no gather + broadcast)")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int:
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-transfer-")
    os.makedirs(root, exist_ok=True)
    knobs = {} if args.bucket_mb is None else {"bucket_bytes": int(args.bucket_mb * (1 << 20))}
    if args.window is not None:
        knobs["window"] = args.window
    if args.raw_only:
        knobs["raw_only"] = 1
    res = run(args.ranks, args.size_mb, args.tensors, args.repeats, root, args.device, knobs)
    title = f"{args.ranks} {args.device} ranks, {res['bytes'] / 1e6:.0f} MB rows -> columns"
    print_table(title, COLUMNS, rows_for(res))
    for mode in ("same", "disjoint"):
        print(f"{mode}: transfer {res[mode]['transfer']}")
    print("\n" + markdown_table(COLUMNS, rows_for(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
