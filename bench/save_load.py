"""Save/load throughput of ckpt against torch DCP, torch.save and safetensors, single process (CPU).

One state (``--tensors`` 2-D matrices, half fp32 and half bf16, random shapes, ``--size-gb`` GiB in
all, fixed seed) is generated once. Each repeat runs every contender in the same order (dd, ckpt,
dcp, torch, safetensors): a save to a fresh directory that ends durable (fsynced), a warm load
(straight after the save: the file is in the page cache), and, where the page cache may be dropped
(root), a cold load. The checkpoint is removed before the next contender, so the disk holds at most
one checkpoint at a time. Figures are medians over repeats; throughput is the state's tensor bytes
over the median time (GB = 1e9 bytes).

ckpt and DCP load into preallocated tensors (zeroed, hence already touched, before each load);
torch.load and safetensors' load_file allocate their results, which is part of what they cost, and
are then copied into the same preallocated tensors (what ``load_state_dict`` does); the time until
the API returned is kept separately. dd writes (conv=fdatasync) and reads back a file of the state's
size in the same directory as the physical reference. Best (minimum) times are reported too.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import ckpt
from bench.common import (
    GB,
    can_drop_caches,
    dir_bytes,
    drop_caches,
    fmt,
    fresh_dir,
    fsync_path,
    gbps,
    machine_info,
    markdown_table,
    median,
    print_table,
    remove,
    run_dd,
    run_dd_read,
    same_bytes,
    timed,
)

State = dict[str, torch.Tensor]
DD_BLOCK_MIB = 16


# ---------------------------------------------------------------------------------------------
# the state


def make_state(total_bytes: int, n_tensors: int, seed: int = 0) -> State:
    """``n_tensors`` random 2-D tensors (even indices fp32, odd bf16) of about ``total_bytes`` in all.

    Sizes vary (weights 0.25-1.75 around the mean) and so do shapes (aspect ratio 1/4 to 4); the
    same seed gives the same state.
    """
    if n_tensors < 1 or total_bytes < n_tensors * 4:
        raise ValueError(f"need at least one tensor and 4 bytes per tensor; got {n_tensors} tensors, "
                         f"{total_bytes} bytes")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    weights = [rng.uniform(0.25, 1.75) for _ in range(n_tensors)]
    wsum = sum(weights)
    state: State = {}
    for i, w in enumerate(weights):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        esize = 4 if dtype == torch.float32 else 2
        numel = max(1, int(total_bytes * w / wsum) // esize)
        aspect = 2.0 ** rng.uniform(-2.0, 2.0)
        rows = max(1, min(numel, round(math.sqrt(numel * aspect))))
        cols = max(1, numel // rows)
        state[f"layers.{i:03d}.weight"] = torch.randn(rows, cols, generator=gen, dtype=dtype)
    return state


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def bitwise_mismatches(expected: State, got: dict[str, Any]) -> list[str]:
    """Keys whose tensor in ``got`` differs from ``expected`` in dtype, shape or any byte."""
    bad = []
    for k, a in expected.items():
        if not same_bytes(a, got.get(k)):
            bad.append(k)
    if set(got) - set(expected):
        bad.extend(sorted(set(got) - set(expected)))
    return bad


# ---------------------------------------------------------------------------------------------
# contenders: save(state, empty dir) ends durable; load(dir, dest) returns the loaded tensors


@dataclass(slots=True)
class Contender:
    name: str
    save: Callable[[State, str], None]
    load: Callable[[str, State], dict[str, Any]]
    in_place: bool  # load fills ``dest`` (preallocated) rather than allocating new tensors
    how: str  # the calls, for the report


def _ckpt_save(state: State, d: str) -> None:
    ckpt.save(state, d)  # fsyncs the data file, its directory and the manifest


def _ckpt_load(d: str, dest: State) -> dict[str, Any]:
    return ckpt.load(dest, d)


def _dcp_save(state: State, d: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(d), no_dist=True)  # sync_files=True by default


def _dcp_load(d: str, dest: State) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    dcp.load(dest, storage_reader=dcp.FileSystemReader(d), no_dist=True)
    return dest


def _torch_save(state: State, d: str) -> None:
    path = os.path.join(d, "model.pt")
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(d)


def _torch_load(d: str, dest: State) -> dict[str, Any]:
    return torch.load(os.path.join(d, "model.pt"), weights_only=True)


def _st_save(state: State, d: str) -> None:
    from safetensors.torch import save_file

    path = os.path.join(d, "model.safetensors")
    save_file(state, path)
    fsync_path(path)
    fsync_path(d)


def _st_load(d: str, dest: State) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(os.path.join(d, "model.safetensors"))


CONTENDERS = [
    Contender("ckpt", _ckpt_save, _ckpt_load, True, "ckpt.save / ckpt.load (in place)"),
    Contender("dcp", _dcp_save, _dcp_load, True,
              "dcp.save(FileSystemWriter) / dcp.load(FileSystemReader) (in place), no_dist=True"),
    Contender("torch", _torch_save, _torch_load, False,
              "torch.save + fsync / torch.load(weights_only=True) (allocates)"),
    Contender("safetensors", _st_save, _st_load, False,
              "save_file + fsync / load_file (allocates)"),
]


# ---------------------------------------------------------------------------------------------
# the run


def load_into(c: Contender, d: str, dest: State) -> tuple[float, float]:
    """Load checkpoint ``d`` so that its bytes end in ``dest``; returns (total s, s until the API returned).

    For allocating APIs the total includes copying their result into ``dest`` (what
    ``load_state_dict`` does); safetensors' ``load_file`` returns mmap-backed tensors, so its API
    time alone would not include reading the bytes at all.
    """
    t0 = time.perf_counter()
    out = c.load(d, dest)
    t1 = time.perf_counter()
    if not c.in_place:
        for k, v in out.items():
            dest[k].copy_(v)
    t2 = time.perf_counter()
    del out
    return t2 - t0, t1 - t0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(size_gb: float, n_tensors: int, repeats: int, root: str, seed: int = 0,
        names: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark in ``root``; returns raw times, medians and the machine description."""
    contenders = [c for c in CONTENDERS if names is None or c.name in names]
    target = int(size_gb * (1 << 30))
    _log(f"generating the state: {n_tensors} tensors, ~{target / GB:.2f} GB (seed {seed}) ...")
    gen_s, state = timed(lambda: make_state(target, n_tensors, seed))
    nbytes = state_bytes(state)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}  # allocated and touched once
    dd_count = max(1, round(nbytes / (DD_BLOCK_MIB << 20)))
    cold_note = can_drop_caches()
    if cold_note:
        _log(f"cold loads skipped: {cold_note}")

    raw: dict[str, dict[str, list[float]]] = {
        "save": {"dd": [], **{c.name: [] for c in contenders}},
        "load_warm": {"dd": [], **{c.name: [] for c in contenders}},
        "load_cold": {"dd": [], **{c.name: [] for c in contenders}},
        "load_warm_api": {c.name: [] for c in contenders if not c.in_place},
        "load_cold_api": {c.name: [] for c in contenders if not c.in_place},
    }
    on_disk: dict[str, int] = {}
    checked: dict[str, bool] = {}
    # one untimed round on a small state: imports, thread pools and lazy initialisation
    small = dict(list(state.items())[:4])
    small_dest = {k: torch.zeros_like(v) for k, v in small.items()}
    for c in contenders:
        d = fresh_dir(root, c.name)
        c.save(small, d)
        load_into(c, d, small_dest)
        remove(d)
    del small, small_dest

    for r in range(repeats):
        os.sync()
        dd_path = os.path.join(root, "dd.bin")
        dd = run_dd(dd_path, bs_mib=DD_BLOCK_MIB, count=dd_count, keep=True)
        dd_bytes = dd.nbytes
        raw["save"]["dd"].append(dd.seconds)
        line = f"[{r + 1}/{repeats}] dd          save {dd.seconds:6.2f} s"
        for kind in ("load_warm", "load_cold"):  # reading the file back: the reference for loads
            if kind == "load_cold":
                if cold_note:
                    continue
                drop_caches()
            rd = run_dd_read(dd_path, bs_mib=DD_BLOCK_MIB)
            raw[kind]["dd"].append(rd.seconds)
            line += f"  {kind[5:]} load {rd.seconds:6.2f} s"
        remove(dd_path)
        _log(line)
        for c in contenders:
            d = fresh_dir(root, c.name)
            os.sync()
            gc.collect()
            t_save, _ = timed(lambda c=c, d=d: c.save(state, d))
            raw["save"][c.name].append(t_save)
            on_disk[c.name] = dir_bytes(d)
            line = f"[{r + 1}/{repeats}] {c.name:<11} save {t_save:6.2f} s"
            for kind in ("load_warm", "load_cold"):
                if kind == "load_cold" and cold_note:
                    continue
                for t in dest.values():
                    t.zero_()  # so the check below cannot pass on stale bytes
                gc.collect()
                if kind == "load_cold":
                    why = drop_caches()
                    if why:
                        raise RuntimeError(why)
                t_load, t_api = load_into(c, d, dest)
                raw[kind][c.name].append(t_load)
                line += f"  {kind[5:]} load {t_load:6.2f} s"
                if not c.in_place:
                    raw[kind + "_api"][c.name].append(t_api)
                    line += f" (API {t_api:.2f} s)"
                if c.name not in checked:
                    bad = bitwise_mismatches(state, dest)
                    if bad:
                        raise RuntimeError(f"{c.name}: loaded state differs from the source in {len(bad)} "
                                           f"tensors (first: {bad[:3]}); the figures would be meaningless")
                    checked[c.name] = True
            _log(line)
            remove(d)
    gc.collect()

    return summarize({
        "benchmark": "save-load",
        "config": {"size_gb": size_gb, "tensors": n_tensors, "repeats": repeats, "seed": seed, "dir": root,
                   "dd": f"dd if=/dev/zero of=FILE bs={DD_BLOCK_MIB}M count={dd_count} conv=fdatasync; "
                         f"dd if=FILE of=/dev/null bs={DD_BLOCK_MIB}M"},
        "machine": machine_info(root),
        "state": {"bytes": nbytes, "tensors": len(state),
                  "fp32": sum(t.dtype == torch.float32 for t in state.values()),
                  "bf16": sum(t.dtype == torch.bfloat16 for t in state.values()),
                  "generate_s": gen_s},
        "dd_bytes": dd_bytes,
        "contenders": {c.name: {"how": c.how, "load_in_place": c.in_place,
                                "bytes_on_disk": on_disk.get(c.name)} for c in contenders},
        "cold_loads": cold_note or "page cache dropped (echo 3 > /proc/sys/vm/drop_caches) before each",
        "verified_bitwise": sorted(checked),
        "raw": raw,
    })


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Add medians, bests (minimum over repeats), throughputs and the targets to a run's raw times."""
    raw, nbytes, dd_bytes = res["raw"], res["state"]["bytes"], res["dd_bytes"]
    med = {kind: {n: median(v) for n, v in per.items()} for kind, per in raw.items()}
    best = {kind: {n: min(v, default=math.nan) for n, v in per.items()} for kind, per in raw.items()}

    def rates(times: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        return {kind: {n: gbps(dd_bytes if n == "dd" else nbytes, t) for n, t in per.items()}
                for kind, per in times.items()}

    res.update(median=med, best=best, gbps=rates(med), best_gbps=rates(best))
    tm, tb = targets(med, nbytes, dd_bytes), targets(best, nbytes, dd_bytes)
    for a, b in zip(tm, tb, strict=True):
        a["ratio_best"], a["met_best"] = b["ratio"], b["met"]
    res["targets"] = tm
    return res


def targets(med: dict[str, dict[str, float]], nbytes: int, dd_bytes: int) -> list[dict[str, Any]]:
    """The issue's targets, each with its measured ratio (ckpt's throughput / the other's) and status."""
    out = []

    def add(name: str, ratio: float, goal: float) -> None:
        if not math.isnan(ratio):
            out.append({"target": name, "goal": goal, "ratio": ratio, "met": bool(ratio >= goal)})

    save = med["save"]
    ck = save.get("ckpt", math.nan)
    add("save throughput >= 0.8x dd's", gbps(nbytes, ck) / gbps(dd_bytes, save["dd"]), 0.8)
    add("save throughput >= 2x DCP's", save.get("dcp", math.nan) / ck, 2.0)
    for kind, label in (("load_warm", "warm"), ("load_cold", "cold")):
        add(f"load throughput >= 2x DCP's ({label} cache)",
            med[kind].get("dcp", math.nan) / med[kind].get("ckpt", math.nan), 2.0)
    return out


# ---------------------------------------------------------------------------------------------
# reporting


def tables(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, rows) for the save table, the load table and the targets."""
    med, rate = res["median"], res["gbps"]
    rows_for = ["dd", *res["contenders"]]

    def label(n: str) -> str:
        return "dd (reference)" if n == "dd" else n

    def ratio(kind: str, n: str) -> str:
        return fmt(med[kind][n] / med[kind].get("ckpt", math.nan))

    save_rows = []
    for n in rows_for:
        disk = "-" if n == "dd" else f"{res['contenders'][n]['bytes_on_disk'] / GB:.3f} GB"
        save_rows.append([label(n), fmt(med["save"][n]), fmt(rate["save"][n]), ratio("save", n),
                          fmt(res["best"]["save"][n]), fmt(res["best_gbps"]["save"][n]), disk])
    save_cols = ["save (ends fsynced)", "median s", "GB/s", "x ckpt", "best s", "best GB/s", "on disk"]

    load_rows = []
    for n in rows_for:
        if n == "dd":
            note = "dd to /dev/null"
        elif res["contenders"][n]["load_in_place"]:
            note = "in place"
        else:
            note = (f"allocates: API {fmt(med['load_warm_api'][n])} / {fmt(med['load_cold_api'][n])} s, "
                    "then copy")
        load_rows.append([label(n), fmt(med["load_warm"][n]), fmt(rate["load_warm"][n]), ratio("load_warm", n),
                          fmt(med["load_cold"][n]), fmt(rate["load_cold"][n]), ratio("load_cold", n), note])
    load_cols = ["load (into preallocated tensors)", "warm s", "GB/s", "x ckpt", "cold s", "GB/s", "x ckpt", "how"]

    tgt_rows = [[t["target"], f"{t['ratio']:.2f}x", "met" if t["met"] else "missed",
                 f"{t['ratio_best']:.2f}x", "met" if t["met_best"] else "missed"] for t in res["targets"]]
    return [(f"Save ({res['state']['bytes'] / GB:.2f} GB, {res['config']['repeats']} repeats, medians)",
             save_cols, save_rows),
            ("Load", load_cols, load_rows),
            ("Targets (ckpt)", ["target", "medians", "status", "bests", "status"], tgt_rows)]


LEGEND = ("x ckpt: the row's median time / ckpt's, i.e. ckpt's throughput as a multiple of the row's "
          "(above 1: ckpt is faster by that factor)")


def report(res: dict[str, Any]) -> None:
    for title, cols, rows in tables(res):
        print_table(title, cols, rows)
    print(LEGEND)
    print(f"cold loads: {res['cold_loads']}")
    print(f"verified bitwise against the source: {', '.join(res['verified_bitwise'])}")


def to_markdown(res: dict[str, Any]) -> str:
    parts = []
    for title, cols, rows in tables(res):
        parts.append(f"**{title}**\n\n{markdown_table(cols, rows)}\n")
    return "\n".join(parts) + f"\n{LEGEND}.\n"


# ---------------------------------------------------------------------------------------------
# command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=2.0, help="state size in GiB (default 2)")
    p.add_argument("--tensors", type=int, default=200, help="number of tensors (default 200)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; figures are medians (default 3)")
    p.add_argument("--dir", default=None,
                   help="where checkpoints are written (default: a temporary directory under $TMPDIR); "
                        "dd writes here too, so it measures the same disk")
    p.add_argument("--seed", type=int, default=0, help="seed for the state (default 0)")
    p.add_argument("--only", default=None, help="comma-separated contenders to run (default: all)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")
    p.add_argument("--markdown", default=None, help="also write the tables as markdown here")
    p.add_argument("--from-json", default=None,
                   help="do not measure: report a run saved earlier with --json (e.g. after changing the tables)")


def main(args: argparse.Namespace) -> int:
    if args.from_json:
        with open(args.from_json) as f:
            res = summarize(json.load(f))
    else:
        warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint.*")
        if args.dir:
            os.makedirs(args.dir, exist_ok=True)
        root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
        try:
            res = run(args.size_gb, args.tensors, args.repeats, root, seed=args.seed,
                      names=args.only.split(",") if args.only else None)
        finally:
            remove(root)
    report(res)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(res))
    return 0
