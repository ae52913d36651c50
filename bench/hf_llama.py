"""Hugging Face import and export of a Llama (an adapter family, not the embedded MoE): ckpt against
transformers' own ``from_pretrained`` + ``save_pretrained``, same data, same run (CPU).

A Llama-shaped model of ``--size-gb`` GB of fp32 weights (random values, written once with
safetensors in ``save_pretrained``'s layout) is the source. Each repeat runs every contender in a
fresh subprocess (page cache dropped first when root) and records wall time and peak RSS (VmHWM):

- ``ckpt-import``: ``import_hf(HF_DIR, CKPT)`` (streaming, single layout);
- ``ckpt-export``: ``export_hf(CKPT, OUT)`` (streaming);
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(HF_DIR)`` then ``save_pretrained(OUT)``,
  the job both of ckpt's commands replace;
- ``transformers+fsync``: the same, then ``fsync`` of every file written and of the directory: the
  durability ckpt's commands give (they fsync before they return), so the two can be compared with
  the disk's write-back counted on both sides.

The disk's own write speed (``dd conv=fdatasync`` of the source's size) is measured in the same run.

The ckpt export is compared with the source tensor by tensor (bitwise) once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.common import (
    GB,
    drop_caches,
    fmt,
    markdown_table,
    median,
    print_table,
    proc_status_bytes,
    remove,
    run_dd,
)

CONTENDERS = ["ckpt-import", "ckpt-export", "transformers", "transformers+fsync"]


def _config(size_gb: float) -> dict[str, Any]:
    h, inter, vocab = 2048, 5632, 32000
    per_layer = 4 * h * h + 3 * h * inter + 2 * h
    layers = max(1, int((size_gb * GB / 4 - 2 * vocab * h) // per_layer))
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": h,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 4, "tie_word_embeddings": False, "dtype": "float32", "torch_dtype": "float32"}


def make_source(path: str, size_gb: float) -> None:
    """A save_pretrained-style Llama directory of random fp32 weights (files of <= 5 GB)."""
    import torch
    from safetensors.torch import save_file

    from ckpt.hf.adapters import ADAPTERS

    cfg = _config(size_gb)
    os.makedirs(path, exist_ok=True)
    params = ADAPTERS["llama"].params(ADAPTERS["llama"].complete(cfg, where=path))
    g = torch.Generator().manual_seed(0)
    files: list[dict[str, Any]] = [{}]
    size, wmap = 0, {}
    for name, shape in params:
        t = torch.randn(shape, generator=g) * 0.02
        if size and size + t.numel() * 4 > 5 * 10**9:
            files.append({})
            size = 0
        files[-1][name] = t
        size += t.numel() * 4
    for k, group in enumerate(files):
        fn = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(group, os.path.join(path, fn), metadata={"format": "pt"})
        wmap |= {n: fn for n in group}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)
    import transformers

    with open(os.path.join(path, "config.json"), "w") as f:  # every field, as save_pretrained writes it
        json.dump(transformers.LlamaConfig(**cfg).to_dict(), f)



def worker(name: str, src: str, ck: str, out: str) -> dict[str, Any]:
    """One contender in this process: wall time and peak RSS."""
    import torch
    import transformers

    from ckpt.hf.convert import export_hf, import_hf

    t0 = time.perf_counter()
    if name == "ckpt-import":
        import_hf(src, ck)
    elif name == "ckpt-export":
        export_hf(ck, out)
    elif name in ("transformers", "transformers+fsync"):
        m = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        m.save_pretrained(out)
        if name == "transformers+fsync":
            for f in os.listdir(out):
                fd = os.open(os.path.join(out, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fd = os.open(out, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    else:
        raise SystemExit(f"unknown contender {name!r}")
    return {"seconds": time.perf_counter() - t0, "peak_rss": proc_status_bytes("VmHWM")}


def run_one(name: str, src: str, ck: str, out: str) -> dict[str, Any]:
    remove(out)
    if name == "ckpt-import":
        remove(ck)
    os.sync()
    drop_caches()
    proc = subprocess.run([sys.executable, "-m", "bench.hf_llama", "--worker", name, src, ck, out],
                          capture_output=True, text=True,
                          env=dict(os.environ, TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _bitwise(src: str, out: str) -> int:
    from safetensors import safe_open

    def tensors(d: str) -> dict[str, str]:
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            return {k: os.path.join(d, v) for k, v in json.load(f)["weight_map"].items()}

    a, b = tensors(src), tensors(out)
    assert sorted(a) == sorted(b), "exported names differ from the source"
    for k in a:
        with safe_open(a[k], "pt") as fa, safe_open(b[k], "pt") as fb:
            assert fa.get_tensor(k).equal(fb.get_tensor(k)), k
    return len(a)


def main(args: argparse.Namespace) -> int:
    root = args.dir or os.path.join(tempfile.gettempdir(), "ckpt-bench-hf-llama")
    src, ck, out = (os.path.join(root, n) for n in ("hf", "ckpt", "out"))
    if not os.path.exists(os.path.join(src, "config.json")):
        make_source(src, args.size_gb)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in CONTENDERS}
    for _ in range(args.repeats):
        for n in CONTENDERS:
            runs[n].append(run_one(n, src, ck, out))
            if n == "ckpt-export" and not runs.get("_checked"):
                runs["_checked"] = [{"tensors": _bitwise(src, out)}]
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors"))
    tf = {k: median([r[k] for r in runs["transformers"]]) for k in ("seconds", "peak_rss")}
    rows = []
    for n in CONTENDERS:
        s, rss = (median([r[k] for r in runs[n]]) for k in ("seconds", "peak_rss"))
        rows.append([n, fmt(s), f"{size / s / GB:.2f}", f"{rss / GB:.2f}", f"{tf['seconds'] / s:.2f}x",
                     f"{rss / tf['peak_rss']:.2f}"])
    cols = ["contender", "seconds (median)", "GB/s", "peak RSS GB", "speed vs transformers", "RSS / transformers"]
    dd = run_dd(os.path.join(root, "dd.bin"), count=max(1, int(size / (16 << 20))))
    durable = median([r["seconds"] for r in runs["transformers+fsync"]])
    checked = runs["_checked"][0]["tensors"]
    title = (f"Llama {size / GB:.2f} GB fp32 ({args.repeats} repeats; export bitwise: {checked}); "
             f"dd conv=fdatasync {dd.gbps:.2f} GB/s = {size / dd.gbps / GB:.2f} s for the export's bytes; "
             f"ckpt-export vs transformers+fsync {durable / median([r['seconds'] for r in runs['ckpt-export']]):.2f}x")
    print_table(title, cols, rows)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"**{title}**\n\n{markdown_table(cols, rows)}\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=4.0, help="source size in GB (10**9 bytes) of fp32 (default 4)")
    p.add_argument("--repeats", type=int, default=2, help="repeats; figures are medians (default 2)")
    p.add_argument("--dir", default=None, help="working directory (default: under $TMPDIR, kept)")
    p.add_argument("--markdown", default=None, help="also write the table as markdown here")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(*sys.argv[2:6])), flush=True)
    else:
        parser = argparse.ArgumentParser(prog="python -m bench.hf_llama", description=__doc__)
        add_arguments(parser)
        sys.exit(main(parser.parse_args()))
