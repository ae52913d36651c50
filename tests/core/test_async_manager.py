"""Async save, the checkpoint manager, retention, gc, and ls/gc on the command line."""

from __future__ import annotations

import os
import resource
import time

import pytest
import torch
from typer.testing import CliRunner

import ckpt
from ckpt.async_save import AsyncSaver
from ckpt.cli.app import app
from ckpt.manager import CheckpointInfo, select_removals, step_dir
from ckpt.manifest import MANIFEST_NAME
from tests.dist_utils import run_ranks
from tests.helpers import fail_local_writes, random_state

pytestmark = pytest.mark.multiproc

runner = CliRunner(env={"COLUMNS": "200"})


def _state(seed: int = 0) -> dict:
    return {"model": random_state(seed, {"w": (256, 256), "b": ((256,), torch.bfloat16)}), "step": seed}


def test_modifying_after_staged_keeps_pre_modification_values(tmp_path):
    st = _state()
    ref = {k: v.clone() for k, v in st["model"].items()}
    h = ckpt.async_save(st, str(tmp_path / "a"), step=1)
    h.staged()
    for v in st["model"].values():
        v.fill_(7)  # the optimizer step
    m = h.done()
    assert m is not None and m.step == 1
    dst = {"model": {k: torch.zeros_like(v) for k, v in ref.items()}, "step": None}
    ckpt.load(dst, str(tmp_path / "a"))
    for k in ref:
        assert torch.equal(dst["model"][k], ref[k])
    assert ckpt.verify(str(tmp_path / "a"), deep=True).ok


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_twenty_async_saves_keep_memory_flat(tmp_path):
    st = {"w": torch.randn(2048, 1024)}  # 8 MiB
    saver = AsyncSaver()
    rss = []
    for i in range(20):
        saver.save(st, str(tmp_path / f"s{i}"), step=i).done()
        rss.append(_rss_kib())
    assert saver.pool.allocations == 1  # the staging pool was allocated once and reused
    growth_mib = (rss[-1] - rss[2]) / 1024
    assert growth_mib < 8, f"RSS grew {growth_mib:.1f} MiB over 17 steady-state saves: {rss}"


def test_failed_async_save_surfaces_on_done_and_next_save_and_latest_unchanged(tmp_path, monkeypatch):
    mgr = ckpt.CheckpointManager(str(tmp_path), keep_last=3)
    mgr.save(1, _state(1)).done()
    assert mgr.latest() == mgr.url_for(1)
    fail_local_writes(monkeypatch, over=1000)
    h = mgr.save(2, _state(2))
    with pytest.raises(ckpt.StorageError, match="injected"):
        h.done()
    assert mgr.latest() == mgr.url_for(1)
    assert not os.path.exists(os.path.join(mgr.url_for(2), MANIFEST_NAME))
    h = mgr.save(3, _state(3))  # fails too; not observed through done()
    with pytest.raises(ckpt.CheckpointError, match="previous async save"):
        mgr.save(4, _state(4))
    monkeypatch.undo()
    assert h.is_done
    st = _state(9)
    assert mgr.restore(st) == 1
    assert torch.equal(st["model"]["w"], _state(1)["model"]["w"]) and st["step"] == 1


def test_retention_keeps_exactly_the_newest_and_every_kth(tmp_path):
    mgr = ckpt.CheckpointManager(str(tmp_path), keep_last=2, keep_every=4)
    for step in range(1, 10):
        mgr.save(step, _state(step))
    mgr.wait()
    kept = [c.step for c in mgr.list()]
    assert kept == [4, 8, 9], kept  # newest 2 are 8 and 9; 4 is a multiple of 4
    assert all(c.committed for c in mgr.list())


def test_sync_manager_and_restore_on_empty_root(tmp_path):
    mgr = ckpt.CheckpointManager(str(tmp_path / "r"), async_save=False, keep_last=1)
    st = _state()
    assert mgr.restore(st) is None and mgr.latest() is None
    mgr.save(5, st)
    mgr.save(6, st)
    assert [c.step for c in mgr.list()] == [6]


def test_select_removals_never_drops_newest_committed_or_live():
    def info(step, committed, live=False):
        return CheckpointInfo(step, step_dir(step), f"/r/{step_dir(step)}", committed, live, 0, 0.0)

    infos = [info(1, True), info(2, False), info(3, True), info(4, False, live=True), info(5, False)]
    doomed = {c.step for c in select_removals(infos, keep_last=1, keep_every=None)}
    assert doomed == {1, 2, 5}
    assert {c.step for c in select_removals(infos, keep_last=None, keep_every=None)} == {2, 5}


def test_gc_and_ls_cli(tmp_path):
    root = str(tmp_path)
    for s in (1, 2, 3):
        ckpt.save(_state(s), os.path.join(root, step_dir(s)), step=s)
    os.unlink(os.path.join(root, step_dir(2), MANIFEST_NAME))  # a crashed save
    r = runner.invoke(app, ["ls", root])
    assert r.exit_code == 0 and "incomplete" in r.output and "committed" in r.output
    r = runner.invoke(app, ["gc", root, "--dry-run"])
    assert r.exit_code == 0 and "would remove" in r.output and step_dir(2) in r.output
    assert os.path.exists(os.path.join(root, step_dir(2)))
    r = runner.invoke(app, ["gc", root, "--keep-last", "1"])
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(root)) == [step_dir(3)]


def test_manager_startup_gc_spares_a_live_lease(tmp_path):
    root = str(tmp_path)
    live = os.path.join(root, step_dir(7))
    os.makedirs(live)
    import json
    import socket

    with open(os.path.join(live, ".writing"), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "time": 0}, f)
    dead = os.path.join(root, step_dir(8))
    os.makedirs(dead)
    with open(os.path.join(dead, ".writing"), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": 2**22 + 12345, "time": 0}, f)
    ckpt.CheckpointManager(root)
    assert os.path.exists(live) and not os.path.exists(dead)


def _mgr_ranks(rank: int, world: int, root: str) -> None:
    mgr = ckpt.CheckpointManager(root, keep_last=2)
    g = torch.arange(64.0).reshape(8, 8)
    for step in range(3):
        piece = ckpt.Shard((g[rank * 4 : rank * 4 + 4] + step).clone(), (8, 8), (rank * 4, 0))
        h = mgr.save(step, {"w": piece, "step": step})
        h.staged()
        piece.local.fill_(-1)  # staged: must not leak into the checkpoint
    mgr.wait()
    target = ckpt.Shard(torch.zeros(8, 4), (8, 8), (0, rank * 4))
    st = {"w": target, "step": None}
    assert mgr.restore(st) == 2
    assert torch.equal(target.local, (g + 2)[:, rank * 4 : rank * 4 + 4])


def test_async_manager_on_two_ranks(tmp_path):
    run_ranks(2, _mgr_ranks, str(tmp_path))
    assert [c.step for c in ckpt.CheckpointManager(str(tmp_path)).list()] == [1, 2]


def _every_step(rank: int, world: int, root: str) -> None:
    # With the plan cache, rank 1 starts writing step N+1 before rank 0's lease exists while rank 0's
    # background thread runs retention for step N: retention must spare later steps.
    mgr = ckpt.CheckpointManager(root, keep_last=2)
    for step in range(12):
        if rank == 0:
            time.sleep(0.1)  # the coordinator is busy training; its lease for this step comes late
        piece = ckpt.Shard(torch.full((4, 8), float(step)), (8, 8), (rank * 4, 0))
        h = mgr.save(step, {"w": piece})
        if rank == 1:
            h.done()  # rank 1 races ahead as soon as each commit is acknowledged
    mgr.wait()


def test_retention_never_removes_a_starting_save(tmp_path):
    run_ranks(2, _every_step, str(tmp_path))
    infos = ckpt.CheckpointManager(str(tmp_path), gc_on_start=False).list()
    assert [c.step for c in infos] == [10, 11] and all(c.committed for c in infos)
    for c in infos:
        assert ckpt.verify(c.url, deep=True).ok
