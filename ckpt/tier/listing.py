"""What memory tiers hold, for ``ckpt ls``: found through each run's ``tier.json``, never by guessing."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ckpt.tier.nodes import NODE_DIR, RANK_DIR, shm_base
from ckpt.tier.store import REPLICAS, _listdir, _steps, read_entry


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
        try:
            with open(os.path.join(run, "tier.json")) as f:
                doc = json.load(f)
            run_id, world = str(doc["run_id"]), int(doc["world"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a tier of ours (or not readable): left alone
        if root is not None and not _same_root(str(doc.get("root", "")), root):
            continue
        for node_name in _listdir(run):
            nm = NODE_DIR.match(node_name)
            if nm is None:
                continue
            node = int(nm.group(1))
            ndir = os.path.join(run, node_name)
            places = [(int(m.group(1)), os.path.join(ndir, d), "local") for d in _listdir(ndir)
                      if (m := RANK_DIR.match(d))]
            places += [(int(m.group(1)), os.path.join(ndir, REPLICAS, d), "replica")
                       for d in _listdir(os.path.join(ndir, REPLICAS)) if (m := RANK_DIR.match(d))]
            for owner, where, kind in places:
                for step, path in _steps(where):
                    e = read_entry(path, owner, step, kind, run_id, world)
                    status = "committed" if e.usable else ("unusable" if e.committed else "incomplete")
                    out.append(MemoryInfo(run_id, node, owner, step, kind, status, e.bytes, path, e.problem))
    return sorted(out, key=lambda i: (i.step, i.node, i.owner, i.kind))
