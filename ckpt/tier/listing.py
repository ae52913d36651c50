"""What memory tiers hold, for ``ckpt ls``, and what of them can go, for ``ckpt gc --memory``: found
through each run's ``tier.json``, never by guessing (a directory without one is not ours)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from typing import Any

from ckpt.tier.nodes import NODE_DIR, RANK_DIR, shm_base
from ckpt.tier.reshard import VIEW_PREFIX
from ckpt.tier.slots import SLOTS_DIR
from ckpt.tier.store import REPLICAS, _listdir, _steps, read_entry

MAX_TIER_JSON = 1 << 20  # tier.json is a few hundred bytes: anything larger is not ours
LINEAGE = ".ckpt-lineage"  # as ckpt.manager.LINEAGE (not imported: the manager imports this package)


def read_small(path: str, limit: int = MAX_TIER_JSON) -> bytes | None:
    """The bytes of a small regular file, or None when it is missing, unreadable, a symlink, larger
    than ``limit`` or not a regular file: a FIFO or a device would block or never end, so it is
    opened non-blocking and checked with fstat before any read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_tier_json(path: str) -> dict[str, Any] | None:
    """A run's ``tier.json`` (see :func:`read_small`), or None when it is not the JSON object the
    tier writes."""
    data = read_small(path)
    if data is None:
        return None
    try:
        doc = json.loads(data)
        doc["run_id"], doc["world"] = str(doc["run_id"]), int(doc["world"])
    except (ValueError, KeyError, TypeError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """One memory checkpoint copy: ``kind`` ``local`` (its owner's) or ``replica`` (kept for it on
    another node); ``status`` ``committed``, ``incomplete`` or ``unusable`` (``note`` says why)."""

    run_id: str
    node: int
    owner: int
    step: int
    kind: str
    status: str
    bytes: int
    path: str
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"tier": "memory", "run_id": self.run_id, "node": self.node, "rank": self.owner, "step": self.step,
                "copy": self.kind, "status": self.status, "committed": self.status == "committed",
                "bytes": self.bytes, "path": self.path, "note": self.note}


def _same_root(a: str, b: str) -> bool:
    norm = lambda u: (u if "://" in u else os.path.abspath(u)).rstrip("/")  # noqa: E731
    return norm(a) == norm(b)


def list_memory(root: str | None = None, shm_dir: str | None = None) -> list[MemoryInfo]:
    """Every memory checkpoint copy under the shared-memory base (``shm_dir``, ``$CKPT_SHM_DIR`` or
    ``/dev/shm``) of the runs whose persistent root is ``root`` (every run when None), by step,
    node and rank. Reads only directory listings and manifests; never raises for what it finds."""
    base = shm_base(shm_dir)
    out: list[MemoryInfo] = []
    for name in sorted(_listdir(base)):
        if not name.startswith("ckpt-"):
            continue
        run = os.path.join(base, name)
        doc = read_tier_json(os.path.join(run, "tier.json"))
        if doc is None:
            continue  # not a tier of ours (or not readable): left alone
        run_id, world = doc["run_id"], doc["world"]
        if root is not None and not _same_root(str(doc.get("root", "")), root):
            continue
        for node_name in _listdir(run):
            nm = NODE_DIR.match(node_name)
            if nm is None:
                continue
            node = int(nm.group(1))
            ndir = os.path.join(run, node_name)
            for owner, where, kind in _places(ndir):
                for step, path in _steps(where):
                    e = read_entry(path, owner, step, kind, run_id, world)
                    status = "committed" if e.usable else ("unusable" if e.committed else "incomplete")
                    out.append(MemoryInfo(run_id, node, owner, step, kind, status, e.bytes, path, e.problem))
    return sorted(out, key=lambda i: (i.step, i.node, i.owner, i.kind))


@dataclass(frozen=True, slots=True)
class MemoryRemoval:
    """One directory ``gc_memory`` removed (or would remove): a copy, a leftover view, or a whole run."""

    run_id: str
    path: str
    reason: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"tier": "memory", "run_id": self.run_id, "path": self.path, "reason": self.reason,
                "bytes": self.bytes}


def _tree(path: str) -> tuple[int, float]:
    """Bytes and newest mtime of everything under ``path`` (itself included)."""
    size, newest = 0, 0.0
    for dirpath, _dirs, files in os.walk(path):
        with contextlib.suppress(OSError):
            newest = max(newest, os.lstat(dirpath).st_mtime)
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                size, newest = size + st.st_size, max(newest, st.st_mtime)
    return size, newest


def _lineage(root: str) -> tuple[str | None, str]:
    """``(token, problem)`` of a run's persistent root: its lineage token (None: unknown, e.g. not a
    local path), or a problem that makes every copy of the run unrestorable."""
    if "://" in root or not root:
        return None, ""
    if not os.path.isdir(root):
        return None, f"its persistent root {root} no longer exists"
    data = read_small(os.path.join(root, LINEAGE), 4096)
    return (data.decode("ascii", "replace").strip() if data is not None else None), ""


def _places(ndir: str) -> list[tuple[int, str, str]]:
    """``(owner, directory, kind)`` of every rank directory of a node: its own ranks' (``local``) and
    the copies it keeps for others (``replica``)."""
    out = [(int(m.group(1)), os.path.join(ndir, d), "local") for d in _listdir(ndir) if (m := RANK_DIR.match(d))]
    return out + [(int(m.group(1)), os.path.join(ndir, REPLICAS, d), "replica")
                  for d in _listdir(os.path.join(ndir, REPLICAS)) if (m := RANK_DIR.match(d))]


def gc_memory(root: str | None = None, shm_dir: str | None = None, *, min_age: float = 300.0,
              dry_run: bool = False) -> list[MemoryRemoval]:
    """Remove what no job can restore from the memory tiers on this host (of the runs saving to
    ``root``; every run when None), untouched for ``min_age`` seconds (a job writing now is left
    alone): copies of a root emptied or replaced since (another lineage) or gone, of another run
    id, of another world size than the run's newest job, incomplete copies (no manifest), and
    leftover resharding views; then directories left empty, and the run when only its
    ``tier.json`` is left. Never raises for what it finds; ``dry_run``: only report."""
    base = shm_base(shm_dir)
    now = time.time()
    out: list[MemoryRemoval] = []

    def remove(run_id: str, path: str, reason: str) -> None:
        size, newest = _tree(path)
        if now - newest < min_age:
            return
        out.append(MemoryRemoval(run_id, path, reason, size))
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)

    for name in sorted(_listdir(base)):
        run = os.path.join(base, name)
        doc = read_tier_json(os.path.join(run, "tier.json")) if name.startswith("ckpt-") else None
        if doc is None or os.path.islink(run):
            continue
        if root is not None and not _same_root(str(doc.get("root", "")), root):
            continue
        run_id, world = doc["run_id"], doc["world"]
        token, gone = _lineage(str(doc.get("root", "")))
        for view in _listdir(run):
            if view.startswith(VIEW_PREFIX):
                remove(run_id, os.path.join(run, view), "a resharding view left by a killed restore")
        for node_name in _listdir(run):
            ndir = os.path.join(run, node_name)
            if NODE_DIR.match(node_name) is None or os.path.islink(ndir):
                continue
            for owner, where, kind in _places(ndir):
                for step, path in _steps(where):
                    e = read_entry(path, owner, step, kind, run_id, world, token)
                    if gone:
                        remove(run_id, path, f"stale: {gone}")
                    elif e.problem and (e.committed or e.problem.startswith("incomplete")):
                        remove(run_id, path, e.problem)  # an unreadable manifest is reported by ls, left alone
                slots = os.path.join(where, SLOTS_DIR)
                if not dry_run and not _steps(where) and os.path.isdir(slots) and now - _tree(slots)[1] >= min_age:
                    # the files this rank's copies were written into (ckpt.tier.slots): with no copy left they
                    # go with the directory, as its empty subdirectories do (not a copy: not listed)
                    shutil.rmtree(slots, ignore_errors=True)
                for d in (where, os.path.dirname(where) if kind == "replica" else ""):
                    if d and not dry_run:
                        with contextlib.suppress(OSError):
                            os.rmdir(d)  # only when empty
            if not dry_run:
                with contextlib.suppress(OSError):
                    os.rmdir(ndir)
        if not dry_run and _listdir(run) == ["tier.json"]:
            with contextlib.suppress(OSError):
                if now - os.lstat(os.path.join(run, "tier.json")).st_mtime >= min_age:  # no job started since
                    os.unlink(os.path.join(run, "tier.json"))
                    os.rmdir(run)
    return out
