"""Async checkpointing: blocking, staged and done times of ``ckpt.async_save`` against torch DCP's
``async_save`` (thread mode; on GPU also a reused ``FileSystemWriter(cache_staged_state_dict=True)``),
``torch.save`` and ``safetensors`` (both synchronous: blocking = done), on the same state, in one
process, alternating contenders each round. Physical references measured in the same run: dd with
conv=fdatasync on the same disk, and pinned device-to-host bandwidth (GPU). On GPU it also times a
training-like step (bf16 matmuls) with and without a checkpoint being staged during it.

Figures per contender: first save, and the median of the later (steady-state) saves:
blocking (call -> return), staged (call -> state may change), done (call -> durable/committed),
throughput (bytes / done), peak extra host RSS during the save.

    python -m bench async [--size-gb 2] [--tensors 200] [--saves 5] [--device cpu|cuda] [--dir DIR]
                          [--caps 0.25,0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import (
    fmt,
    fresh_dir,
    gbps,
    machine_info,
    markdown_table,
    median,
    print_table,
    remove,
    run_dd,
)

# The synchronous contenders are the save-load benchmark's own (same files, same fsyncs).
from bench.save_load import _st_save, _torch_save, make_state


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples RSS every 5 ms in a thread; ``peak - start`` is the extra host memory of a save."""

    def __init__(self) -> None:
        self.start = _rss()
        self.peak = self.start
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())
        return self.peak - self.start


Result = dict[str, float]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class CkptAsync:
    """``ckpt.async_save`` through one saver (its staging pool is reused), optionally with a
    ``max_staging_bytes`` cap of ``cap`` x the state's size."""

    def __init__(self, cap: float | None = None, nbytes: int = 0) -> None:
        from ckpt.async_save import AsyncSaver

        self.saver = AsyncSaver()
        self.cap = None if cap is None else max(2 << 20, int(cap * nbytes))
        self.name = "ckpt.async_save" + ("" if cap is None else f" cap={cap:g}x")

    def save(self, state: dict[str, torch.Tensor], d: str) -> Result:
        t0 = time.perf_counter()
        h = self.saver.save(state, d, max_staging_bytes=self.cap)
        t1 = time.perf_counter()
        h.staged()
        t2 = time.perf_counter()
        h.done()
        t3 = time.perf_counter()
        # staging memory held (pinned for GPU state) / bytes staged; alloc: time spent allocating it
        return {"blocking": t1 - t0, "staged": t2 - t0, "done": t3 - t0, "alloc": h.stats.get("alloc", 0.0),
                "staging_ratio": h.stats["staging_bytes"] / max(1, h.stats["staged_bytes"])}


class DcpAsync:
    def __init__(self, cached_writer: bool) -> None:
        self.cached = cached_writer
        self.name = "dcp.async_save" + (" (cached writer)" if cached_writer else "")
        self.writer: Any = None

    def save(self, state: dict[str, torch.Tensor], d: str) -> Result:
        import torch.distributed.checkpoint as dcp

        if self.cached:
            # A reused writer keeps its pinned staging cache across saves (DCP's best steady state).
            if self.writer is None:
                self.writer = dcp.FileSystemWriter(d, cache_staged_state_dict=True)
            self.writer.fs.mkdir(d)
            self.writer.path = self.writer.fs.init_path(d)
            writer = self.writer
        else:
            writer = dcp.FileSystemWriter(d)
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=writer)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        # DCP copies the state out before returning: staged == blocking.
        return {"blocking": t1 - t0, "staged": t1 - t0, "done": t2 - t0}


class SyncSaver:
    def __init__(self, name: str, fn: Callable[[dict[str, torch.Tensor], str], None]) -> None:
        self.name = name
        self.fn = fn

    def save(self, state: dict[str, torch.Tensor], d: str) -> Result:
        t0 = time.perf_counter()
        self.fn(state, d)
        t = time.perf_counter() - t0
        return {"blocking": t, "staged": t, "done": t}


def pinned_d2h_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-host bandwidth into a pinned, already-touched buffer (GB/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return gbps(nbytes, median(ts))


def step_slowdown(state: dict[str, torch.Tensor], root: str, steps: int = 10) -> dict[str, float]:
    """Median time of a bf16 matmul 'training step' alone vs while a ckpt async save stages."""
    from ckpt.async_save import AsyncSaver

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def step() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    alone = [step() for _ in range(steps)]
    saver = AsyncSaver()
    saver.save(state, os.path.join(root, "warm")).done()  # allocate the pinned pool once
    during = []
    for i in range(steps):
        d = os.path.join(root, f"during{i}")
        h = saver.save(state, d)
        during.append(step())  # the step overlaps the device-to-host copies
        h.done()
        remove(d)
    remove(os.path.join(root, "warm"))
    return {"step_alone_s": median(alone), "step_during_s": median(during),
            "slowdown": median(during) / median(alone) - 1.0}


def run(size_gb: float, n_tensors: int, saves: int, root: str, device: str, dtype: str,
        caps: tuple[float, ...] = ()) -> dict[str, Any]:
    import torch.distributed as dist

    if not dist.is_initialized():  # dcp.async_save needs a process group; a world of one
        store = dist.FileStore(os.path.join(root, "pg-store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    state = make_state(int(size_gb * 1e9), n_tensors)
    if dtype == "bf16":
        state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    if device == "cuda":
        state = {k: v.cuda() for k, v in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    contenders: list[Any] = [CkptAsync(), *(CkptAsync(c, nbytes) for c in caps), DcpAsync(cached_writer=False)]
    if device == "cuda":
        contenders.append(DcpAsync(cached_writer=True))
    contenders += [SyncSaver("torch.save", _torch_save), SyncSaver("safetensors.save_file", _st_save)]
    if device == "cuda":  # these two need host tensors
        cpu_state = None
    results: dict[str, list[Result]] = {c.name: [] for c in contenders}
    dd = []
    for rnd in range(saves):
        for c in contenders:
            d = fresh_dir(root, "ckpt-" + c.name.replace(" ", "_").replace("(", "").replace(")", ""))
            src = state
            if device == "cuda" and isinstance(c, SyncSaver):
                if cpu_state is None:
                    cpu_state = {k: v.cpu() for k, v in state.items()}
                src = cpu_state
            _sync(device)
            rss = PeakRSS()
            r = c.save(src, d)
            r["rss"] = rss.stop()
            results[c.name].append(r)
            remove(d)
            print(f"round {rnd} {c.name}: blocking {r['blocking']:.4f}s staged {r['staged']:.3f}s "
                  f"done {r['done']:.3f}s rss +{r['rss'] / 2**20:.0f} MiB", flush=True)
        dd.append(run_dd(os.path.join(root, "dd.bin"), count=max(1, int(nbytes / (16 << 20)))))
    out: dict[str, Any] = {"bytes": nbytes, "tensors": n_tensors, "device": device, "dtype": dtype,
                           "saves": saves, "machine": machine_info(root),
                           "dd_gbps": median([x.gbps for x in dd]), "contenders": {}}
    for name, rs in results.items():
        steady = rs[1:] if len(rs) > 1 else rs
        out["contenders"][name] = {
            "first": rs[0],
            "steady": {k: median([r[k] for r in steady]) for k in ("blocking", "staged", "done", "rss")},
        }
        if "staging_ratio" in rs[0]:
            out["contenders"][name]["staging_ratio"] = rs[0]["staging_ratio"]
    if device == "cuda":
        out["pinned_d2h_gbps"] = pinned_d2h_gbps()
        out["step"] = step_slowdown(state, root)
        out["gpu"] = torch.cuda.get_device_name()
    return out


def rows(res: dict[str, Any]) -> list[list[str]]:
    n = res["bytes"]
    ours = res["contenders"]["ckpt.async_save"]["steady"]
    out = []
    for name, c in res["contenders"].items():
        f, s = c["first"], c["steady"]
        out.append([name, fmt(f["blocking"], 4), fmt(s["blocking"], 4), fmt(s["staged"], 3), fmt(s["done"], 3),
                    fmt(gbps(n, s["done"]), 2), fmt(s["rss"] / 2**20, 0),
                    fmt(s["blocking"] / ours["blocking"], 1) if ours["blocking"] else "-"])
    return out


COLUMNS = ["contender", "first blocking s", "blocking s", "staged s", "done s", "done GB/s", "peak +RSS MiB",
           "blocking / ckpt"]


def report(res: dict[str, Any]) -> str:
    n = res["bytes"]
    ours = res["contenders"]["ckpt.async_save"]["steady"]
    lines = [f"state: {n / 1e9:.2f} GB, {res['tensors']} tensors ({res['dtype']}) on {res['device']}; "
             f"{res['saves']} saves each, steady = median of saves 2..n",
             f"dd conv=fdatasync: {res['dd_gbps']:.2f} GB/s; ckpt done rate {gbps(n, ours['done']):.2f} GB/s "
             f"= {gbps(n, ours['done']) / res['dd_gbps']:.2f}x dd"]
    dcp = res["contenders"].get("dcp.async_save")
    if dcp:
        lines.append(f"ckpt steady blocking = {100 * ours['blocking'] / dcp['steady']['blocking']:.2f}% of "
                     "dcp.async_save's")
    for name, c in res["contenders"].items():
        if "staging_ratio" in c:
            lines.append(f"{name}: first save blocking {c['first']['blocking'] * 1e3:.1f} ms (allocating "
                         f"{c['first'].get('alloc', 0):.2f} s in the background), staging memory "
                         f"{c['staging_ratio']:.3f}x the staged bytes, staged {c['steady']['staged']:.3f} s")
    if "pinned_d2h_gbps" in res:
        ideal = n / 1e9 / res["pinned_d2h_gbps"]
        lines.append(f"pinned D2H {res['pinned_d2h_gbps']:.1f} GB/s: bytes/bandwidth {ideal:.3f} s; ckpt staged "
                     f"{ours['staged']:.3f} s = {ours['staged'] / ideal:.2f}x")
        lines.append(f"training step alone {res['step']['step_alone_s'] * 1e3:.1f} ms, during staging "
                     f"{res['step']['step_during_s'] * 1e3:.1f} ms: slowdown {100 * res['step']['slowdown']:.1f}%")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--saves", type=int, default=5, help="saves per contender (first + steady state)")
    # "auto" is resolved in main, not here: every subcommand's parser is built, and asking CUDA here
    # initialized it in the parent of `bench multirank`'s forked ranks ("Cannot re-initialize CUDA")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["mixed", "bf16"], default="mixed", help="mixed: fp32+bf16 halves")
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--caps", default="", help="also ckpt with max_staging_bytes at these fractions of the state, "
                   "e.g. 0.25,0.5")


def main(args: argparse.Namespace) -> int:
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-async-")
    os.makedirs(root, exist_ok=True)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    caps = tuple(float(x) for x in args.caps.split(",") if x.strip())
    res = run(args.size_gb, args.tensors, args.saves, root, device, args.dtype, caps)
    print_table("async save", COLUMNS, rows(res))
    print(report(res))
    print("\n" + markdown_table(COLUMNS, rows(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0
