"""The main job (``ckpt demo``): train, lose a rank, resume, reshard onto fewer ranks, verify, export.

1. train ``tiny`` on 4 ranks (``tp=2, ep=2``, ZeRO-1) through torchrun with async checkpoints;
2. one rank SIGKILLs itself mid-run; the launcher restarts the group, which resumes from the newest
   committed checkpoint (same layout: bitwise the same trajectory);
3. stop, then continue on 2 ranks under another layout (``pp=2``, 1F1B), resharding at load;
4. verify the final checkpoint (structure, coverage, checksums) and evaluate it in one process;
5. export to Hugging Face and reload in transformers when the exporter (``ckpt.hf.convert``) exists;
6. plot the loss curve with the saves, the failure and the resume marked (matplotlib optional).

``node_loss`` (``ckpt demo --node-loss``): phase 1 keeps a memory checkpoint every step (node-local
shared memory, each rank's pieces copied to a rank of the other simulated node) and loses a whole
node instead of one rank: ranks 2 and 3 (node 1) delete node 1's shared memory and SIGKILL
themselves; the restarted group resumes from the memory tier, ranks 2 and 3 fetching their pieces
from the copies node 0 keeps (every checksum checked), with no step lost.

The workers' and torchrun's output (including the killed rank's peers' errors) goes to
``<out>/logs/phase-<n>.log``; the console tells the story only.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

import ckpt
from ckpt.errors import StateError
from ckpt.layout import Layout
from ckpt.manager import CheckpointManager
from ckpt.trainer.checkpoint import load_full_model
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.data import SampleSource
from ckpt.trainer.hybrid import HybridConfig
from ckpt.trainer.launch import launch
from ckpt.trainer.metrics import plot_loss, read_metrics
from ckpt.trainer.model import ModelConfig

MARKER = ".ckpt-demo"
FIRST_LAYOUT = Layout(tp=2, ep=2, zero=1)
SECOND_LAYOUT = Layout(pp=2, zero=1)


@dataclass(slots=True)
class DemoReport:
    """Where everything went and what was checked."""

    out_dir: str
    ckpt_dir: str
    metrics: str
    final_checkpoint: str | None = None
    plot: str | None = None
    plot_note: str = ""
    verified: bool = False
    eval_loss: float | None = None
    hf_export: str | None = None
    hf_note: str = ""
    phases: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    node_loss: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain data (written as ``demo.json``)."""
        return asdict(self)


def _prepare(out_dir: str) -> None:
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not os.path.exists(os.path.join(out_dir, MARKER)):
            raise StateError(f"{out_dir} exists and was not made by `ckpt demo`; pass another --out")
        shutil.rmtree(out_dir)  # a previous demo's output: start afresh
    os.makedirs(out_dir, exist_ok=True)
    open(os.path.join(out_dir, MARKER), "w").close()


def evaluate(url: str, config: ModelConfig | HybridConfig, samples: int = 32, seq_len: int = 64) -> float:
    """Mean loss of the checkpoint's model on held-out text (another corpus seed), in one process."""
    model = load_full_model(url, config)
    ids = SampleSource(seq_len, seed=12345).batch(0, samples)
    with torch.no_grad():
        _, loss = model(ids, labels=ids)
    return float(loss)


def hf_roundtrip(url: str, out: str, config: ModelConfig | HybridConfig) -> tuple[str | None, str]:
    """Export with ``ckpt.hf.convert.export_hf(url, out)`` and reload in transformers, comparing
    logits with this package's model; ``(path, note)``, path None when skipped."""
    try:
        from ckpt.hf.convert import export_hf
    except ImportError:
        return None, "skipped: the Hugging Face exporter (ckpt.hf.convert.export_hf) is not installed yet"
    try:
        import transformers
    except ImportError:
        return None, "skipped: transformers is not installed (pip install ckpt[hf])"
    export_hf(url, out)
    # keep the console to the story: transformers' "Loading weights" bar is noise here
    transformers.utils.logging.disable_progress_bar()
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    finally:
        transformers.utils.logging.enable_progress_bar()
    ours = load_full_model(url, config)
    ids = SampleSource(32, seed=12345).batch(0, 2)
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()  # type: ignore[operator]
    return out, f"reloaded in transformers; max |logits difference| {diff:.2e}"


def run_demo(out_dir: str = "ckpt-demo", *, steps: int = 200, say: Callable[[str], None] = print,
             node_loss: bool = False) -> DemoReport:
    """Run the whole main job on this machine (CPU is enough); returns where everything is.
    ``node_loss``: phase 1 loses node 1 and recovers from the memory tier (see the module docstring)."""
    t0 = time.perf_counter()
    out_dir = os.path.abspath(out_dir)
    _prepare(out_dir)
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    report = DemoReport(out_dir, ckpt_dir, os.path.join(ckpt_dir, "metrics.jsonl"), node_loss=node_loss)
    logs = os.path.join(out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    stop = int(steps * 0.6)
    fail_at = int(steps * 0.35)
    base = TrainConfig(steps=steps, global_batch=16, seq_len=64, save_every=max(steps // 10, 1), ckpt_dir=ckpt_dir,
                       keep_last=3, warmup=max(steps // 20, 1), lr=4e-3, device="cpu")
    first = replace(base, stop_after=stop, fail_at_step=fail_at, fail_rank=FIRST_LAYOUT.world_size - 1)
    lost = f"rank {FIRST_LAYOUT.world_size - 1} killed at step {fail_at}"
    if node_loss:
        # this demo's own run id: a fresh tier, whatever an earlier demo in the same --out left
        first = replace(first, fail_node=1, nodes=2, memory_every=1, run_id=f"demo-{uuid.uuid4().hex[:8]}")
        lost = f"memory checkpoint every step, node 1 (ranks 2-3) lost at step {fail_at}"
    phases = [
        (FIRST_LAYOUT, first, f"phase 1: {FIRST_LAYOUT.world_size} ranks ({FIRST_LAYOUT}), steps 0-{stop}, {lost}"),
        (SECOND_LAYOUT, base, f"phase 2: {SECOND_LAYOUT.world_size} ranks ({SECOND_LAYOUT}), steps {stop}-{steps}, "
                              "resharded at load"),
    ]
    for n, (layout, cfg, text) in enumerate(phases, 1):
        say(text)
        t = time.perf_counter()
        log = os.path.join(logs, f"phase-{n}.log")
        restarts = launch(cfg, layout, max_restarts=2, log=log)
        report.phases.append({"what": text, "layout": str(layout), "restarts": restarts, "log": log,
                              "wall_s": round(time.perf_counter() - t, 1)})
    report.final_checkpoint = CheckpointManager(ckpt_dir, gc_on_start=False).latest()
    if report.final_checkpoint is None:
        raise StateError(f"{ckpt_dir}: the run left no committed checkpoint")
    vr = ckpt.verify(report.final_checkpoint, deep=True)
    report.verified = vr.ok
    if not vr.ok:
        raise StateError(f"{report.final_checkpoint} failed verification: {vr.problems}")
    report.eval_loss = evaluate(report.final_checkpoint, base.model)
    report.hf_export, report.hf_note = hf_roundtrip(report.final_checkpoint, os.path.join(out_dir, "hf"), base.model)
    png = plot_loss(report.metrics, os.path.join(out_dir, "loss.png"))
    report.plot = png
    report.plot_note = "" if png else "skipped: matplotlib is not installed (pip install ckpt[plot])"
    report.wall_s = round(time.perf_counter() - t0, 1)
    with open(os.path.join(out_dir, "demo.json"), "w") as f:
        json.dump(report.to_dict(), f, indent=2)
    return report


def summarize(report: DemoReport) -> list[str]:
    """Lines describing the run from its metrics (restarts, resumes, losses, stalls)."""
    return summarize_records(read_metrics(report.metrics))


def summarize_records(records: list[dict[str, Any]]) -> list[str]:
    """Lines describing a run from its metrics records (a killed rank or lost node, resumes, the
    loss from the first step to the last, checkpoint stalls, memory checkpoints); also what
    ``ckpt train`` prints of the records its own run wrote."""
    steps = [r for r in records if "loss" in r and "event" not in r]
    lines = []
    lost_nodes: dict[tuple[int, int], list[int]] = {}
    for r in records:
        if r.get("event") == "fail" and "node" in r:
            lost_nodes.setdefault((r["node"], r["step"]), []).append(r["rank"])
    said: set[tuple[int, int]] = set()
    for r in records:
        if r.get("event") == "fail" and "node" in r:
            key = (r["node"], r["step"])
            if key not in said:
                said.add(key)
                ranks = ", ".join(str(x) for x in sorted(lost_nodes[key]))
                lines.append(f"node {key[0]} lost at step {key[1]}: its shared memory deleted, ranks {ranks} "
                             "killed (SIGKILL)")
        elif r.get("event") == "fail":
            lines.append(f"rank {r['rank']} killed itself (SIGKILL) at step {r['step']}")
        elif r.get("event") == "init_from":
            lines.append(f"started from the weights of {r['from']}")
        elif r.get("event") == "recovery" and str(r.get("tier", "")).startswith("memory"):
            peers = r.get("peer_ranks") or []
            how = (f"ranks {', '.join(map(str, peers))} fetched {r.get('fetched_bytes', 0) / 1e6:.1f} MB from peer "
                   "copies" if peers else "every rank from its own copy")
            lines.append(f"resumed at step {r['step']} from the memory tier, {r.get('steps_lost', 0)} step(s) lost "
                         f"({how}; checksums checked): restore {r['restore_ms']:.0f} ms, training again "
                         f"{r.get('total_ms', 0) / 1e3:.1f} s after the failure")
        elif r.get("event") == "resume" and not str(r.get("tier", "")).startswith("memory"):  # see "recovery"
            how = "resharded from another layout" if r.get("resharded") else "same layout"
            lines.append(f"resumed at step {r['step']} under {r['layout_text']} ({how}) from {r['from']}")
    if steps:
        stalls = [r["ckpt_stall_ms"] for r in steps if r["ckpt_stall_ms"] > 0]
        lines.append(f"loss {steps[0]['loss']:.3f} (step {steps[0]['step']}) -> {steps[-1]['loss']:.3f} "
                     f"(step {steps[-1]['step']})")
        mem_steps = any(r.get("event") == "memory_checkpoint" for r in records)
        if stalls:
            what = "step (saves and memory checkpoints)" if mem_steps else "save"
            lines.append(f"checkpoint stall per {what}: median {sorted(stalls)[len(stalls) // 2]:.1f} ms, "
                         f"max {max(stalls):.1f} ms over {len(stalls)} {what.split(' ')[0]}s")
    mem = [r for r in records if r.get("event") == "memory_checkpoint"]
    if mem:
        snap = sorted(r["snapshot_ms"] for r in mem)[len(mem) // 2]
        lines.append(f"memory checkpoints: {sum(r['complete'] for r in mem)} complete of {len(mem)}, "
                     f"{mem[-1]['bytes'] / 1e6:.1f} MB each plus a peer copy; training thread's snapshot median "
                     f"{snap:.1f} ms")
    return lines


__all__ = ["MARKER", "FIRST_LAYOUT", "SECOND_LAYOUT", "DemoReport", "evaluate", "hf_roundtrip", "run_demo",
           "summarize", "summarize_records"]
