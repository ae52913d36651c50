"""Shared CLI plumbing: one table mapping library errors to one-line messages and exit codes."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import typer
from rich.console import Console

from ckpt import errors

# Piped output gets full values: rich would cut table cells to an 80-column terminal otherwise.
console = Console(width=None if sys.stdout.isatty() else 100_000)
err_console = Console(stderr=True)

# Expected failures: one line on stderr, no traceback.
EXIT_CODES: dict[type[errors.CheckpointError], int] = {
    errors.ManifestIntegrityError: 3,  # before ManifestError: a damaged manifest is corruption
    errors.ManifestError: 2,
    errors.IntegrityError: 3,
    errors.StorageError: 4,
    errors.LayoutError: 5,
    errors.MismatchError: 5,
    errors.StateError: 5,
    errors.CheckpointExistsError: 6,
    errors.CheckpointError: 1,
}

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Turn CheckpointError (and missing optional packages) into ``error: ...`` on stderr and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except errors.CheckpointError as e:
            code = next(c for t, c in EXIT_CODES.items() if isinstance(e, t))
            err_console.print("[red]error:[/red] ", end="", highlight=False)
            err_console.print(str(e), markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(code) from None
        except ImportError as e:  # printed without markup: "[gcs]" in an install hint is not a style
            err_console.print("[red]error:[/red] ", end="", highlight=False)
            err_console.print(str(e), markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def parse_storage_options(opts: list[str] | None) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict; values that parse as JSON (numbers, true/false) are converted."""
    out: dict[str, Any] = {}
    for o in opts or []:
        if "=" not in o:
            raise errors.StateError(f"--storage-option {o!r}: expected key=value")
        k, v = o.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def print_json(obj: Any) -> None:
    """Write JSON to stdout without rich markup."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@contextmanager
def byte_bar(what: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A byte progress bar on stderr (stdout stays clean for --json); yields ``update(done, total)``
    or None when disabled (``--json``, ``--quiet``)."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update
