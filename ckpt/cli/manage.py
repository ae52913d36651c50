"""``ckpt ls`` and ``ckpt gc``: checkpoints under a root directory."""

from __future__ import annotations

import os
import time

import typer
from rich.table import Table

from ckpt.cli.common import console, handle_errors, human_bytes, parse_storage_options, print_json
from ckpt.manager import LEASE_GRACE_S, gc, list_checkpoints

StorageOpt = typer.Option(None, "--storage-option", "-o", help="backend option key=value (repeatable)")
LeaseGrace = typer.Option(LEASE_GRACE_S, "--lease-grace", min=0,
                          help="seconds a save's lease written on another machine counts as live (same-machine "
                               "leases are checked exactly: live while their process runs)")


def _age(mtime: float) -> str:
    if not mtime:
        return "-"
    s = time.time() - mtime
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit}"
    return f"{s:.0f}s"


def _is_a_checkpoint(root: str) -> str:
    """A hint when ROOT is itself a checkpoint (``ls`` lists the step-N checkpoints under a root)."""
    from ckpt.manifest import MANIFEST_NAME

    if "://" in root or not os.path.isfile(os.path.join(root, MANIFEST_NAME)):
        return ""
    parent = os.path.dirname(os.path.abspath(root))
    return f"; {root} is itself a checkpoint: `ckpt inspect {root}` shows it, `ckpt ls {parent}` lists its root"


@handle_errors
def ls_cmd(
    root: str = typer.Argument(..., help="directory holding step-N checkpoints"),
    json_out: bool = typer.Option(False, "--json", help="print as JSON"),
    storage_option: list[str] = StorageOpt,
    memory: bool = typer.Option(True, "--memory/--no-memory",
                                help="also list the run's memory tier (node-local shared memory copies)"),
    shm_dir: str | None = typer.Option(None, "--shm-dir",
                                       help="memory tier base directory (default $CKPT_SHM_DIR or /dev/shm)"),
    lease_grace: float = LeaseGrace,
) -> None:
    """List checkpoints under ROOT: step, committed or not (``writing``: a save holds a lease on it),
    size, age; then the memory tier's copies of the runs saving to ROOT on this host (own copies and
    replicas kept for peer nodes)."""
    infos = list_checkpoints(root, parse_storage_options(storage_option), lease_grace_s=lease_grace)
    mem = []
    if memory:
        from ckpt.tier import list_memory

        mem = list_memory(root, shm_dir)
    if json_out:
        print_json([c.to_dict() for c in infos] + [m.to_dict() for m in mem])  # memory entries: "tier": "memory"
        return
    table = Table("step", "state", "size", "age", "path", "note")
    colors = {"committed": "green", "incomplete": "red", "unreadable": "magenta", "foreign": "magenta",
              "link": "cyan"}
    for c in infos:
        status = "writing" if c.live else c.status
        state = f"[{colors.get(status, 'yellow')}]{status}[/]"
        table.add_row(str(c.step), state, human_bytes(c.bytes), _age(c.mtime), c.url, c.note)
    if infos:
        console.print(table)
    else:  # an empty table says nothing: say what was looked for
        console.print(f"no checkpoints under {root} (no step-N directories){_is_a_checkpoint(root)}",
                      highlight=False, markup=False)
    if mem:
        mtable = Table("step", "node", "rank", "copy", "state", "size", "path", "note",
                       title=f"memory tier (run {', '.join(sorted({m.run_id for m in mem}))})")
        mcolors = {"committed": "green", "incomplete": "red", "unusable": "magenta"}
        for m in mem:
            mtable.add_row(str(m.step), str(m.node), str(m.owner), m.kind,
                           f"[{mcolors.get(m.status, 'yellow')}]{m.status}[/]", human_bytes(m.bytes), m.path, m.note)
        console.print(mtable)


@handle_errors
def gc_cmd(
    root: str = typer.Argument(..., help="directory holding step-N checkpoints"),
    keep_last: int | None = typer.Option(None, "--keep-last", min=1, help="remove committed ones but the newest N"),
    keep_every: int | None = typer.Option(None, "--keep-every", min=1, help="also keep steps divisible by N"),
    dry_run: bool = typer.Option(False, "--dry-run", help="only show what would be removed"),
    json_out: bool = typer.Option(False, "--json", help="print what was (or would be) removed and what was kept"),
    storage_option: list[str] = StorageOpt,
    memory: bool = typer.Option(False, "--memory",
                                help="also remove what no job can restore from ROOT's memory tiers on this host"),
    shm_dir: str | None = typer.Option(None, "--shm-dir",
                                       help="memory tier base directory (default $CKPT_SHM_DIR or /dev/shm)"),
    min_age: float = typer.Option(300.0, "--min-age", min=0,
                                  help="with --memory: only what nothing touched for this many seconds"),
    lease_grace: float = LeaseGrace,
) -> None:
    """Remove unfinished saves of ours and, with --keep-last, old committed ones. Entries gc cannot
    prove are ours (unreadable manifest, foreign files, symlinks) are reported and kept, and so is
    every directory a running save holds a lease on (safe to run while jobs save). With
    --memory: memory-tier copies of a root emptied or replaced since, of another run id, of another
    world size once a newer step of the run's newest job is complete (until then a resharding
    restore can use them), incomplete ones and leftover views; never a run whose job is alive on
    this host, never through a link (see ckpt.tier.gc_memory)."""
    opts = parse_storage_options(storage_option)
    doomed = gc(root, keep_last=keep_last, keep_every=keep_every, dry_run=dry_run, storage_options=opts,
                lease_grace_s=lease_grace)
    after = list_checkpoints(root, opts, lease_grace_s=lease_grace)
    kept = [c for c in after if c.status not in ("committed", "incomplete")]
    live = [c for c in after if c.live and c.status in ("committed", "incomplete")]
    mem = []
    if memory:
        from ckpt.tier import gc_memory

        mem = gc_memory(root, shm_dir, min_age=min_age, dry_run=dry_run)
    if json_out:
        print_json({"dry_run": dry_run, "removed": [c.to_dict() for c in doomed],
                    "kept_not_ours": [c.to_dict() for c in kept], "kept_writing": [c.to_dict() for c in live],
                    "memory_removed": [m.to_dict() for m in mem]})
        return
    verb = "would remove" if dry_run else "removed"
    for c in kept:
        console.print(f"kept {c.url} ({c.status}: {c.note})", highlight=False, markup=False)
    for c in live:
        console.print(f"kept {c.url} (writing: {c.note})", highlight=False, markup=False)
    for c in doomed:
        console.print(f"{verb} {c.url} ({'committed' if c.committed else 'incomplete'}, {human_bytes(c.bytes)})",
                      highlight=False)
    console.print(f"{verb} {len(doomed)} checkpoint(s)", highlight=False)
    for m in mem:
        console.print(f"{verb} memory tier {m.path} ({m.reason}, {human_bytes(m.bytes)})", highlight=False,
                      markup=False)
    if memory:
        console.print(f"{verb} {len(mem)} memory-tier director(ies)", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``ls`` and ``gc`` to the app."""
    app.command("ls")(ls_cmd)
    app.command("gc")(gc_cmd)


__all__ = ["StorageOpt", "LeaseGrace", "ls_cmd", "gc_cmd", "register"]
