"""Tier fixtures: a fresh shared-memory base directory, and ``save_memory``: the 2-node memory-tier
saves of kill_harness.state_of that the forked-rank tests start from."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

import ckpt
from tests.tier.kill_harness import state_of


@pytest.fixture
def shm() -> Iterator[str]:
    """A fresh shared-memory base directory (under /dev/shm when there is one), removed afterwards."""
    base = tempfile.mkdtemp(prefix="ckpt-test-tier-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _save_memory(rank: int, world: int, shm: str, root: str, steps: tuple[int, ...],
                 persist: tuple[int, ...] = ()) -> None:
    """One rank: save ``persist``'s steps to storage, then ``steps`` to the memory tier (2 nodes); no clean
    end, so the copies stay in shared memory as after a kill."""
    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=shm, nodes=2, memory_timeout=30)
    for step in persist:
        mgr.save(step, state_of(rank, step))
    for step in steps:
        assert mgr.save_memory(step, state_of(rank, step)).result().complete


@pytest.fixture
def save_memory() -> Callable[..., None]:
    """``fn(rank, world, shm, root, steps, persist=())`` for ``run_ranks``: each rank saves
    ``state_of(rank, step)`` for ``persist``'s steps to storage, then for ``steps`` to the memory tier."""
    return _save_memory
