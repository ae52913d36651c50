"""GPU restores and synchronous GPU saves, one process, same state and disk for every contender.

Loads into GPU tensors (preallocated, as a resume does): ``ckpt.load``, ``dcp.load`` and
``safetensors.load_file(device="cuda")`` (copied into the same tensors), warm (files in the page
cache) and cold (``drop_caches`` when root, else ``posix_fadvise(DONTNEED)`` on every file, which
empties the page cache of those files too). Synchronous saves of the GPU state: ``ckpt.save``,
``dcp.save`` and ``safetensors.save_file`` after ``.cpu()`` (both fsynced). Physical limits measured
in the same run: pageable and pinned host-to-device bandwidth, a cold sequential read of one file
of the same size (disk read), and ``dd`` writing with ``conv=fdatasync``. Every load is checked
bitwise against the source. Without a GPU the same run happens on CPU tensors (no H2D figures).

    python -m bench gpu-io [--size-gb 8] [--tensors 300] [--repeats 3] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import (
    drop_caches,
    fmt,
    fresh_dir,
    gbps,
    machine_info,
    median,
    print_table,
    remove,
    run_dd,
    run_dd_read,
)
from bench.save_load import _st_save, make_state


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def evict(path: str) -> str:
    """Empty the page cache of every file under ``path``; returns how."""
    if drop_caches() is None:
        return "drop_caches"
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def disk_read_gbps(path: str) -> float:
    """A cold sequential read of ``path`` (dd, 16 MiB blocks)."""
    evict(path)
    return run_dd_read(path).gbps


def h2d_gbps(nbytes: int, pinned: bool) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    _sync()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        _sync()
        times.append(time.perf_counter() - t0)
    return gbps(nbytes, median(times))


def _ckpt_load(d: str, dest: dict[str, torch.Tensor]) -> None:
    import ckpt

    ckpt.load(dest, d)


def _dcp_load(d: str, dest: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(dest, storage_reader=dcp.FileSystemReader(d), no_dist=True)


def _st_load(d: str, dest: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    dev = next(iter(dest.values())).device
    out = load_file(os.path.join(d, "model.safetensors"), device=str(dev))
    for k, v in out.items():
        dest[k].copy_(v)


def _ckpt_save(state: dict[str, torch.Tensor], d: str) -> None:
    import ckpt

    ckpt.save(state, d)


def _dcp_save(state: dict[str, torch.Tensor], d: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(d), no_dist=True)


def _st_save_cpu(state: dict[str, torch.Tensor], d: str) -> None:
    _st_save({k: v.cpu() for k, v in state.items()}, d)


LOADS: dict[str, Callable[[str, dict[str, torch.Tensor]], None]] = {
    "ckpt.load": _ckpt_load, "dcp.load": _dcp_load, "safetensors.load_file": _st_load}
SAVES: dict[str, Callable[[dict[str, torch.Tensor], str], None]] = {
    "ckpt.save": _ckpt_save, "dcp.save": _dcp_save, "safetensors.save_file(.cpu())": _st_save_cpu}
WRITER = {"ckpt.load": "ckpt.save", "dcp.load": "dcp.save", "safetensors.load_file": "safetensors.save_file(.cpu())"}


def run(size_gb: float, n_tensors: int, repeats: int, root: str) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = {k: v.to(device=device, dtype=torch.bfloat16) for k, v in make_state(int(size_gb * 1e9), n_tensors).items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    ref = {k: v.cpu() for k, v in state.items()} if device == "cuda" else state
    times: dict[str, list[float]] = {}
    how = ""
    mismatches: list[str] = []
    dirs = {name: fresh_dir(root, name.split(".")[0]) for name in SAVES}
    for r in range(repeats):
        for name, fn in SAVES.items():  # rotate? the order is fixed; each repeat rewrites every checkpoint
            remove(dirs[name])
            os.makedirs(dirs[name], exist_ok=True)
            _sync()
            t0 = time.perf_counter()
            fn(state, dirs[name])
            times.setdefault(f"save {name}", []).append(time.perf_counter() - t0)
        for name, fn in LOADS.items():
            d = dirs[WRITER[name]]
            for temp in ("cold", "warm"):
                if temp == "cold":
                    how = evict(d)
                dest = {k: torch.zeros_like(v) for k, v in state.items()}
                _sync()
                t0 = time.perf_counter()
                fn(d, dest)
                _sync()
                times.setdefault(f"{temp} {name}", []).append(time.perf_counter() - t0)
                bad = [k for k, v in dest.items() if not torch.equal(v.cpu(), ref[k])]
                if bad:
                    mismatches.append(f"{temp} {name}: {bad[:4]}")
                del dest
        print(f"repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    big = os.path.join(root, "dd.bin")
    dd = run_dd(big, count=max(1, nbytes // (16 << 20)), keep=True)
    out: dict[str, Any] = {"bytes": nbytes, "tensors": n_tensors, "device": device, "repeats": repeats,
                           "evict": how, "machine": machine_info(root), "dd_write_gbps": dd.gbps,
                           "disk_read_gbps": disk_read_gbps(big), "times": {k: median(v) for k, v in times.items()},
                           "mismatches": mismatches}
    remove(big)
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
        out["h2d_pageable_gbps"] = h2d_gbps(1 << 30, False)
        out["h2d_pinned_gbps"] = h2d_gbps(1 << 30, True)
    for d in dirs.values():
        remove(d)
    return out


def rows(res: dict[str, Any]) -> list[list[str]]:
    n, t = res["bytes"], res["times"]
    out = []
    for kind in ("warm", "cold", "save"):
        names = LOADS if kind != "save" else SAVES
        ours = t[f"{kind} {'ckpt.load' if kind != 'save' else 'ckpt.save'}"]
        limit = {"warm": res.get("h2d_pinned_gbps"), "cold": res["disk_read_gbps"], "save": res["dd_write_gbps"]}[kind]
        for name in names:
            s = t[f"{kind} {name}"]
            out.append([kind, name, fmt(s, 3), fmt(gbps(n, s), 2), fmt(s / ours, 2),
                        fmt(gbps(n, s) / limit, 2) if limit else "-"])
    return out


COLUMNS = ["case", "contender", "median s", "GB/s", "x ckpt time", "x limit"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--tensors", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-gpuio-")
    os.makedirs(root, exist_ok=True)
    res = run(args.size_gb, args.tensors, args.repeats, root)
    print_table("GPU restores and synchronous GPU saves", COLUMNS, rows(res))
    print(f"{res['bytes'] / 1e9:.2f} GB bf16 in {res['tensors']} tensors on {res['device']} "
          f"({res.get('gpu', 'no GPU')}); limits: warm = pinned H2D {res.get('h2d_pinned_gbps', 0):.1f} GB/s "
          f"(pageable {res.get('h2d_pageable_gbps', 0):.1f}), cold = disk read {res['disk_read_gbps']:.2f} GB/s "
          f"(cache emptied by {res['evict']}), save = dd fdatasync {res['dd_write_gbps']:.2f} GB/s")
    print("bitwise: " + ("all loads equal the source" if not res["mismatches"] else f"MISMATCHES {res['mismatches']}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0 if not res["mismatches"] else 1
