"""Hugging Face export: ``ckpt export-hf`` (streaming) against the naive paths, single node (CPU).

A checkpoint of the embedded MoE (``--size-gb`` GiB of fp32 weights, random values, no optimizer
state) is generated once by 4 forked ranks under the layout tp=2 x ep=2, each saving its own boxes
of every parameter (4 data files, up to 4 shards per tensor), as the trainer would. Then each
repeat runs every contender in a fresh subprocess and measures the export's wall time (the output
is fsynced by every contender) and the process's peak RSS (VmHWM, which includes the ~0.3-0.5 GB of
Python + torch that every contender pays; the baseline column is VmRSS just before the export):

- ``ckpt``: :func:`ckpt.hf.convert.export_hf` with ``--budget`` bytes of buffers;
- ``naive-safetensors``: ``ckpt.load`` of every weight into the trainer's model in one process,
  ``to_hf_state_dict`` (per-expert copies), cast, ``safetensors.torch.save_file`` per 5 GB shard;
- ``naive-save-pretrained``: the same load, then transformers' ``Qwen3MoeForCausalLM`` (built on the
  meta device, weights assigned, experts fused as transformers holds them) and ``save_pretrained``.

Before each run the page cache is dropped when possible (root), so every contender reads the
source from disk. The outputs of all contenders are compared tensor by tensor (bitwise) once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any

import torch

from bench.common import (
    GB,
    can_drop_caches,
    dir_bytes,
    drop_caches,
    fmt,
    fsync_path,
    machine_info,
    markdown_table,
    median,
    print_table,
    proc_status_bytes,
    remove,
)

CONTENDERS = ["ckpt", "naive-safetensors", "naive-save-pretrained"]
LAYOUT = "tp=2,ep=2"
MAX_SHARD = 5 * 10**9


def bench_config(size_gb: float) -> Any:
    """A Qwen3-MoE-shaped config (32 experts of 768, hidden 1024) with as many layers as fit ``size_gb`` GiB in fp32."""
    from ckpt.trainer.model import ModelConfig

    base = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=768,
                       num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                       num_experts=32, num_experts_per_tok=4)
    two = dataclasses.replace(base, num_hidden_layers=2)
    per_layer = two.num_parameters() - base.num_parameters()
    fixed = base.num_parameters() - per_layer
    layers = max(1, round((size_gb * (1 << 30) / 4 - fixed) / per_layer))
    return dataclasses.replace(base, num_hidden_layers=layers)


# ---------------------------------------------------------------------------------------------
# the source checkpoint: 4 forked ranks, tp=2 x ep=2


def _save_rank(rank: int, world: int, path: str, cfg_dict: dict[str, Any]) -> None:
    import torch.distributed as dist

    import ckpt
    from ckpt.layout import Layout
    from ckpt.resharders.rules import MOE_RULES, param_box
    from ckpt.trainer.model import ModelConfig, MoEForCausalLM

    torch.set_num_threads(1)
    try:
        cfg = ModelConfig.from_dict(cfg_dict)
        layout = Layout.parse(LAYOUT)
        coord = layout.coord(rank)
        with torch.device("meta"):
            shapes = {n: tuple(p.shape) for n, p in MoEForCausalLM(cfg).named_parameters()}
        model: dict[str, Any] = {}
        for name, shape in shapes.items():
            box = param_box(name, shape, layout, coord, MOE_RULES)
            # Seeded by name and box, so replicas of a piece are identical on every rank.
            g = torch.Generator().manual_seed(zlib.crc32(f"{name}{box.offsets}".encode()))
            local = torch.empty(box.lengths).normal_(0.0, 0.02, generator=g)
            model[name] = ckpt.Shard(local, shape, box.offsets)
        meta = {"model_config": cfg.to_dict(), "layout": layout.to_dict(), "rules": "embedded-moe"}
        ckpt.save({"model": model, "train": {"step": 100}}, path, step=100, user_metadata=meta,
                  layout=layout.to_dict())
        dist.barrier()
    finally:
        dist.destroy_process_group()


def make_source(path: str, cfg: Any) -> float:
    """Write the source checkpoint at ``path`` (kept if it already matches ``cfg``); returns seconds."""
    import ckpt
    from bench.ranks import gloo_ranks

    try:
        if ckpt.inspect(path).user_metadata.get("model_config") == cfg.to_dict():
            return 0.0
    except ckpt.CheckpointError:
        pass
    remove(path)
    t0 = time.perf_counter()
    gloo_ranks(4, _save_rank, path, cfg.to_dict())
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# contenders (each runs in its own process: `python -m bench.hf_export --worker NAME ...`)


def _fsync_tree(path: str) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)


def _load_all(src: str) -> tuple[Any, dict[str, torch.Tensor]]:
    import ckpt
    from ckpt.trainer.model import ModelConfig, MoEForCausalLM

    cfg = ModelConfig.from_dict(ckpt.inspect(src).user_metadata["model_config"])
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    model.to_empty(device="cpu")
    state = model.state_dict()
    ckpt.load({"model": state}, src, strict=False)
    return cfg, state


def _naive_safetensors(src: str, out: str, dtype: torch.dtype | None) -> None:
    from safetensors.torch import save_file

    from ckpt.trainer.hf_adapters import to_hf_state_dict

    cfg, state = _load_all(src)
    hf = to_hf_state_dict(state)
    del state
    if dtype is not None:
        hf = {k: v.to(dtype) for k, v in hf.items()}
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in hf.items():
        n = v.numel() * v.element_size()
        if groups[-1] and size + n > MAX_SHARD:
            groups.append({})
            size = 0
        groups[-1][k] = v
        size += n
    os.makedirs(out, exist_ok=True)
    weight_map = {}
    for i, g in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(g, os.path.join(out, name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(g, name)
    total = sum(v.numel() * v.element_size() for v in hf.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    conf = cfg.to_hf_config_dict()
    conf["dtype"] = conf["torch_dtype"] = str(dtype or torch.float32).removeprefix("torch.")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    _fsync_tree(out)


def _naive_save_pretrained(src: str, out: str, dtype: torch.dtype | None) -> None:
    import transformers

    cfg, state = _load_all(src)
    fused: dict[str, torch.Tensor] = {}
    for k, v in state.items():  # transformers holds gate and up fused: (E, 2I, H)
        if k.endswith("mlp.experts.gate_proj"):
            fused[k.replace("gate_proj", "gate_up_proj")] = torch.cat([v, state[k[: -len("gate_proj")] + "up_proj"]], 1)
        elif not k.endswith("mlp.experts.up_proj"):
            fused[k] = v
    del state
    conf = transformers.Qwen3MoeConfig(**cfg.to_hf_config_dict())
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(conf)
    model.load_state_dict(fused, strict=True, assign=True)
    del fused
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out, max_shard_size=MAX_SHARD)
    _fsync_tree(out)


def _ckpt(src: str, out: str, dtype: torch.dtype | None, budget: int) -> None:
    from ckpt.hf.convert import export_hf

    export_hf(src, out, dtype=dtype, memory_budget=budget, max_shard_size=MAX_SHARD)



def worker(name: str, src: str, out: str, dtype_s: str, budget: int) -> dict[str, Any]:
    """Run one contender in this process; returns its wall time and memory figures."""
    import transformers  # noqa: F401  (imported before timing by every contender: same baseline)

    import ckpt  # noqa: F401

    dtype = None if dtype_s == "keep" else {"bf16": torch.bfloat16, "fp16": torch.float16,
                                           "fp32": torch.float32}[dtype_s]
    base = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    if name == "ckpt":
        _ckpt(src, out, dtype, budget)
    elif name == "naive-safetensors":
        _naive_safetensors(src, out, dtype)
    elif name == "naive-save-pretrained":
        _naive_save_pretrained(src, out, dtype)
    else:
        raise SystemExit(f"unknown contender {name!r}")
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_rss": proc_status_bytes("VmHWM"), "baseline_rss": base}


def run_one(name: str, src: str, out: str, dtype_s: str, budget: int) -> dict[str, Any]:
    remove(out)
    os.sync()
    drop_caches()
    cmd = [sys.executable, "-m", "bench.hf_export", "--worker", name, src, out, dtype_s, str(budget)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(a: str, b: str) -> int:
    """Tensors of export ``b`` bitwise equal to export ``a`` (streaming, one tensor at a time)."""
    from safetensors import safe_open

    def where(d: str) -> dict[str, str]:
        index = os.path.join(d, "model.safetensors.index.json")
        if not os.path.exists(index):  # save_pretrained writes one model.safetensors when it fits
            with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
                return dict.fromkeys(f.keys(), "model.safetensors")
        with open(index) as f:
            return dict(json.load(f)["weight_map"])

    wa, wb = where(a), where(b)
    if set(wa) != set(wb):
        raise RuntimeError(f"{a} and {b} hold different tensor names: {sorted(set(wa) ^ set(wb))[:5]}")
    for k in wa:
        with safe_open(os.path.join(a, wa[k]), "pt") as fa, safe_open(os.path.join(b, wb[k]), "pt") as fb:
            ta, tb = fa.get_tensor(k), fb.get_tensor(k)
            if ta.dtype != tb.dtype or not torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)):
                raise RuntimeError(f"{k}: {a} and {b} differ")
    return len(wa)


# ---------------------------------------------------------------------------------------------
# driver


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(size_gb: float, repeats: int, root: str, dtypes: list[str], budget: int, names: list[str]) -> dict[str, Any]:
    import ckpt

    cfg = bench_config(size_gb)
    src = os.path.join(root, "src")
    _log(f"source: {cfg.num_parameters() / 1e9:.2f} B parameters, {cfg.num_hidden_layers} layers, layout {LAYOUT} ...")
    gen_s = make_source(src, cfg)
    m = ckpt.inspect(src)
    src_bytes = m.total_bytes
    cold = can_drop_caches()
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {d: {n: [] for n in names} for d in dtypes}
    verified: dict[str, int] = {}
    for d in dtypes:
        for r in range(repeats):
            for n in names:
                out = os.path.join(root, f"out-{n}")
                res = run_one(n, src, out, d, budget)
                res["out_bytes"] = dir_bytes(out)
                raw[d][n].append(res)
                _log(f"[{d} {r + 1}/{repeats}] {n:<22} {res['seconds']:6.2f} s  peak RSS "
                     f"{res['peak_rss'] / GB:5.2f} GB (baseline {res['baseline_rss'] / GB:.2f})")
                if r == 0 and n != "ckpt" and "ckpt" in names:
                    ours = os.path.join(root, "out-ckpt")
                    if not os.path.exists(ours):
                        run_one("ckpt", src, ours, d, budget)
                    verified[f"{d}: {n}"] = compare(ours, out)
                if n != "ckpt":
                    remove(out)
            remove(os.path.join(root, "out-ckpt"))
    return {
        "benchmark": "hf-export",
        "config": {"size_gb": size_gb, "repeats": repeats, "dtypes": dtypes, "budget": budget, "dir": root,
                   "layout": LAYOUT, "model_config": cfg.to_dict()},
        "machine": machine_info(root),
        "source": {"bytes": src_bytes, "tensors": len(m.tensors), "files": len(m.files), "generate_s": gen_s},
        "cold": cold or "page cache dropped before each run",
        "verified_bitwise_tensors": verified,
        "raw": raw,
    }


def tables(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    src_bytes = res["source"]["bytes"]
    for d, per in res["raw"].items():
        med = {n: {k: median([x[k] for x in xs]) for k in ("seconds", "peak_rss", "baseline_rss", "out_bytes")}
               for n, xs in per.items() if xs}
        ref = med.get("ckpt")
        rows = []
        for n, v in med.items():
            rows.append([n, fmt(v["seconds"]), fmt(src_bytes / GB / v["seconds"]), fmt(v["peak_rss"] / GB),
                         fmt(v["baseline_rss"] / GB), fmt(v["out_bytes"] / GB),
                         fmt(v["seconds"] / ref["seconds"]) + "x" if ref else "-",
                         fmt(v["peak_rss"] / ref["peak_rss"]) + "x" if ref else "-"])
        title = (f"export {src_bytes / GB:.2f} GB fp32 checkpoint ({LAYOUT}), dtype {d}, "
                 f"{res['config']['repeats']} repeat(s), medians")
        out.append((title, ["contender", "time s", "GB/s (source)", "peak RSS GB", "baseline GB", "written GB",
                            "time / ckpt", "RSS / ckpt"], rows))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=4.0, help="source checkpoint size in GiB of fp32 (default 4)")
    p.add_argument("--repeats", type=int, default=2, help="repeats; figures are medians (default 2)")
    p.add_argument("--dtypes", default="keep,bf16", help="export dtypes to run, comma-separated (default keep,bf16)")
    p.add_argument("--budget", default="1GiB", help="ckpt's memory budget (default 1GiB)")
    p.add_argument("--dir", default=None, help="working directory (default: a directory under $TMPDIR, kept)")
    p.add_argument("--only", default=None, help="comma-separated contenders (default: all)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")
    p.add_argument("--markdown", default=None, help="also write the tables as markdown here")


def main(args: argparse.Namespace) -> int:
    from ckpt.hf.convert import parse_size

    root = args.dir or os.path.join(tempfile.gettempdir(), "ckpt-bench-hf")
    os.makedirs(root, exist_ok=True)
    names = args.only.split(",") if args.only else CONTENDERS
    res = run(args.size_gb, args.repeats, root, args.dtypes.split(","), parse_size(args.budget), names)
    for title, cols, rows in tables(res):
        print_table(title, cols, rows)
    print(f"cold source reads: {res['cold']}; verified bitwise: {res['verified_bitwise_tensors']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            for title, cols, rows in tables(res):
                f.write(f"**{title}**\n\n{markdown_table(cols, rows)}\n\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, name, src, out, dtype_s, budget = sys.argv
        print(json.dumps(worker(name, src, out, dtype_s, int(budget))), flush=True)
    else:
        parser = argparse.ArgumentParser(prog="python -m bench.hf_export", description=__doc__)
        add_arguments(parser)
        sys.exit(main(parser.parse_args()))
