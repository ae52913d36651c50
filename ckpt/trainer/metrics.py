"""Per-step metrics as JSON lines, and a loss-curve PNG (matplotlib is an optional extra).

Records are ``{"step", "loss", "lr", "grad_norm", "tokens_per_s", "ckpt_stall_ms", ...}`` per step
and ``{"event": "start" | "resume" | "init_from" | "save" | "checkpoint" | "save_failed" | "fail" |
"restore_failed" | "memory_checkpoint" | "memory_tier_ignored" | "recovery" | "attempt_end" | "end",
"step", ...}`` for what happened. Every attempt of a run (a torchrun restart, a relaunch
under another layout) appends to the same file, so the file tells the run's whole story.

Checkpoint figures (rank 0's own, durations in ms, sizes in bytes):

- ``save`` is written when a save starts; ``checkpoint`` when it has committed (an async save is
  picked up once its handle is done, without waiting for it): ``step`` (the checkpoint's),
  ``plan_ms``, ``stage_ms``, ``persist_ms``, ``commit_ms`` (async saves; see :func:`save_record`),
  ``bytes_written`` (this rank's data file), ``checkpoint_bytes`` (all files of the checkpoint),
  ``ranks`` and ``across_ranks`` (min / median / max over ranks and the slowest rank, from the
  manifest's ``stats``). ``save_failed`` carries the save's ``error`` instead.
- ``memory_checkpoint`` (every ``memory_every`` steps): ``complete`` / ``skipped`` (with ``warning``
  and per-rank ``errors``: shared memory full, ...), ``bytes`` (every rank's copy), ``replica_bytes``
  (sent to peer nodes), ``write_ms`` / ``replicate_ms`` / ``agree_ms`` (rank 0's background work),
  ``max_write_ms`` / ``max_replicate_ms`` (the slowest rank's), ``snapshot_ms`` / ``wait_ms`` (rank
  0's training thread: the host copy, and waiting for the previous one), ``busy_skipped`` (due steps
  skipped before it with ``--memory-busy skip``; those get no record), ``budget_gbps`` (rank 0's
  budget for the tier's traffic when it ended, with ``--memory-max-gbps`` or ``--memory-max-overhead``)
  and ``overhead`` (the governor's last measured slowdown of a step). Written once the background
  work is over (it may come after later steps' records).
- ``recovery`` (after a resume, once the first step is done): ``tier`` (``memory``: every rank its own
  copy; ``memory-peer``: some fetched from peer nodes, ``peer_ranks``; ``memory-reshard``: written
  under another layout, read through the resharding load; ``storage``), ``step``,
  ``bytes`` (all ranks), ``steps_lost`` (steps done before the failure and redone), ``detect_ms``
  (the failure until the launcher saw the attempt end), ``restart_ms`` (from there, or from the
  failure without the launcher, to the restore), ``restore_ms``, ``first_step_ms``, ``total_ms``.
  ``attempt_end`` is the launcher's (``rc`` of each torchrun attempt).
- ``resume`` / ``init_from`` carry the load's phases (:func:`load_fields`): ``manifest_ms``,
  ``plan_ms``, ``read_ms``, ``copy_ms``, ``bytes_read``, ``read_ops``, and ``restore_ms``
  (the whole restore, as the trainer timed it).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ckpt.manifest import DATA_DIR, Manifest

SAVE_PHASES = ("plan", "stage", "persist", "commit")
LOAD_PHASES = ("manifest", "plan", "verify", "read", "copy")


def _ms(seconds: Any) -> float:
    return round(float(seconds) * 1e3, 3)


def rank_bytes(manifest: Manifest, rank: int) -> int:
    """Bytes of the data files ``rank`` wrote in the save that returned ``manifest``.

    A non-coordinator's (partial) manifest lists only its own files; in the coordinator's full
    manifest a rank's safetensors file is ``data/<rank:05d>-<random>.safetensors`` (docs/FORMAT.md).
    """
    if manifest.partial:
        return sum(manifest.files.values())
    prefix = f"{DATA_DIR}/{rank:05d}-"
    return sum(size for name, size in manifest.files.items() if name.startswith(prefix))


def save_record(step: int, url: str, rank: int, manifest: Manifest | None, stats: dict[str, float] | None, *,
                async_save: bool, save_s: float | None = None) -> dict[str, Any]:
    """The ``checkpoint`` record of a committed save, as seen by ``rank``.

    ``stats``: this rank's figures (``SaveHandle.stats`` or ``ckpt.save(stats=)``): durations in
    seconds ``plan``, ``stage``, ``persist``, ``commit`` (from the end of ``persist`` to the commit's
    status, which includes waiting for the slowest rank) and ``bytes``. ``save_s``: how long a
    synchronous save blocked the caller.
    ``manifest``: what the save returned (the full one on the coordinator: then ``checkpoint_bytes``
    and the ``across_ranks`` aggregate are added).
    """
    rec: dict[str, Any] = {"event": "checkpoint", "step": step, "url": url, "rank": rank, "async": async_save}
    if save_s is not None:
        rec["save_ms"] = _ms(save_s)
    for phase in SAVE_PHASES:
        if stats and phase in stats:
            rec[f"{phase}_ms"] = _ms(stats[phase])
    if manifest is None:
        return rec
    # async handles report the bytes themselves; a sync save's are found from the file names
    rec["bytes_written"] = int(stats["bytes"]) if stats and "bytes" in stats else rank_bytes(manifest, rank)
    if not manifest.partial:
        rec["checkpoint_bytes"] = sum(manifest.files.values())
    agg = manifest.stats or {}
    if "ranks" in agg and not manifest.partial:
        rec["ranks"] = agg["ranks"]
        rec["across_ranks"] = {
            phase: {"min_ms": _ms(a["min"]), "median_ms": _ms(a["median"]), "max_ms": _ms(a["max"]),
                    "slowest_rank": a["slowest_rank"]}
            for phase in SAVE_PHASES if isinstance(a := agg.get(phase), dict)}
    return rec


def load_fields(stats: dict[str, Any]) -> dict[str, Any]:
    """``ckpt.load(..., stats=)`` figures as record fields: ``<phase>_ms``, ``bytes_read``, ``read_ops``
    (and ``bytes_verified`` after a verified load)."""
    out: dict[str, Any] = {f"{p}_ms": _ms(stats[p]) for p in LOAD_PHASES if p in stats}
    for key, name in (("bytes_read", "bytes_read"), ("bytes_verified", "bytes_verified"), ("ops", "read_ops")):
        if key in stats:
            out[name] = int(stats[key])
    return out


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


__all__ = ["SAVE_PHASES", "LOAD_PHASES", "rank_bytes", "save_record", "load_fields", "MetricsLog", "read_metrics",
           "plot_loss"]
