"""The trainer with a memory tier, 4 forked gloo ranks (tp=2 x ep=2, ZeRO-1) in 2 simulated nodes:
node 1 is lost (its ranks SIGKILLed, its shared memory deleted) and the run resumes from the memory
tier with no step lost beyond the last memory checkpoint, ending bitwise equal to an uninterrupted
run (model, optimizer, RNG, data position); with both copies of a piece lost, or a damaged copy, it
falls back to storage and still ends bitwise equal; a full shared memory skips memory checkpoints
with a warning while training goes on."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing import ProcessExitedException

import ckpt
from ckpt.layout import Layout
from ckpt.manager import list_checkpoints, step_dir
from ckpt.tier.nodes import SHM_ENV, run_id_for, step_name
from ckpt.trainer.config import TrainConfig
from ckpt.trainer.metrics import read_metrics
from ckpt.trainer.train import train
from tests.dist_utils import run_ranks
from tests.trainer.trainer_utils import _worker, checkpoint_tensors, run_training

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

LAYOUT = Layout(tp=2, ep=2, zero=1)
STEPS, SAVE_EVERY = 10, 5


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="ckpt-test-tier-train-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _cfg(base: str, name: str, **kw: Any) -> TrainConfig:
    return TrainConfig(steps=STEPS, save_every=SAVE_EVERY, memory_every=1, nodes=2, shm_dir=os.path.join(base, "shm"),
                       ckpt_dir=os.path.join(base, name), device="cpu", **kw)


@pytest.fixture(scope="module")
def full(base: str) -> dict[str, Any]:
    """The uninterrupted run: its losses and every tensor of its last checkpoint."""
    cfg = _cfg(base, "full")
    losses = run_training(cfg, LAYOUT)["losses"]
    tier = Path(base) / "shm" / f"ckpt-{run_id_for(cfg.ckpt_dir or '')}"
    assert not tier.exists()  # the run's end gives the shared memory back
    return {"losses": losses, "tensors": checkpoint_tensors(os.path.join(base, "full", step_dir(STEPS)))}


def _lose_node(cfg: TrainConfig, at: int) -> None:
    with pytest.raises(ProcessExitedException, match="SIGKILL"):
        run_training(dataclasses.replace(cfg, fail_at_step=at, fail_node=1), LAYOUT)


def _node(cfg: TrainConfig, node: int) -> Path:
    return Path(cfg.shm_dir or "") / f"ckpt-{run_id_for(cfg.ckpt_dir or '')}" / f"node-{node}"


def _same_end(full: dict[str, Any], cfg: TrainConfig) -> None:
    got = checkpoint_tensors(os.path.join(cfg.ckpt_dir or "", step_dir(STEPS)))
    want = full["tensors"]
    assert got.keys() == want.keys()
    for k in want:  # model and optimizer state, every bit
        assert torch.equal(got[k], want[k]), k
    assert ckpt.inspect(os.path.join(cfg.ckpt_dir or "", step_dir(STEPS))).objects.keys() >= {"rng", "train.step"}


def _events(cfg: TrainConfig, name: str) -> list[dict[str, Any]]:
    return [r for r in read_metrics(cfg.metrics_file or "") if r.get("event") == name]


def test_losing_a_node_resumes_from_the_memory_tier_bitwise(base: str, full: dict[str, Any]) -> None:
    at = random.Random().randint(1, STEPS - 1)  # a random step: every one of them must work
    cfg = _cfg(base, f"lose-node-at-{at}")
    _lose_node(cfg, at)
    assert not _node(cfg, 1).exists() and _node(cfg, 0).exists()
    resumed = run_training(cfg, LAYOUT)
    assert resumed["start"] == at, f"lost node at step {at}"  # no step lost: memory checkpoint every step
    assert resumed["losses"] == {k: v for k, v in full["losses"].items() if k > at}  # the same floats
    _same_end(full, cfg)
    (rec,) = _events(cfg, "recovery")
    assert rec["tier"] == "memory-peer" and rec["step"] == at and rec["steps_lost"] == 0
    assert rec["peer_ranks"] == [2, 3] and rec["fetched_bytes"] > 0 and rec["bytes"] > 0
    assert {"restore_ms", "first_step_ms", "restart_ms", "total_ms"} <= rec.keys()
    # rank 0 (node 0 kept its copies) mapped its newest step while the model was built (not pinned: CPU)
    assert rec["pin_ahead_bytes"] > 0 and rec["pin_ahead_pinned"] is False and rec["pin_ahead_ms"] > 0
    (resume,) = _events(cfg, "resume")
    assert resume["tier"] == "memory-peer" and resume["bytes_verified"] > 0  # every piece's checksum checked
    mem = _events(cfg, "memory_checkpoint")
    # step `at`'s record may be missing from the first attempt: its background work ended while rank 0
    # (which writes the metrics) was already stuck in step at+1 with the lost node (start == at says
    # it was complete everywhere)
    assert [r["step"] for r in mem if r["step"] != at] == [*range(1, at), *range(at + 1, STEPS)]
    # each record times the training thread's snapshot and the background's write, copy and agreement
    # (which is longer is the benchmark's business: with slots the write is a checksum and a link)
    assert all(r["snapshot_ms"] > 0 and r["write_ms"] > 0 and r["replicate_ms"] > 0 and r["agree_ms"] >= 0
               for r in mem), mem
    assert all(r["complete"] and r["replica_bytes"] > 0 for r in mem)
    assert len(_events(cfg, "fail")) == 2  # both ranks of node 1


def test_both_copies_lost_falls_back_to_storage(base: str, full: dict[str, Any]) -> None:
    cfg = _cfg(base, "both-lost")
    _lose_node(cfg, 7)
    shutil.rmtree(_node(cfg, 0) / "replicas" / "rank-2")  # the only other copy of rank 2's pieces
    resumed = run_training(cfg, LAYOUT)
    assert resumed["start"] == SAVE_EVERY
    _same_end(full, cfg)
    (rec,) = _events(cfg, "recovery")
    assert rec["tier"] == "storage" and rec["step"] == SAVE_EVERY and rec["steps_lost"] == 7 - SAVE_EVERY
    (ignored,) = _events(cfg, "memory_tier_ignored")
    assert any("memory step 7: no copy of rank(s) [2]" in n for n in ignored["notes"])


def test_a_damaged_copy_falls_back_and_still_ends_bitwise(base: str, full: dict[str, Any]) -> None:
    cfg = _cfg(base, "damaged-copy")
    _lose_node(cfg, 7)
    copy = _node(cfg, 0) / "replicas" / "rank-3" / step_name(7)
    m = ckpt.inspect(str(copy))
    # the biggest piece only rank 3 holds (its ZeRO-1 optimizer slice): a replicated piece would be
    # read from another rank's copy by the resharding restore (the fallback after the own-copy one)
    s = max((s for k, t in m.tensors.items() if k.startswith("optim.") for s in t.shards), key=lambda s: s.length)
    with open(copy / s.file, "r+b") as f:  # flipped bytes in the middle of it
        f.seek(s.offset + s.length // 2)
        b = f.read(2)
        f.seek(s.offset + s.length // 2)
        f.write(bytes(x ^ 0xFF for x in b))
    resumed = run_training(cfg, LAYOUT)
    assert resumed["start"] == SAVE_EVERY  # keep=1: no older memory step, so storage's
    _same_end(full, cfg)
    failed, resharded = _events(cfg, "restore_failed")
    assert failed["tier"] == "memory" and failed["rank"] == 3 and failed["source"] == "peer" and failed["step"] == 7
    assert "checksum" in failed["error"].lower() or "IntegrityError" in failed["error"]
    assert resharded["tier"] == "memory-reshard" and "checksum" in resharded["error"].lower()
    assert _events(cfg, "recovery")[0]["tier"] == "storage"
    assert [c.step for c in list_checkpoints(cfg.ckpt_dir or "") if c.committed][-1] == STEPS


def _full_shm_worker(rank: int, world: int, cfg: TrainConfig) -> None:
    import errno

    from ckpt.tier.tier import MemoryTier

    slot_for, calls = MemoryTier._slot_for, [0]

    def full(self: MemoryTier, flat: dict[str, Any]) -> Any:
        # rank 1's memory checkpoint of step 3 finds no room in shared memory for its slot
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return slot_for(self, flat)

    MemoryTier._slot_for = full  # type: ignore[method-assign]
    train(cfg, LAYOUT)


def test_full_shared_memory_skips_memory_checkpoints_and_training_goes_on(base: str, full: dict[str, Any]) -> None:
    cfg = _cfg(base, "shm-full")
    run_ranks(4, _full_shm_worker, cfg)
    _same_end(full, cfg)
    mem = {r["step"]: r for r in _events(cfg, "memory_checkpoint")}
    assert mem[3]["skipped"] and "No space left on device" in mem[3]["warning"] and "rank 1" in mem[3]["errors"][0]
    assert all(mem[s]["complete"] for s in mem if s != 3) and sorted(mem) == list(range(1, STEPS))
    assert [r["step"] for r in _events(cfg, "checkpoint")] == [SAVE_EVERY, STEPS]  # persistent saves unaffected


def test_a_layout_change_resumes_from_the_memory_tier(base: str, full: dict[str, Any]) -> None:
    cfg = _cfg(base, "lose-node-then-reshard")
    _lose_node(cfg, 7)
    # the job comes back on 2 ranks (one per node) under another layout: pipeline-parallel
    resumed = run_training(cfg, Layout(pp=2, zero=1))
    assert resumed["start"] == 7  # the memory step, read through the resharding load: no step lost
    (rec,) = _events(cfg, "recovery")
    assert rec["tier"] == "memory-reshard" and rec["steps_lost"] == 0
    (resume,) = _events(cfg, "resume")
    assert resume["resharded"] and resume["bytes_verified"] > 0  # every piece's checksum checked
    # the same trajectory up to float reassociation across layouts
    for k, v in resumed["losses"].items():
        assert abs(v - full["losses"][k]) < 1e-3 * abs(full["losses"][k]), (k, v, full["losses"][k])


def _on_host(rank: int, world: int, cfg: TrainConfig, layout: Layout, hosts: list[str], out: str) -> None:
    os.environ[SHM_ENV] = hosts[rank]  # this rank's host: its own shared memory
    _worker(rank, world, cfg, layout, out)


def test_a_layout_change_across_hosts_resumes_from_the_peers_memory(base: str, full: dict[str, Any]) -> None:
    """Node 1 lost; the job comes back on 2 ranks under pp=2, one per host, each host's shared memory
    holding half of the surviving copies (node 0's own on one host, the replicas of node 1's ranks it
    kept on the other): each rank receives from the other host only the stored shards its pipeline
    stage wants, no storage read."""
    cfg = _cfg(base, "lose-node-then-reshard-hosts")
    _lose_node(cfg, 7)
    run = f"ckpt-{run_id_for(cfg.ckpt_dir or '')}"
    src = Path(cfg.shm_dir or "") / run
    hosts = [os.path.join(base, "host-a"), os.path.join(base, "host-b")]
    for h, keep in zip(hosts, ("own", "replicas"), strict=True):
        dst = Path(h) / run / "node-0"
        dst.mkdir(parents=True, mode=0o700)
        os.chmod(Path(h), 0o700)
        os.chmod(Path(h) / run, 0o700)
        for p in src.iterdir():
            if p.is_file():
                shutil.copy2(p, Path(h) / run / p.name)
        if keep == "own":
            shutil.copytree(src / "node-0", dst, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("replicas", ".slots"))
        else:
            shutil.copytree(src / "node-0" / "replicas", dst / "replicas")
    other = sum(f.stat().st_size for f in (Path(hosts[1]) / run).rglob("*") if f.is_file())
    shutil.rmtree(src)  # nothing of the tier left where both ranks would reach it
    fd, out = tempfile.mkstemp(prefix="ckpt-train-", suffix=".json")
    os.close(fd)
    run_ranks(2, _on_host, dataclasses.replace(cfg, shm_dir=None), Layout(pp=2, zero=1), hosts, out)
    with open(out) as f:
        resumed = json.load(f)
    os.unlink(out)
    assert resumed["start"] == 7  # the memory step: no step lost, nothing read from storage
    (rec,) = _events(cfg, "recovery")
    assert rec["tier"] == "memory-reshard" and rec["steps_lost"] == 0 and rec["peer_ranks"] == [1]
    # rank 0 (pipeline stage 0) received part of the other host's copies: its stage's shards only
    assert 0 < rec["fetched_bytes"] < other / 2, (rec["fetched_bytes"], other)
    for k, v in resumed["losses"].items():
        k = int(k)
        assert abs(v - full["losses"][k]) < 1e-3 * abs(full["losses"][k]), (k, v, full["losses"][k])


def test_memory_busy_skip_skips_the_same_steps_everywhere_and_training_is_unchanged(base: str,
                                                                                    full: dict[str, Any]) -> None:
    cfg = dataclasses.replace(_cfg(base, "busy-skip"), memory_busy="skip")
    run_training(cfg, LAYOUT)
    _same_end(full, cfg)  # memory checkpoints never change training
    mem = _events(cfg, "memory_checkpoint")
    assert mem and all(r["complete"] for r in mem) and mem[0]["step"] == 1
    steps = [r["step"] for r in mem]
    assert steps == sorted(set(steps))
    # each record counts the due steps skipped since the previous one (the same on every rank: the
    # background agreement would otherwise have mixed steps and failed)
    assert all(r["busy_skipped"] == r["step"] - p - 1 for p, r in zip([0, *steps], mem, strict=False))
