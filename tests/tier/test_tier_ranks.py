"""The memory tier on 4 forked gloo ranks in 2 simulated nodes, with a synthetic state (tensors as
Shard and FlatShard pieces, objects per rank and global): bounded memory, restore from own copies,
from peers after a node loss, fallback on lost or damaged copies, stale tiers, shared memory full."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import ckpt
from ckpt.tier import MemoryTier, TierConfig, list_memory
from ckpt.tier.nodes import step_name
from tests.dist_utils import run_ranks
from tests.tier.kill_harness import state_of

pytestmark = pytest.mark.multiproc

ROOT = "/tier-tests/run"


def _tier(shm: str, **kw: Any) -> MemoryTier:
    return MemoryTier(TierConfig(kw.pop("root", ROOT), shm_dir=shm, nodes=2, timeout=30, **kw))


def _node(shm: str, node: int, run_id: str | None = None) -> Path:
    from ckpt.tier.nodes import run_id_for

    return Path(shm) / f"ckpt-{run_id or run_id_for(ROOT)}" / f"node-{node}"


def _save_steps(rank: int, world: int, shm: str, steps: list[int], keep: int, out: str | None = None) -> None:
    tier = _tier(shm, keep=keep)
    tier.reset(None)
    records = [tier.save(s, state_of(rank, s)).to_record() for s in steps]
    assert all(r["complete"] for r in records), records
    own = [s for s, _ in tier.store.own_steps()]
    held = [s for o in tier.senders[rank] for s, _ in tier.store.replica_steps(o)]
    assert own == steps[-keep:] and held == steps[-keep:], (own, held)  # bounded: keep complete steps
    # own copies were written, and kept copies received, straight into slots (the slot + the step's link)
    for _s, path in tier.store.own_steps() + [x for o in tier.senders[rank] for x in tier.store.replica_steps(o)]:
        assert [f.stat().st_nlink for f in Path(path, "data").iterdir()] == [2], path
    for root in [tier.store.own_root()] + [tier.store.replica_root(o) for o in tier.senders[rank]]:
        assert len(list(Path(root, ".slots").iterdir())) <= keep + 1  # bounded too
    if out and rank == 0:
        Path(out).write_text(json.dumps(records))


def _restore(rank: int, world: int, shm: str, out: str, kw: dict[str, Any]) -> None:
    tier = _tier(shm, **kw)
    target = state_of(rank, 0)
    failures: list[dict[str, Any]] = []
    got = tier.restore(target, on_failure=failures.append)
    rec: dict[str, Any] = {"rank": rank, "step": None, "failures": failures}
    if got is not None:
        ref = state_of(rank, got.step)
        assert torch.equal(target["model"]["w"].local, ref["model"]["w"].local)
        assert torch.equal(target["optim"]["m"].local, ref["optim"]["m"].local)
        assert got.value["train"] == ref["train"] and got.value["rng"] == ref["rng"].value
        rec.update(step=got.step, source=got.source, holder=got.holder, tier=got.tier, peers=got.peer_ranks,
                   fetched=got.fetched_bytes)
        tier.reset(got.step)
        assert [s for s, _ in tier.store.own_steps()] == [got.step]  # a fetched copy is this rank's own now
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _restored(shm: str, tmp: Path, **kw: Any) -> dict[int, dict[str, Any]]:
    out = tmp / f"restored-{len(list(tmp.glob('restored-*')))}.jsonl"
    run_ranks(4, _restore, shm, str(out), kw)
    return {r["rank"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_memory_checkpoints_are_bounded_and_restore_bitwise(shm: str, tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    run_ranks(4, _save_steps, shm, [1, 2, 3], 1, str(out))
    rec = json.loads(out.read_text())[-1]
    assert rec["event"] == "memory_checkpoint" and rec["step"] == 3 and rec["bytes"] > 4 * 256 * 256 * 4
    assert rec["replica_bytes"] > 0 and not rec["skipped"]
    # each step directory is an ordinary checkpoint: verify --deep passes
    own = _node(shm, 1) / "rank-2" / step_name(3)
    assert ckpt.verify(str(own), deep=True).ok
    assert ckpt.inspect(str(own)).user_metadata["ckpt_tier"]["owner"] == 2
    got = _restored(shm, tmp_path)
    assert {r["step"] for r in got.values()} == {3} and {r["source"] for r in got.values()} == {"local"}
    run_ranks(4, _save_steps, shm, [4, 5, 6], 2)  # keep=2: two complete steps per rank and per copy


def test_a_lost_node_is_restored_from_peer_copies(shm: str, tmp_path: Path) -> None:
    run_ranks(4, _save_steps, shm, [1, 2], 1)
    shutil.rmtree(_node(shm, 1))  # node 1 lost: ranks 2 and 3 come back with empty shared memory
    got = _restored(shm, tmp_path)
    assert {r["step"] for r in got.values()} == {2}
    assert [(got[r]["source"], got[r]["holder"]) for r in range(4)] == [
        ("local", 0), ("local", 1), ("peer", 0), ("peer", 1)]
    assert got[0]["tier"] == "memory-peer" and got[0]["peers"] == [2, 3] and got[0]["fetched"] > 0
    # the fetched copies are the ranks' own now: the next restart finds them locally
    got = _restored(shm, tmp_path)
    assert {(r["step"], r["source"]) for r in got.values()} == {(2, "local")}


def test_a_damaged_copy_falls_back_to_the_next_source(shm: str, tmp_path: Path) -> None:
    run_ranks(4, _save_steps, shm, [1, 2, 3], 2)
    copy = _node(shm, 0) / "replicas" / "rank-2" / step_name(3)
    m = ckpt.inspect(str(copy))
    s = next(s for t in m.tensors.values() for s in t.shards if s.length)
    with open(copy / s.file, "r+b") as f:  # one flipped bit in rank 2's copy of step 3
        f.seek(s.offset + 5)
        b = f.read(1)
        f.seek(s.offset + 5)
        f.write(bytes([b[0] ^ 0x10]))
    shutil.rmtree(_node(shm, 1))
    got = _restored(shm, tmp_path)
    assert {r["step"] for r in got.values()} == {2}  # step 3 cannot be restored whole: the older complete one
    fail = [f for f in got[0]["failures"] if f["event"] == "restore_failed"]
    assert len(fail) == 1 and fail[0]["step"] == 3 and fail[0]["rank"] == 2 and fail[0]["source"] == "peer"
    assert "IntegrityError" in fail[0]["error"] or "checksum" in fail[0]["error"]
    assert got[0]["failures"] == got[3]["failures"]  # every rank has the same account


def _manager(rank: int, world: int, shm: str, root: str, phase: str, out: str) -> None:
    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=shm, nodes=2, memory_timeout=30)
    if phase.startswith("save"):
        for step in (1, 2, 3):
            if step == 1 and phase == "save":
                mgr.save(step, state_of(rank, step))
            assert mgr.memory_due(step)
            assert mgr.save_memory(step, state_of(rank, step)).result().complete
        return
    target = state_of(rank, 0)
    step = mgr.restore(target)
    tier = mgr.last_restore.tier if mgr.last_restore is not None else "storage"
    assert step is not None and torch.equal(target["model"]["w"].local, state_of(rank, step)["model"]["w"].local)
    assert target["train"] == state_of(rank, step)["train"]  # objects restored in place
    with open(out, "a") as f:
        f.write(f"{rank} {step} {tier}\n")


def test_manager_restores_across_tiers_and_ls_shows_the_memory_tier(shm: str, tmp_path: Path) -> None:
    from ckpt.cli.app import app

    root = str(tmp_path / "ckpts")
    run_ranks(4, _manager, shm, root, "save", "")
    r = CliRunner().invoke(app, ["ls", root, "--shm-dir", shm])
    assert r.exit_code == 0, r.output
    assert "memory tier" in r.output and "replica" in r.output and "committed" in r.output
    entries = json.loads(CliRunner().invoke(app, ["ls", root, "--shm-dir", shm, "--json"]).output)
    mem = [e for e in entries if e.get("tier") == "memory"]
    assert {(e["step"], e["copy"]) for e in mem} == {(3, "local"), (3, "replica")} and len(mem) == 8
    assert [e["step"] for e in entries if "tier" not in e] == [1]
    assert len(list_memory(root, shm)) == 8 and list_memory(str(tmp_path / "other"), shm) == []
    out = tmp_path / "out.txt"
    run_ranks(4, _manager, shm, root, "restore", str(out))  # memory step 3 is newer than storage's 1
    assert sorted(out.read_text().split("\n")[:-1]) == [f"{r} 3 memory" for r in range(4)]
    # both copies of rank 2's pieces lost (its node, and node 0's copy): storage's step 1
    run_ranks(4, _manager, shm, root, "save-memory", "")
    shutil.rmtree(_node(shm, 1, _run(root)))
    shutil.rmtree(_node(shm, 0, _run(root)) / "replicas" / "rank-2")
    out.unlink()
    run_ranks(4, _manager, shm, root, "restore", str(out))
    assert sorted(out.read_text().split("\n")[:-1]) == [f"{r} 1 storage" for r in range(4)]


def _run(root: str) -> str:
    from ckpt.tier.nodes import run_id_for

    return run_id_for(root)


def test_a_stale_tier_is_never_restored(shm: str, tmp_path: Path) -> None:
    run_ranks(4, _save_steps, shm, [1], 1)
    assert {r["step"] for r in _restored(shm, tmp_path, run_id="another-run").values()} == {None}
    # the same directory name, written by another run: its manifests say so
    shutil.rmtree(Path(shm) / "ckpt-another-run")
    os.rename(Path(shm) / f"ckpt-{_run(ROOT)}", Path(shm) / "ckpt-another-run")
    got = _restored(shm, tmp_path, run_id="another-run")
    assert {r["step"] for r in got.values()} == {None}
    notes = [n for f in got[0]["failures"] if f["event"] == "memory_tier_ignored" for n in f["notes"]]
    assert any("stale: written by run" in n for n in notes), notes
    # another layout: the same run, other pieces per rank (a different model shape)
    run_ranks(4, _save_steps, shm, [1], 1)
    run_ranks(4, _restore_other_layout, shm)


def _restore_other_layout(rank: int, world: int, shm: str) -> None:
    tier = _tier(shm)
    target = state_of(rank, 0)
    target["model"]["w"] = ckpt.Shard(torch.zeros(128, 256), (world * 256, 256), (rank * 256, 0))
    notes: list[dict[str, Any]] = []
    assert tier.restore(target, on_failure=notes.append) is None
    assert any("other pieces" in n for f in notes for n in f.get("notes", []))


def _shm_full(rank: int, world: int, shm: str, out: str) -> None:
    tier = _tier(shm)
    tier.reset(None)
    fallocate = os.posix_fallocate
    state = {"step": 0}
    replica_slot = tier._replica_slot

    def full(owner: int, size: int) -> Any:
        # step 3: rank 0 keeping rank 2's copy (the peer's memory is full)
        if state["step"] == 3 and rank == 0 and owner == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return replica_slot(owner, size)

    def no_room(fd: int, offset: int, length: int) -> None:
        # step 2: rank 1's own memory checkpoint finds no room for its slot (the one step 1 used is
        # linked; the spare one, shaped ahead during step 1, found no room either)
        ahead = threading.current_thread().name == "ckpt-memory-tier-slots-ahead"
        if rank == 1 and (state["step"] == 2 or ahead):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fallocate(fd, offset, length)

    tier._replica_slot = full  # type: ignore[method-assign]
    os.posix_fallocate = no_room
    records = []
    for step in (1, 2, 3, 4):
        state["step"] = step
        r = tier.save(step, state_of(rank, step))
        records.append(r.to_record())
        own = [s for s, _ in tier.store.own_steps()]
        assert own == ([1] if step in (2, 3) else [step]), (step, own)  # the complete step stays
    if rank == 0:
        Path(out).write_text(json.dumps(records))


def test_shared_memory_full_skips_the_memory_checkpoint_with_a_warning(shm: str, tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    run_ranks(4, _shm_full, shm, str(out))
    recs = json.loads(out.read_text())
    assert [r["complete"] for r in recs] == [True, False, False, True]
    assert "No space left on device" in recs[1]["warning"] and "rank 1" in recs[1]["errors"][0]
    assert "newest complete memory step stays 1" in recs[1]["warning"]
    assert "could not keep rank 2's copy" in recs[2]["errors"][0] and "No space left" in recs[2]["warning"]
    assert {r["step"] for r in _restored(shm, tmp_path).values()} == {4}


def _subgroup_tier(rank: int, world: int, shm: str) -> None:
    import datetime

    import torch.distributed as dist

    sub = dist.new_group([0, 1])  # torch's own groups: created by every rank
    if rank < 2:  # ranks 2 and 3 never touch the memory tier (and never wait for it)
        _tier_on(rank, shm, sub)
    # a group every rank creates afterwards still matches on every rank (new_group inside the tier
    # would have moved ranks 0 and 1's group counters ahead of 2 and 3's: a hang here)
    every = dist.new_group([0, 1, 2, 3], timeout=datetime.timedelta(seconds=20))
    t = torch.ones(1)
    dist.all_reduce(t, group=every)
    assert t.item() == 4


def _tier_on(rank: int, shm: str, sub: Any) -> None:
    tier = MemoryTier(TierConfig(ROOT, shm_dir=shm, nodes=2, timeout=30, run_id="subgroup"), group=sub)
    assert (tier.rank, tier.world, tier.nodes) == (rank, 2, [0, 1])
    tier.reset(None)
    for step in (1, 2):
        assert tier.save(step, state_of(rank, step)).complete
    target = state_of(rank, 0)
    got = tier.restore(target)
    assert got is not None and got.step == 2
    assert torch.equal(target["model"]["w"].local, state_of(rank, 2)["model"]["w"].local)
    assert tier.store.replica_steps(1 - rank) == [(2, tier.store.replica(1 - rank, 2))]  # each keeps the other's
    tier.clear()


def test_a_tier_on_a_subgroup_needs_no_call_from_the_other_ranks(shm: str) -> None:
    # the tier makes its group from its members alone (ckpt._comm.side_group); new_group would have
    # waited for ranks 2 and 3, which never create a tier
    run_ranks(4, _subgroup_tier, shm)


def test_single_process(shm: str) -> None:
    with pytest.warns(RuntimeWarning, match="no peer copies"):
        tier = MemoryTier(TierConfig(ROOT, shm_dir=shm))
    tier.reset(None)
    assert tier.save(5, state_of(0, 5)).complete
    target = state_of(0, 0)
    got = tier.restore(target)
    assert got is not None and got.step == 5 and got.source == "local"
    assert torch.equal(target["model"]["w"].local, state_of(0, 5)["model"]["w"].local)
    tier.clear()
    assert not os.path.exists(Path(shm) / f"ckpt-{_run(ROOT)}")


def _fresh_root(rank: int, world: int, shm: str, root: str) -> None:
    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=shm, nodes=2, memory_timeout=30)
    assert mgr.memory is not None
    notes: list[dict[str, Any]] = []
    assert mgr.memory.restore(state_of(rank, 0), on_failure=notes.append) is None
    assert any("earlier run under the same root" in n for f in notes for n in f.get("notes", [])), notes
    assert mgr.restore(state_of(rank, 0)) is None  # a fresh start: and the old copies are gone
    assert mgr.memory.store.own_steps() == []


def test_a_new_run_in_an_emptied_root_never_restores_the_old_memory_tier(shm: str, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpts")
    run_ranks(4, _manager, shm, root, "save", "")
    shutil.rmtree(root)  # the same path, a new run: same run id, but the root's lineage token is new
    run_ranks(4, _fresh_root, shm, root)


def _bad_state(rank: int, world: int, shm: str) -> None:
    from ckpt.errors import StateError

    tier = _tier(shm)
    state = state_of(rank, 1)
    if rank == 1:
        state["train"]["sched"] = {"fn": object()}  # not msgpack-able: ckpt.save refuses it
    with pytest.raises(StateError, match="rank 1"):  # on every rank, not a hang on the others
        tier.save(1, state)
    assert tier.store.own_steps() == []


def test_a_state_one_rank_cannot_save_raises_on_every_rank(shm: str) -> None:
    run_ranks(4, _bad_state, shm)


def test_save_async_returns_after_the_snapshot_and_the_caller_may_change_its_state(shm: str) -> None:
    from tests.tier.kill_harness import _scribble

    tier = MemoryTier(TierConfig(ROOT, shm_dir=shm, replicas=0))
    tier.reset(None)
    handles = []
    for step in (1, 2, 3):
        state = state_of(0, step)
        handles.append(tier.save_async(step, state))  # waits for the previous one, then snapshots
        _scribble(state)  # what the optimizer does next: the memory checkpoint must not see it
    assert [h.result().complete for h in handles] == [True, True, True]
    # the snapshots landed in two slots (keep + 1), reused: step 3 went where step 1 was, once freed
    assert tier._slots.allocations == 2 and tier._snapshots.allocations == 0
    data = [p for p in Path(tier.store.own(3), "data").iterdir()]
    assert len(data) == 1 and data[0].stat().st_nlink == 2  # the step's data file is a slot, linked
    target = state_of(0, 0)
    got = tier.restore(target)
    assert got is not None and got.step == 3
    ref = state_of(0, 3)
    assert torch.equal(target["model"]["w"].local, ref["model"]["w"].local)
    assert torch.equal(target["optim"]["m"].local, ref["optim"]["m"].local)
    assert got.value["train"] == ref["train"]
    rec = handles[-1].result().to_record()
    assert rec["snapshot_ms"] > 0 and rec["wait_ms"] >= 0
    tier.clear()


def _busy_skip(rank: int, world: int, shm: str, out: str, overhead: float | None = None) -> None:
    import time

    import ckpt.tier.tier as tier_mod

    tier = _tier(shm, busy="skip", max_overhead=overhead)
    tier.reset(None)
    exchange = tier_mod.exchange

    def slow(*a: Any, **k: Any) -> Any:
        time.sleep(0.01 * (rank + 1))  # the background work outlasts a step, longer on some ranks
        return exchange(*a, **k)

    tier_mod.exchange = slow  # type: ignore[assignment]
    from ckpt._comm import Comm

    agree = Comm.exchange

    def late_verdict(self: Any, obj: Any, reply: Any, **k: Any) -> Any:
        out = agree(self, obj, reply, **k)
        if rank == 3 and str(k.get("what", "")).startswith("memory tier agreement"):
            time.sleep(0.08)  # rank 3 hears the verdict late: its training thread runs on meanwhile
        return out

    Comm.exchange = late_verdict  # type: ignore[method-assign]
    seen = []
    import torch.distributed as dist

    # until 4 started (the same step on every rank: the starts are agreed), however slow the box
    for step in range(1, 400):
        dist.barrier()  # training's collectives keep the ranks within a step of each other
        time.sleep(0.002 * ((step * (rank + 3)) % 4))  # but they reach each step at different times
        h = tier.save_async(step, state_of(rank, step))
        seen.append([step, h.busy])
        if sum(1 for _s, busy in seen if not busy) == 4:
            break
    last = tier.drain()
    assert last is not None and last.result().complete
    with open(out, "a") as f:
        f.write(json.dumps({"rank": rank, "seen": seen, "last": last.step,
                            "busy_skipped": last.result().busy_skipped,
                            "idle": len(tier.governor.idle) if tier.governor else None,
                            "budget": last.result().budget_gbps}) + "\n")


@pytest.mark.parametrize("overhead", [None, 0.05])
def test_busy_skip_never_waits_and_every_rank_skips_the_same_steps(shm: str, tmp_path: Path,
                                                                   overhead: float | None) -> None:
    """... also with a governor (``max_overhead``), whose first calls start no memory checkpoint
    (the same on every rank) and whose pauses hold only this rank's copies."""
    out = tmp_path / "busy.jsonl"
    run_ranks(4, _busy_skip, shm, str(out), overhead)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(g["seen"] == got[0]["seen"] for g in got)  # the same steps started (or skipped) on every rank
    started = [s for s, busy in got[0]["seen"] if not busy]
    from ckpt.tier.cadence import WARM_CALLS

    first = 1 if overhead is None else 1 + WARM_CALLS  # a governor measures idle steps first
    assert started[0] == first and 3 <= len(started) < len(got[0]["seen"])  # some due steps were skipped
    assert {g["last"] for g in got} == {started[-1]}
    assert {r["step"] for r in _restored(shm, tmp_path).values()} == {started[-1]}  # bitwise (see _restore)
    if overhead is not None:  # every rank measured steps with nothing in flight (the first calls)
        assert all(g["idle"] >= WARM_CALLS and g["budget"] is not None for g in got), got
