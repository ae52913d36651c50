"""Ownership (ckpt/_transaction.py): a writer creates only names no other writer can produce and removes
only its own written set; one regression test per way the audit lost data, plus the resume rules.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time

import pytest
import torch

import ckpt
from ckpt import _transaction as transaction
from ckpt.convert import export_dcp, import_checkpoint
from ckpt.errors import CheckpointExistsError
from ckpt.layout import Layout
from ckpt.manifest import MANIFEST_NAME
from ckpt.resharders import reshard as reshard_mod
from ckpt.resharders.diff import diff
from ckpt.resharders.reshard import MARKER_DIR, reshard
from ckpt.storage import local
from tests.integrity import writers as W

LAY = Layout.parse("dp=2")


def _data(d: str) -> set[str]:
    return {f for f in W.files_under(d) if transaction.in_data_area(f)}


def _race(*calls):
    """Run ``calls`` on threads that start together; returns each one's result or exception."""
    go = threading.Barrier(len(calls), timeout=30)
    out: list = [None] * len(calls)

    def run(i, fn):
        go.wait()
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001 - returned to the test, which checks its type
            out[i] = e

    ts = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


def _one_winner(results):
    wins = [r for r in results if isinstance(r, ckpt.Manifest)]
    assert len(wins) == 1 and all(isinstance(r, CheckpointExistsError) for r in results if r is not wins[0]), results
    return wins[0]


@pytest.fixture
def env(tmp_path):
    return W.make_env(str(tmp_path))


# --- audit 1: two reshards of one plan into one new destination --------------------------------

def test_two_reshards_into_one_destination_threads(tmp_path, env):
    dst = str(tmp_path / "dst")
    both = threading.Barrier(2, timeout=30)  # both are writing before either commits

    def job():
        return reshard(env.src, dst, LAY, progress=lambda d, t: both.wait() if d == 0 else None)

    m = _one_winner(_race(job, job))
    assert ckpt.verify(dst, deep=True).ok and diff(env.src, dst).ok
    assert _data(dst) == set(m.files)  # the loser left none of its files and deleted none of the winner's
    assert not os.path.exists(os.path.join(dst, MARKER_DIR))


def _reshard_child(src: str, dst: str, barrier, q) -> None:
    try:
        reshard(src, dst, LAY, progress=lambda d, t: barrier.wait(30) if d == 0 else None)
        q.put("ok")
    except CheckpointExistsError:
        q.put("exists")
    except Exception as e:  # noqa: BLE001
        q.put(repr(e))


@pytest.mark.multiproc
def test_two_reshard_processes_into_one_destination(tmp_path, env):
    dst = str(tmp_path / "dst")
    ctx = mp.get_context("fork")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    ps = [ctx.Process(target=_reshard_child, args=(env.src, dst, barrier, q)) for _ in range(2)]
    for p in ps:
        p.start()
    got = sorted(q.get(timeout=60) for _ in ps)
    for p in ps:
        p.join(30)
    assert got == ["exists", "ok"]
    m = ckpt.inspect(dst)
    assert ckpt.verify(dst, deep=True).ok and _data(dst) == set(m.files)


# --- audit 2: a second writer beside a save still writing -----------------------------------------

def test_reshard_never_deletes_a_save_in_progress(tmp_path, env, monkeypatch):
    dst = str(tmp_path / "dst")
    paused, resume = threading.Event(), threading.Event()
    real = local.LocalWriter.write
    saver: list[threading.Thread] = []

    def write(self, data):
        if saver and threading.current_thread() is saver[0] and not resume.is_set():
            paused.set()  # the save's data file is open and half written
            resume.wait(30)
        real(self, data)

    monkeypatch.setattr(local.LocalWriter, "write", write)
    res: list = []
    t = threading.Thread(target=lambda: res.append(ckpt.save(W.state(5), dst, step=5)))
    saver.append(t)
    t.start()
    assert paused.wait(30)

    def progress(done, total):
        if done == 0:  # the reshard is under way: let the save finish and commit first
            resume.set()
            t.join(30)

    with pytest.raises(CheckpointExistsError):
        reshard(env.src, dst, LAY, progress=progress)
    assert res and ckpt.verify(dst, deep=True).ok
    got = W.load(dst)
    assert all(torch.equal(got[k], v) for k, v in W.state(5).items())
    assert _data(dst) == set(res[0].files)  # the reshard's files are gone, the save's all there


def test_two_imports_into_one_destination(tmp_path, env):
    dst = str(tmp_path / "dst")
    m = _one_winner(_race(lambda: import_checkpoint(env.pt, dst), lambda: import_checkpoint(env.pt, dst)))
    assert ckpt.verify(dst, deep=True).ok and _data(dst) == set(m.files)
    got = W.load(dst)
    assert all(torch.equal(got[k], v) for k, v in W.state(W.PT_SEED).items())


# --- audit 3: two zarr saves into one new step --------------------------------------------------

@pytest.mark.multiproc
def test_two_zarr_saves_into_one_new_step(tmp_path, env):
    dst = str(tmp_path / "dst")
    outs = W.run_round(env, dst, [("zarr", 11, "none", 0), ("zarr", 12, "none", 0)], overwrite=False,
                       scratch=str(tmp_path))
    assert sorted(o.result for o in outs) == ["exists", "ok"]
    win = next(o for o in outs if o.result == "ok")
    m = ckpt.inspect(dst)
    assert ckpt.verify(dst, deep=True).ok and _data(dst) == set(m.files)
    got = W.load(dst)
    assert all(torch.equal(got[k], v) for k, v in W.state(win.seed).items())
    lose = next(o for o in outs if o.result == "exists")
    assert not lose.created & set(m.files)  # each save wrote its own tree
    assert len({f.split("/", 1)[0] for f in win.created | lose.created}) == 2


def test_every_zarr_save_writes_its_own_tree(tmp_path):
    m = ckpt.save(W.state(1), str(tmp_path / "z"), data_format="zarr")
    tree = {f.split("/", 1)[0] for f in m.files}
    assert len(tree) == 1 and tree.pop().startswith("zarr-")  # never the shared name "zarr"


# --- resume: adopt only a gone writer's files, never delete another's --------------------------

def _killed_reshard(src: str, dst: str) -> None:
    reshard_mod.MAX_CHUNK = 4096

    def progress(done: int, total: int) -> None:
        if os.path.isdir(os.path.join(dst, MARKER_DIR)) and os.listdir(os.path.join(dst, MARKER_DIR)):
            os._exit(17)  # one file finished (its marker is there), the other one half written

    reshard(src, dst, LAY, progress=progress, workers=1)


@pytest.mark.multiproc
def test_rerun_adopts_a_killed_runs_finished_file_and_deletes_nothing(tmp_path, env):
    dst = str(tmp_path / "dst")
    p = mp.get_context("fork").Process(target=_killed_reshard, args=(env.src, dst))
    p.start()
    p.join(60)
    assert p.exitcode == 17
    left = _data(dst)
    m = reshard(env.src, dst, LAY)
    assert m.stats is not None and m.stats["resumed_files"] >= 1
    assert ckpt.verify(dst, deep=True).ok and diff(env.src, dst).ok
    assert left <= _data(dst)  # the killed run's leftovers are gc's, not the re-run's
    assert len(left & set(m.files)) == m.stats["resumed_files"]  # finished files, adopted under their names


def test_a_live_writers_finished_files_are_never_adopted(tmp_path, env, monkeypatch):
    """B must not adopt A's finished file while A runs: A, losing its commit, removes it."""
    dst = str(tmp_path / "dst")
    monkeypatch.setattr(reshard_mod, "MAX_CHUNK", 4096)
    marked, go = threading.Event(), threading.Event()

    def a_progress(done, total):
        if os.path.isdir(os.path.join(dst, MARKER_DIR)) and os.listdir(os.path.join(dst, MARKER_DIR)):
            marked.set()
            go.wait(30)

    res: list = []

    def a():
        try:
            res.append(reshard(env.src, dst, LAY, progress=a_progress, workers=1))
        except Exception as e:  # noqa: BLE001
            res.append(e)

    t = threading.Thread(target=a)
    t.start()
    assert marked.wait(30)
    m = reshard(env.src, dst, LAY)  # B, same plan, same process
    go.set()
    t.join(30)
    assert isinstance(res[0], CheckpointExistsError)
    assert m.stats is not None and m.stats["resumed_files"] == 0
    assert ckpt.verify(dst, deep=True).ok and _data(dst) == set(m.files)


@pytest.mark.multiproc
def test_writer_gone():
    with transaction.live_writer() as me:
        assert not transaction.writer_gone(me)  # this process, still writing
    assert transaction.writer_gone(me)  # returned: it will never touch its files again
    host = socket.gethostname()
    p = mp.get_context("fork").Process(target=os._exit, args=(0,))
    p.start()
    p.join()
    assert transaction.writer_gone({"host": host, "pid": p.pid, "token": "0" * 12, "time": time.time()})
    other = {"host": host + "-elsewhere", "pid": 1, "token": "0" * 12}
    assert not transaction.writer_gone({**other, "time": time.time()})  # cannot tell yet
    assert transaction.writer_gone({**other, "time": time.time() - transaction.WRITER_GRACE_S - 1})
    for junk in (None, {}, "x", {"host": host, "pid": "nan", "token": 1, "time": 0}):
        assert not transaction.writer_gone(junk)


def test_remove_files_takes_only_a_written_set(tmp_path):
    ckpt.save(W.state(1), str(tmp_path / "c"))
    st = local.LocalStorage(str(tmp_path / "c"))
    listed = [f for f in st.list() if f != MANIFEST_NAME]
    with pytest.raises(TypeError, match="WrittenSet"):
        transaction.remove_files(st, listed)  # type: ignore[arg-type]
    assert transaction.remove_files(st, transaction.WrittenSet()) == []
    assert ckpt.verify(str(tmp_path / "c"), deep=True).ok


def test_fresh_names_never_repeat():
    names = {transaction.fresh_data_file(3) for _ in range(2000)}
    assert len(names) == 2000 and all(transaction.data_file_rank(n) == 3 for n in names)
    assert len({transaction.fresh_zarr_root() for _ in range(2000)}) == 2000


# --- convert outputs: DCP export ------------------------------------------------------------------

@pytest.mark.slow
def test_two_dcp_exports_into_one_directory(tmp_path, env):
    import torch.distributed.checkpoint as dcp

    out = str(tmp_path / "d")
    results = _race(lambda: export_dcp(env.src, out), lambda: export_dcp(env.src, out))
    wins = [r for r in results if isinstance(r, dict)]
    assert len(wins) == 1 and any(isinstance(r, CheckpointExistsError) for r in results), results
    assert len([n for n in os.listdir(out) if n.endswith(".distcp")]) == wins[0]["files"]
    sd = {"w": torch.zeros(8, 6), "b": torch.zeros(6)}
    dcp.load(sd, checkpoint_id=out)
    assert all(torch.equal(sd[k], v) for k, v in W.state(W.SRC_SEED).items())
    export_dcp(env.src, out, overwrite=True)  # replaced files go only after the new .metadata is in
    assert len([n for n in os.listdir(out) if n.endswith(".distcp")]) == wins[0]["files"]
