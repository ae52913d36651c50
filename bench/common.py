"""Helpers shared by the benchmarks: timing, medians, dd, page-cache drops, durability, tables.

Units: sizes in bytes, times in seconds, throughput in GB/s with GB = 1e9 bytes (dd's unit).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

GB = 1e9
MiB = 1 << 20
DROP_CACHES = "/proc/sys/vm/drop_caches"


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` once; return (wall seconds, its result)."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def timed_collective(fn: Callable[[], object]) -> float:
    """Wall seconds of ``fn`` on every rank of the default group, barriers before and after (the
    slowest rank's time)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
    """Median of ``xs``; NaN when empty (so a skipped measurement shows as missing, not as zero)."""
    return statistics.median(xs) if xs else float("nan")


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (1e9 bytes)."""
    return nbytes / GB / seconds if seconds > 0 else float("nan")


def fsync_path(path: str) -> None:
    """fsync a file or a directory by path (a directory fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fresh_dir(root: str, name: str) -> str:
    """An empty directory ``root/name`` (whatever was there is removed first)."""
    path = os.path.join(root, name)
    remove(path)
    os.makedirs(path)
    return path


def remove(path: str) -> None:
    """Remove a file or a directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def proc_status_bytes(field: str) -> int:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...) in bytes; 0 where absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def drop_caches() -> str | None:
    """Write back dirty pages and drop the page cache; None on success, else why it was not possible."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError as e:
        return f"cannot write {DROP_CACHES} ({e.strerror}); run as root for cold-cache figures"
    return None


def can_drop_caches() -> str | None:
    """None if ``drop_caches`` will work here (root, and the write succeeds), else the reason."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "not running as root; cold-cache loads skipped"
    return drop_caches()


@dataclass(slots=True)
class DDResult:
    seconds: float  # dd's own figure (includes the final fdatasync) or, failing that, wall time
    wall: float  # wall time of the dd process
    nbytes: int

    @property
    def gbps(self) -> float:
        return gbps(self.nbytes, self.seconds)


_DD_LINE = re.compile(r"^(\d+) bytes .*copied, ([0-9.,eE+-]+) s", re.MULTILINE)


def _dd(args: list[str], nbytes: int) -> DDResult:
    cmd = ["dd", *args]
    env = dict(os.environ, LC_ALL="C")  # dd's summary line in a parseable locale
    wall, proc = timed(lambda: subprocess.run(cmd, capture_output=True, text=True, env=env))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    m = _DD_LINE.search(proc.stderr)
    if m is None:
        return DDResult(wall, wall, nbytes)
    return DDResult(float(m.group(2).replace(",", ".")), wall, int(m.group(1)))


def run_dd(path: str, *, bs_mib: int = 16, count: int = 128, keep: bool = False) -> DDResult:
    """Write ``count`` blocks of ``bs_mib`` MiB of zeros to ``path`` with conv=fdatasync.

    This is the physical reference for sequential durable writes on the disk holding ``path``.
    The file is removed unless ``keep`` (e.g. to time reading it back with ``run_dd_read``).
    Raises RuntimeError when dd fails.
    """
    remove(path)
    try:
        return _dd(["if=/dev/zero", f"of={path}", f"bs={bs_mib}M", f"count={count}", "conv=fdatasync"],
                   bs_mib * MiB * count)
    finally:
        if not keep:
            remove(path)


def run_dd_read(path: str, *, bs_mib: int = 16) -> DDResult:
    """Read ``path`` sequentially to /dev/null with dd (cold if the page cache was dropped first)."""
    return _dd([f"if={path}", "of=/dev/null", f"bs={bs_mib}M"], os.path.getsize(path))


def dir_bytes(path: str) -> int:
    """Total size of the files under ``path`` (a file: its size)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


def machine_info(path: str) -> dict[str, Any]:
    """What the figures depend on: CPUs, memory, kernel, Python/torch versions, the filesystem of ``path``."""
    import torch

    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kernel": platform.release(),
        "machine": platform.machine(),
    }
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["mem_gib"] = round(kb / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        out = subprocess.run(["df", "-PT", path], capture_output=True, text=True, check=True).stdout
        fields = out.splitlines()[1].split()
        info["fs_device"], info["fs_type"] = fields[0], fields[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        pass
    return info


def fmt(x: float, digits: int = 2) -> str:
    """A number for a table cell; '-' for NaN/None."""
    if x is None or x != x:
        return "-"
    return f"{x:.{digits}f}"


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a table with rich when it is installed, else as aligned plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}")
        widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(columns)]
        print("  ".join(str(c).ljust(w) for c, w in zip(columns, widths, strict=True)))
        for r in rows:
            print("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)))
        return
    table = Table(title=title)  # piped output: wide enough that cells do not wrap
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*(str(v) for v in r))
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def _numeric(cell: str) -> bool:
    try:
        float(cell.rstrip("x"))
    except ValueError:
        return cell == "-"
    return True


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The same table as GitHub markdown: numeric columns right-aligned, text columns left-aligned."""
    align = [i > 0 and all(_numeric(str(r[i])) for r in rows) for i in range(len(columns))]
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if a else ":---" for a in align) + "|"]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json_atomic(path: str, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` through a temporary file (a reader never sees half a JSON)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def activation_bytes(fn: Any, params: set[int]) -> tuple[Any, int]:
    """Run ``fn``; return (its result, bytes of the unique non-parameter storages autograd saved)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def print_tables(tables: Sequence[tuple[str, Sequence[str], Sequence[Sequence[str]]]]) -> None:
    """Each ``(title, columns, rows)`` as a console table, then all of them again as markdown (for
    docs/BENCHMARKS.md)."""
    for title, cols, rows in tables:
        print_table(title, cols, rows)
    print()
    for title, cols, rows in tables:
        print(f"**{title}**\n\n{markdown_table(cols, rows)}\n")


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same bytes (dtype and shape too): bitwise, NaN payloads
    included, where ``torch.equal`` would call NaN != NaN."""
    import torch

    def raw(t: Any) -> Any:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and torch.equal(raw(a), raw(b)))
