"""Delta refits: ``ckpt.transfer(delta=True)`` and ``ckpt.transfer_iter(delta=True)`` when a few of a
model's tensors changed, against sending everything, and what finding the changes costs.

The model is ``transfer-moe``'s (attention, experts, norms per layer); rank 0 holds it whole
(trainer), rank 1 wants it whole (engine), as a refit to a disjoint rank. Per refit, medians of
repeats: ``full`` (delta off), ``delta, nothing changed``, ``delta, N% changed`` (the first tensors
of the model, about N% of its bytes, changed in place before each refit), the same three as a stream
of ``(name, tensor)`` pairs, and ``digests`` (rank 0 digesting its pieces alone: the floor of a
delta refit). Checked bitwise once per mode.

    python -m bench transfer-delta [--size-gb 1] [--changed-pct 3] [--repeats 5] [--device cpu|cuda] [--json F]

On GPUs the digests are computed on the device (ckpt._digest); on the host, BLAKE2b-128.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch

import ckpt
from bench.common import fmt, markdown_table, median, print_table, timed_collective
from bench.ranks import cuda_sync, fork_ranks, gloo_ranks
from bench.transfer_moe import layers_for, shapes
from ckpt._digest import digests
from ckpt.transfer_stream import ALL, transfer_iter


def _rank_main(rank: int, world: int, device: torch.device, layers: int, pct: float, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator(device=device).manual_seed(0)
    full = {k: torch.randn(s, generator=g, device=device, dtype=torch.bfloat16) for k, s in shapes(layers).items()}
    total = sum(t.numel() * t.element_size() for t in full.values())
    # the tensors that change: the model's first ones, up to pct of its bytes
    changing, acc = [], 0
    for k, t in full.items():
        if acc >= total * pct / 100:
            break
        changing.append(k)
        acc += t.numel() * t.element_size()
    src = {k: t.clone() for k, t in full.items()} if rank == 0 else None
    dst = {k: torch.zeros_like(t) for k, t in full.items()} if rank == 1 else None

    def change() -> None:
        if src is not None:
            for k in changing:
                src[k].add_(1)

    def timed(fn: Any) -> float:
        def once() -> None:
            fn()
            cuda_sync(device)

        return timed_collective(once)

    rows: dict[str, list[float]] = {}
    info: dict[str, Any] = {"changed_bytes": acc, "changed_tensors": len(changing), "total_bytes": total}
    state = ckpt.TransferState()
    sstate = ckpt.TransferState()
    engine: dict[str, torch.Tensor] = {}

    def stream(delta: bool) -> None:
        s = transfer_iter(src, ALL if rank == 1 else None, delta=delta, state=sstate, timeout=600, device=device)
        for name, t in s:
            engine[name] = t
        info.setdefault("stream_skipped", []).append(s.stats.bytes_skipped)

    plans = {
        "full": lambda: ckpt.transfer(src, dst, timeout=600),
        "delta, nothing changed": lambda: ckpt.transfer(src, dst, delta=True, state=state, timeout=600),
        f"delta, {pct:g}% changed": lambda: (change(), ckpt.transfer(src, dst, delta=True, state=state,
                                                                      timeout=600)),
        "stream, full": lambda: stream(False),
        "stream, delta, nothing changed": lambda: stream(True),
        f"stream, delta, {pct:g}% changed": lambda: (change(), stream(True)),
    }
    for name, fn in plans.items():
        fn()  # warm: the plan, the first version (and for delta the first digests)
        rows[name] = [timed(fn) for _ in range(repeats)]
    # correctness once, with the state the timed runs left: one more changed delta refit
    change()
    res = ckpt.transfer(src, dst, delta=True, state=state, timeout=600)
    stream(True)
    if src is not None:
        info["sent_last"] = res.bytes_sent
        info["skipped_last"] = res.bytes_skipped
        want = {k: t.clone() for k, t in src.items()}
    else:
        want = {}
    # rank 0's values reach rank 1 through a plain transfer (the check's own truth)
    truth = {k: torch.empty_like(t) for k, t in full.items()} if rank == 1 else None
    ckpt.transfer(want if rank == 0 else None, truth, timeout=600)
    if rank == 1:
        assert truth is not None and dst is not None
        bad = [k for k in truth if not torch.equal(dst[k], truth[k]) or not torch.equal(engine[k], truth[k])]
        assert not bad, f"delta refits are not bitwise: {bad[:3]}"
    if rank == 0:
        assert src is not None
        pieces = list(src.values())
        digests(pieces)
        t_d = []
        for _ in range(repeats):
            cuda_sync(device)
            t0 = time.perf_counter()
            digests(pieces)
            cuda_sync(device)
            t_d.append(time.perf_counter() - t0)
        rows["digests (rank 0 alone)"] = t_d
        with open(out, "w") as f:
            json.dump({"rows": rows, **info}, f)


def _cpu_main(rank: int, world: int, *args: Any) -> None:
    _rank_main(rank, world, torch.device("cpu"), *args)


def run(size_gb: float, pct: float, repeats: int, device: str) -> dict[str, Any]:
    layers = layers_for(size_gb, 2)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        args = (layers, pct, repeats, f.name)
        if device == "cpu":
            gloo_ranks(2, _cpu_main, *args)
        elif fork_ranks(2, _rank_main, *args, device=device):
            raise RuntimeError("a rank died")
        with open(f.name) as g:
            res = json.load(g)
    res.update(layers=layers, device=device, repeats=repeats)
    return res


COLUMNS = ["refit", "median s", "x full"]


def rows_for(res: dict[str, Any]) -> list[list[str]]:
    base = median(res["rows"]["full"])
    sbase = median(res["rows"]["stream, full"])
    out = []
    for name, ts in res["rows"].items():
        m = median(ts)
        out.append([name, fmt(m, 4), fmt(m / (sbase if name.startswith("stream") else base), 2) + "x"])
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=0.25)
    p.add_argument("--changed-pct", type=float, default=3.0, help="percent of the model's bytes changed per refit")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int:
    res = run(args.size_gb, args.changed_pct, args.repeats, args.device)
    title = (f"delta refits, 2 {args.device} ranks, rank 0's {res['total_bytes'] / 1e9:.2f} GB bf16 MoE to rank 1 "
             f"({res['changed_tensors']} tensors, {res['changed_bytes'] / 1e9:.3f} GB changed per refit)")
    print_table(title, COLUMNS, rows_for(res))
    print(f"last delta refit: sent {res.get('sent_last')} bytes, skipped {res.get('skipped_last')}")
    print("\n" + markdown_table(COLUMNS, rows_for(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
