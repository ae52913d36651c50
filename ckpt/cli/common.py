"""Shared CLI plumbing: one table mapping library errors to one-line messages and exit codes."""

from __future__ import annotations

import errno
import functools
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from typer.models import ArgumentInfo, OptionInfo

from ckpt import errors

# Piped output gets full values: rich would cut table cells to an 80-column terminal otherwise.
console = Console(width=None if sys.stdout.isatty() else 100_000)
err_console = Console(stderr=True)

# Expected failures: one line on stderr, no traceback, and ONE exit code per error type, whatever the
# command (first match wins: subclasses before their bases). `ckpt --help` prints this table.
EXIT_CODES: dict[type[errors.CheckpointError], int] = {
    errors.NoSuchPathError: 2,  # nothing at the path: the same code and message from every command
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
OS_ERROR_CODE = EXIT_CODES[errors.StorageError]  # an OSError no library call wrapped: an I/O fault all the same
EXIT_CODE_HELP = ("Exit codes: 0 ok; 1 other failure (diff: different, verify: problems found); 2 no such path or "
                  "no checkpoint there; 3 corrupted data (checksum, damaged manifest); 4 storage / I/O error; "
                  "5 bad input (layout, names, shapes, options); 6 DST already holds a checkpoint (--overwrite).")

# Argument names: what a command reads (checked to exist before it runs) and what it writes.
INPUT_ARGS = ("url", "src", "root", "a", "b", "hf_dir")
OUTPUT_ARGS = ("dst", "out")

F = TypeVar("F", bound=Callable[..., Any])


def exit_code(e: BaseException) -> int:
    """The exit code of an error, from :data:`EXIT_CODES` (OSError: a storage error)."""
    if isinstance(e, errors.CheckpointError):
        return next(c for t, c in EXIT_CODES.items() if isinstance(e, t))
    return OS_ERROR_CODE if isinstance(e, OSError) else 1


def _flags(sig: inspect.Signature) -> dict[str, list[str]]:
    """Python parameter -> its command-line spellings (``--x`` / ``--no-x`` split)."""
    out: dict[str, list[str]] = {}
    for name, p in sig.parameters.items():
        if isinstance(p.default, OptionInfo):
            decls = [d for decl in p.default.param_decls or () for d in decl.split("/")]
            out[name] = [d.strip() for d in decls if d.strip().startswith("--")]
    return out


_KWARG = re.compile(r"\b([a-z][a-z0-9_]*)=(True|False)(?:(?:\s*/\s*|\s*\(\s*)(--[a-z0-9-]+)\)?)?")


def cli_message(message: str, sig: inspect.Signature | None = None) -> str:
    """A library message as the command line says it: Python keyword arguments (``overwrite=True``,
    ``verify_source=False``) become the command's flags (``--overwrite``, ``--no-verify-source``); a
    library hint already naming the flag (``overwrite=True (--overwrite)``) keeps only the flag. A keyword
    the command has no flag for is left as it is (it is advice for the Python API)."""
    flags = _flags(sig) if sig is not None else {}

    def flag(m: re.Match[str]) -> str:
        name, value, given = m.group(1), m.group(2), m.group(3)
        if value == "True" and flags.get(name):
            return flags[name][0]
        if value == "False":
            if flags.get("no_" + name):
                return flags["no_" + name][0]
            negative = [d for d in flags.get(name, []) if d.startswith("--no-")]
            if negative:
                return negative[0]
        return given if given and (sig is None or any(given in v for v in flags.values())) else m.group(0)

    return _KWARG.sub(flag, message)


def _local(url: str) -> str | None:
    """The local path of ``url`` (None for a remote URL)."""
    if url.startswith("file://"):
        return url[len("file://"):]
    return None if "://" in url else url


def require_paths(bound: dict[str, Any]) -> None:
    """NoSuchPathError for the first local input path that does not exist (one message for every command)."""
    for name in INPUT_ARGS:
        url = bound.get(name)
        path = _local(url) if isinstance(url, str) else None
        if path is not None and not os.path.lexists(path):
            raise errors.NoSuchPathError(f"{url}: no such file or directory (nothing to read there; check the path)")


def remove_created(paths: list[str]) -> None:
    """Remove the directories a failed command created, only where empty (files are never removed):
    a refused write leaves DST as it found it, absent."""
    for root in paths:
        if not os.path.isdir(root) or os.path.islink(root):
            continue
        for d, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):  # deepest first
            try:
                os.rmdir(d)
            except OSError:
                pass


_OS_HINTS = {errno.EEXIST: "a file is in the way: give a directory path", errno.ENOTDIR: "a file is in the way: "
             "give a directory path", errno.EACCES: "not writable by you: choose another path or fix its "
             "permissions", errno.EPERM: "not permitted: choose another path", errno.EROFS: "a read-only file "
             "system: choose another path", errno.ENOSPC: "the disk is full: free space or choose another path"}


def os_message(e: OSError) -> str:
    """One line for an OSError: the path, the cause, and what to do."""
    where = f"{e.filename}: " if e.filename else ""
    hint = _OS_HINTS.get(e.errno or 0)
    return f"{where}{e.strerror or e}" + (f" ({hint})" if hint else "")


def _fail(message: str, code: int) -> NoReturn:
    err_console.print("[red]error:[/red] ", end="", highlight=False)
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code) from None


def handle_errors(fn: F) -> F:
    """Run a command under the CLI's rules: its input paths must exist; a CheckpointError (or an OSError
    nothing wrapped, or a missing optional package) is one ``error: ...`` line on stderr with the exit
    code of :data:`EXIT_CODES`, in the command's flag names (:func:`cli_message`); and an output
    directory the command created is removed again when empty."""
    sig = inspect.signature(fn)
    outputs = [n for n in OUTPUT_ARGS if n in sig.parameters and isinstance(sig.parameters[n].default, ArgumentInfo)]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind_partial(*args, **kwargs).arguments
        created = [p for n in outputs if isinstance(bound.get(n), str) and (p := _local(bound[n])) is not None
                   and not os.path.lexists(p)]
        try:
            require_paths(bound)
            return fn(*args, **kwargs)
        except errors.CheckpointError as e:
            remove_created(created)
            _fail(cli_message(str(e), sig), exit_code(e))
        except OSError as e:  # a fault the library let through: still one line, never a traceback
            remove_created(created)
            _fail(os_message(e), exit_code(e))
        except ImportError as e:  # printed without markup: "[gcs]" in an install hint is not a style
            _fail(str(e), 1)

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


__all__ = ["console", "err_console", "EXIT_CODES", "OS_ERROR_CODE", "EXIT_CODE_HELP", "INPUT_ARGS", "OUTPUT_ARGS", "F",
           "exit_code", "cli_message", "require_paths", "remove_created", "os_message", "handle_errors",
           "parse_storage_options", "print_json", "human_bytes", "byte_bar"]
