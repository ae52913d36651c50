"""Kill-9 harness for the memory tier: SIGKILL ranks (or a whole node) while they write and replicate
memory checkpoints, then restore on fresh ranks and check that what comes back is never torn.

One *trial*: fork 4 gloo ranks in 2 simulated nodes; each saves memory checkpoints of steps 1, 2, 3,
... forever (values: a deterministic function of rank and step; tensors and objects), as a trainer
does: ``save_async`` (the host snapshot on the calling thread, the write, copy, agreement and free on
the tier's background thread), then the caller scribbles over its tensors and objects at once and
prepares the next step while the background work runs; it appends ``<rank> <step>`` to a progress
file once a step is known agreed complete. The parent kills:

- ``random`` trials: a random victim after a random delay (uniform in ``[0, 0.6]`` s after every
  rank started saving);
- ``targeted`` trials: the victim kills itself the n-th time it reaches a kill point of the snapshot,
  the write, the copy, the agreement or the freeing (:data:`KILL_POINTS`).

The victim is one rank (its node's shared memory survives: a process crash) or, in ``node`` trials,
all ranks of its node, whose directory is then deleted (a lost node). Every other rank is killed
next (torchrun tears the job down). Then 4 fresh ranks restore, and the parent checks:

- all ranks restore the same step S (or all find none), and each rank's state is bitwise the
  state of (its rank, S), objects included: never a mix of steps, never a half-written copy;
- S is at least the newest step any rank saw agreed complete before the kill (nothing complete is
  lost, even with a node gone) and at most the newest step any rank started.

The child records its phase in shared memory, so every kill is attributed to what it interrupted.
Instrumentation is installed in the children only (after fork). ``python -m tests.tier.kill_harness
--trials 60`` runs more trials than the suite does (the suite: 20).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckpt
from ckpt.tier import MemoryTier, TierConfig
from tests.dist_utils import run_ranks

WORLD, NODES = 4, 2
PHASES = ["-", "startup", "snapshot", "write", "replicate", "agree", "free", "between"]
KILL_POINTS = {
    "snapshot": "the host snapshot taken on the calling thread, the background write not started",
    "write": "writing its own memory checkpoint: the snapshot in its slot, checksums and the link next "
             "(or, without a slot, the data file being written)",
    "own-commit": "own data written, its manifest about to be committed",
    "replicate": "entering the copy to its peer (sends posted next)",
    "replica-commit": "a received copy's data written, its manifest not yet committed",
    "agree": "entering the agreement on the step",
    "free": "the step agreed complete, freeing the older one",
}


def state_of(rank: int, step: int) -> dict[str, Any]:
    """The values rank ``rank`` saves at ``step`` (``step`` 0: zeros, a restore target)."""
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    w = torch.randn(256, 256, generator=g) if step else torch.zeros(256, 256)
    m = torch.randn(WORLD * 8192, generator=g)[rank * 8192:(rank + 1) * 8192] if step else torch.zeros(8192)
    return {"model": {"w": ckpt.Shard(w, (WORLD * 256, 256), (rank * 256, 0))},
            "optim": {"m": ckpt.FlatShard(m, (WORLD * 8192,), rank * 8192)},
            "train": {"step": step, "sample_index": step * 16, "sched": {"last": step}},
            "rng": ckpt.PerRank(bytes([rank, step % 256]) * 8)}


@dataclass(slots=True)
class Trial:
    """One trial: how it killed, what it interrupted, what the restore found."""

    mode: str  # "random" or the kill point
    node_loss: bool
    victim: int
    phase: str  # the victim's phase when it died
    complete_before: int  # newest step any rank saw agreed complete
    started: int  # newest step any rank started
    restored: int | None
    ok: bool
    error: str = ""


def _set_phase(buf: mmap.mmap, rank: int, phase: str) -> None:
    buf[rank] = PHASES.index(phase)


def _instrument(buf: mmap.mmap, rank: int, point: str | None, nth: int) -> None:
    """Record phases (and, for the victim of a targeted trial, die at the n-th arrival at ``point``)."""
    import ckpt._comm
    import ckpt.tier.snapshot as snapshot_mod
    import ckpt.tier.tier as tier_mod
    import ckpt.tier.transfer as transfer_mod
    from ckpt.storage.local import LocalStorage, LocalWriter

    save_mod = sys.modules["ckpt.save"]  # (``ckpt.save`` is also the function's name on the package)
    seen: Counter[str] = Counter()

    def at(p: str) -> None:
        seen[p] += 1
        if p == point and seen[p] == nth:
            os.kill(os.getpid(), signal.SIGKILL)

    save, exchange, commit_replica = save_mod.save, tier_mod.exchange, transfer_mod._commit
    comm_exchange, remove, write, commit = ckpt._comm.Comm.exchange, tier_mod.remove_step, LocalWriter.write, \
        LocalStorage.commit
    take, background = snapshot_mod.HostSnapshots.take, tier_mod.MemoryTier._background
    save_linked = tier_mod.save_linked

    def take_(self: Any, flat: Any, **kw: Any) -> Any:
        _set_phase(buf, rank, "snapshot")
        out = take(self, flat, **kw)
        at("snapshot")
        return out

    def save_linked_(*a: Any, **k: Any) -> Any:
        _set_phase(buf, rank, "write")
        at("write")
        return save_linked(*a, **k)

    def background_(self: Any, *a: Any) -> None:
        background(self, *a)
        _set_phase(buf, rank, "between")

    def save_(*a: Any, **k: Any) -> Any:
        _set_phase(buf, rank, "write")
        return save(*a, **k)

    def write_(self: Any, data: Any) -> None:
        if PHASES[buf[rank]] == "write":
            at("write")  # (a slot's step writes no data: its kill point is save_linked_)
        write(self, data)

    def commit_(self: Any, path: str, data: bytes, **k: Any) -> None:
        if PHASES[buf[rank]] == "write":
            at("own-commit")
        commit(self, path, data, **k)

    def exchange_(*a: Any, **k: Any) -> Any:
        _set_phase(buf, rank, "replicate")
        at("replicate")
        return exchange(*a, **k)

    def commit_replica_(*a: Any, **k: Any) -> Any:
        at("replica-commit")
        return commit_replica(*a, **k)

    def comm_exchange_(self: Any, obj: Any, reply: Any, **k: Any) -> Any:
        agreement = str(k.get("what", "")).startswith("memory tier agreement")
        if agreement:
            _set_phase(buf, rank, "agree")
            at("agree")
        out = comm_exchange(self, obj, reply, **k)
        if agreement:
            _set_phase(buf, rank, "free")
        return out

    def remove_(path: str) -> None:
        if PHASES[buf[rank]] == "free":
            at("free")
        remove(path)

    save_mod.save = save_
    tier_mod.save_linked = save_linked_
    snapshot_mod.HostSnapshots.take = take_  # type: ignore[method-assign]
    tier_mod.MemoryTier._background = background_  # type: ignore[method-assign]
    tier_mod.exchange = exchange_
    transfer_mod._commit = commit_replica_
    ckpt._comm.Comm.exchange = comm_exchange_  # type: ignore[method-assign]
    tier_mod.remove_step = remove_
    LocalWriter.write = write_  # type: ignore[method-assign]
    LocalStorage.commit = commit_  # type: ignore[method-assign]


def _saver(rank: int, init: str, shm: str, run_id: str, progress: str, buf: mmap.mmap, victim: int,
           point: str | None, nth: int) -> None:
    torch.set_num_threads(1)
    _set_phase(buf, rank, "startup")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    tier = MemoryTier(TierConfig("/kill-harness", run_id=run_id, shm_dir=shm, nodes=NODES, timeout=30))
    tier.reset(None)
    _instrument(buf, rank, point if rank == victim else None, nth)
    step, handle = 0, None
    while True:
        step += 1
        state = state_of(rank, step)  # "training": runs while the previous step's background work does
        if handle is not None and handle.result().complete:  # over now: one in flight, as in the trainer
            with open(progress, "a") as f:
                f.write(f"{rank} {step - 1}\n")
        with open(progress + ".started", "a") as f:
            f.write(f"{rank} {step}\n")
        handle = tier.save_async(step, state)
        _scribble(state)  # the caller changes its state as soon as the snapshot is taken


def _scribble(state: dict[str, Any]) -> None:
    """What an optimizer step does to a state just snapshotted: change it in place."""
    state["model"]["w"].local.fill_(float("nan"))
    state["optim"]["m"].local.add_(1.0)
    state["train"]["sched"]["last"] = -1
    state["train"]["step"] = -1


def _restorer(rank: int, world: int, shm: str, run_id: str, out: str) -> None:
    tier = MemoryTier(TierConfig("/kill-harness", run_id=run_id, shm_dir=shm, nodes=NODES, timeout=30))
    if rank % 2 == 0:  # one rank per node reads its copy through the slot mapped ahead, as the trainer does
        tier.pin_ahead("cpu")
    target = state_of(rank, 0)
    got = tier.restore(target)
    step = got.step if got is not None else None
    if step is not None:
        ref = state_of(rank, step)
        assert torch.equal(target["model"]["w"].local, ref["model"]["w"].local), f"rank {rank}: model torn"
        assert torch.equal(target["optim"]["m"].local, ref["optim"]["m"].local), f"rank {rank}: optimizer torn"
        value = got.value  # type: ignore[union-attr]
        assert value["train"] == {"step": step, "sample_index": step * 16, "sched": {"last": step}}, value["train"]
        assert value["rng"] == bytes([rank, step % 256]) * 8, f"rank {rank}: rng of another step"
    with open(out, "a") as f:
        f.write(f"{rank} {step}\n")


def _max_step(path: str) -> int:
    try:
        with open(path) as f:
            return max((int(line.split()[1]) for line in f if line.strip()), default=0)
    except OSError:
        return 0


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_trial(base: str, index: int, rng: random.Random, mode: str, node_loss: bool, nth: int = 2) -> Trial:
    """One trial under ``base`` (its own run id and files); see the module docstring."""
    shm, run_id = os.path.join(base, "shm"), f"kill-{index}"
    progress = os.path.join(base, f"progress-{index}")
    init = f"file://{os.path.join(base, f'pg-{index}')}"
    buf = mmap.mmap(-1, WORLD)  # shared with the forked children
    victim = rng.randrange(WORLD)
    point = None if mode == "random" else mode
    ctx = mp.start_processes(_saver, args=(init, shm, run_id, progress, buf, victim, point, nth), nprocs=WORLD,
                             start_method="fork", join=False)
    procs = ctx.processes
    deadline = time.monotonic() + 30
    try:
        if point is None:
            while (_max_step(progress + ".started") < 1 and time.monotonic() < deadline
                   and all(p.is_alive() for p in procs)):
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.6))
            phase = PHASES[buf[victim]]
            _kill([procs[victim].pid])
        else:
            while procs[victim].is_alive() and time.monotonic() < deadline:
                time.sleep(0.002)
            phase = PHASES[buf[victim]]
        procs[victim].join(5)
        node = victim // (WORLD // NODES)
        mates = [r for r in range(WORLD) if r // (WORLD // NODES) == node and r != victim]
        if node_loss:
            _kill([procs[r].pid for r in mates])
            shutil.rmtree(os.path.join(shm, f"ckpt-{run_id}", f"node-{node}"), ignore_errors=True)
        _kill([p.pid for p in procs])
    finally:
        _kill([p.pid for p in procs if p.is_alive()])
        for p in procs:
            p.join(5)
    complete, started = _max_step(progress), _max_step(progress + ".started")
    out = os.path.join(base, f"restored-{index}")
    trial = Trial(mode, node_loss, victim, phase, complete, started, None, False)
    try:
        run_ranks(WORLD, _restorer, shm, run_id, out)
        with open(out) as f:
            steps = {int(a): (None if b == "None" else int(b)) for a, b in (line.split() for line in f)}
        found = set(steps.values())
        if len(steps) != WORLD or len(found) != 1:
            raise AssertionError(f"ranks restored different steps: {steps}")
        trial.restored = found.pop()
        lowest = complete if complete else None
        if lowest is not None and (trial.restored is None or trial.restored < lowest):
            raise AssertionError(f"restored step {trial.restored}, but step {complete} was agreed complete")
        if trial.restored is not None and trial.restored > started:
            raise AssertionError(f"restored step {trial.restored}, newer than any started ({started})")
        trial.ok = True
    except Exception as e:  # noqa: BLE001 - reported per trial
        trial.error = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(os.path.join(shm, f"ckpt-{run_id}"), ignore_errors=True)
    return trial


def run_trials(base: str, *, random_trials: int, targeted_rounds: int, seed: int = 0) -> list[Trial]:
    """``random_trials`` random-delay kills and ``targeted_rounds`` kills at every kill point,
    alternating process and node loss."""
    rng = random.Random(seed)
    plan = [("random", i % 2 == 1) for i in range(random_trials)]
    plan += [(p, (i + r) % 2 == 0) for r in range(targeted_rounds) for i, p in enumerate(KILL_POINTS)]
    return [run_trial(base, i, rng, mode, node, nth=rng.choice([1, 2, 3])) for i, (mode, node) in enumerate(plan)]


def summarize(trials: list[Trial]) -> dict[str, Any]:
    """Counts by what was interrupted, by kind, and the failures."""
    return {"trials": len(trials), "ok": sum(t.ok for t in trials),
            "phases": dict(Counter(t.phase for t in trials)),
            "node_loss": sum(t.node_loss for t in trials),
            "restored_none": sum(t.restored is None for t in trials),
            "failures": [f"{t.mode} victim {t.victim} ({t.phase}): {t.error}" for t in trials if not t.ok]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.tier.kill_harness")
    p.add_argument("--trials", type=int, default=40, help="random-delay kills (default 40)")
    p.add_argument("--targeted-rounds", type=int, default=2, help="rounds of one kill per kill point (default 2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="ckpt-tier-kill-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    t0 = time.perf_counter()
    try:
        trials = run_trials(base, random_trials=args.trials, targeted_rounds=args.targeted_rounds, seed=args.seed)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    s = summarize(trials)
    print(f"{s['ok']}/{s['trials']} trials restored a consistent state in {time.perf_counter() - t0:.1f} s "
          f"({s['node_loss']} node losses, {s['restored_none']} with nothing to restore)")
    print(f"interrupted phases: {s['phases']}")
    for f in s["failures"]:
        print(f"FAIL {f}")
    return 0 if s["ok"] == s["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
