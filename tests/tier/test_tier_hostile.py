"""The memory tier in a shared-memory directory that someone else (or a stale process) has tampered with.

The class of bug: the tier trusted ``/dev/shm``, which every local user can write. A link planted at
any tier path made it write, truncate or delete what the link points to; a FIFO made a restore block
forever; two jobs with one run id handed out the same slots (restores passing every checksum with
the other job's tensors); ``ckpt gc --memory`` deleted copies a resharding restore could still use.
The rule (:mod:`ckpt.tier.safefs`, :mod:`ckpt.tier.runlock`): nothing below the run directory is
followed through a link, only regular files of this user are opened (never blocking), directories
are ours and 0700, deletion removes a link itself, one run id is held by one job, and gc removes only
what no restore can use, never in a live run.

Tests plant links (to a canary file or directory outside the tier), FIFOs, directories where files
belong and files of another owner at every level (run dir, ``tier.json``, node, rank, ``.slots``,
slots, step directories, manifests, data files, replicas, views) and check that the canary is
byte-identical afterwards, that no operation blocks, and that each one succeeds or raises a typed
``CheckpointError``; a hypothesis state machine does so between random tier operations.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import ckpt
from ckpt.errors import CheckpointError, RunInUseError, UnsafePathError
from ckpt.manifest import MANIFEST_NAME
from ckpt.tier import MemoryTier, TierConfig, gc_memory, list_memory
from ckpt.tier.listing import superseded
from ckpt.tier.nodes import run_id_for, step_name
from ckpt.tier.slots import Slot, plan_layout
from ckpt.tier.store import Entry
from tests.dist_utils import run_ranks

ROOT = "/tier-tests/hostile"
RUN = f"ckpt-{run_id_for(ROOT)}"
ROOT_USER = os.geteuid() == 0
OTHER_UID = 4242  # a user that is not us (root can hand a file to it)


def state_of(step: int) -> dict[str, Any]:
    """A small state (a 64 KiB piece, a bf16 one, objects): fast to save many times."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 128, generator=g), "h": torch.randn(33, generator=g).to(torch.bfloat16)},
            "train": {"step": step}}


def zeros() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(128, 128), "h": torch.zeros(33, dtype=torch.bfloat16)}, "train": {"step": 0}}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])


def tree(path: Path) -> dict[str, Any]:
    """Every entry under ``path`` (links not followed): its kind and bytes, to compare before/after."""
    out: dict[str, Any] = {}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            p = Path(dirpath, name)
            st_ = p.lstat()
            rel = str(p.relative_to(path))
            out[rel] = p.read_bytes() if stat.S_ISREG(st_.st_mode) else stat.S_IFMT(st_.st_mode)
    return out


@pytest.fixture
def canary(tmp_path: Path) -> Iterator[Path]:
    """A directory outside the tier that looks like tier content (steps, slots, a manifest): a link to
    it (or to its files) must never lead to any of it being written or deleted."""
    c = tmp_path / "canary"
    (c / step_name(1) / "data").mkdir(parents=True)
    (c / step_name(1) / MANIFEST_NAME).write_bytes(b"a persistent checkpoint's manifest")
    (c / step_name(1) / "data" / "0.safetensors").write_bytes(b"persistent bytes" * 64)
    (c / "slot-0").write_bytes(b"precious " * 100)
    (c / "slot-7").write_bytes(b"more precious")
    (c / "tier.json").write_bytes(b"{}")
    before = tree(c)
    yield c
    assert tree(c) == before, "a file outside the memory tier was changed through a planted object"


def bounded(fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    """``fn()`` on a thread: its result or its exception; a test failure if it is still running
    after ``timeout`` (a FIFO opened for reading would block it forever)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} blocked for {timeout} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def tier_of(shm: str, **kw: Any) -> MemoryTier:
    tier = MemoryTier(TierConfig(ROOT, shm_dir=shm, replicas=0, timeout=20, **kw))
    tier.reset(None)
    return tier


def plant_link(path: Path, target: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


# --- the listed instances ---------------------------------------------------------------------------


def test_a_link_at_a_slot_is_never_written_through(shm: str, canary: Path) -> None:
    tier = tier_of(shm)
    slots = Path(tier.store.own_root(), ".slots")
    assert tier.save(1, state_of(1)).complete
    plant_link(slots / "slot-1", canary / "slot-0")  # the slot the next memory checkpoint takes
    assert tier.save(2, state_of(2)).complete  # the link is removed (itself), a real slot made instead
    assert (slots / "slot-1").is_file() and not (slots / "slot-1").is_symlink()
    target = zeros()
    got = tier.restore(target)
    assert got is not None and got.step == 2 and same(target, state_of(2))
    # a loose slot (no tier around it): the link at its own path is refused, never opened
    loose = Path(shm, "loose")
    loose.symlink_to(canary / "slot-7")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        Slot(str(loose)).shape_for(plan_layout({"a": torch.ones(100)}), pin=False)
    tier.clear()


def test_a_linked_slots_directory_is_never_trimmed(shm: str, canary: Path) -> None:
    tier = tier_of(shm)
    assert tier.save(1, state_of(1)).complete
    slots = Path(tier.store.own_root(), ".slots")
    plant_link(slots, canary)  # holds "slot-7": beyond keep + 1, what trim would delete
    tier._slots.trim()
    tier._slots.close(remove=True)
    assert slots.is_symlink()
    assert tier.save(2, state_of(2)).complete  # the link itself goes, a real .slots comes
    assert slots.is_dir() and not slots.is_symlink()
    tier.clear()


def test_a_linked_rank_directory_is_never_reset_saved_into_or_collected(shm: str, canary: Path) -> None:
    tier = tier_of(shm)
    assert tier.save(1, state_of(1)).complete
    rank = Path(tier.store.own_root())
    plant_link(rank, canary)  # the canary holds a "step-0000000001" directory: reset would free it
    tier.reset(None)
    tier.reset(1)
    result = tier.save(2, state_of(2))
    assert not result.complete and str(rank) in result.warning and "symbolic link" in result.warning
    assert tier.restore(zeros()) is None
    tier.close()
    assert bounded(lambda: gc_memory(None, shm, min_age=0)) == []  # nothing of ours behind a link
    assert rank.is_symlink()  # left alone, reported by nothing: not ours
    assert [m for m in list_memory(None, shm) if m.owner == 0 and m.kind == "local"] == []


def test_a_fifo_in_place_of_a_data_file_never_blocks_a_restore(shm: str) -> None:
    tier = tier_of(shm, keep=2)
    for step in (1, 2):
        assert tier.save(step, state_of(step)).complete
    (data,) = Path(tier.store.own(2), "data").iterdir()
    data.unlink()
    os.mkfifo(data)  # a read of it would wait for a writer forever
    failures: list[dict[str, Any]] = []
    target = zeros()
    got = bounded(lambda: tier.restore(target, on_failure=failures.append))
    assert got is not None and got.step == 1 and same(target, state_of(1))  # the older step, bitwise
    assert any("FIFO" in f.get("error", "") for f in failures), failures
    # nor do the listing, gc and a resharding restore
    os.mkfifo(Path(tier.store.own(1), "data", "extra"))
    bounded(lambda: list_memory(None, shm))
    bounded(lambda: tier.restore_resharded(zeros()))
    tier.close()
    bounded(lambda: gc_memory(None, shm, min_age=0))


def test_a_fifo_manifest_is_an_incomplete_copy_not_a_hang(shm: str) -> None:
    tier = tier_of(shm)
    assert tier.save(1, state_of(1)).complete
    m = Path(tier.store.own(1), MANIFEST_NAME)
    m.unlink()
    os.mkfifo(m)
    assert bounded(lambda: tier.restore(zeros())) is None
    assert bounded(lambda: tier.save(2, state_of(2))).complete
    tier.clear()


@pytest.mark.parametrize("level", ["run", "tier.json", "node", "step", "manifest", "replicas", "view"])
def test_a_link_at_any_level_leads_nowhere(shm: str, canary: Path, level: str) -> None:
    run = Path(shm, RUN)
    if level == "run":
        plant_link(run, canary)
        with pytest.raises(UnsafePathError, match=f"{run}.*symbolic link"):
            tier_of(shm)
        assert list_memory(None, shm) == [] and gc_memory(None, shm, min_age=0) == []
        return
    tier = tier_of(shm)
    assert tier.save(1, state_of(1)).complete
    at = {"tier.json": run / "tier.json", "node": run / "node-0", "step": Path(tier.store.own(2)),
          "manifest": Path(tier.store.own(1), MANIFEST_NAME), "replicas": run / "node-0" / "replicas" / "rank-1",
          "view": run / "view-0-deadbeef"}[level]
    plant_link(at, canary / ("tier.json" if level in ("tier.json", "manifest") else step_name(1)))
    outcomes = []
    for op in (lambda: tier.save(2, state_of(2)), lambda: tier.restore(zeros()), lambda: tier.reset(None),
               lambda: tier.save(3, state_of(3)), tier.close, lambda: gc_memory(None, shm, min_age=0),
               lambda: list_memory(None, shm)):
        try:
            outcomes.append(bounded(op))
        except CheckpointError as e:
            outcomes.append(e)
    again = tier_of(shm)  # a restarted job: tier.json rewritten (a link there replaced, never written through)
    assert Path(run, "tier.json").is_file() and not Path(run, "tier.json").is_symlink()
    json.loads(Path(run, "tier.json").read_text())
    again.clear()


def test_a_run_directory_of_another_owner_or_writable_by_others_is_refused(shm: str) -> None:
    run = Path(shm, RUN)
    run.mkdir()
    run.chmod(0o777)
    with pytest.raises(UnsafePathError, match=f"{run}: is writable by group or others"):
        tier_of(shm)
    run.chmod(0o755)  # an older version's: ours, readable by others only: taken, made private
    tier = tier_of(shm)
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert tier.save(1, state_of(1)).complete
    assert stat.S_IMODE(Path(tier.store.own_root()).stat().st_mode) == 0o700
    tier.clear()
    open_base = Path(shm, "open")
    open_base.mkdir()
    open_base.chmod(0o777)  # anyone could rename our run directory out of it and plant another
    with pytest.raises(UnsafePathError, match="sticky"):
        tier_of(str(open_base))
    if ROOT_USER:
        run.mkdir()
        os.chown(run, OTHER_UID, -1)
        with pytest.raises(UnsafePathError, match=f"owned by uid {OTHER_UID}"):
            tier_of(shm)
        assert list_memory(None, shm) == [] and gc_memory(None, shm, min_age=0) == []


@pytest.mark.skipif(not ROOT_USER, reason="handing a file to another user needs root")
def test_files_of_another_owner_are_never_read(shm: str) -> None:
    tier = tier_of(shm, keep=2)
    for step in (1, 2):
        assert tier.save(step, state_of(step)).complete
    (data,) = Path(tier.store.own(2), "data").iterdir()
    os.chown(data, OTHER_UID, -1)
    failures: list[dict[str, Any]] = []
    target = zeros()
    got = tier.restore(target, on_failure=failures.append)
    assert got is not None and got.step == 1 and same(target, state_of(1))
    assert any(f"owned by uid {OTHER_UID}" in f.get("error", "") for f in failures), failures
    os.chown(Path(tier.store.own(1), MANIFEST_NAME), OTHER_UID, -1)
    assert tier.restore(zeros()) is None  # no manifest of ours: incomplete
    tier.clear()


# --- one run id, one job ----------------------------------------------------------------------------


def _hold(shm: str, run_id: str, ready: Any, done: Any) -> None:
    tier = MemoryTier(TierConfig(ROOT, run_id=run_id, shm_dir=shm, replicas=0, timeout=20))
    tier.reset(None)
    tier.save(1, state_of(1))
    ready.set()
    done.wait(60)


@pytest.fixture
def holder(shm: str) -> Iterator[Callable[[str], Any]]:
    """Start a forked process holding a tier of ``run_id`` (as a first job would)."""
    ctx = multiprocessing.get_context("fork")
    procs = []

    def start(run_id: str) -> Any:
        ready, done = ctx.Event(), ctx.Event()
        p = ctx.Process(target=_hold, args=(shm, run_id, ready, done), daemon=True)
        p.start()
        assert ready.wait(60)
        procs.append((p, done))
        return p

    yield start
    for p, done in procs:
        if p.is_alive():  # (a killed waiter would never acknowledge the event: not set for it)
            done.set()
            p.join(30)
        if p.is_alive():
            p.kill()


@pytest.mark.multiproc
def test_a_second_job_with_the_same_run_id_fails_at_once(shm: str, holder: Callable[[str], Any]) -> None:
    first = holder("shared-id")
    t0 = time.monotonic()
    with pytest.raises(RunInUseError, match=r"run id 'shared-id' is in use on this host by another job \(pid "
                       f"{first.pid} "):
        MemoryTier(TierConfig(ROOT, run_id="shared-id", shm_dir=shm, replicas=0, timeout=20))
    assert time.monotonic() - t0 < 5  # at once, not after a timeout
    # the first job's slots and step are untouched: its restore is its own step, bitwise
    first.kill()  # a killed job: the kernel gives its lock back, the restart is never locked out
    first.join(10)
    tier = MemoryTier(TierConfig(ROOT, run_id="shared-id", shm_dir=shm, replicas=0, timeout=20))
    target = zeros()
    got = tier.restore(target)
    assert got is not None and got.step == 1 and same(target, state_of(1))
    # two tiers of one process: the same refusal, naming this process
    with pytest.raises(RunInUseError, match="another MemoryTier of this process"):
        MemoryTier(TierConfig(ROOT, run_id="shared-id", shm_dir=shm, replicas=0, timeout=20))
    tier.close()
    MemoryTier(TierConfig(ROOT, run_id="shared-id", shm_dir=shm, replicas=0, timeout=20)).clear()


def _second_job(rank: int, world: int, shm: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(RunInUseError, match="in use on this host"):  # every rank: agreed in the setup
        MemoryTier(TierConfig(ROOT, run_id="busy", shm_dir=shm, nodes=2, timeout=20))
    assert time.monotonic() - t0 < 10
    ok = MemoryTier(TierConfig(ROOT, run_id="other", shm_dir=shm, nodes=2, timeout=20))  # its own id: fine
    ok.reset(None)
    assert ok.save(1, state_of(rank + 1)).complete
    ok.clear()


@pytest.mark.multiproc
def test_every_rank_of_a_second_job_fails_and_ranks_of_one_job_share_the_host(shm: str,
                                                                               holder: Callable[[str], Any]) -> None:
    holder("busy")
    run_ranks(2, _second_job, shm)


def _copies_with_hostile_places(rank: int, world: int, shm: str, canary: str) -> None:
    tier = MemoryTier(TierConfig(ROOT, run_id="peers", shm_dir=shm, nodes=2, timeout=20))
    tier.reset(None)
    assert tier.save(1, _piece(rank, 1)).complete
    run = Path(shm, "ckpt-peers")
    if rank == 1:  # rank 1 keeps rank 0's copies under node-1/replicas/rank-0: a link there now
        plant_link(run / "node-1" / "replicas" / "rank-0", Path(canary))
    tier.comm.exchange(None, lambda got: got, timeout=20, what="test barrier")
    result = tier.save(2, _piece(rank, 2))  # rank 0's copy cannot be kept: the step is incomplete everywhere
    assert not result.complete and "symbolic link" in result.warning, result
    if rank == 1:
        Path(run / "node-1" / "replicas" / "rank-0").unlink()
        (data,) = Path(tier.store.own(1), "data").iterdir()
        data.unlink()
        os.mkfifo(data)  # what rank 1 would send for step 1: never opened, never waited on
    tier.comm.exchange(None, lambda got: got, timeout=20, what="test barrier")
    target = {"model": {"w": ckpt.Shard(torch.zeros(64, 32), (128, 32), (rank * 64, 0))}, "train": {"step": 0}}
    failures: list[dict[str, Any]] = []
    got = tier.restore(target, on_failure=failures.append)  # rank 1's own copy refused: rank 0's copy of it serves
    assert got is not None and got.step == 1
    assert torch.equal(target["model"]["w"].local, _piece(rank, 1)["model"]["w"].local)  # bitwise
    assert got.tier == "memory-peer" and any("FIFO" in f.get("error", "") for f in failures), failures
    tier.clear()


@pytest.mark.multiproc
def test_peer_copies_never_go_through_a_link_or_read_a_fifo(shm: str, canary: Path) -> None:
    run_ranks(2, _copies_with_hostile_places, shm, str(canary))


# --- gc ---------------------------------------------------------------------------------------------


def _piece(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    full = torch.randn(128, 32, generator=g)
    return {"model": {"w": ckpt.Shard(full[rank * 64:(rank + 1) * 64].clone(), (128, 32), (rank * 64, 0))},
            "train": {"step": step}}


def _two_rank_job(rank: int, world: int, shm: str, root: str) -> None:
    tier = MemoryTier(TierConfig(root, shm_dir=shm, nodes=2, timeout=20))
    tier.reset(None)
    for step in (1, 2):
        assert tier.save(step, _piece(rank, step)).complete
    # killed here: the copies stay in shared memory


def _age(path: Path, seconds: float = 3600) -> None:
    past = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (past, past), follow_symlinks=False)


@pytest.mark.multiproc
def test_gc_keeps_the_copies_a_resharding_restore_can_use(shm: str, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpts")
    os.makedirs(root)
    run = Path(shm, f"ckpt-{run_id_for(root)}")
    run_ranks(2, _two_rank_job, shm, root)
    copies = {(m.step, m.node, m.owner, m.kind) for m in list_memory(root, shm)}
    assert len(copies) == 4  # the newest step (keep=1) x 2 ranks x (own + replica)
    # a 1-rank restart rewrites tier.json (world 1) and dies before its restore
    MemoryTier(TierConfig(root, shm_dir=shm, replicas=0, timeout=20)).close()
    assert json.loads(Path(run, "tier.json").read_text())["world"] == 1
    _age(run)
    assert gc_memory(root, shm, min_age=300) == []  # every copy still serves a resharding restore
    assert {(m.step, m.node, m.owner, m.kind) for m in list_memory(root, shm)} == copies
    assert all("resharding" in m.note for m in list_memory(root, shm))
    tier = MemoryTier(TierConfig(root, shm_dir=shm, replicas=0, timeout=20))
    target = {"model": {"w": ckpt.Shard(torch.zeros(128, 32), (128, 32), (0, 0))}, "train": {"step": 0}}
    got = tier.restore_resharded(target)
    assert got is not None and got.step == 2
    assert torch.equal(target["model"]["w"].local, torch.randn(128, 32, generator=torch.Generator().manual_seed(2)))
    # while the 1-rank job lives, gc touches nothing of the run, whatever its age
    _age(run)
    assert gc_memory(root, shm, min_age=0) == []
    # once it has a newer complete step of its own, the 2-rank copies are superseded: gc may take them
    whole = {"model": {"w": ckpt.Shard(target["model"]["w"].local.clone(), (128, 32), (0, 0))}, "train": {"step": 3}}
    assert tier.save(3, whole).complete
    tier.close()
    _age(run)
    removed = gc_memory(root, shm, min_age=300)
    assert removed and all(r.reason.startswith("superseded") for r in removed)
    assert {(m.step, m.owner) for m in list_memory(root, shm)} == {(3, 0)}


def test_superseded_is_the_newest_step_complete_under_the_world_size() -> None:
    def e(owner: int, step: int, world: int, epoch: str = "a") -> Entry:
        return Entry(owner, step, "", "local", True, 0, "d", epoch, "", world)

    assert superseded([e(0, 5, 2), e(1, 5, 2)], 1) is None  # only copies of another size: all kept
    assert superseded([e(0, 5, 2), e(1, 5, 2), e(0, 3, 1)], 1) == 3
    assert superseded([e(0, 4, 2), e(1, 4, 2, "b"), e(0, 3, 2), e(1, 3, 2)], 2) == 3  # one attempt's copies only
    assert superseded([e(0, 4, 2)], 2) is None  # rank 1's copy is on another host: not known complete here


# --- any hostile object, between any operations -----------------------------------------------------

DIRS = ["", "node-0", "node-0/rank-0", "node-0/rank-0/.slots", "node-0/rank-0/STEP", "node-0/rank-0/STEP/data",
        "node-0/replicas", "node-0/replicas/rank-1", "node-0/replicas/rank-1/STEP", "view-0-deadbeef"]
FILES = ["tier.json", "node-0/rank-0/.slots/slot-0", "node-0/rank-0/.slots/slot-1", "node-0/rank-0/.slots/slot-5",
         "node-0/rank-0/STEP/manifest.msgpack", ".lock", ".lock-0"] + ["node-0/rank-0/STEP/DATA"] * 4
# where a directory belongs: mostly a link to the canary directory (what a scan or a reset would then
# find "steps" in); where a file belongs: mostly a link to the canary file or a FIFO
HOSTILE = st.one_of(
    st.tuples(st.sampled_from(DIRS), st.sampled_from(["link-dir", "link-dir", "link-file", "file"])),
    st.tuples(st.sampled_from(FILES), st.sampled_from(["link-file", "fifo", "fifo", "dir", "link-dir"])))


class HostileTier(RuleBasedStateMachine):
    """A one-process tier and a canary; hostile objects planted at random tier paths between random
    operations. After every step: the canary is byte-identical, and every operation finished in
    time, succeeding or raising a CheckpointError."""

    def __init__(self) -> None:
        super().__init__()
        self.base = tempfile.mkdtemp(prefix="ckpt-hostile-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.shm = os.path.join(self.base, "shm")
        os.makedirs(self.shm)
        self.canary = Path(self.base, "canary")
        (self.canary / step_name(1) / "data").mkdir(parents=True)
        (self.canary / step_name(1) / MANIFEST_NAME).write_bytes(b"persistent manifest")
        (self.canary / "slot-3").write_bytes(b"precious" * 512)
        self.before = tree(self.canary)
        self.tier: MemoryTier | None = None
        self.steps = 0

    @initialize()
    def start(self) -> None:
        self._open()

    def _open(self) -> None:
        try:
            self.tier = bounded(lambda: MemoryTier(TierConfig(ROOT, shm_dir=self.shm, replicas=0, keep=1,
                                                              timeout=10)))
        except CheckpointError:
            self.tier = None

    def _op(self, fn: Callable[[], Any]) -> Any:
        try:
            return bounded(fn, 10)
        except CheckpointError as e:
            return e

    @rule()
    def snapshot(self) -> None:
        if self.tier is None:
            return
        self.steps += 1
        step = self.steps
        got = self._op(lambda: self.tier.save(step, state_of(step)))  # type: ignore[union-attr]
        event("snapshot: " + ("error" if isinstance(got, CheckpointError) else
                              "complete" if got.complete else "skipped"))

    @rule()
    def restore(self) -> None:
        if self.tier is None:
            return
        target = zeros()
        got = self._op(lambda: self.tier.restore(target))  # type: ignore[union-attr]
        event("restore: " + ("error" if isinstance(got, CheckpointError) else "none" if got is None else "restored"))
        if got is not None and not isinstance(got, CheckpointError):
            assert same(target, state_of(got.step)), got.step  # what was restored is that step's, bitwise

    @rule(keep=st.booleans())
    def reset(self, keep: bool) -> None:
        if self.tier is not None:
            step = self.steps if keep else None
            self._op(lambda: self.tier.reset(step))  # type: ignore[union-attr]

    @rule()
    def gc_live(self) -> None:
        removed = self._op(lambda: gc_memory(None, self.shm, min_age=0))
        if self.tier is not None:
            assert removed == [], removed  # a live run is never collected
        self._op(lambda: list_memory(None, self.shm))

    @rule()
    def restart_and_gc(self) -> None:
        if self.tier is not None:
            self._op(self.tier.close)
        self.tier = None
        self._op(lambda: gc_memory(None, self.shm, min_age=0))
        self._open()
        if self.tier is None:  # refused (a planted run directory or lock): the operator removes it, as told
            run = Path(self.shm, RUN)
            for p in (run, run / ".lock", run / ".lock-0"):
                if p.is_symlink() or (p.exists() and not (p.is_dir() if p == run else p.is_file())):
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            self._open()
            assert self.tier is not None

    @rule()
    def tidy(self) -> None:
        """The operator removes the whole run directory (links in it removed as links): a fresh tier."""
        if self.tier is not None:
            self._op(self.tier.close)
        run = Path(self.shm, RUN)
        if run.is_symlink() or run.is_file():
            run.unlink()
        elif run.exists():
            shutil.rmtree(run)
        self._open()
        assert self.tier is not None

    @rule(hostile=st.lists(HOSTILE, min_size=1, max_size=3), fresh=st.booleans(),
          then=st.permutations(["snapshot", "restore", "reset", "gc_live", "restart_and_gc"]))
    def plant(self, hostile: list[tuple[str, str]], fresh: bool, then: list[str]) -> None:
        """Plant hostile objects (``fresh``: right after a memory checkpoint, so that its step, slots and
        data file are there to be attacked), then run every operation at once in a random order."""
        if fresh:
            self.snapshot()
        for place, kind in hostile:
            self._plant(place, kind)
        for op in then:
            if op == "reset":
                self.reset(False)
            else:
                getattr(self, op)()

    def _plant(self, place: str, kind: str) -> None:
        run = Path(self.shm, RUN)
        step = step_name(max(self.steps, 1))
        rel = place.replace("STEP", step)
        path = run / rel if rel else run
        if "DATA" in rel:
            found = sorted(Path(str(path.parent)).glob("data/*")) if not path.parent.is_symlink() else []
            if not found:
                return
            path = found[0]
        for parent in [path.parent, *path.parent.parents]:  # never plant through an earlier plant
            if parent == Path(self.shm):
                break
            if parent.is_symlink() or (parent.exists() and not parent.is_dir()):
                return
        if path.is_symlink() or path.is_file() or (path.exists() and not path.is_dir()):
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "link-file":
            path.symlink_to(self.canary / "slot-3")
        elif kind == "link-dir":
            path.symlink_to(self.canary)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "dir":
            path.mkdir()
        else:
            path.write_bytes(b"planted")

    @invariant()
    def canary_intact(self) -> None:
        assert tree(self.canary) == self.before

    def teardown(self) -> None:
        try:
            if self.tier is not None:
                self._op(self.tier.close)
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


TestHostileTier = pytest.mark.slow(HostileTier.TestCase)
TestHostileTier.settings = settings(max_examples=50, stateful_step_count=20, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
