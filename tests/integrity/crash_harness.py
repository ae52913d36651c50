"""Crash harness: SIGKILL a process that checkpoints in a loop, then audit what it left behind.

One *trial*: fork a child that opens a ``CheckpointManager`` on ``root`` (startup gc, restore of the
newest checkpoint, bitwise check of what it restored), then saves steps ``latest+1, latest+2, ...``
forever, sync or async, with ``keep_last=2`` retention. Saved values are a deterministic function of
the step. The parent kills the child with SIGKILL, either after a random delay (``random`` trials) or
when the child reaches a chosen point of the save (``targeted`` trials: the child kills itself at the
n-th time it gets there). Trials chain on one root, like restarts of a training job.

After each kill the parent checks:

- every ``step-N`` directory that holds a manifest verifies deep, says step N, and loads (with
  verification) bitwise-equal to the values of step N;
- ``CheckpointManager(root).latest()`` exists once any step was committed, never goes back to an
  older step than the previous trial's latest, and loads bitwise-equal to its step's values;
- the startup gc of that manager leaves no incomplete directory behind (the killed save held no live lease).

The child records which phase it is in (plan, stage, write, data-fsync, commit, ...) in shared memory,
so every kill is attributed to the phase it interrupted. Instrumentation is installed in the child
only (after fork): the parent runs the unmodified library.
"""

from __future__ import annotations

import importlib
import mmap
import os
import random
import re
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import ckpt
from ckpt.errors import CheckpointError
from ckpt.manifest import MANIFEST_NAME

PHASES = ["fork", "startup", "restore", "fill", "lease", "plan", "stage", "write", "data-fsync", "commit",
          "committed", "retention", "gc", "staged-wait", "between"]
# Where a targeted trial makes the child kill itself (the n-th time it gets there).
KILL_POINTS = {
    "plan": "entering the collective planning phase",
    "stage": "entering the staging copy (async only)",
    "write": "before a write(2) of the data file (header or a piece)",
    "data-close": "before the data file's fsync/close",
    "before-rename": "manifest written to its temporary name and fsynced, not yet renamed",
    "after-rename": "manifest renamed into place, directory not yet fsynced",
    "lease-delete": "after the commit, before the save's lease is removed",
    "gc": "entering retention gc after a commit",
    "rmtree": "retention gc: old manifest deleted, its data files not yet removed",
}
ASYNC_ONLY = {"stage"}
KEEP_LAST = 2
STEP_RE = re.compile(r"^step-(\d+)$")
EXIT_BAD_RESTORE = 3
EXIT_ERROR = 4


def is_lease_race(e: BaseException) -> bool:
    """The signature of the lease/retention race (see ``_child``)."""
    return isinstance(e, ckpt.StorageError) and "/.writing: atomic commit failed (No such file or directory)" in str(e)


# ------------------------------------------------------------------------------------------------
# the state: a deterministic function of the step


def expected(step: int) -> dict[str, Any]:
    """The values saved at ``step`` (about 200 KiB of tensors, plus objects)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {
            "w": torch.randn(128, 96, generator=g),
            "b": torch.randn(96, generator=g).bfloat16(),
            "emb": torch.randint(0, 1 << 30, (64, 16), generator=g),
        },
        "opt": {"m": torch.randn(128 * 96, generator=g), "count": torch.tensor(step)},
        "step": step,
        "meta": {"lr": 1e-3 * step, "tag": f"step{step}"},
    }


def fill(state: dict[str, Any], step: int) -> None:
    """Overwrite ``state`` in place with the values of ``step`` (the same tensor objects every
    step, as a training loop does: an async save must have staged the previous values)."""
    new = expected(step)
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(state.get(k), dict):
            for kk, vv in v.items():
                if isinstance(vv, torch.Tensor):
                    state[k][kk].copy_(vv)
                else:
                    state[k][kk] = vv
        else:
            state[k] = v


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested states."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def blank() -> dict[str, Any]:
    """A load target for the state: zeroed tensors of the right shapes; objects to be filled."""
    out = expected(0)
    for v in out.values():
        if isinstance(v, dict):
            for kk, vv in v.items():
                if isinstance(vv, torch.Tensor):
                    v[kk] = torch.zeros_like(vv)
    out["step"] = None
    out["meta"] = None
    return out


# ------------------------------------------------------------------------------------------------
# the child


class _Probe:
    """Phase recorder and self-killer installed in the child."""

    def __init__(self, shm: mmap.mmap, kill_point: str | None, kill_at: int):
        self.shm = shm
        self.kill_point = kill_point
        self.kill_at = kill_at
        self.hits: Counter[str] = Counter()
        self.renamed = False

    def phase(self, name: str) -> None:
        self.shm[0] = PHASES.index(name)

    def count_lease_race(self) -> None:
        self.shm[2] = min(self.shm[2] + 1, 255)

    def point(self, name: str) -> None:
        self.hits[name] += 1
        if name == self.kill_point and self.hits[name] == self.kill_at:
            self.shm[1] = 1  # "killed at the targeted point"
            os.kill(os.getpid(), signal.SIGKILL)


def _wrap(owner: Any, attr: str, before: Callable[..., None], after: Callable[..., None] | None = None) -> None:
    inner = getattr(owner, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        out = inner(*args, **kwargs)
        if after is not None:
            after(*args, **kwargs)
        return out

    setattr(owner, attr, wrapper)


def _instrument(p: _Probe) -> None:
    # importlib: ``ckpt.save`` and ``ckpt.async_save`` are also the names of functions on the package.
    async_save_mod = importlib.import_module("ckpt.async_save")
    manager_mod = importlib.import_module("ckpt.manager")
    save_mod = importlib.import_module("ckpt.save")
    local_mod = importlib.import_module("ckpt.storage.local")

    def plan(*a: Any, **k: Any) -> None:
        p.phase("plan")
        p.point("plan")

    _wrap(save_mod, "prepare", plan)
    _wrap(async_save_mod, "prepare", plan)

    def stage(*a: Any, **k: Any) -> None:
        p.phase("stage")
        p.point("stage")

    _wrap(async_save_mod.AsyncSaver, "_stage", stage)

    def write(*a: Any, **k: Any) -> None:
        p.phase("write")
        p.point("write")

    _wrap(local_mod.LocalWriter, "write", write)

    def close(*a: Any, **k: Any) -> None:
        p.phase("data-fsync")
        p.point("data-close")

    _wrap(local_mod.LocalWriter, "close", close)

    def commit(_self: Any, path: str, data: bytes, **_k: Any) -> None:
        p.phase("commit" if path == MANIFEST_NAME else "lease")

    def committed(_self: Any, path: str, data: bytes, **_k: Any) -> None:
        if path == MANIFEST_NAME:
            p.phase("committed")

    _wrap(local_mod.LocalStorage, "commit", commit, committed)

    def naming(real: Callable[..., None]) -> Callable[..., None]:
        """``os.replace`` (overwriting commits) or ``os.link`` (exclusive ones) with the kill point
        before the manifest gets its name."""

        def call(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            if str(dst).endswith(MANIFEST_NAME):
                p.point("before-rename")
                real(src, dst, *a, **k)
                p.renamed = True
                return
            real(src, dst, *a, **k)

        return call

    os.replace = naming(os.replace)  # type: ignore[assignment]  # child process only
    os.link = naming(os.link)  # type: ignore[assignment]

    def fsync_dir(*a: Any, **k: Any) -> None:
        if p.renamed:
            p.renamed = False
            p.point("after-rename")

    _wrap(local_mod, "_fsync_dir", fsync_dir)

    def retention(*a: Any, **k: Any) -> None:
        p.phase("retention")

    _wrap(manager_mod.CheckpointManager, "_after_commit", retention)

    lease_mod = importlib.import_module("ckpt._lease")

    def delete(_self: Any, path: str) -> None:
        if lease_mod.is_lease(path):  # each rank's own lease (ckpt._lease), dropped after the commit
            p.point("lease-delete")

    _wrap(local_mod.LocalStorage, "delete", delete)

    def gc(*a: Any, **k: Any) -> None:
        p.phase("gc")
        p.point("gc")

    _wrap(manager_mod, "gc", gc)

    def nothing(*a: Any, **k: Any) -> None:
        pass

    def deleted(_self: Any, path: str, *a: Any, **k: Any) -> None:
        if path.endswith(MANIFEST_NAME):
            p.point("rmtree")

    _wrap(local_mod.LocalStorage, "delete", nothing, deleted)


def _child(root: str, mode: str, p: _Probe) -> None:
    torch.set_num_threads(1)
    _instrument(p)
    p.phase("startup")
    mgr = ckpt.CheckpointManager(root, keep_last=KEEP_LAST, async_save=mode == "async")
    state = expected(0)
    p.phase("restore")
    start = mgr.restore(state)
    if start is not None and not same(state, expected(start)):
        print(f"crash harness child: restored step {start} differs from what was saved", file=sys.stderr)
        os._exit(EXIT_BAD_RESTORE)
    step = (start or 0) + 1
    while True:
        p.phase("fill")
        fill(state, step)
        try:
            h = mgr.save(step, state)
        except CheckpointError as e:
            # A bug this harness found (docs/RELIABILITY.md, fixed since by spare_after_step): the
            # previous async save's retention gc could delete this step's directory while its lease
            # was being written. Counted (the suite asserts zero) and skipped, so that a recurrence
            # shows up as a number rather than ending the trial chain.
            if not is_lease_race(e):
                raise
            p.count_lease_race()
            step += 1
            continue
        if mode == "async":
            assert isinstance(h, ckpt.SaveHandle)
            p.phase("staged-wait")
            h.staged()
        p.phase("between")
        step += 1


# ------------------------------------------------------------------------------------------------
# the parent


@dataclass(slots=True)
class Trial:
    """What one kill did and what the audit found."""

    mode: str  # sync | async
    kind: str  # random | targeted
    point: str | None  # targeted: the kill point
    delay: float  # random: seconds before the kill
    phase: str  # phase the child was in when it died
    reached: bool  # targeted: the child died at the point (False: it never got there in time)
    latest_before: int | None
    latest_after: int | None
    committed: int  # step directories with a manifest, all verified deep and loaded
    incomplete: int  # step directories holding files but no manifest, before the startup gc
    failures: list[str] = field(default_factory=list)
    empty_dirs: int = 0  # empty step directories under root after the audit (gc does not see them)
    lease_races: int = 0  # saves that failed with the reported lease/retention race (child went on)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "kind": self.kind, "point": self.point, "delay": round(self.delay, 4),
                "phase": self.phase, "reached": self.reached, "latest_before": self.latest_before,
                "latest_after": self.latest_after, "committed": self.committed, "incomplete": self.incomplete,
                "failures": self.failures, "empty_dirs": self.empty_dirs, "lease_races": self.lease_races}


def _steps(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = STEP_RE.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def audit(root: str, latest_before: int | None) -> tuple[int | None, int, int, list[str]]:
    """Check ``root`` after a kill. Returns (latest step, committed dirs, incomplete dirs, failures)."""
    failures: list[str] = []
    committed = incomplete = 0
    for step, url in _steps(root):
        if not os.path.exists(os.path.join(url, MANIFEST_NAME)):
            incomplete += _has_files(url)  # empty ones are counted apart (empty_step_dirs)
            continue
        committed += 1
        rep = ckpt.verify(url, deep=True)
        if not rep.ok:
            failures.append(f"{url}: has a manifest but does not verify: {[p.message for p in rep.problems]}")
            continue
        try:
            if ckpt.inspect(url).step != step:
                failures.append(f"{url}: manifest says step {ckpt.inspect(url).step}")
            out = ckpt.load(blank(), url, verify=True)
        except CheckpointError as e:
            failures.append(f"{url}: verifies but does not load: {e}")
            continue
        if not same(out, expected(step)):
            failures.append(f"{url}: loads values that differ from what step {step} saved")
    mgr = ckpt.CheckpointManager(root, keep_last=KEEP_LAST, async_save=False)  # startup gc runs here
    url = mgr.latest()
    latest = None
    if url is None:
        if latest_before is not None:
            failures.append(f"latest() is None after step {latest_before} had been committed")
    else:
        m = STEP_RE.match(os.path.basename(url))
        latest = int(m.group(1)) if m else None
        if latest is None:
            failures.append(f"latest() = {url} is not a step directory")
        else:
            if latest_before is not None and latest < latest_before:
                failures.append(f"latest() went back from step {latest_before} to {latest}")
            try:
                out = ckpt.load(blank(), url, verify=True)
                if not same(out, expected(latest)):
                    failures.append(f"latest() = {url} loads values that differ from step {latest}")
            except CheckpointError as e:
                failures.append(f"latest() = {url} does not load: {e}")
    # gc lists files, so a directory the kill left empty (created, nothing written yet) stays; it
    # holds nothing and is no checkpoint. Anything else without a manifest must be gone.
    left = [u for _s, u in _steps(root) if not os.path.exists(os.path.join(u, MANIFEST_NAME)) and _has_files(u)]
    if left:
        failures.append(f"startup gc left incomplete directories: {left}")
    return latest, committed, incomplete, failures


def _has_files(d: str) -> bool:
    return any(files for _dirpath, _dirs, files in os.walk(d))


def empty_step_dirs(root: str) -> int:
    """Step directories holding no file at all (left by a kill between mkdir and the first write)."""
    return sum(not _has_files(u) for _s, u in _steps(root))


def run_trial(root: str, mode: str, rng: random.Random, latest_before: int | None, *,
              point: str | None = None, max_delay: float = 0.25, point_timeout: float = 20.0) -> Trial:
    """Fork a saving child, kill it (after a random delay, or at ``point``), audit ``root``."""
    shm = mmap.mmap(-1, 16)
    kill_at = rng.randint(1, 4) if point else 0
    probe = _Probe(shm, point, kill_at)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child never returns
        code = EXIT_ERROR
        try:
            _child(root, mode, probe)
        except BaseException:  # noqa: BLE001 - report anything, then leave without running atexit
            traceback.print_exc()
        finally:
            os._exit(code)
    delay = 0.0
    if point is None:
        delay = rng.uniform(0.0, max_delay)
        time.sleep(delay)
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
    else:
        deadline = time.monotonic() + point_timeout
        done, status = 0, 0
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.002)
        if not done:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
    phase = PHASES[shm[0]]
    reached = bool(shm[1])
    failures: list[str] = []
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
        what = "restored values differ from the saved ones" if code == EXIT_BAD_RESTORE else "raised"
        failures.append(f"child exited by itself with status {code} ({what}) in phase {phase}")
    if point is not None and not reached:
        failures.append(f"child never reached kill point {point!r} (hit {kill_at}) within {point_timeout} s")
    latest, committed, incomplete, audit_failures = audit(root, latest_before)
    return Trial(mode, "random" if point is None else "targeted", point, delay, phase, reached,
                 latest_before, latest, committed, incomplete, failures + audit_failures, empty_step_dirs(root),
                 shm[2])


def run_trials(root: str, *, random_trials: int, targeted_rounds: int = 1, seed: int = 0,
               max_delay: float = 0.25, log: Callable[[str], None] | None = None) -> list[Trial]:
    """``random_trials`` random kills (alternating sync/async), then ``targeted_rounds`` rounds of one
    targeted kill per (kill point, mode). All trials chain on ``root``."""
    rng = random.Random(seed)
    trials: list[Trial] = []
    latest: int | None = None
    plan: list[tuple[str, str | None]] = [("sync" if i % 2 == 0 else "async", None) for i in range(random_trials)]
    for _ in range(targeted_rounds):
        for point in KILL_POINTS:
            for mode in ("sync", "async"):
                if point in ASYNC_ONLY and mode == "sync":
                    continue
                plan.append((mode, point))
    for i, (mode, point) in enumerate(plan):
        t = run_trial(root, mode, rng, latest, point=point, max_delay=max_delay)
        latest = t.latest_after if t.latest_after is not None else latest
        trials.append(t)
        if log is not None and (t.failures or (i + 1) % 50 == 0 or i + 1 == len(plan)):
            log(f"trial {i + 1}/{len(plan)}: {t.kind} {t.mode} {t.point or ''} phase={t.phase} "
                f"latest={t.latest_after} failures={t.failures}")
    return trials


def summarize(trials: list[Trial]) -> dict[str, Any]:
    """Counts for docs/RELIABILITY.md."""
    return {
        "trials": len(trials),
        "random": sum(t.kind == "random" for t in trials),
        "targeted": sum(t.kind == "targeted" for t in trials),
        "by_mode": dict(Counter(t.mode for t in trials)),
        "kills_by_phase": dict(sorted(Counter(t.phase for t in trials if t.kind == "random").items())),
        "kills_by_point": dict(Counter(t.point for t in trials if t.kind == "targeted" and t.reached)),
        "checkpoints_audited": sum(t.committed for t in trials),
        "partial_saves_seen": sum(t.incomplete for t in trials),
        "latest_step": max((t.latest_after or 0) for t in trials) if trials else None,
        "empty_dirs_left": trials[-1].empty_dirs if trials else 0,
        "lease_races": sum(t.lease_races for t in trials),
        "trials_failed": sum(bool(t.failures) for t in trials),
        "failures": [f for t in trials for f in t.failures][:20],
    }
