"""Compressed checkpoints: file bytes and save / load throughput of ckpt's zstd codec (with and
without byte planes) against uncompressed ckpt and against DCP, plain and with ``_extensions=
[ZStandard()]``, on the same states in one run.

States:

- ``bf16``: a transformer-like state of ``--mb`` MB of bf16 weights, ``randn * 0.02`` (the usual
  init scale), matrices of a few shapes (attention, MLP, embeddings) plus norm vectors of ones;
- ``trained``: ckpt's trainer MoE (``CONFIGS["tiny"]``, fp32) after ``--steps`` AdamW steps on random
  tokens: its weights and the optimizer's ``exp_avg`` / ``exp_avg_sq`` (skip with ``--no-trained``).

Each round saves every case once into a fresh directory and loads it back (warm page cache; every
save durable: ckpt fsyncs, DCP's FileSystemWriter with ``sync_files=True``); rounds alternate the
cases so that a busy machine's drift hits them alike; figures are medians over ``--repeat`` rounds.
Throughput is raw state bytes (uncompressed) per second, so the columns compare directly; ``ratio``
is bytes on disk over raw bytes. Every load is checked bitwise against the saved state.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch

from bench.common import GB, dir_bytes, fmt, machine_info, median, print_table, remove, write_json_atomic

CASES = ("ckpt", "ckpt-zstd", "ckpt-zstd-planes", "dcp", "dcp-zstd")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=int, default=128, help="MB of bf16 weights in the synthetic state (default 128)")
    p.add_argument("--repeat", type=int, default=3, help="saves and loads per case (median)")
    p.add_argument("--level", type=int, default=1,
                   help="zstd level for ckpt (default 1, ckpt's default; DCP's ZStandard uses zstd's default, 3)")
    p.add_argument("--steps", type=int, default=20, help="AdamW steps for the trained state")
    p.add_argument("--no-trained", action="store_true", help="skip the trained-model state")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write results here (e.g. bench/results/compression_cpu.json)")


def bf16_state(mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Transformer-like bf16 weights, ``randn * 0.02``, about ``mb`` MB."""
    g = torch.Generator().manual_seed(seed)
    h = 1024
    out: dict[str, torch.Tensor] = {"embed": (torch.randn(8192, h, generator=g) * 0.02).to(torch.bfloat16)}
    layer = 0
    while sum(t.numel() * 2 for t in out.values()) < mb * 1e6:
        for name, shape in (("q", (h, h)), ("k", (h // 4, h)), ("v", (h // 4, h)), ("o", (h, h)),
                            ("up", (2816, h)), ("gate", (2816, h)), ("down", (h, 2816))):
            out[f"layers.{layer}.{name}"] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        out[f"layers.{layer}.norm"] = torch.ones(h, dtype=torch.bfloat16)
        layer += 1
    return out


def trained_state(steps: int) -> dict[str, torch.Tensor]:
    """The trainer's tiny MoE after ``steps`` AdamW steps: weights and optimizer moments (fp32)."""
    from ckpt.trainer.model import MoEForCausalLM
    from ckpt.trainer.model_config import CONFIGS

    torch.manual_seed(0)
    model = MoEForCausalLM(CONFIGS["tiny"])
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = CONFIGS["tiny"].vocab_size
    for _ in range(steps):
        ids = torch.randint(0, vocab, (4, 64))
        _, loss = model(ids, labels=ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = dict(enumerate(n for n, _ in model.named_parameters()))
    for i, s in opt.state_dict()["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"optim.{names[i]}.{k}"] = s[k].clone()
    return out


def _save(case: str, state: dict[str, torch.Tensor], path: str, level: int) -> None:
    import ckpt
    from ckpt._codec import Codec

    if case.startswith("ckpt"):
        comp = None if case == "ckpt" else Codec(level=level, planes=case.endswith("planes"))
        ckpt.save(state, path, compression=comp, overwrite=True)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    ext = [ZStandard()] if case == "dcp-zstd" else None
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True, _extensions=ext), no_dist=True)


def _load(case: str, like: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    target = {k: torch.empty_like(v) for k, v in like.items()}
    if case.startswith("ckpt"):
        import ckpt

        ckpt.load(target, path)
        return target
    import torch.distributed.checkpoint as dcp

    dcp.load(target, checkpoint_id=path, no_dist=True)
    return target


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def run_cases(state: dict[str, torch.Tensor], root: str, repeat: int, level: int) -> list[dict[str, Any]]:
    """Every case, ``repeat`` rounds interleaved: save, size on disk, load (checked bitwise)."""
    raw = sum(t.numel() * t.element_size() for t in state.values())
    saves: dict[str, list[float]] = {c: [] for c in CASES}
    loads: dict[str, list[float]] = {c: [] for c in CASES}
    disk: dict[str, int] = {}
    for _ in range(repeat):
        for case in CASES:
            path = os.path.join(root, case)
            remove(path)
            os.sync()
            t0 = time.perf_counter()
            _save(case, state, path, level)
            saves[case].append(time.perf_counter() - t0)
            disk[case] = dir_bytes(path)
            t0 = time.perf_counter()
            got = _load(case, state, path)
            loads[case].append(time.perf_counter() - t0)
            bad = [k for k, v in state.items() if not torch.equal(_bytes(got[k]), _bytes(v))]
            if bad:
                raise AssertionError(f"{case}: loaded values differ for {bad[:3]}")
            remove(path)
    return [{"case": c, "raw_bytes": raw, "disk_bytes": disk[c], "ratio": disk[c] / raw,
             "save_s": median(saves[c]), "load_s": median(loads[c]), "save_gbps": raw / GB / median(saves[c]),
             "load_gbps": raw / GB / median(loads[c]), "saves": saves[c], "loads": loads[c]} for c in CASES]


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    root = tempfile.mkdtemp(prefix="ckpt-compress-", dir=args.dir)
    states = {"bf16": bf16_state(args.mb)}
    if not args.no_trained:
        states["trained"] = trained_state(args.steps)
    result: dict[str, Any] = {"machine": machine_info(root), "level": args.level, "repeat": args.repeat,
                              "states": {}}
    try:
        for name, state in states.items():
            rows = run_cases(state, root, args.repeat, args.level)
            raw = rows[0]["raw_bytes"]
            result["states"][name] = {"raw_bytes": raw, "tensors": len(state), "cases": rows}
            print_table(f"{name}: {raw / 1e6:.0f} MB raw, {len(state)} tensors (median of {args.repeat})",
                        ["case", "MB on disk", "ratio", "save GB/s", "load GB/s", "save s", "load s"],
                        [[r["case"], fmt(r["disk_bytes"] / 1e6, 1), fmt(r["ratio"], 3), fmt(r["save_gbps"]),
                          fmt(r["load_gbps"]), fmt(r["save_s"]), fmt(r["load_s"])] for r in rows])
    finally:
        remove(root)
    if args.json:
        write_json_atomic(args.json, result)
    return 0
