"""``ckpt inspect`` and ``ckpt verify``."""

from __future__ import annotations

import datetime as dt
import os

import typer
from rich.table import Table

import ckpt
from ckpt.cli.common import byte_bar, console, handle_errors, human_bytes, parse_storage_options, print_json

StorageOpt = typer.Option(None, "--storage-option", "-o", help="backend option key=value (repeatable)")


def require_checkpoint(url: str, opts: dict) -> None:
    """ManifestError when ``url`` holds no manifest (saying so when the path does not exist at all)."""
    from ckpt.errors import ManifestError
    from ckpt.interop.sources import LOOKED_FOR, detect
    from ckpt.storage import get_storage

    st = get_storage(url, **opts)
    try:
        if detect(st) is not None:  # ours, or a DCP / DeepSpeed checkpoint read in place
            return
        root = st.local_dir
    finally:
        st.close()
    if isinstance(root, str) and "://" not in url and not os.path.exists(root):
        raise ManifestError(f"{url}: no such file or directory, so no committed checkpoint here; pass the "
                            "checkpoint's directory")
    raise ManifestError(f"{url}: no committed checkpoint here (looked for {LOOKED_FOR}); a ckpt save may not "
                        "have finished (see `ckpt ls` of its parent)")


@handle_errors
def inspect_cmd(
    url: str = typer.Argument(..., help="checkpoint directory or URL"),
    json_out: bool = typer.Option(False, "--json", help="print the manifest summary as JSON"),
    timings: bool = typer.Option(False, "--timings", help="show the save's per-phase timings over ranks"),
    storage_option: list[str] = StorageOpt,
) -> None:
    """Show a checkpoint's step, layout, totals and tensors (reads only the manifest)."""
    opts = parse_storage_options(storage_option)
    require_checkpoint(url, opts)
    m = ckpt.inspect(url, storage_options=opts)
    if timings:
        _print_timings(m.stats or {}, json_out)
        return
    if json_out:
        print_json({
            "url": url, "step": m.step, "version": list(m.version), "created": m.created,
            "world_size": m.world_size, "layout": m.layout, "total_bytes": m.total_bytes,
            "files": m.files, "user_metadata": m.user_metadata, "objects": sorted(m.objects),
            "tensors": {k: {"dtype": t.dtype, "shape": list(t.shape), "shards": len(t.shards), "bytes": t.nbytes}
                        for k, t in m.tensors.items()},
        })
        return
    created = dt.datetime.fromtimestamp(m.created).isoformat(timespec="seconds")
    console.print(f"[bold]{url}[/bold]  format {m.version[0]}.{m.version[1]}  step {m.step}  created {created}")
    console.print(f"saved by {m.world_size} rank(s)  layout {m.layout or '-'}  "
                  f"{len(m.tensors)} tensors  {len(m.objects)} objects  {len(m.files)} files  "
                  f"{human_bytes(m.total_bytes)}")
    table = Table("tensor", "dtype", "global shape", "shards", "bytes")
    for k in sorted(m.tensors):
        t = m.tensors[k]
        table.add_row(k, t.dtype, str(list(t.shape)), str(len(t.shards)), human_bytes(t.nbytes))
    console.print(table)


COUNTS = ("cast", "tensors", "files", "shards", "pieces", "ranks", "step")


def figure(name: str, value: float) -> str:
    """A per-rank save figure in its unit, told by its name: bytes (``bytes``, ``*_bytes``, ``sent``,
    ``received``, ``pinned``), milliseconds (``*_ms``), counts, else seconds (the save's phases)."""
    if "bytes" in name or name in ("sent", "received", "pinned"):
        return human_bytes(value)
    if name.endswith("_ms") or name == "ms":
        return f"{value:.1f} ms"
    if name in COUNTS:
        return f"{value:.0f}"
    return f"{value:.4f} s"


def _print_timings(stats: dict, json_out: bool) -> None:
    if json_out:
        print_json(stats)
        return
    if not stats:
        console.print("no timings recorded in this checkpoint")
        return
    table = Table("figure", "min", "median", "max", "slowest rank")
    for k, v in stats.items():
        if isinstance(v, dict) and {"min", "median", "max"} <= set(v):
            cells = [figure(k, v[q]) for q in ("min", "median", "max")]
            table.add_row(k, *cells, str(v.get("slowest_rank", "-")))
    # commit_s is measured after the manifest is written: only the saving process's copy has it
    commit = f"; coordinator commit {stats['commit_s']:.4f} s" if "commit_s" in stats else ""
    console.print(f"save over {stats.get('ranks', '?')} rank(s){commit}")
    console.print(table)


@handle_errors
def verify_cmd(
    url: str = typer.Argument(..., help="checkpoint directory or URL"),
    deep: bool = typer.Option(False, "--deep", help="also recompute every checksum (reads all data)"),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar (--deep shows one on a terminal)"),
    storage_option: list[str] = StorageOpt,
) -> None:
    """Check structure, file sizes, headers and coverage (and checksums with --deep). Exit 0 only if intact."""
    opts = parse_storage_options(storage_option)
    require_checkpoint(url, opts)  # nothing there: one `error:` line and inspect's exit code, not a report
    with byte_bar("verify", deep and not (quiet or json_out)) as progress:
        r = ckpt.verify(url, deep=deep, storage_options=opts, progress=progress)
    if json_out:
        print_json(r.to_dict())
    else:
        for p in r.problems:
            console.print(f"[red]{p.kind}[/red]: {p.message}", highlight=False, soft_wrap=True)
        if r.note:
            console.print(f"note: {r.note}", highlight=False, markup=False, soft_wrap=True)
        what = "deep " if deep else ""
        if r.ok:
            console.print(f"[green]ok[/green]: {what}verify of {url}: {r.tensors} tensors, {r.shards} shards, "
                          f"{r.files} files" + (f", {human_bytes(r.bytes_hashed)} hashed" if deep else ""),
                          highlight=False)
        else:
            console.print(f"[red]FAILED[/red]: {len(r.problems)} problem(s) in {url}", highlight=False)
    if not r.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``inspect`` and ``verify`` to the app."""
    app.command("inspect")(inspect_cmd)
    app.command("verify")(verify_cmd)


__all__ = ["StorageOpt", "require_checkpoint", "inspect_cmd", "COUNTS", "figure", "verify_cmd", "register"]
