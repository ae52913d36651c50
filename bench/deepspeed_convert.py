"""DeepSpeed ZeRO -> full fp32: DeepSpeed's ``zero_to_fp32`` (``convert_zero_checkpoint_to_fp32_state_dict``)
vs ``ckpt import`` of the same checkpoint, each in a fresh process: wall time and peak RSS (and the
RSS of a process that only imports torch, the baseline both pay). zero_to_fp32 writes the fp32
parameters only; ckpt import writes the parameters and both Adam moments (3x the bytes), streaming
under ``--memory-budget``. The checkpoint is made by DeepSpeed itself (ZeRO-2, 2 forked gloo ranks
on CPU, one Adam step) unless ``--dir`` already holds one. Needs deepspeed importable (a test-only
tool; see tests/fixtures/deepspeed/make_fixtures.py for how to install it); skipped otherwise.

    python -m bench deepspeed [--params-m 125] [--stage 2] [--dir DIR] [--memory-budget 256MB] [--json FILE]
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

import torch

from bench.common import dir_bytes, fmt, print_table
from bench.ranks import gloo_ranks


def _deepspeed_init(device: str) -> torch.device:
    """Join the group as DeepSpeed does, from the torchrun environment the launcher set."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return torch.device(device)


def _rank(rank: int, world: int, params_m: float, stage: int, out: str) -> None:
    import deepspeed

    torch.manual_seed(0)
    width = 2048
    layers = max(1, int(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(1, width)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag="step1")


def make_checkpoint(out: str, params_m: float, stage: int) -> None:
    """A ZeRO checkpoint of about ``params_m`` million fp32 parameters, by DeepSpeed on 2 CPU ranks."""
    gloo_ranks(2, _rank, params_m, stage, out, init=_deepspeed_init, env={"DS_ACCELERATOR": "cpu"}, barrier=False)


def _measure(code: str, env: dict[str, str]) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; wall time and its peak RSS (ru_maxrss of the child)."""
    wrapper = ("import resource, sys, time, json\nt = time.perf_counter()\n" + code +
               "\nprint(json.dumps({'s': time.perf_counter() - t, "
               "'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")
    p = subprocess.run([sys.executable, "-c", wrapper], env=env, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def run(root: str, params_m: float, stage: int, budget: str) -> dict[str, Any]:
    src = os.path.join(root, "ds")
    if not os.path.exists(os.path.join(src, "latest")):
        make_checkpoint(src, params_m, stage)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"}
    base = _measure("import torch", env)
    zfp = os.path.join(root, "zero_to_fp32.bin")
    ds = _measure("from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c\n"
                  f"c({src!r}, {zfp!r}, safe_serialization=False)", env)
    out = os.path.join(root, "ckpt")
    ck = _measure("from ckpt.convert import import_checkpoint\nfrom ckpt.cli.reshard import parse_size\n"
                  f"import_checkpoint({src!r}, {out!r}, memory_budget=parse_size({budget!r}), overwrite=True)", env)
    import ckpt

    m = ckpt.inspect(out)
    params = sum(t.nbytes for k, t in m.tensors.items() if k.startswith("model."))
    return {"source_bytes": dir_bytes(src), "param_bytes": params, "ckpt_bytes": m.total_bytes,
            "zero_to_fp32_out_bytes": os.path.getsize(zfp) if os.path.isfile(zfp) else dir_bytes(zfp),
            "baseline": base, "zero_to_fp32": ds, "ckpt_import": ck, "memory_budget": budget, "stage": stage}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params-m", type=float, default=125.0, help="millions of fp32 parameters")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--memory-budget", default="256MB")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("skipped: deepspeed is not importable (see tests/fixtures/deepspeed/make_fixtures.py to install it)")
        return 0
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-ds-")
    os.makedirs(root, exist_ok=True)
    t0 = time.perf_counter()
    res = run(root, args.params_m, args.stage, args.memory_budget)
    base = res["baseline"]["rss"]
    rows = [[name, fmt(r["s"], 2), fmt(r["rss"] / 2**20, 0), fmt((r["rss"] - base) / 2**20, 0), fmt(out / 1e9, 3)]
            for name, r, out in (("zero_to_fp32 (params)", res["zero_to_fp32"], res["zero_to_fp32_out_bytes"]),
                                 ("ckpt import (params + moments)", res["ckpt_import"], res["ckpt_bytes"]))]
    print_table(f"DeepSpeed ZeRO-{res['stage']} -> fp32 ({res['param_bytes'] / 1e9:.2f} GB of parameters, "
                f"{res['source_bytes'] / 1e9:.2f} GB on disk)",
                ["converter", "s", "peak RSS MiB", "above torch import MiB", "written GB"], rows)
    print(f"baseline (python -c 'import torch'): {base / 2**20:.0f} MiB; ckpt budget {res['memory_budget']}; "
          f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
