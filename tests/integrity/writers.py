"""Concurrent writers of every kind into one destination, each in a forked process, with faults.

Used by tests/integrity/test_ownership*.py. A *round* forks one process per writer (save, async_save,
zarr save, reshard, import of a ``torch.save`` file); they meet at a barrier, then write into the same
destination at once (each write sleeps a random few hundred microseconds, so their steps interleave).
A writer may be given a fault: ``fail`` (the storage raises after N bytes) or ``kill`` (``os._exit``
after N bytes: no clean-up at all). Every child logs each file it creates and deletes (the
instrumentation is installed after fork: the parent runs the unmodified library), so the parent can
check ownership exactly: who deleted what, and what each writer left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import ckpt
from ckpt.errors import CheckpointError, CheckpointExistsError, StorageError
from ckpt.layout import Layout

KINDS = ("save", "async_save", "zarr", "reshard", "import")
FAULTS = ("none", "fail", "kill")
SRC_SEED, PT_SEED = 7001, 7002
KILLED = 86


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g)}


@dataclass(slots=True)
class Env:
    """The sources of the reshard and import writers (made once)."""

    src: str  # a committed ckpt checkpoint of state(SRC_SEED)
    pt: str  # a torch.save file of state(PT_SEED)


def make_env(base: str) -> Env:
    src, pt = os.path.join(base, "src"), os.path.join(base, "m.pt")
    ckpt.save(state(SRC_SEED), src, step=SRC_SEED)
    torch.save(state(PT_SEED), pt)
    return Env(src, pt)


def expected(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """What a checkpoint committed by this writer holds."""
    return state({"reshard": SRC_SEED, "import": PT_SEED}.get(kind, seed))


def write(kind: str, seed: int, env: Env, dst: str, overwrite: bool) -> Any:
    """One writer, in this process."""
    from ckpt.convert import import_checkpoint
    from ckpt.resharders.reshard import reshard

    if kind == "save":
        return ckpt.save(state(seed), dst, step=seed, overwrite=overwrite)
    if kind == "async_save":
        return ckpt.async_save(state(seed), dst, step=seed, overwrite=overwrite).done(timeout=60)
    if kind == "zarr":
        return ckpt.save(state(seed), dst, step=seed, overwrite=overwrite, data_format="zarr")
    if kind == "reshard":
        return reshard(env.src, dst, Layout.parse("dp=2"), overwrite=overwrite, workers=2)
    if kind == "import":
        return import_checkpoint(env.pt, dst, overwrite=overwrite)
    raise AssertionError(kind)


def load(dst: str) -> dict[str, torch.Tensor]:
    return ckpt.load({"w": torch.zeros(8, 6), "b": torch.zeros(6)}, dst, verify=True)


@dataclass(slots=True)
class Outcome:
    kind: str
    seed: int
    fault: str
    result: str = "killed"  # ok | exists | error:<type> | killed | crash:<repr>
    created: set[str] = field(default_factory=set)  # paths relative to dst
    deleted: set[str] = field(default_factory=set)
    listed: set[str] = field(default_factory=set)  # the files of every manifest it committed (adopted ones too)


def _instrument(dst: str, log: str, fault: str, nbytes: int, jitter: int) -> None:
    """In the child: log creations and deletions under ``dst``; inject the fault; interleave."""
    from ckpt.storage import local

    root = os.path.realpath(dst)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    rnd = random.Random(jitter)
    written = [0]

    def note(op: str, full: str) -> None:
        rel = os.path.relpath(os.path.realpath(full), root)
        if not rel.startswith(".."):
            os.write(fd, f"{op} {rel}\n".encode())

    init, wr, abort, delete = (local.LocalWriter.__init__, local.LocalWriter.write, local.LocalWriter.abort,
                               local.LocalStorage.delete)

    def init_(self: Any, full: str) -> None:
        note("C", full)
        init(self, full)

    def write_(self: Any, data: Any) -> None:
        time.sleep(rnd.random() * 0.0005)
        n = memoryview(data).nbytes
        if fault != "none" and written[0] + n > nbytes:
            if fault == "kill":
                os._exit(KILLED)
            raise StorageError(f"{self.full}: injected failure after {written[0]} bytes")
        written[0] += n
        wr(self, data)

    def abort_(self: Any) -> None:
        note("D", self.full)
        abort(self)

    def delete_(self: Any, path: str) -> None:
        note("D", os.path.join(self.root, path))
        delete(self, path)

    from ckpt import _transaction as transaction

    commit = transaction.commit_manifest

    def commit_(storage: Any, data: bytes, **kw: Any) -> Any:
        m = commit(storage, data, **kw)
        if os.path.realpath(getattr(storage, "root", "")) == root:  # (a manifest committed at dst: its files)
            for f in m.files:
                os.write(fd, f"L {f}\n".encode())
        return m

    transaction.commit_manifest = commit_  # type: ignore[assignment]
    local.LocalWriter.__init__ = init_  # type: ignore[method-assign]
    local.LocalWriter.write = write_  # type: ignore[method-assign]
    local.LocalWriter.abort = abort_  # type: ignore[method-assign]
    local.LocalStorage.delete = delete_  # type: ignore[method-assign]


def _child(kind: str, seed: int, env: Env, dst: str, overwrite: bool, fault: str, nbytes: int, jitter: int,
           barrier: Any, log: str, result: str) -> None:
    torch.set_num_threads(1)
    out = "crash:no result"
    try:
        _instrument(dst, log, fault, nbytes, jitter)
        barrier.wait(30)
        write(kind, seed, env, dst, overwrite)
        out = "ok"
    except CheckpointExistsError:
        out = "exists"
    except CheckpointError as e:
        out = f"error:{type(e).__name__}:{e}"
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        out = f"crash:{e!r}"
    finally:
        with open(result, "w") as f:
            f.write(out)
        os._exit(0)


def run_round(env: Env, dst: str, writers: list[tuple[str, int, str, int]], *, overwrite: bool,
              scratch: str) -> list[Outcome]:
    """Run ``writers`` (kind, seed, fault, fault after n bytes) at once into ``dst``, each forked."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(writers))
    procs, outs = [], []
    for i, (kind, seed, fault, nbytes) in enumerate(writers):
        log, res = os.path.join(scratch, f"{seed}-{i}.log"), os.path.join(scratch, f"{seed}-{i}.res")
        p = ctx.Process(target=_child, args=(kind, seed, env, dst, overwrite, fault, nbytes, seed * 31 + i,
                                             barrier, log, res))
        p.start()
        procs.append((p, log, res))
        outs.append(Outcome(kind, seed, fault))
    for (p, log, res), o in zip(procs, outs, strict=True):
        p.join(90)
        if p.is_alive():
            p.kill()
            p.join()
            raise AssertionError(f"writer {o.kind} hung")
        if os.path.exists(res):
            with open(res) as f:
                o.result = f.read()
        else:
            assert p.exitcode == KILLED, (o, p.exitcode)
        if os.path.exists(log):
            with open(log) as f:
                for line in f:
                    op, path = line.rstrip("\n").split(" ", 1)
                    {"C": o.created, "D": o.deleted, "L": o.listed}[op].add(path)
    return outs


def files_under(d: str) -> set[str]:
    out = set()
    for dirpath, _dirs, names in os.walk(d):
        for n in names:
            out.add(os.path.relpath(os.path.join(dirpath, n), d))
    return out
