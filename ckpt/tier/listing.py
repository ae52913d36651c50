"""What memory tiers hold, for ``ckpt ls``, and what of them can go, for ``ckpt gc --memory``: found
through each run's ``tier.json``, never by guessing (a directory without one is not ours)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from ckpt.tier import safefs
from ckpt.tier.nodes import NODE_DIR, RANK_DIR, shm_base
from ckpt.tier.reshard import VIEW_PREFIX
from ckpt.tier.runlock import exclusive, lock_names, remove_locks
from ckpt.tier.slots import SLOTS_DIR
from ckpt.tier.store import REPLICAS, Entry, _listdir, _steps, read_entry

MAX_TIER_JSON = 1 << 20  # tier.json is a few hundred bytes: anything larger is not ours
LINEAGE = ".ckpt-lineage"  # as ckpt.manager.LINEAGE (not imported: the manager imports this package)


def read_small(path: str, limit: int = MAX_TIER_JSON) -> bytes | None:
    """The bytes of a small regular file of this user, or None when it is missing, unreadable, a
    link, larger than ``limit`` or not a regular file (a FIFO or a device would block or never end:
    see :func:`ckpt.tier.safefs.open_file`)."""
    try:
        return safefs.read_bytes(path, limit)
    except OSError:
        return None


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


def _runs(base: str, root: str | None) -> list[tuple[str, dict[str, Any]]]:
    """``(run directory, tier.json)`` of every run under ``base`` saving to ``root`` (every run when
    None) whose directory is a safe one of ours (a real directory of this user, not writable by
    others: :func:`ckpt.tier.safefs.trust_root`); any other is not ours, left alone."""
    out = []
    try:
        names = sorted(os.listdir(base))  # (the base itself may be a link, /dev/shm -> /run/shm: the admin's)
    except OSError:
        names = []
    for name in names:
        if not name.startswith("ckpt-"):
            continue
        try:
            run = safefs.trust_root(os.path.join(base, name), create=False)
        except OSError:
            continue
        doc = read_tier_json(os.path.join(run, "tier.json"))
        if doc is None or (root is not None and not _same_root(str(doc.get("root", "")), root)):
            continue  # not a tier of ours (or not readable), or another root's
        out.append((run, doc))
    return out


def _copies(run: str, run_id: str, lineage: str | None) -> list[tuple[int, Entry]]:
    """``(node, entry)`` of every step directory of a run, checked against its run id and lineage
    but not its world size (a copy of another world size serves a resharding restore)."""
    out = []
    for node_name in sorted(safefs.listdir(run)):
        nm = NODE_DIR.match(node_name)
        if nm is None:
            continue
        for owner, where, kind in _places(os.path.join(run, node_name)):
            out += [(int(nm.group(1)), read_entry(path, owner, step, kind, run_id, None, lineage))
                    for step, path in _steps(where)]
    return out


def list_memory(root: str | None = None, shm_dir: str | None = None) -> list[MemoryInfo]:
    """Every memory checkpoint copy under the shared-memory base (``shm_dir``, ``$CKPT_SHM_DIR`` or
    ``/dev/shm``) of the runs whose persistent root is ``root`` (every run when None), by step,
    node and rank. Reads only directory listings and manifests, never through a link; never raises
    for what it finds. A copy written by a job of another world size than the run's newest is
    listed as committed, with a note: a resharding restore can still use it."""
    out: list[MemoryInfo] = []
    for run, doc in _runs(shm_base(shm_dir), root):
        run_id, world = doc["run_id"], doc["world"]
        for node, e in _copies(run, run_id, None):
            status = "committed" if e.usable else ("unusable" if e.committed else "incomplete")
            note = e.problem or (f"written by a job of {e.world} ranks (the run's newest has {world}): for a "
                                 "resharding restore" if e.usable and e.world != world else "")
            out.append(MemoryInfo(run_id, node, e.owner, e.step, e.kind, status, e.bytes, e.path, note))
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
    """Bytes and newest mtime of everything under ``path`` (itself included; no link followed)."""
    st = safefs.lstat(path)
    if st is None:
        return 0, 0.0
    size, newest = (st.st_size if not safefs.is_dir(path) else 0), st.st_mtime
    for name in safefs.listdir(path):
        s, n = _tree(os.path.join(path, name))
        size, newest = size + s, max(newest, n)
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


def superseded(copies: list[Entry], world: int) -> int | None:
    """The newest step complete on this host under ``world`` ranks (a usable copy of every owner
    0..world-1, own or kept by a peer, of one attempt), or None. A copy of another world size older
    than it is one no restore takes: the same-world restore takes that step, and a resharding one
    the newest step. Copies of other world sizes at or after it are kept (a job of another size may
    reshard from them). Pure."""
    groups: dict[tuple[int, str], set[int]] = {}
    for e in copies:
        if e.usable and e.world == world:
            groups.setdefault((e.step, e.epoch), set()).add(e.owner)
    done = [step for (step, _epoch), owners in groups.items() if owners >= set(range(world))]
    return max(done) if done else None


def gc_memory(root: str | None = None, shm_dir: str | None = None, *, min_age: float = 300.0,
              dry_run: bool = False) -> list[MemoryRemoval]:
    """Remove what no restore (own copy, a peer's, or resharded to another world size) can use from
    the memory tiers on this host (of the runs saving to ``root``; every run when None), untouched
    for ``min_age`` seconds: copies of a root emptied or replaced since (another lineage) or gone, of
    another run id, incomplete copies (no manifest), copies of another world size older than the
    newest step complete under the run's newest world size (:func:`superseded`), and leftover
    resharding views; then directories left empty, and the run when only its ``tier.json`` is left.
    A run whose tier is alive on this host (its lock held, :mod:`ckpt.tier.runlock`) is not touched,
    nor anything through a link. Never raises for what it finds; ``dry_run``: only report."""
    now = time.time()
    out: list[MemoryRemoval] = []

    def remove(run_id: str, path: str, reason: str) -> None:
        size, newest = _tree(path)
        if now - newest < min_age:
            return
        out.append(MemoryRemoval(run_id, path, reason, size))
        if not dry_run:
            safefs.rmtree(path)

    for run, doc in _runs(shm_base(shm_dir), root):
        with exclusive(run) as free:
            if free:  # no tier of the run is alive here, and none starts until this run is done
                _gc_run(run, doc, remove, now, min_age, dry_run)
    return out


def _gc_run(run: str, doc: dict[str, Any], remove: Any, now: float, min_age: float, dry_run: bool) -> None:
    run_id, world = doc["run_id"], doc["world"]
    token, gone = _lineage(str(doc.get("root", "")))
    for view in safefs.listdir(run):
        if view.startswith(VIEW_PREFIX):
            remove(run_id, os.path.join(run, view), "a resharding view left by a killed restore")
    copies = _copies(run, run_id, token)
    newest = superseded([e for _node, e in copies], world)
    for _node, e in copies:
        if gone:
            remove(run_id, e.path, f"stale: {gone}")
        elif e.problem and (e.committed or e.problem.startswith("incomplete")):
            remove(run_id, e.path, e.problem)  # an unreadable manifest is reported by ls, left alone
        elif e.usable and e.world != world and newest is not None and e.step < newest:
            remove(run_id, e.path, f"superseded: written by a job of {e.world} ranks, and step {newest} of the "
                   f"run's newest job ({world} ranks) is complete")
    if dry_run:
        return
    for node_name in safefs.listdir(run):
        ndir = os.path.join(run, node_name)
        if NODE_DIR.match(node_name) is None or not safefs.is_dir(ndir):
            continue
        for _owner, where, kind in _places(ndir):
            slots = os.path.join(where, SLOTS_DIR)
            if not _steps(where) and safefs.is_dir(slots) and now - _tree(slots)[1] >= min_age:
                # the files this rank's copies were written into (ckpt.tier.slots): with no copy left they
                # go with the directory, as its empty subdirectories do (not a copy: not listed)
                safefs.rmtree(slots)
            for d in (where, os.path.dirname(where) if kind == "replica" else ""):
                if d:
                    with contextlib.suppress(OSError):
                        safefs.rmdir(d)  # only when empty
        with contextlib.suppress(OSError):
            safefs.rmdir(ndir)
    names = safefs.listdir(run)
    if not set(names) - {"tier.json", *lock_names(names)}:
        tj = safefs.lstat(os.path.join(run, "tier.json"))
        if tj is None or now - tj.st_mtime >= min_age:  # no job started since
            with contextlib.suppress(OSError):
                safefs.unlink(os.path.join(run, "tier.json"))
            remove_locks(run)  # (under the exclusive lock: no tier holds them)
            with contextlib.suppress(OSError):
                safefs.rmdir(run)


__all__ = ["MAX_TIER_JSON", "LINEAGE", "read_small", "read_tier_json", "MemoryInfo", "list_memory", "MemoryRemoval",
           "superseded", "gc_memory"]
