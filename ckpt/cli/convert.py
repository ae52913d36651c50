"""``ckpt import`` (DCP / DeepSpeed / torch.save -> ckpt) and ``ckpt export`` (-> DCP)."""

from __future__ import annotations

import time

import typer

from ckpt.cli.common import byte_bar, console, handle_errors, human_bytes, parse_storage_options, print_json
from ckpt.cli.reshard import RulesOpt, _layout, parse_size, short_layout
from ckpt.errors import StateError
from ckpt.resharders.rules import MOE_RULES, load_rules

StorageOpt = typer.Option(None, "--storage-option", "-o", help="backend option key=value (repeatable)")
BudgetOpt = typer.Option("2GB", "--memory-budget", help="buffer memory, e.g. 2GB, 512MiB")
QuietOpt = typer.Option(False, "--quiet", "-q", help="no progress bar")
JsonOpt = typer.Option(False, "--json", help="print the result as JSON (no progress bar)")


@handle_errors(file_inputs=("src",))  # a torch.save file is read as it is
def import_cmd(
    src: str = typer.Argument(..., help="DCP or DeepSpeed checkpoint directory, or a torch.save file"),
    dst: str = typer.Argument(..., help="new ckpt checkpoint directory or URL"),
    to: str | None = typer.Option(None, "--to", help="target layout (default: whole tensors, one file)"),
    rules: str | None = RulesOpt,
    memory_budget: str = BudgetOpt,
    workers: int = typer.Option(2, "--workers", min=1, help="new files written concurrently"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a committed checkpoint at DST"),
    unstack_layers: bool = typer.Option(False, "--unstack-layers",
                                        help="split tensors stacked over layers (Megatron's decoder.layers.*) "
                                             "into per-layer tensors decoder.layers.<i>.*"),
    quiet: bool = QuietOpt,
    json_out: bool = JsonOpt,
    storage_option: list[str] = StorageOpt,
) -> None:
    """Convert another tool's checkpoint into a ckpt checkpoint (with checksums), streaming.
    Pickled metadata is read with an allowlist: nothing from the files runs."""
    from ckpt.convert import import_checkpoint

    opts = parse_storage_options(storage_option)
    layout = _layout(to) if to else None
    t0 = time.perf_counter()
    with byte_bar("import", not (quiet or json_out)) as progress:
        m = import_checkpoint(src, dst, to=layout, rules=load_rules(rules) if rules else MOE_RULES,
                              memory_budget=parse_size(memory_budget), workers=workers, progress=progress,
                              overwrite=overwrite, storage_options=opts, unstack=unstack_layers)
    dt = time.perf_counter() - t0
    source = (m.user_metadata.get("source") or {}).get("format", "?")
    summary = {"src": src, "dst": dst, "source_format": source, "tensors": len(m.tensors), "objects": len(m.objects),
               "files": len(m.files), "total_bytes": m.total_bytes, "seconds": round(dt, 3),
               "layout": short_layout(layout) if layout else "single"}
    if json_out:
        print_json(summary)
        return
    console.print(f"[green]ok[/green]: {dst}: {len(m.tensors)} tensors, {len(m.objects)} objects from a {source} "
                  f"checkpoint, {human_bytes(m.total_bytes)} in {dt:.1f} s, layout {summary['layout']}",
                  highlight=False)


@handle_errors
def export_cmd(
    src: str = typer.Argument(..., help="checkpoint directory or URL"),
    dst: str = typer.Argument(..., help="output directory"),
    fmt: str = typer.Option(..., "--format", help="dcp (for Hugging Face use `ckpt export-hf`)"),
    to: str | None = typer.Option(None, "--to", help="one DCP file per rank of this layout (default: as stored)"),
    rules: str | None = RulesOpt,
    memory_budget: str = BudgetOpt,
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a DCP checkpoint at DST"),
    quiet: bool = QuietOpt,
    json_out: bool = JsonOpt,
    storage_option: list[str] = StorageOpt,
) -> None:
    """Write a checkpoint in another tool's format: --format dcp gives a directory that
    torch.distributed.checkpoint.load (and torchtitan) loads on any layout."""
    from ckpt.convert import export_dcp

    if fmt != "dcp":
        raise StateError(f"--format {fmt!r}: ckpt exports 'dcp' here; for Hugging Face use `ckpt export-hf`")
    opts = parse_storage_options(storage_option)
    t0 = time.perf_counter()
    with byte_bar("export", not (quiet or json_out)) as progress:
        out = export_dcp(src, dst, to=_layout(to) if to else None, rules=load_rules(rules) if rules else MOE_RULES,
                         memory_budget=parse_size(memory_budget), progress=progress, overwrite=overwrite,
                         storage_options=opts)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    if json_out:
        print_json(out)
        return
    console.print(f"[green]ok[/green]: {dst}: DCP checkpoint, {out['tensors']} tensors, {out['objects']} objects, "
                  f"{out['files']} file(s), {human_bytes(out['bytes'])} in {out['seconds']:.1f} s", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``import`` and ``export`` to the app."""
    app.command("import")(import_cmd)
    app.command("export")(export_cmd)


__all__ = ["StorageOpt", "BudgetOpt", "QuietOpt", "JsonOpt", "import_cmd", "export_cmd", "register"]
