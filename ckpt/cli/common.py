"""Shared CLI plumbing: one table mapping library errors to one-line messages and exit codes."""

from __future__ import annotations

import errno
import functools
import inspect
import json
import math
import os
import re
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from typer.core import TyperGroup
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
USAGE_EXIT = 2  # click's code for a command line it refuses (missing argument, unknown or out-of-range option)
EXIT_CODE_HELP = ("Exit codes: 0 ok; 1 other failure (diff: different, verify: problems found); 2 no such path or "
                  "no checkpoint there, or a command line refused (missing argument, unknown or out-of-range "
                  "option); 3 corrupted data (checksum, damaged manifest); 4 storage / I/O error; "
                  "5 bad input (layout, names, shapes, options); 6 DST already holds a checkpoint (--overwrite). "
                  "An error is one `error: ...` line on stderr; with --json, stdout also gets "
                  '{"error": {"message": ..., "type": ..., "exit_code": ...}}.')

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


def cli_message(message: str, sig: inspect.Signature | None = None, bound: dict[str, Any] | None = None) -> str:
    """A library message as the command line says it: Python keyword arguments (``overwrite=True``,
    ``verify_source=False``) become the command's flags (``--overwrite``, ``--no-verify-source``); a
    library hint already naming the flag (``overwrite=True (--overwrite)``) keeps only the flag. A keyword
    the command has no flag for is left as it is (it is advice for the Python API).

    With the command's ``bound`` arguments: a message that names none of the command's flags but quotes a
    value the user gave an option (``size '-1': ...`` for ``--memory-budget -1``, ``layout: tp=0 must be
    ...`` for ``--to tp=0``) is prefixed with that option's flag (``--memory-budget: size '-1': ...``)."""
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

    out = _KWARG.sub(flag, message)
    if sig is None or not bound or any(_mentions(out, f) for fl in flags.values() for f in fl):
        return out
    for option, value in _given_options(sig, bound, flags):
        if f"'{value}'" in out or f'"{value}"' in out or (len(value) >= 3 and _mentions(out, value)):
            return f"{option}: {out}"
    return out


def _mentions(message: str, word: str) -> bool:
    """``word`` in ``message`` on its own (not part of a longer flag, name or path)."""
    return re.search(rf"(?<![\w./-]){re.escape(word)}(?![\w/-])", message) is not None


def _given_options(sig: inspect.Signature, bound: dict[str, Any], flags: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(flag, value) of every text option the user set to something other than its default."""
    out = []
    for name, value in bound.items():
        p = sig.parameters.get(name)
        if p is None or not isinstance(p.default, OptionInfo) or not flags.get(name):
            continue
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v.strip() and v != p.default.default:
                out.append((flags[name][0], v))
    return out


def _local(url: str) -> str | None:
    """The local path of ``url`` (None for a remote URL)."""
    if url.startswith("file://"):
        return url[len("file://"):]
    return None if "://" in url else url


_DIR_HINTS = {"root": "pass the directory that holds the step-N checkpoints",
              "hf_dir": "pass the Hugging Face model's directory (config.json and safetensors files)"}


def require_paths(bound: dict[str, Any], file_inputs: tuple[str, ...] = ()) -> None:
    """NoSuchPathError for the first local input path that does not exist (one message for every command);
    ManifestError for an input that is a regular file where a directory is read (every input but those
    in ``file_inputs``); StateError for any path given (argument or option) that is a FIFO, socket or
    device (reading one could block forever or never end: only regular files and directories are read)."""
    for name in INPUT_ARGS:
        url = bound.get(name)
        path = _local(url) if isinstance(url, str) else None
        if path is not None and not os.path.lexists(path):
            raise errors.NoSuchPathError(f"{url}: no such file or directory (nothing to read there; check the path)")
        if path is not None and name not in file_inputs and os.path.isfile(path):
            hint = _DIR_HINTS.get(name, "a checkpoint is a directory: pass the directory that holds it")
            raise errors.ManifestError(f"{url}: a file, not a directory; {hint}")
    for value in bound.values():
        for v in value if isinstance(value, list) else [value]:
            path = _local(v) if isinstance(v, str) and v else None
            try:
                mode = os.stat(path).st_mode if path is not None else None
            except (OSError, ValueError):
                continue
            if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
                raise errors.StateError(f"{v}: {what}, not a regular file or directory (nothing is read from "
                                        "one); pass a file or directory")


def require_apart(bound: dict[str, Any], outputs: list[str]) -> None:
    """StateError when an output path is an input path, or lies inside one, or holds one: a command never
    writes into what it reads (with --overwrite it would replace its own source)."""
    def real(name: str) -> str | None:
        url = bound.get(name)
        path = _local(url) if isinstance(url, str) else None
        return os.path.realpath(path) if path else None

    for out in outputs:
        dst = real(out)
        for name in INPUT_ARGS:
            src = real(name)
            if dst is None or src is None:
                continue
            if dst == src:
                how = "is the input"
            elif dst.startswith(src.rstrip(os.sep) + os.sep):
                how = "lies inside the input"
            elif src.startswith(dst.rstrip(os.sep) + os.sep):
                how = "holds the input"
            else:
                continue
            raise errors.StateError(f"{bound[out]}: the output {how} {bound[name]}; write to a new directory "
                                    "outside it")


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


def error_object(message: str, code: int, kind: str) -> dict[str, Any]:
    """What ``--json`` prints on stdout for an error (the same message as the stderr line)."""
    return {"error": {"message": message, "type": kind, "exit_code": code}}


def fail(message: str, code: int, *, json_out: bool = False, kind: str = "UsageError") -> NoReturn:
    """The one way a command fails: one ``error: ...`` line on stderr (a multi-line message is joined),
    with ``--json`` the :func:`error_object` on stdout, and exit ``code``."""
    message = " ".join(part.strip() for part in message.splitlines() if part.strip())
    if json_out:
        print_json(error_object(message, code, kind))
    err_console.print("[red]error:[/red] ", end="", highlight=False)
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code) from None


def _check_numbers(bound: dict[str, Any], sig: inspect.Signature, json_out: bool) -> None:
    """NaN passes every range click checks (``nan < 0`` is false): refuse it for every float option."""
    flags = _flags(sig)
    for name, value in bound.items():
        if isinstance(value, float) and math.isnan(value):
            flag = (flags.get(name) or [name])[0]
            fail(f"Invalid value for '{flag}': nan is not a number; give a number in the option's range "
                 "(see --help)", USAGE_EXIT, json_out=json_out)


def handle_errors(fn: F | None = None, *, file_inputs: tuple[str, ...] = ()) -> Any:
    """Run a command under the CLI's rules: its input paths must exist (directories, but for the arguments
    named in ``file_inputs``; no path given may be a FIFO or device; no output may overlap an input); a
    float option may not be NaN; a CheckpointError (or an OSError nothing wrapped, or a missing optional
    package) is one ``error: ...`` line on stderr (with ``--json``, also the :func:`error_object` on
    stdout) with the exit code of :data:`EXIT_CODES`, in the command's flag names (:func:`cli_message`);
    and an output directory the command created is removed again when empty.

    ``@handle_errors`` or ``@handle_errors(file_inputs=("src",))``."""
    if fn is None:
        return functools.partial(handle_errors, file_inputs=file_inputs)
    sig = inspect.signature(fn)
    outputs = [n for n in OUTPUT_ARGS if n in sig.parameters and isinstance(sig.parameters[n].default, ArgumentInfo)]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind_partial(*args, **kwargs).arguments
        json_out = bound.get("json_out") is True
        created = [p for n in outputs if isinstance(bound.get(n), str) and (p := _local(bound[n])) is not None
                   and not os.path.lexists(p)]
        _check_numbers(bound, sig, json_out)
        try:
            require_paths(bound, file_inputs)
            require_apart(bound, outputs)
            return fn(*args, **kwargs)
        except errors.CheckpointError as e:
            remove_created(created)
            fail(cli_message(str(e), sig, bound), exit_code(e), json_out=json_out, kind=type(e).__name__)
        except OSError as e:  # a fault the library let through: still one line, never a traceback
            remove_created(created)
            fail(os_message(e), exit_code(e), json_out=json_out, kind=type(e).__name__)
        except ImportError as e:  # printed without markup: "[gcs]" in an install hint is not a style
            fail(str(e), 1, json_out=json_out, kind=type(e).__name__)

    return wrapper


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


def _finite(obj: Any) -> Any:
    """``obj`` with non-finite floats as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has no such
    numbers: ``json.dumps`` would write bare NaN / Infinity, which strict parsers refuse)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def print_json(obj: Any) -> None:
    """Write strict JSON to stdout without rich markup."""
    sys.stdout.write(json.dumps(_finite(obj), indent=2, default=str, allow_nan=False) + "\n")


# click's exception base, found through typer's public API (typer vendors click from 0.2x on)
_ClickException: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class CkptGroup(TyperGroup):
    """The app's command group: the command line click refuses (a missing argument, an unknown or
    out-of-range option, an unknown command) fails like every other error: one ``error: ...`` line
    naming the help to read, and with ``--json`` the error object on stdout, exit 2."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        extra.update(prog_name=prog_name, complete_var=complete_var, windows_expand_args=windows_expand_args)
        if not standalone_mode:
            return super().main(args=argv, standalone_mode=False, **extra)
        try:
            rv = super().main(args=argv, standalone_mode=False, **extra)
        except _ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `ckpt` alone: the help is printed already
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            where = ctx.command_path if ctx is not None else (prog_name or "ckpt")
            opts = argv[:argv.index("--")] if "--" in argv else argv
            try:
                fail(f"{e.format_message()} (see `{where} --help`)", e.exit_code, json_out="--json" in opts,
                     kind=type(e).__name__)
            except typer.Exit as done:
                sys.exit(done.exit_code)
        except typer.Abort:
            err_console.print("aborted", highlight=False, markup=False)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


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
    or None when disabled (``--json``, ``--quiet``, or stderr not a terminal: a bar cannot be drawn
    there, and a stopped one would leave a stray line before an ``error:`` line)."""
    if not enabled or not err_console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


__all__ = ["console", "err_console", "EXIT_CODES", "OS_ERROR_CODE", "USAGE_EXIT", "EXIT_CODE_HELP", "INPUT_ARGS",
           "OUTPUT_ARGS", "F", "exit_code", "cli_message", "require_paths", "require_apart", "remove_created",
           "os_message", "error_object", "fail", "handle_errors", "parse_storage_options", "print_json", "human_bytes",
           "CkptGroup", "byte_bar"]
