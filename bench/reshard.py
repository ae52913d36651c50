"""Offline reshard: ``ckpt reshard`` against dd's disk rate and against torch DCP (load + save).

A synthetic MoE checkpoint (the embedded model's architecture, scaled to ``--size-gb`` GiB: bf16
parameters plus fp32 AdamW moments, fixed seed) is generated once, saved from one process and
rewritten (untimed) under the source layout ``--src`` (default ``tp=2,ep=2``). The same data is also
saved with DCP under that layout (one forked process per source rank, DTensors on a gloo CPU mesh).

Each repeat then runs, in this order:

- **dd**: ``dd if=/dev/zero of=FILE bs=16M count=N conv=fdatasync`` with N x 16 MiB about the
  checkpoint's size: the disk's durable sequential write rate, measured in the same run;
- **ckpt**: ``ckpt.resharders.reshard(src, dst, --to)`` in a fresh Python process (so that its peak
  RSS is its own), once per ``--budgets`` value (by default also once without the source checksum
  check, to show its cost); timed inside that process, from the call to the commit (files fsynced,
  manifest committed);
- **dcp**: one forked process per target rank; each builds empty DTensors for what it holds under
  ``--to``, then ``dcp.load`` from the DCP source and ``dcp.save`` to a fresh directory; timed on
  rank 0 between barriers (process start and mesh set-up excluded).

Throughput is bytes written / second (ckpt: the new data files; DCP: its new ``.distcp`` files;
GB = 1e9). Peak RSS is the high-water mark (``VmHWM``) of each process minus its RSS just before
the timed part; for DCP the sum over ranks. The source is made warm before each run (its files are
read once, untimed, so that they sit in the page cache and the run measures the rewrite, not a
cold read competing with the writes on the same disk); ``--cold`` drops the page cache instead
(root only). ZeRO-1 layouts are not used because DCP has no flat-range-of-a-box placement to
express them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

import ckpt
from bench.common import (
    GB,
    dir_bytes,
    drop_caches,
    fmt,
    gbps,
    machine_info,
    markdown_table,
    median,
    print_table,
    remove,
    run_dd,
)
from ckpt.layout import RANK_ORDER, Layout
from ckpt.trainer.model import ModelConfig, MoEForCausalLM

DD_BLOCK_MIB = 16
MiB = 1 << 20

BASE = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=1024,
                   num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                   num_experts=8, num_experts_per_tok=2)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the checkpoint


def config_for(size_bytes: int) -> ModelConfig:
    """BASE with as many layers as make ``size_bytes`` of bf16 parameters plus two fp32 moments."""
    per_param = 2 + 4 + 4
    fixed = 2 * BASE.vocab_size * BASE.hidden_size + BASE.hidden_size
    per_layer = (BASE.num_parameters() - fixed) // BASE.num_hidden_layers
    layers = max(2, round((size_bytes / per_param - fixed) / per_layer))
    return dataclasses.replace(BASE, num_hidden_layers=layers)


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in MoEForCausalLM(cfg).state_dict().items()}


def make_state(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """The trainer's checkpoint keys: ``model.<param>`` (bf16), ``optim.exp_avg/exp_avg_sq.<param>`` (fp32)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for k, s in shapes(cfg).items():
        out[f"model.{k}"] = torch.randn(s, generator=g, dtype=torch.bfloat16)
        out[f"optim.exp_avg.{k}"] = torch.randn(s, generator=g) * 1e-3
        out[f"optim.exp_avg_sq.{k}"] = torch.rand(s, generator=g) * 1e-6
    out["optim.step"] = torch.tensor(1000)
    out["step"] = 1000
    return out


# ---------------------------------------------------------------------------------------------
# DCP: DTensors on a CPU mesh, one forked process per rank


def _dtensor_state(manifest: Any, layout: Layout, rank: int) -> dict[str, Any]:
    """What ``rank`` holds under ``layout`` (no ZeRO), as DTensors of its stage's (dp, ep, sp, tp) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    from ckpt.resharders.placement import GLOBAL, classify, specs_of
    from ckpt.resharders.placement import rank_state as ckpt_rank_state
    from ckpt.resharders.rules import MOE_RULES

    # The mesh in the layout's rank order (slowest first), so mesh coordinates are layout coordinates.
    order = RANK_ORDER[::-1]
    mesh = init_device_mesh("cpu", tuple(getattr(layout, a) for a in order), mesh_dim_names=order)
    sub = mesh["dp", "ep", "sp", "tp"]
    specs = specs_of(manifest)
    out: dict[str, Any] = {}
    for key, piece in ckpt_rank_state(manifest, layout, rank, MOE_RULES).items():
        shape = specs[key][1]
        role = classify(key, shape, specs, MOE_RULES)
        if role.kind == GLOBAL or role.param is None:
            out[key] = piece.local
            continue
        p = MOE_RULES.placement(role.param)
        placements = [Replicate(),
                      DShard(p.ep_dim) if p.ep_dim is not None and layout.ep > 1 else Replicate(),
                      Replicate(),  # sp replicates parameters
                      DShard(p.tp_dim) if p.tp_dim is not None and layout.tp > 1 else Replicate()]
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        out[key] = DTensor.from_local(piece.local, sub, placements, run_check=False, shape=torch.Size(shape),
                                      stride=stride)
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _rss_kib() -> int:
    return _status_kib("VmRSS")


def _peak_kib() -> int:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over an exec from the parent's image, which
    # would charge this process with the benchmark driver's memory.
    return _status_kib("VmHWM")


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (a forked child starts with its parent's high-water mark)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _dcp_rank(rank: int, world: int, job: dict[str, Any]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        manifest = ckpt.inspect(job["ckpt_src"])
        layout = Layout.parse(job["layout"])
        _reset_peak()
        base = _rss_kib()
        dist.barrier()
        t0 = time.perf_counter()
        state = _dtensor_state(manifest, layout, rank)
        if job["mode"] == "prepare":  # untimed: fill from the ckpt source, save the DCP source
            from ckpt.resharders.placement import rank_state
            from ckpt.resharders.rules import MOE_RULES

            pieces = rank_state(manifest, layout, rank, MOE_RULES)
            ckpt.load(pieces, job["ckpt_src"], strict=False)
            for k, v in state.items():
                (v.to_local() if hasattr(v, "to_local") else v).copy_(pieces[k].local)
            dcp.save(state, checkpoint_id=job["dst"])
        else:
            dcp.load(state, checkpoint_id=job["src"])
            t1 = time.perf_counter()
            dcp.save(state, checkpoint_id=job["dst"])
        dist.barrier()
        t2 = time.perf_counter()
        res = {"rank": rank, "seconds": t2 - t0, "peak_kib": _peak_kib(), "base_kib": base}
        if job["mode"] != "prepare":
            res.update(load_s=t1 - t0, save_s=t2 - t1)
        with open(os.path.join(job["out"], f"{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def run_dcp(job: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Run ``_dcp_rank`` on ``world`` forked ranks; returns each rank's result."""
    from bench.ranks import gloo_ranks

    out = tempfile.mkdtemp(prefix="bench-dcp-")
    try:
        gloo_ranks(world, _dcp_rank, {**job, "out": out})
        res = []
        for r in range(world):
            with open(os.path.join(out, f"{r}.json")) as f:
                res.append(json.load(f))
        return res
    finally:
        remove(out)


# ---------------------------------------------------------------------------------------------
# ckpt: a fresh process per run, so that its peak RSS is its own

_CKPT_CHILD = r"""
import json, resource, sys, time
from ckpt.layout import Layout
from ckpt.resharders.reshard import reshard
src, dst, layout, budget, workers, verify = sys.argv[1:7]
def status(field):  # VmHWM, not ru_maxrss (which an exec inherits from the parent)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := current RSS
base = status("VmRSS")
t0 = time.perf_counter()
m = reshard(src, dst, Layout.parse(layout), memory_budget=int(budget), workers=int(workers),
            verify_source=verify == "1")
dt = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": dt, "base_kib": base, "peak_kib": status("VmHWM"), "cpu_s": ru.ru_utime + ru.ru_stime,
                  "bytes_written": sum(m.files.values()), "largest_piece": max(s.length for t in m.tensors.values()
                                                                               for s in t.shards)}))
"""


def run_ckpt(src: str, dst: str, layout: str, budget: int, workers: int, verify: bool = True) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _CKPT_CHILD, src, dst, layout, str(budget), str(workers),
                           "1" if verify else "0"],
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    if proc.returncode != 0:
        raise RuntimeError(f"ckpt reshard failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# the run


def warm(path: str) -> float:
    """Read every file under ``path`` once (into the page cache); returns the seconds it took."""
    t0 = time.perf_counter()
    buf = bytearray(16 * MiB)
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    return time.perf_counter() - t0


def _prepare_source(path: str, cold: bool) -> None:
    os.sync()
    if cold:
        drop_caches()
    else:
        warm(path)


def _parse_budget(text: str) -> int:
    from ckpt.cli.reshard import parse_size

    return parse_size(text)


def run(size_gb: float, src_layout: str, dst_layout: str, budgets: list[str], workers: int, repeats: int,
        root: str, cold: bool, seed: int = 0) -> dict[str, Any]:
    """Generate, prepare the two sources, then time dd, ckpt (per budget) and DCP ``repeats`` times."""
    from ckpt.resharders.diff import diff
    from ckpt.resharders.reshard import reshard

    src_lay, dst_lay = Layout.parse(src_layout), Layout.parse(dst_layout)
    cfg = config_for(int(size_gb * (1 << 30)))
    _log(f"generating the state: {cfg.num_hidden_layers} layers x {cfg.num_experts} experts ...")
    state = make_state(cfg, seed)
    nbytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    n_tensors = sum(isinstance(v, torch.Tensor) for v in state.values())
    _log(f"  {n_tensors} tensors, {nbytes / GB:.2f} GB; saving from one process ...")
    orig, src, dcp_src = (os.path.join(root, n) for n in ("orig", "src", "dcp-src"))
    ckpt.save(state, orig, step=1000, user_metadata={"model_config": cfg.to_dict(), "rules": "embedded-moe",
                                                      "layout": Layout().to_dict()})
    del state
    _log(f"rewriting it under the source layout {src_layout} (untimed) ...")
    reshard(orig, src, src_lay)
    remove(orig)
    _log(f"saving the DCP source under {src_layout} ({src_lay.world_size} forked ranks, untimed) ...")
    run_dcp({"mode": "prepare", "ckpt_src": src, "layout": src_layout, "dst": dcp_src}, src_lay.world_size)
    src_bytes = dir_bytes(os.path.join(src, "data"))
    dd_count = max(1, round(src_bytes / (DD_BLOCK_MIB * MiB)))
    cold_note = None
    if cold and (cold_note := drop_caches()) is not None:
        _log(f"cold runs impossible: {cold_note}")
        cold = False

    variants = []  # (name, budget bytes, verify the source)
    for spec in budgets:
        b, _, flag = spec.partition(":")
        verify = flag != "noverify"
        variants.append((f"ckpt ({b} budget{'' if verify else ', source not verified'})", _parse_budget(b), verify))
    names = [v[0] for v in variants] + ["dcp"]
    raw: dict[str, list[dict[str, Any]]] = {"dd": [], **{n: [] for n in names}}
    verified: list[str] = []
    for r in range(repeats):
        os.sync()
        dd = run_dd(os.path.join(root, "dd.bin"), bs_mib=DD_BLOCK_MIB, count=dd_count)
        raw["dd"].append({"seconds": dd.seconds, "bytes_written": dd.nbytes})
        _log(f"[{r + 1}/{repeats}] dd      {dd.seconds:6.2f} s  {dd.gbps:.2f} GB/s")
        for name, budget, verify in variants:
            dst = os.path.join(root, "dst")
            remove(dst)
            _prepare_source(src, cold)
            res = run_ckpt(src, dst, dst_layout, budget, workers, verify)
            res["budget"] = budget
            raw[name].append(res)
            over = (res["peak_kib"] - res["base_kib"]) / 1024
            _log(f"[{r + 1}/{repeats}] {name:<42} {res['seconds']:6.2f} s  "
                 f"{gbps(res['bytes_written'], res['seconds']):.2f} GB/s  peak RSS +{over:.0f} MiB")
            if "ckpt" not in verified:
                if not diff(src, dst).ok:
                    raise RuntimeError("ckpt reshard output differs from its source; the figures would be meaningless")
                verified.append("ckpt")
            remove(dst)
        dcp_dst = os.path.join(root, "dcp-dst")
        remove(dcp_dst)
        _prepare_source(dcp_src, cold)
        wall0 = time.perf_counter()
        ranks = run_dcp({"mode": "convert", "ckpt_src": src, "layout": dst_layout, "src": dcp_src, "dst": dcp_dst},
                        dst_lay.world_size)
        wall = time.perf_counter() - wall0
        written = dir_bytes(dcp_dst)
        res = {"seconds": ranks[0]["seconds"], "load_s": ranks[0]["load_s"], "save_s": ranks[0]["save_s"],
               "wall_with_start_s": wall, "bytes_written": written,
               "peak_kib": sum(x["peak_kib"] for x in ranks), "base_kib": sum(x["base_kib"] for x in ranks),
               "max_rank_peak_over_base_kib": max(x["peak_kib"] - x["base_kib"] for x in ranks)}
        raw["dcp"].append(res)
        _log(f"[{r + 1}/{repeats}] dcp        {res['seconds']:6.2f} s  {gbps(written, res['seconds']):.2f} GB/s  "
             f"(load {res['load_s']:.1f} s, save {res['save_s']:.1f} s; with process start {wall:.1f} s)")
        if "dcp" not in verified:
            _check_dcp(src, dcp_dst, dst_lay)
            verified.append("dcp")
        remove(dcp_dst)
    return {
        "benchmark": "reshard",
        "config": {"size_gb": size_gb, "src": src_layout, "dst": dst_layout, "budgets": budgets, "workers": workers,
                   "repeats": repeats, "seed": seed, "cold": cold, "dir": root,
                   "dd": f"dd if=/dev/zero of=FILE bs={DD_BLOCK_MIB}M count={dd_count} conv=fdatasync"},
        "machine": machine_info(root),
        "state": {"bytes": nbytes, "tensors": n_tensors, "layers": cfg.num_hidden_layers,
                  "experts": cfg.num_experts, "source_bytes_on_disk": src_bytes},
        "verified_bitwise": verified,
        "raw": raw,
    }


def _check_dcp(src: str, dcp_dst: str, layout: Layout) -> None:
    """A sample of tensors of DCP's result equals the ckpt source (DCP loads them whole, one process)."""
    import torch.distributed.checkpoint as dcp

    m = ckpt.inspect(src)
    keys = sorted(m.tensors, key=lambda k: -m.tensors[k].nbytes)[:2] + sorted(m.tensors)[::25]
    from ckpt._dtypes import dtype_from_name

    want = {k: torch.zeros(m.tensors[k].shape, dtype=dtype_from_name(m.tensors[k].dtype)) for k in keys}
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    ckpt.load(want, src, strict=False)
    dcp.load(got, checkpoint_id=dcp_dst, no_dist=True)
    bad = [k for k in keys if not torch.equal(want[k].view(-1).view(torch.uint8), got[k].view(-1).view(torch.uint8))]
    if bad:
        raise RuntimeError(f"DCP's rewritten checkpoint differs from the source in {bad[:3]}")


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Medians per contender: seconds, GB/s written, the ratio to dd (median of the per-repeat ratios:
    each run against the dd of its own repeat, since the disk's rate drifts), peak RSS, targets."""
    rows: dict[str, dict[str, float]] = {}
    dd_runs = res["raw"]["dd"]
    for name, runs in res["raw"].items():
        if not runs:
            continue
        s = median([x["seconds"] for x in runs])
        w = median([x["bytes_written"] for x in runs])
        ratios = [gbps(x["bytes_written"], x["seconds"]) / gbps(d["bytes_written"], d["seconds"])
                  for x, d in zip(runs, dd_runs, strict=False)]
        row = {"seconds": s, "gbps": gbps(int(w), s), "bytes_written": w, "x_dd": median(ratios),
               "x_dd_min": min(ratios), "x_dd_max": max(ratios)}
        if name != "dd":
            row["peak_over_base_mib"] = max((x["peak_kib"] - x["base_kib"]) / 1024 for x in runs)
            row["peak_mib"] = max(x["peak_kib"] / 1024 for x in runs)
        if "budget" in runs[0]:
            row["budget_mib"] = runs[0]["budget"] / MiB
            row["largest_piece_mib"] = runs[0]["largest_piece"] / MiB
        rows[name] = row
    res["median"] = rows
    targets = []
    for name, row in rows.items():
        if name.startswith("ckpt"):
            targets.append({"target": f"{name}: throughput >= 0.7x dd (same repeat)", "ratio": row["x_dd"],
                            "met": row["x_dd"] >= 0.7})
            limit = row["budget_mib"] + row["largest_piece_mib"]
            targets.append({"target": f"{name}: peak RSS over baseline <= budget + largest piece "
                                      f"({limit:.0f} MiB)", "ratio": row["peak_over_base_mib"] / limit,
                            "met": row["peak_over_base_mib"] <= limit})
    res["targets"] = targets
    return res


def tables(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = []
    med = res["median"]
    for name, row in med.items():
        spread = "" if row["x_dd_min"] == row["x_dd_max"] else f" ({row['x_dd_min']:.2f}-{row['x_dd_max']:.2f})"
        rows.append([name if name != "dd" else "dd (reference, write only)", fmt(row["seconds"]),
                     f"{row['bytes_written'] / GB:.2f}", fmt(row["gbps"]), fmt(row["x_dd"]) + spread,
                     "-" if "peak_mib" not in row else f"{row['peak_mib']:.0f}",
                     "-" if "peak_over_base_mib" not in row else f"{row['peak_over_base_mib']:.0f}"])
    c = res["config"]
    title = (f"Reshard {c['src']} -> {c['dst']}, {res['state']['bytes'] / GB:.2f} GB of tensors "
             f"({'cold' if c['cold'] else 'warm'} source, {c['repeats']} repeat(s), medians)")
    tgt = [[t["target"], f"{t['ratio']:.2f}x", "met" if t["met"] else "missed"] for t in res["targets"]]
    cols = ["contender", "s", "GB written", "GB/s", "x dd (per repeat: median, range)", "peak RSS MiB",
            "over baseline MiB"]
    return [(title, cols, rows),
            ("Targets", ["target", "measured", "status"], tgt)]


def report(res: dict[str, Any]) -> None:
    for title, cols, rows in tables(res):
        print_table(title, cols, rows)
    print(f"verified bitwise: {', '.join(res['verified_bitwise'])}")


def to_markdown(res: dict[str, Any]) -> str:
    return "\n".join(f"**{t}**\n\n{markdown_table(c, r)}\n" for t, c, r in tables(res))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=4.0, help="tensor bytes in GiB (default 4)")
    p.add_argument("--src", default="tp=2,ep=2", help="source layout (default tp=2,ep=2)")
    p.add_argument("--to", default="tp=1,ep=4,pp=2", help="target layout (default tp=1,ep=4,pp=2)")
    p.add_argument("--budgets", default="2GB,256MiB,2GB:noverify",
                   help="ckpt runs, by memory budget; ':noverify' skips the source checksum check "
                        "(default 2GB,256MiB,2GB:noverify)")
    p.add_argument("--workers", type=int, default=2, help="ckpt reshard workers (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="repeats; figures are medians (default 1)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each ckpt / DCP run (root)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: under $TMPDIR)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")
    p.add_argument("--markdown", default=None, help="also write the tables as markdown here")
    p.add_argument("--from-json", default=None, help="do not measure: report a run saved with --json")


def main(args: argparse.Namespace) -> int:
    if args.from_json:
        with open(args.from_json) as f:
            res = summarize(json.load(f))
    else:
        warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
        if args.dir:
            os.makedirs(args.dir, exist_ok=True)
        root = tempfile.mkdtemp(prefix="ckpt-bench-reshard-", dir=args.dir)
        try:
            res = summarize(run(args.size_gb, args.src, args.to, args.budgets.split(","), args.workers,
                                args.repeats, root, args.cold, args.seed))
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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    sys.exit(main(p.parse_args()))
