"""A layout change restores from the memory tier through the ordinary resharding load when every
piece is reachable (4 forked gloo ranks -> 2, and -> 3 with uneven pieces), else from storage."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt.tier.nodes import run_id_for
from tests.dist_utils import run_ranks
from tests.tier.kill_harness import WORLD, state_of

pytestmark = pytest.mark.multiproc


def _global(step: int) -> dict[str, torch.Tensor]:
    """The global tensors the 4 ranks of kill_harness.state_of hold pieces of."""
    return {"w": torch.cat([state_of(r, step)["model"]["w"].local for r in range(WORLD)]),
            "m": torch.cat([state_of(r, step)["optim"]["m"].local for r in range(WORLD)])}


def _target(rank: int, world: int) -> dict[str, Any]:
    """The same global tensors split another way: ``w`` by rows, ``m`` flat, ``world`` ranks (uneven)."""
    rows, n = WORLD * 256, WORLD * 8192
    r0, r1 = rank * rows // world, (rank + 1) * rows // world
    f0, f1 = rank * n // world, (rank + 1) * n // world
    return {"model": {"w": ckpt.Shard(torch.zeros(r1 - r0, 256), (rows, 256), (r0, 0))},
            "optim": {"m": ckpt.FlatShard(torch.zeros(f1 - f0), (n,), f0)},
            "train": {"step": 0, "sample_index": 0, "sched": {"last": 0}}}


def _restore(rank: int, world: int, shm: str, root: str, out: str) -> None:
    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=shm, nodes=world if world % 2 else 2,
                                 memory_timeout=30)
    target = _target(rank, world)
    step = mgr.restore(target)
    tier = mgr.last_restore.tier if mgr.last_restore is not None else "storage"
    assert step is not None
    g = _global(step)
    w, m = target["model"]["w"], target["optim"]["m"]
    assert torch.equal(w.local, g["w"][w.offsets[0]:w.offsets[0] + w.local.shape[0]])  # bitwise
    assert torch.equal(m.local, g["m"][m.start:m.start + m.local.numel()])
    assert target["train"] == state_of(0, step)["train"]
    with open(out, "a") as f:
        f.write(json.dumps({"rank": rank, "step": step, "tier": tier}) + "\n")


def _restored(world: int, shm: str, root: str, tmp: Path) -> set[tuple[int, str]]:
    out = tmp / f"out-{world}-{len(list(tmp.glob('out-*')))}.jsonl"
    run_ranks(world, _restore, shm, root, str(out))
    return {(r["step"], r["tier"]) for r in map(json.loads, out.read_text().splitlines())}


def test_a_layout_change_restores_from_the_memory_tier_when_every_piece_is_reachable(
        shm: str, tmp_path: Path, save_memory: Callable[..., None]) -> None:
    root = str(tmp_path / "ckpts")
    run_ranks(4, save_memory, shm, root, (1, 2, 3), (1,))
    tier = Path(shm) / f"ckpt-{run_id_for(root)}"
    saved = sorted(p.relative_to(tier) for p in tier.rglob("*") if p.is_file())
    assert _restored(2, shm, root, tmp_path) == {(3, "memory-reshard")}  # 4 -> 2 ranks, newer than storage's 1
    # the copies are untouched by the views (hard links, removed after the load)
    assert not list(tier.glob("view-*"))
    # every piece still reachable: 4 -> 3 ranks (uneven split) restores from memory too
    run_ranks(4, save_memory, shm, root, (1, 2, 3))
    assert _restored(3, shm, root, tmp_path) == {(3, "memory-reshard")}
    # a piece no copy holds any more: storage
    run_ranks(4, save_memory, shm, root, (1, 2, 3))
    for p in tier.rglob("rank-2"):
        shutil.rmtree(p)
    assert _restored(2, shm, root, tmp_path) == {(1, "storage")}
    assert saved  # (the 4-rank tier had files to begin with)


def _damaged(rank: int, world: int, shm: str, root: str, out: str) -> None:
    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=shm, nodes=2, memory_timeout=30)
    assert mgr.memory is not None
    notes: list[dict[str, Any]] = []
    got = mgr.memory.restore_resharded(_target(rank, world), on_failure=notes.append)
    assert got is None
    (rec,) = notes
    assert rec["tier"] == "memory-reshard" and rec["step"] == 3 and "checksum" in rec["error"].lower(), rec


def test_a_damaged_piece_fails_the_resharded_restore_on_every_rank(shm: str, tmp_path: Path,
                                                                   save_memory: Callable[..., None]) -> None:
    root = str(tmp_path / "ckpts")
    run_ranks(4, save_memory, shm, root, (1, 2, 3), (1,))
    tier = Path(shm) / f"ckpt-{run_id_for(root)}"
    for copy in [tier / "node-0" / "rank-1" / "step-0000000003", tier / "node-1" / "replicas" / "rank-1" /
                 "step-0000000003"]:
        m = ckpt.inspect(str(copy))
        s = m.tensors["model.w"].shards[0]
        with open(copy / s.file, "r+b") as f:  # the same flipped byte in both copies of rank 1's piece
            f.seek(s.offset + 100)
            b = f.read(1)
            f.seek(s.offset + 100)
            f.write(bytes([b[0] ^ 1]))
    run_ranks(2, _damaged, shm, root, "")
