"""Per-step metrics as JSON lines, and a loss-curve PNG (matplotlib is an optional extra).

Records are ``{"step", "loss", "lr", "grad_norm", "tokens_per_s", "ckpt_stall_ms", ...}`` per step
and ``{"event": "start" | "resume" | "save" | "fail" | "end", "step", ...}`` for what happened.
Every attempt of a run (a torchrun restart, a relaunch under another layout) appends to the same
file, so the file tells the run's whole story.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


class MetricsLog:
    """Append-only JSON lines; a disabled log (other ranks, no path) drops records."""

    def __init__(self, path: str | None, enabled: bool = True):
        self.path = path if enabled else None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (with a wall-clock ``time``), flushed at once so a SIGKILL loses nothing."""
        if not self.path:
            return
        line = json.dumps({**record, "time": round(time.time(), 3)}) + "\n"
        # O_APPEND: the failing rank may add its "fail" line while rank 0 writes steps.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics file, in order (a torn last line is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def plot_loss(metrics_path: str, png_path: str) -> str | None:
    """Draw the loss per step of every attempt, marking saves, the failure and resumes.

    Returns the PNG path, or None when matplotlib is not installed (``pip install ckpt[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    attempt: list[dict[str, Any]] = []
    label = "run"
    segments: list[tuple[str, list[dict[str, Any]]]] = []
    for r in records:
        if r.get("event") == "start":
            if attempt:
                segments.append((label, attempt))
            attempt, label = [], f"attempt {len(segments) + 1}: {r.get('layout_text', '')}"
        elif "loss" in r and "event" not in r:
            attempt.append(r)
    if attempt:
        segments.append((label, attempt))
    for label, seg in segments:
        ax.plot([r["step"] for r in seg], [r["loss"] for r in seg], label=label, linewidth=1.2)
    saves = sorted({r["step"] for r in records if r.get("event") == "save"})
    for i, s in enumerate(saves):
        ax.axvline(s, color="0.75", linestyle=":", linewidth=0.8, label="checkpoint" if i == 0 else None)
    for r in records:
        if r.get("event") == "fail":
            ax.axvline(r["step"], color="red", linewidth=1.5, label=f"rank {r.get('rank')} killed")
        elif r.get("event") == "resume":
            ax.axvline(r["step"], color="green", linestyle="--", linewidth=1.2,
                       label=f"resume from step {r['step']} ({r.get('layout_text', '')})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("ckpt trainer: loss, checkpoints, failure and resume")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
