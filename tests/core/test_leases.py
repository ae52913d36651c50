"""Write leases (ckpt/_lease.py): a step directory is protected from the first byte any rank writes.

Issue 36, class 2: only rank 0 wrote ``.writing``, at its own call, so with rank skew a concurrent
``ckpt gc`` deleted other ranks' data files (a committed step then missed a file) and even the lease's
temporary file; a save into an existing step left the lease inside the committed step. Rules held
here: every writing rank leases before its first byte; gc never deletes a live lease, a live temp
file, or anything in a directory a live lease holds; staleness is decided conservatively; a
finished or failed save leaves no lease and removes only its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from typer.testing import CliRunner

import ckpt
from ckpt import _lease as lease
from ckpt.cli.app import app
from ckpt.manager import gc, list_checkpoints, step_dir
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage import local as local_mod
from tests.dist_utils import run_ranks
from tests.helpers import fail_local_writes, random_state

DEAD_PID = 2**22 + 12345  # above Linux's largest pid_max: never a running process
runner = CliRunner(env={"COLUMNS": "200"})


def _state(seed: int) -> dict[str, Any]:
    return random_state(seed, {"w": (6, 5), "b": ((7,), torch.bfloat16)}, seed=seed)


def _loads(url: str, seed: int) -> bool:
    ref = _state(seed)
    got = ckpt.load({"w": torch.zeros(6, 5), "b": torch.zeros(7, dtype=torch.bfloat16), "seed": None}, url,
                    verify=True)
    return torch.equal(got["w"], ref["w"]) and torch.equal(got["b"], ref["b"]) and got["seed"] == seed


def _files(d: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(d):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), d)] = fh.read()
    return out


def _leases_in(d: str) -> list[str]:
    return sorted(f for f in _files(d) if lease.is_protected_name(f)) if os.path.isdir(d) else []


def _dead_lease(d: str, *, rank: int = 3, pid: int = DEAD_PID, machine: str | None = None,
                when: float | None = None, **extra: Any) -> str:
    """A lease file as a writer that is gone (by default: a pid that cannot exist on this machine)."""
    name = f"{lease.PREFIX}{rank:05d}-{pid}-{machine or lease.machine_id()}-0badc0de"
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "w") as f:
        json.dump({"host": "x", "pid": pid, "time": time.time() if when is None else when, **extra}, f)
    return name


def _data_file(d: str, rank: int = 1, payload: bytes = b"partial") -> str:
    os.makedirs(os.path.join(d, "data"), exist_ok=True)
    rel = f"data/{rank:05d}-{os.urandom(6).hex()}.safetensors"
    with open(os.path.join(d, rel), "wb") as f:
        f.write(payload)
    return rel


def _age(path: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


# ------------------------------------------------------------------------------------------------
# the listed instances


@pytest.mark.parametrize("async_save", [False, True])
def test_save_into_a_committed_step_leaves_it_unchanged_and_no_lease(tmp_path, async_save):
    mgr = ckpt.CheckpointManager(str(tmp_path / "r"), keep_last=None, async_save=async_save)
    url = mgr.url_for(1)
    out = mgr.save(1, _state(1))
    if async_save:
        out.done()
    before = _files(url)
    with pytest.raises(ckpt.CheckpointExistsError):
        out = mgr.save(1, _state(2))
        if async_save:
            out.done()
    assert _files(url) == before and _leases_in(url) == []
    out = mgr.save(1, _state(3), overwrite=True)
    if async_save:
        out.done()
    assert _leases_in(url) == [] and _loads(url, 3) and ckpt.verify(url, deep=True).ok


@pytest.mark.parametrize("async_save", [False, True])
def test_failed_save_drops_only_its_own_lease(tmp_path, monkeypatch, async_save):
    mgr = ckpt.CheckpointManager(str(tmp_path / "r"), keep_last=None, async_save=async_save)
    url = mgr.url_for(5)
    other = lease.acquire(url, 7)  # another writer of the same directory, alive (this process)
    with monkeypatch.context() as mp:
        fail_local_writes(mp)
        with pytest.raises(ckpt.StorageError, match="injected"):
            out = mgr.save(5, _state(5))
            if async_save:
                out.done()
    assert _leases_in(url) == [other.name]  # ours is gone, the other writer's is untouched
    assert gc(str(tmp_path / "r")) == [] and os.path.exists(os.path.join(url, other.name))
    other.release()
    assert [c.step for c in gc(str(tmp_path / "r"))] == [5] and not os.path.exists(url)


def test_skipped_save_leaves_no_directory(tmp_path):
    mgr = ckpt.CheckpointManager(str(tmp_path / "r"), keep_last=None, policy="skip")
    big = {"w": torch.randn(2_000_000)}
    h1 = mgr.save(1, big)
    h2 = mgr.save(2, big)
    h1.done()
    if h2.skipped:
        assert not os.path.exists(mgr.url_for(2))
    mgr.wait()
    assert all(_leases_in(mgr.url_for(s)) == [] for s in (1, 2))


def test_gc_never_touches_a_live_lease_or_temp_file(tmp_path):
    root = tmp_path / "r"
    ckpt.save(_state(1), str(root / step_dir(1)), step=1)
    ckpt.save(_state(2), str(root / step_dir(2)), step=2)
    held = lease.acquire(str(root / step_dir(1)), 0)  # a save overwriting the old committed step
    # a lease being written (its temp name, no content yet) by this live process
    d3 = root / step_dir(3)
    d3.mkdir()
    (d3 / f"{lease.PREFIX}00001-{os.getpid()}-{lease.machine_id()}-12345678.tmp.{os.getpid()}.7").write_bytes(b"")
    # a manifest being committed by a writer whose lease gc cannot see (fresh temp file)
    d4 = root / step_dir(4)
    _data_file(str(d4))
    (d4 / f"{MANIFEST_NAME}.tmp.{DEAD_PID}.1").write_bytes(b"x")
    # the legacy lease of a live process (older versions wrote one .writing on rank 0)
    d5 = root / step_dir(5)
    _data_file(str(d5))
    (d5 / ".writing").write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": os.getpid(),
                                             "time": 0}))
    before = {s: _files(str(root / step_dir(s))) for s in (1, 3, 4, 5)}
    assert gc(str(root), keep_last=1) == []  # step 1 is old, but a save holds it
    assert {s: _files(str(root / step_dir(s))) for s in (1, 3, 4, 5)} == before
    infos = {c.step: c for c in list_checkpoints(str(root))}
    assert [s for s, c in infos.items() if c.live] == [1, 3, 4, 5] and "pid" in infos[1].note
    held.release()
    _age(str(d4 / f"{MANIFEST_NAME}.tmp.{DEAD_PID}.1"), 2 * lease.LEASE_GRACE_S)  # nobody finished it in a day
    assert sorted(c.step for c in gc(str(root), keep_last=1)) == [1, 4]
    assert os.path.exists(root / step_dir(2)) and not os.path.exists(d4)


def test_lease_staleness_rule(tmp_path):
    now = time.time()
    mine = f"{lease.PREFIX}00000-{os.getpid()}-{lease.machine_id()}-00000000"
    me = json.dumps({"pid": os.getpid(), "time": now, "start": lease.start_time(os.getpid())}).encode()
    assert lease.judge(mine, me, now)[:2] == (True, True)  # this machine: checked exactly, however old
    assert lease.judge(mine, me, now - 10 * lease.LEASE_GRACE_S, now=now)[0]
    reused = json.dumps({"pid": os.getpid(), "start": (lease.start_time(os.getpid()) or 0) + 1}).encode()
    assert lease.judge(mine, reused, now)[:2] == (False, True)  # the pid now belongs to a later process
    gone = f"{lease.PREFIX}00000-{DEAD_PID}-{lease.machine_id()}-00000000"
    assert lease.judge(gone, None, None)[:2] == (False, True)
    far = f"{lease.PREFIX}00004-{os.getpid()}-{'0' * 8 if lease.machine_id() != '0' * 8 else '1' * 8}-00000000"
    fresh = json.dumps({"pid": os.getpid(), "time": now - 60}).encode()
    assert lease.judge(far, fresh, None, now=now)[:2] == (True, False)  # another machine: live until the grace
    assert not lease.judge(far, fresh, None, now=now, grace_s=30)[0]
    assert lease.judge(far, fresh, now, now=now, grace_s=30)[0]  # a recent mtime keeps it (clock skew)
    assert lease.judge(far, None, None, now=now)[0]  # nothing to date it by: live, never guessed
    assert lease.judge(".writing", b"garbage", now - 60, now=now)[0]
    assert not lease.judge(".writing", b"garbage", now - 2 * lease.LEASE_GRACE_S, now=now)[0]
    # end to end: a lease from another machine is kept until --lease-grace says it is stale
    root = tmp_path / "r"
    d = root / step_dir(1)
    _data_file(str(d))
    _age(str(d / _dead_lease(str(d), machine=far.split("-")[3], when=now - 600)), 600)
    assert gc(str(root)) == [] and os.path.exists(d)
    r = runner.invoke(app, ["gc", str(root), "--lease-grace", "300"])
    assert r.exit_code == 0, r.output
    assert not os.path.exists(d)


def test_gc_removes_a_dead_writers_leftovers_with_its_lease_and_temp_files(tmp_path):
    root = tmp_path / "r"
    d = root / step_dir(1)
    name = _dead_lease(str(d))
    _data_file(str(d))
    (d / f"{MANIFEST_NAME}.tmp.{DEAD_PID}.9").write_bytes(b"half a manifest")
    (d / f"{lease.PREFIX}00002-{DEAD_PID}-{lease.machine_id()}-11111111.tmp.{DEAD_PID}.9").write_bytes(b"")
    assert not list_checkpoints(str(root))[0].live
    assert [c.step for c in gc(str(root))] == [1] and not os.path.exists(d)
    assert name  # the stale lease went with the directory


def test_gc_backs_off_when_a_writer_arrives_during_its_pass(tmp_path, monkeypatch):
    import ckpt._retention as manager_mod  # gc and its helpers

    root = tmp_path / "r"
    d = root / step_dir(1)
    stale = _data_file(str(d), rank=0)  # a crashed save's leftover, no lease
    real = manager_mod._files_of
    arrived: dict[str, Any] = {}

    def files_of(storage: Any, name: str) -> list[str]:
        out = real(storage, name)
        if not arrived:  # a new save of this step starts right after gc listed the directory
            arrived["lease"] = lease.acquire(str(d), 1)
            arrived["data"] = _data_file(str(d), rank=1, payload=b"new")
        return out

    monkeypatch.setattr(manager_mod, "_files_of", files_of)
    assert gc(str(root)) == []
    assert {stale, arrived["data"], arrived["lease"].name} <= set(_files(str(d)))
    monkeypatch.undo()
    arrived["lease"].release()
    assert [c.step for c in gc(str(root))] == [1]


def test_ls_and_gc_cli_show_a_directory_being_written(tmp_path):
    root = tmp_path / "r"
    held = lease.acquire(str(root / step_dir(3)), 2)
    _data_file(str(root / step_dir(3)), rank=2)
    r = runner.invoke(app, ["ls", str(root), "--no-memory"])
    assert r.exit_code == 0 and "writing" in r.output
    r = runner.invoke(app, ["gc", str(root), "--json"])
    out = json.loads(r.output)
    assert out["removed"] == [] and [c["step"] for c in out["kept_writing"]] == [3]
    assert out["kept_writing"][0]["live"] and "a save in progress holds it" in out["kept_writing"][0]["note"]
    held.release()
    assert [c["step"] for c in json.loads(runner.invoke(app, ["gc", str(root), "--json"]).output)["removed"]] == [3]


# ------------------------------------------------------------------------------------------------
# rank skew: rank 1 writes before rank 0 has even called save (multi-rank, real gloo)


def _skewed(rank: int, world: int, root: str, async_save: bool) -> None:
    mgr = ckpt.CheckpointManager(root, keep_last=None, async_save=async_save)

    def save(step: int) -> None:
        piece = ckpt.Shard(torch.full((4, 8), float(step * 10 + rank)), (8, 8), (rank * 4, 0))
        out = mgr.save(step, {"w": piece})
        if async_save:
            out.done()

    save(1)  # plans; step 2 reuses the plan, so rank 1 writes at once, without waiting for rank 0
    if rank == 0:
        d = os.path.join(root, step_dir(2), "data")
        deadline = time.monotonic() + 30
        while not (os.path.isdir(d) and any(f.startswith("00001-") for f in os.listdir(d))):
            assert time.monotonic() < deadline, "rank 1 never wrote its data file"
            time.sleep(0.002)
        before = set(_files(os.path.join(root, step_dir(2))))  # rank 1's lease and data file (still growing)
        assert gc(root) == []  # a concurrent `ckpt gc ROOT`, in the window before rank 0's own lease
        assert set(_files(os.path.join(root, step_dir(2)))) >= before
    save(2)


def _check_rows(url: str, v: int) -> dict[str, Any]:
    """Step ``url`` verifies deep, holds no lease, and loads rows 0-3 = 10v, rows 4-7 = 10v+1."""
    assert ckpt.verify(url, deep=True).ok, ckpt.verify(url, deep=True).problems
    assert _leases_in(url) == []
    got = ckpt.load({"w": torch.zeros(8, 8), "v": None}, url, verify=True, strict=False)
    assert torch.equal(got["w"][:4], torch.full((4, 8), v * 10.0))
    assert torch.equal(got["w"][4:], torch.full((4, 8), v * 10.0 + 1))
    return got


@pytest.mark.multiproc
@pytest.mark.parametrize("async_save", [False, True])
def test_gc_in_the_skew_window_spares_a_rank_that_writes_first(tmp_path, async_save):
    root = str(tmp_path / "r")
    run_ranks(2, _skewed, root, async_save)
    for s in (1, 2):
        _check_rows(os.path.join(root, step_dir(s)), s)


# ------------------------------------------------------------------------------------------------
# generated: interleavings of saves, failures, existing steps and gc, on one process ...


@contextlib.contextmanager
def _gc_during(root: str, at: int | None, keep: int | None, removed: list[int]) -> Iterator[None]:
    """Run ``gc(root, keep_last=keep)`` at the ``at``-th storage event of what runs inside: a data
    write, or the rename of a commit's temp file (a lease's or the manifest's). Steps it removed
    go to ``removed``."""
    if at is None:
        yield
        return
    seen = [0]
    busy = threading.Lock()

    def tick() -> None:
        if busy.acquire(blocking=False):
            try:
                if seen[0] == at:
                    removed.extend(c.step for c in gc(root, keep_last=keep))
                seen[0] += 1
            finally:
                busy.release()

    real_link, real_replace, real_write = local_mod._link_no_clobber, os.replace, local_mod.LocalWriter.write

    def link(src: Any, dst: Any) -> None:
        tick()
        real_link(src, dst)

    def replace(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        if str(dst).startswith(root):
            tick()
        real_replace(src, dst, *a, **k)

    def write(w: Any, data: Any) -> None:
        tick()
        real_write(w, data)

    local_mod._link_no_clobber = link  # type: ignore[assignment]
    os.replace = replace  # type: ignore[assignment]
    local_mod.LocalWriter.write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        local_mod._link_no_clobber = real_link  # type: ignore[assignment]
        os.replace = real_replace  # type: ignore[assignment]
        local_mod.LocalWriter.write = real_write  # type: ignore[method-assign]


@contextlib.contextmanager
def _failing(kind: str) -> Iterator[None]:
    """Inject an I/O error: at a data write, at a data file's close, or at the manifest's commit."""
    err = ckpt.StorageError("injected failure")
    if kind == "none":
        yield
        return
    owner, attr = {"write": (local_mod.LocalWriter, "write"), "close": (local_mod.LocalWriter, "close"),
                   "manifest": (local_mod.LocalStorage, "commit")}[kind]
    real = getattr(owner, attr)

    def fail(self: Any, *a: Any, **k: Any) -> Any:
        if kind != "manifest" or a[0] == MANIFEST_NAME:
            raise err
        return real(self, *a, **k)

    setattr(owner, attr, fail)
    try:
        yield
    finally:
        setattr(owner, attr, real)


class LeaseMachine(RuleBasedStateMachine):
    """A manager's saves (sync and async; new, failing, into an existing step, overwriting) with gc
    run at any storage event inside them, other live writers and dead writers' leftovers beside."""

    def __init__(self) -> None:
        super().__init__()
        self.base = tempfile.mkdtemp(prefix="ckpt-leases-")
        self.root = os.path.join(self.base, "root")
        os.makedirs(self.root)
        self.mgr = ckpt.CheckpointManager(self.root, keep_last=None, async_save=False)
        self.values: dict[int, int] = {}  # committed step -> the seed it holds
        self.others: dict[int, tuple[lease.Lease, dict[str, bytes]]] = {}  # live writers' directories
        self.dead: set[int] = set()  # a gone writer's leftovers: the next gc removes them
        self.step = 0
        self.seed = 100

    def teardown(self) -> None:
        self.mgr.close()
        for held, _ in self.others.values():
            held.release()
        shutil.rmtree(self.base, ignore_errors=True)

    def _new(self) -> int:
        self.step += 1
        return self.step

    def _gone(self, removed: list[int]) -> None:
        assert not set(removed) & set(self.others), f"gc removed {removed}: live writers hold {set(self.others)}"
        for s in removed:
            self.values.pop(s, None)
            self.dead.discard(s)

    def _save(self, step: int, seed: int, sync: bool, gc_at: int | None, gc_keep: int | None, fail: str = "none",
              overwrite: bool = False) -> None:
        self.mgr.async_save = not sync
        removed: list[int] = []
        try:
            with _gc_during(self.root, gc_at, gc_keep, removed), _failing(fail):
                out = self.mgr.save(step, _state(seed), overwrite=overwrite)
                if not sync:
                    assert isinstance(out, ckpt.SaveHandle)
                    out.done()
        finally:
            self._gone(removed)
            # whatever happened, the save is over on this rank: no lease of it is left
            assert _leases_in(self.mgr.url_for(step)) == [], _leases_in(self.mgr.url_for(step))

    @rule(sync=st.booleans(), gc_at=st.none() | st.integers(0, 5), gc_keep=st.sampled_from([None, 1, 2]),
          fail=st.sampled_from(["none", "none", "write", "close", "manifest"]))
    def save_new(self, sync: bool, gc_at: int | None, gc_keep: int | None, fail: str) -> None:
        s, self.seed = self._new(), self.seed + 1
        if fail == "none":
            self._save(s, self.seed, sync, gc_at, gc_keep)
            self.values[s] = self.seed
            return
        with pytest.raises(ckpt.StorageError, match="injected"):
            self._save(s, self.seed, sync, gc_at, gc_keep, fail)
        assert not os.path.exists(os.path.join(self.mgr.url_for(s), MANIFEST_NAME))

    @precondition(lambda self: self.values)
    @rule(data=st.data(), sync=st.booleans(), gc_at=st.none() | st.integers(0, 5))
    def save_existing(self, data: st.DataObject, sync: bool, gc_at: int | None) -> None:
        s = data.draw(st.sampled_from(sorted(self.values)))
        before = _files(self.mgr.url_for(s))
        with pytest.raises(ckpt.CheckpointExistsError):
            self._save(s, self.seed + 1, sync, gc_at, None)
        assert _files(self.mgr.url_for(s)) == before

    @precondition(lambda self: self.values)
    @rule(data=st.data(), sync=st.booleans(), gc_at=st.none() | st.integers(0, 5),
          gc_keep=st.sampled_from([None, 1]))
    def overwrite(self, data: st.DataObject, sync: bool, gc_at: int | None, gc_keep: int | None) -> None:
        s = data.draw(st.sampled_from(sorted(self.values)))
        self.seed += 1
        self._save(s, self.seed, sync, gc_at, gc_keep, overwrite=True)
        self.values[s] = self.seed

    @rule(rank=st.integers(1, 3))
    def other_writer_starts(self, rank: int) -> None:
        s = self._new()
        url = self.mgr.url_for(s)
        held = lease.acquire(url, rank)
        _data_file(url, rank)
        self.others[s] = (held, _files(url))

    @precondition(lambda self: self.others)
    @rule(data=st.data())
    def other_writer_fails(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.others)))
        held, _ = self.others.pop(s)
        held.release()  # its data stays: an unfinished save that no one holds any more

    @rule(temp=st.booleans())
    def dead_writer_leftovers(self, temp: bool) -> None:
        s = self._new()
        url = self.mgr.url_for(s)
        _dead_lease(url)
        _data_file(url)
        if temp:
            with open(os.path.join(url, f"{MANIFEST_NAME}.tmp.{DEAD_PID}.3"), "wb") as f:
                f.write(b"x")
        self.dead.add(s)

    @rule(keep=st.sampled_from([None, 1, 2, 3]))
    def run_gc(self, keep: int | None) -> None:
        removed = [c.step for c in gc(self.root, keep_last=keep)]
        # (the manager's own gc after a commit may have removed some already)
        kept = {s for s in self.dead - set(removed) if os.path.exists(self.mgr.url_for(s))}
        assert not kept, f"a dead writer's leftovers were kept: {kept}"
        self._gone(removed)

    @invariant()
    def committed_steps_load_and_holders_are_intact(self) -> None:
        for s, seed in self.values.items():
            url = self.mgr.url_for(s)
            assert ckpt.verify(url, deep=True).ok, s
            assert _loads(url, seed), s
        for s, (_held, files) in self.others.items():
            assert _files(self.mgr.url_for(s)) == files, f"gc touched step {s}, which a live writer holds"
        for c in list_checkpoints(self.root, missing_ok=True):
            if c.step in self.others:
                assert c.live and not c.removable
            elif c.step not in self.dead:
                assert _leases_in(c.url) == [], (c.step, _leases_in(c.url))  # no finished save left one
            if c.committed:
                assert c.step in self.values


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=15, stateful_step_count=10, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------------
# ... and on two ranks with random skew and a gc running all the while


def _program_ranks(rank: int, world: int, root: str, ops: list[tuple[str, float, float]], async_save: bool,
                   report: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(90, exit=True)  # a hung rank prints its stacks and fails the test
    mgr = ckpt.CheckpointManager(root, keep_last=None, async_save=async_save, gc_on_start=False)
    stop = threading.Event()
    hits: list[str] = []
    real_delete = local_mod.LocalStorage.delete

    def delete(self: Any, path: str) -> None:
        if threading.current_thread() is hammer and lease.is_protected_name(os.path.basename(path)):
            hits.append(path)  # no writer here dies: every lease and temp file is a live one
        real_delete(self, path)

    def loop() -> None:
        while not stop.is_set():
            gc(root)  # `ckpt gc ROOT` from another terminal, again and again
            time.sleep(0.001)

    hammer = threading.Thread(target=loop, daemon=True)
    if rank == 0:
        local_mod.LocalStorage.delete = delete  # type: ignore[method-assign]
        os.makedirs(root, exist_ok=True)
        hammer.start()
    version: dict[int, int] = {}
    try:
        for i, (kind, skew0, skew1) in enumerate(ops):
            step = min(version) if kind in ("exists", "overwrite") and version else i + 1
            v = i + 1
            time.sleep(skew0 if rank == 0 else skew1)
            failing = kind == f"fail{rank}"
            ctx = _failing("write") if failing else contextlib.nullcontext()
            piece = ckpt.Shard(torch.full((4, 8), float(v * 10 + rank)), (8, 8), (rank * 4, 0))
            try:
                with ctx:
                    out = mgr.save(step, {"w": piece, "v": v}, overwrite=kind == "overwrite")
                    if async_save:
                        out.done()
                ok = True
            except ckpt.CheckpointExistsError:
                assert kind == "exists" and step in version, (kind, step)
                ok = False
            except ckpt.CheckpointError as e:
                assert kind.startswith("fail"), f"op {i} ({kind}, step {step}) failed: {e}"
                ok = False
            if ok:
                assert not kind.startswith("fail") and kind != "exists" or step not in version, (kind, step)
                version[step] = v
            dist.barrier()
            if rank == 0:
                assert _leases_in(mgr.url_for(step)) == [], (i, kind, _leases_in(mgr.url_for(step)))
            dist.barrier()  # the next op may lease the same step: not before the check
    finally:
        stop.set()
        if rank == 0:
            hammer.join()
            local_mod.LocalStorage.delete = real_delete  # type: ignore[method-assign]
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        with open(report, "w") as f:
            json.dump({"hits": hits, "version": version}, f)


_OP = st.tuples(st.sampled_from(["save", "save", "fail0", "fail1", "exists", "overwrite"]),
                st.sampled_from([0.0, 0.01, 0.05, 0.15]), st.sampled_from([0.0, 0.01, 0.05, 0.15]))


@pytest.mark.multiproc
@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_OP, min_size=2, max_size=5), async_save=st.booleans())
def test_two_ranks_with_random_skew_and_a_concurrent_gc(tmp_path, ops, async_save):
    root = str(tmp_path / f"r{uuid.uuid4().hex}")  # tmp_path is shared by the examples
    report = root + ".json"
    run_ranks(2, _program_ranks, root, ops, async_save, report)
    with open(report) as f:
        got = json.load(f)
    assert got["hits"] == [], f"gc deleted live leases / temp files: {got['hits']}"
    version = {int(k): v for k, v in got["version"].items()}
    for step, v in version.items():
        assert _check_rows(os.path.join(root, step_dir(step)), v)["v"] == v
    committed = {c.step for c in list_checkpoints(root) if c.committed}
    assert committed == set(version), (committed, version)


def _exists_async(rank: int, world: int, root: str) -> None:
    from ckpt.async_save import AsyncSaver

    saver = AsyncSaver(timeout=3)
    piece = ckpt.Shard(torch.ones(4, 8), (8, 8), (rank * 4, 0))
    saver.save({"w": piece}, root, step=1).done()
    with pytest.raises(ckpt.CheckpointExistsError):  # not a CollectiveError after the timeout
        saver.save({"w": piece}, root, step=1).done()
    with pytest.raises(ckpt.CheckpointExistsError):  # the synchronous path, cached too
        ckpt.save({"w": piece}, root, step=1)


@pytest.mark.multiproc
def test_async_save_into_an_existing_step_with_a_cached_plan_fails_fast(tmp_path):
    """Only the coordinator sees the existing checkpoint; with a cached plan the other ranks go
    straight to the commit, so the coordinator delivers its refusal there (save.Prepared.refused):
    every rank raises CheckpointExistsError at once and no rank's file is left in the step."""
    root = str(tmp_path / "a")
    run_ranks(2, _exists_async, root)
    m = ckpt.inspect(root)
    assert sorted(os.listdir(os.path.join(root, "data"))) == sorted(f.split("/", 1)[1] for f in m.files)
