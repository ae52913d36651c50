"""``ckpt plan``, ``ckpt reshard`` and ``ckpt diff``: offline resharding between parallel layouts."""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

import ckpt
from ckpt.cli.common import (
    byte_bar,
    console,
    err_console,
    handle_errors,
    human_bytes,
    parse_storage_options,
    print_json,
)
from ckpt.errors import CheckpointError, LayoutError, StateError
from ckpt.layout import AXES, RANK_ORDER, Layout
from ckpt.resharders.derive import unmatched_keys
from ckpt.resharders.diff import diff
from ckpt.resharders.plan import UNMATCHED_SHOWN, parse_stages, plan, rules_for, source_layout
from ckpt.resharders.reshard import DEFAULT_MEMORY_BUDGET, reshard

StorageOpt = typer.Option(None, "--storage-option", "-o", help="backend option key=value (repeatable)")
ToOpt = typer.Option(..., "--to", help="target layout, e.g. tp=2,ep=4,pp=2,dp=1,zero=1 (or 'single'); axes not "
                     "given are 1, except zero, which keeps the source's stage unless given")
RulesOpt = typer.Option(None, "--rules", help="TOML sharding rules (default: the table the checkpoint names; for "
                        "a torchtitan/DCP checkpoint, derived from its key names; else the embedded MoE's)")
StrictOpt = typer.Option(False, "--strict-rules", help="refuse when some tensor matches no sharding rule (it "
                         "would be held whole by every rank); without it they are counted and kept whole")
StagesOpt = typer.Option(None, "--stages", help="layers per pipeline stage, e.g. 3,1 (default: balanced)")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"2GB"`` -> 2_000_000_000; ``"512MiB"`` -> 536_870_912; plain numbers are bytes.

    Decimal units (k, KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) of 1024.
    A size below one byte is refused (a zero budget or cap is never meant).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise StateError(f"size {text!r}: expected a number with an optional unit (e.g. 2GB, 512MiB)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise StateError(f"size {text!r}: must be at least one byte (e.g. 2GB, 512MiB)")
    return n


def _stages(text: str | None, target: Layout) -> list[int] | None:
    """``--stages``: one positive layer count per pipeline stage of the target (``pp`` of them)."""
    stages = parse_stages(text)
    if stages is not None and (len(stages) != target.pp or min(stages) < 1):
        raise LayoutError(f"--stages {text}: give {target.pp} positive layer count(s), one per pipeline stage of "
                          f"--to (pp={target.pp}), or leave --stages out for balanced stages")
    return stages


def _layout(text: str, source: Any = None) -> Layout:
    """``--to``: parallel axes not given are 1; ``zero`` not given keeps the source's ZeRO stage
    (a ``zero=1`` checkpoint stays ZeRO-1 unless ``--to`` says ``zero=0``)."""
    lay = Layout.parse(text)
    given = {p.split("=", 1)[0].strip() for p in text.split(",") if "=" in p}
    src = source_layout(source) if source is not None else None
    if "zero" not in given and isinstance(src, dict) and isinstance(src.get("zero"), int) and src["zero"]:
        lay = dataclasses.replace(lay, zero=src["zero"])
    return lay


def short_layout(lay: Layout | dict | None) -> str:
    """``tp=2,ep=4,zero=1`` (axes of size 1 left out; ``single`` for one process)."""
    if lay is None:
        return "-"
    if isinstance(lay, dict):
        try:
            lay = Layout.from_dict(lay)
        except (CheckpointError, TypeError, ValueError, KeyError):
            return str(lay)
    parts = [f"{a}={getattr(lay, a)}" for a in RANK_ORDER if getattr(lay, a) > 1]
    if lay.zero:
        parts.append(f"zero={lay.zero}")
    return ",".join(parts) or "single"


@handle_errors
def plan_cmd(
    src: str = typer.Argument(..., help="source checkpoint directory or URL"),
    to: str = ToOpt,
    rules: str | None = RulesOpt,
    stages: str | None = StagesOpt,
    strict_rules: bool = StrictOpt,
    json_out: bool = typer.Option(False, "--json", help="the whole plan as JSON (every piece and byte range)"),
    storage_option: list[str] = StorageOpt,
) -> None:
    """Show how SRC would be rewritten for layout --to: one row per target rank; moves no data."""
    m = ckpt.inspect(src, storage_options=parse_storage_options(storage_option))
    target = _layout(to, m)
    p = plan(m, target, rules_for(m, rules), stages=_stages(stages, target), strict_rules=strict_rules)
    if json_out:
        print_json(p.to_dict(detail=True))
        return
    console.print(f"[bold]{src}[/bold]: {short_layout(p.source_layout)} ({m.world_size} ranks) -> "
                  f"[bold]{short_layout(p.target)}[/bold] ({p.target.world_size} ranks); rules {p.rules}, "
                  f"{p.num_layers} layers, plan {p.plan_id}", highlight=False)
    axes = tuple(a for a in AXES if a in p.target.shown_axes())
    table = Table("rank", "/".join(axes), "layers", "tensors", "holds", "writes", "reads", "src files",
                  "largest read", "load files")
    for r in p.ranks:
        layers = "-" if not r.layers else (str(r.layers[0]) if r.layers[1] - r.layers[0] == 1
                                           else f"{r.layers[0]}-{r.layers[1] - 1}")
        coord = "/".join(str(getattr(r.coord, a)) for a in axes)
        table.add_row(str(r.rank), coord, layers, str(len(r.holds)), human_bytes(r.held_bytes),
                      human_bytes(r.bytes_written) if r.file else "-", human_bytes(r.bytes_read),
                      str(len(r.source_files)), human_bytes(r.largest_read), str(len(r.load_files)))
    console.print(table)
    t = p.totals()
    console.print(f"total: read {human_bytes(t['bytes_read'])} from {t['source_files_read']} file(s), "
                  f"write {human_bytes(t['bytes_written'])} to {t['target_files']} file(s), "
                  f"{t['files_touched']} files touched, largest single read {human_bytes(t['largest_read'])}, "
                  f"{t['pieces']} pieces of {t['tensors']} tensors", highlight=False)
    _whole_line(p.whole, t["tensors"])


def _whole_line(whole: list[str], total: int) -> None:
    """The one line saying how many tensors no rule places (held whole by every rank), if any."""
    if whole:
        few = ", ".join(whole[:3]) + (f" and {len(whole) - 3} more" if len(whole) > 3 else "")
        console.print(f"[yellow]{len(whole)} of {total} tensors stay whole[/yellow] on every rank (no sharding "
                      f"rule matches: {few}); --rules FILE to place them, --strict-rules to refuse", highlight=False)


class _AverageSpeed(ProgressColumn):
    """Bytes done / time since the task started (rich's TransferSpeedColumn is a moving window)."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        if not elapsed or not task.completed:
            return Text("?", style="progress.data.speed")
        return Text(f"{task.completed / elapsed / 1e9:.2f} GB/s", style="progress.data.speed")


@handle_errors
def reshard_cmd(
    src: str = typer.Argument(..., help="source checkpoint directory or URL"),
    dst: str = typer.Argument(..., help="new checkpoint directory or URL (resumed if a previous run stopped)"),
    to: str = ToOpt,
    rules: str | None = RulesOpt,
    stages: str | None = StagesOpt,
    strict_rules: bool = StrictOpt,
    memory_budget: str = typer.Option("2GB", "--memory-budget", help="buffer memory, e.g. 2GB, 512MiB"),
    workers: int = typer.Option(2, "--workers", min=1, help="new files written concurrently"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a committed checkpoint at DST"),
    no_verify_source: bool = typer.Option(False, "--no-verify-source",
                                          help="skip checking the source's checksums (corruption would be copied)"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON (no progress bar)"),
    storage_option: list[str] = StorageOpt,
) -> None:
    """Write a new committed checkpoint at DST whose shards follow layout --to (streaming, resumable).
    Every source shard's checksum is checked on the way; a corrupted source commits nothing (exit 3)."""
    opts = parse_storage_options(storage_option)
    budget = parse_size(memory_budget) if memory_budget else DEFAULT_MEMORY_BUDGET
    m = ckpt.inspect(src, storage_options=opts)
    rs = rules_for(m, rules)
    whole = unmatched_keys(m, rs)  # the same count plan() reports
    target = _layout(to, m)
    stage_sizes = _stages(stages, target)
    t0 = time.perf_counter()
    # The bar's speed and the summary's are the same measure: tensor bytes written / time since start.
    with Progress(TextColumn("[bold]reshard[/bold]"), BarColumn(), DownloadColumn(), _AverageSpeed(),
                  TimeRemainingColumn(), console=err_console, transient=False,
                  disable=json_out or not err_console.is_terminal) as bar:
        task = bar.add_task("reshard", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        out = reshard(src, dst, target, rules=rs, stages=stage_sizes, memory_budget=budget,
                      workers=workers, progress=progress, overwrite=overwrite,
                      verify_source=not no_verify_source, storage_options=opts, strict_rules=strict_rules)
    dt = time.perf_counter() - t0
    stats = out.stats or {}
    resumed = stats.get("resumed_files", 0)
    moved = int(stats.get("bytes", out.total_bytes))
    if json_out:
        print_json({"dst": dst, "files": len(out.files), "total_bytes": out.total_bytes, "tensor_bytes": moved,
                    "seconds": round(dt, 3), "gb_per_s": round(moved / max(dt, 1e-9) / 1e9, 3),
                    "layout": short_layout(target), "resumed_files": resumed, "step": out.step,
                    "rules": rs.name, "whole_tensors": len(whole), "unmatched": whole[:UNMATCHED_SHOWN]})
        return
    console.print(f"[green]ok[/green]: {dst}: {len(out.files)} file(s), {human_bytes(out.total_bytes)} in {dt:.1f} s "
                  f"({moved / max(dt, 1e-9) / 1e9:.2f} GB/s of tensor data), layout {short_layout(target)}"
                  + (f", {resumed} file(s) kept from an interrupted run" if resumed else ""), highlight=False)
    _whole_line(whole, len(m.tensors))


@handle_errors
def diff_cmd(
    a: str = typer.Argument(..., help="first checkpoint"),
    b: str = typer.Argument(..., help="second checkpoint"),
    atol: float = typer.Option(0.0, "--atol", min=0.0, help="absolute tolerance (0: bitwise)"),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON"),
    show_all: bool = typer.Option(False, "--all", help="list equal tensors too"),
    no_verify: bool = typer.Option(False, "--no-verify", help="compare without checking the shards' checksums"),
    storage_option: list[str] = StorageOpt,
) -> None:
    """Compare two checkpoints tensor by tensor, whatever their layouts. Exit 0 only when equal (within --atol).
    Every shard compared is first checked against its checksum (a corrupted one: exit 3)."""
    with byte_bar("diff", not json_out) as bar:
        r = diff(a, b, atol, storage_options=parse_storage_options(storage_option), verify=not no_verify,
                 progress=bar)
    if json_out:
        print_json(r.to_dict())
    else:
        rows = [t for t in r.tensors + r.objects if show_all or not t.ok]
        if rows:
            table = Table("key", "status", "max abs diff", "differing", "A", "B")
            for t in rows:
                mad = "-" if t.max_abs_diff is None else f"{t.max_abs_diff:.6g}"
                colour = "green" if t.ok else "red"
                table.add_row(t.key, f"[{colour}]{t.status}[/{colour}]", mad,
                              f"{t.differing}/{t.numel}" if t.numel else "-", t.a or "-", t.b or "-")
            console.print(table)
        counts = ", ".join(f"{n} {s}" for s, n in sorted(r.counts().items()))
        verdict = "[green]equal[/green]" if r.ok else "[red]DIFFERENT[/red]"
        console.print(f"{verdict}: {len(r.tensors)} tensors ({counts}), {len(r.objects)} objects, "
                      f"{human_bytes(r.bytes_compared)} compared" + (f", atol {atol:g}" if atol else ""),
                      highlight=False)
    if not r.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``plan``, ``reshard`` and ``diff`` to the app."""
    app.command("plan")(plan_cmd)
    app.command("reshard")(reshard_cmd)
    app.command("diff")(diff_cmd)


__all__ = ["StorageOpt", "ToOpt", "RulesOpt", "StrictOpt", "StagesOpt", "parse_size", "short_layout", "plan_cmd",
           "reshard_cmd", "diff_cmd", "register"]
