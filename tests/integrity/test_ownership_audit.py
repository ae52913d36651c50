"""Ownership audit: every writer and deleter among adversarial surroundings (docs/RELIABILITY.md).

The rules (DESIGN.md, "The commit transaction", "Ownership", "Memory tier"): a writer owns exactly the
files it created in this process and a failed one removes only those; a directory being written is
leased before any byte goes in; leases and temp files are never gc's to take; gc removes only what
provably is an unfinished save of ours and reports (keeps) what it cannot read; nothing outside a
checkpoint or the memory tier is ever opened for writing or deleted; the tier never goes through a link.

Generated sequences (hypothesis state machines) run saves (sync, async, zarr, overwrite), manager
saves with retention, gc, writers killed (``os._exit``) or paused at their k-th file write in a forked
child (gc runs in the parent meanwhile), reshards and Hugging Face exports into output directories
that already hold user files, and memory-tier saves / restores / resets / gc, while planting, before
and between the steps: foreign files whose names look like ours (``.tmp``, manifest-like, data-like,
zarr-like, marker-like), links inside checkpoint, output and tier directories to files and
directories outside (and to a sibling checkpoint), a live lease of another writer, damaged and
newer-format checkpoints. After every step: every foreign entry is still there, byte-identical (and
its mtime), the tree outside the checkpoint root / outputs / tier is unchanged, every committed
checkpoint still loads bitwise, and every error was a ``CheckpointError``.

Below them, one explicit example per bug the machines found.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ckpt
from ckpt import _lease as lease
from ckpt import _transaction as transaction
from ckpt.errors import CheckpointError, CheckpointExistsError, StorageError
from ckpt.hf.convert import INDEX_NAME, export_hf
from ckpt.layout import Layout
from ckpt.manager import gc, list_checkpoints, step_dir
from ckpt.manifest import MANIFEST_NAME
from ckpt.resharders.reshard import reshard
from ckpt.storage import local
from tests.integrity.writers import state
from tests.manifest_edit import edit_manifest

KILLED = 87
DAY = 86400.0


def loads(url: str, seed: int) -> bool:
    got = ckpt.load({"w": torch.zeros(8, 6), "b": torch.zeros(6)}, url, verify=True)
    want = state(seed)
    return all(torch.equal(got[k], want[k]) for k in want)


# --- the surroundings: foreign entries and the outside tree, snapshotted ------------------------------

def entry(path: str) -> tuple[Any, ...]:
    """What must not change about one foreign entry: a file's bytes and mtime, a link's target."""
    st_ = os.lstat(path)
    if stat.S_ISLNK(st_.st_mode):
        return ("link", os.readlink(path))
    if stat.S_ISDIR(st_.st_mode):
        return ("dir",)
    with open(path, "rb") as f:
        return ("file", f.read(), st_.st_mtime_ns)


def tree(path: str) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``path`` (links not followed)."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, path)] = entry(p)
    return out


class Surroundings:
    """A base directory with ``outside/`` (what links point to: must never change) and the areas the
    writers own (``root/``, ``out/``, ``shm/``); foreign entries planted inside those areas are
    recorded and checked."""

    AREAS = ("root", "out", "shm")

    def __init__(self, prefix: str) -> None:
        self.base = tempfile.mkdtemp(prefix=prefix)
        self.outside = os.path.join(self.base, "outside")
        for a in self.AREAS:
            os.makedirs(os.path.join(self.base, a))
        os.makedirs(os.path.join(self.outside, "dir", "data"))
        self._write(os.path.join(self.outside, "precious.bin"), b"precious " * 64)
        self._write(os.path.join(self.outside, "dir", "data", "00000-0123456789ab.safetensors"), b"not yours")
        self._write(os.path.join(self.outside, "dir", MANIFEST_NAME), b"a manifest of someone else")
        ckpt.save(state(999), os.path.join(self.outside, "ckpt"), step=999)
        self.outside_tree = tree(self.outside)
        self.top = sorted(os.listdir(self.base))
        self.foreign: dict[str, tuple[Any, ...]] = {}

    @staticmethod
    def _write(path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def path(self, area: str, *parts: str) -> str:
        return os.path.join(self.base, area, *parts)

    def _free(self, path: str) -> bool:
        """Whether ``path`` can be planted: nothing there, and no link or file on the way."""
        cur = os.path.dirname(path)
        while len(cur) > len(self.base):
            if os.path.islink(cur) or (os.path.lexists(cur) and not os.path.isdir(cur)):
                return False
            cur = os.path.dirname(cur)
        return not os.path.lexists(path)

    def plant_file(self, path: str, data: bytes, *, aged: bool = False) -> None:
        if not self._free(path):
            return
        self._write(path, data)
        if aged:  # old enough for any age-based rule to call it stale
            t = time.time() - 3 * DAY
            os.utime(path, (t, t))
        self.foreign[path] = entry(path)

    def plant_link(self, path: str, target: str) -> None:
        if not self._free(path):
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(target, path)
        self.foreign[path] = entry(path)

    def freeze(self, d: str) -> None:
        """Every entry now under ``d`` is foreign from here on (a damaged checkpoint: not ours to touch)."""
        for rel in tree(d):
            p = os.path.join(d, rel)
            if not os.path.isdir(p) or os.path.islink(p):
                self.foreign[p] = entry(p)

    def check(self) -> None:
        for p, e in self.foreign.items():
            assert os.path.lexists(p), f"foreign {p} was deleted"
            assert entry(p) == e, f"foreign {p} was changed"
        assert tree(self.outside) == self.outside_tree, "the tree outside the writers' areas changed"
        assert sorted(os.listdir(self.base)) == self.top, "something was created next to the writers' areas"

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def typed(fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, or the CheckpointError it raised; any other exception fails the test."""
    try:
        return fn()
    except CheckpointError as e:
        return e


# --- a writer hooked at its k-th file write: raising (here), killed or paused (in a forked child) ------

@contextlib.contextmanager
def at_kth_write(k: int, act: Callable[[list[str]], None]) -> Iterator[list[str]]:
    """Call ``act(made)`` at the k-th file write of what runs inside (a data file write, or an atomic
    commit: a manifest, a lease, a marker); ``made``: the files created so far (yielded too)."""
    n = [0]
    made: list[str] = []

    def at_write() -> None:
        n[0] += 1
        if n[0] == k:
            act(made)

    init, write, commit = local.LocalWriter.__init__, local.LocalWriter.write, local.LocalStorage.commit

    def init_(self: Any, full: str) -> None:
        init(self, full)
        made.append(full)

    def write_(self: Any, data: Any) -> None:
        at_write()
        write(self, data)

    def commit_(self: Any, path: str, data: bytes, **kw: Any) -> None:
        at_write()
        commit(self, path, data, **kw)
        made.append(os.path.join(self.root, path))

    local.LocalWriter.__init__ = init_  # type: ignore[method-assign]
    local.LocalWriter.write = write_  # type: ignore[method-assign]
    local.LocalStorage.commit = commit_  # type: ignore[method-assign]
    try:
        yield made
    finally:
        local.LocalWriter.__init__ = init  # type: ignore[method-assign]
        local.LocalWriter.write = write  # type: ignore[method-assign]
        local.LocalStorage.commit = commit  # type: ignore[method-assign]


def failing(k: int) -> contextlib.AbstractContextManager[list[str]]:
    """The k-th file write raises an injected StorageError."""
    def fail(_made: list[str]) -> None:
        raise StorageError("injected failure")
    return at_kth_write(k, fail)


class Forked:
    """``job`` in a forked child whose k-th file write (:func:`at_kth_write`) kills it (``kill``) or
    blocks it until :meth:`resume` (``pause``; :meth:`paused` then gives the files it created so far)."""

    def __init__(self, job: Callable[[], Any], k: int, mode: str) -> None:
        self.res_r, res_w = os.pipe()
        self.hit_r, hit_w = os.pipe()
        go_r, self.go_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            out = "crash:no result"
            for fd in (self.res_r, self.hit_r, self.go_w):  # (a parent gone: the pause reads EOF and goes on)
                os.close(fd)
            try:
                torch.set_num_threads(1)

                def act(made: list[str]) -> None:
                    if mode == "kill":
                        os._exit(KILLED)
                    os.write(hit_w, json.dumps([p for p in made if os.path.exists(p)]).encode() + b"\n")
                    os.read(go_r, 1)

                with at_kth_write(k, act):
                    job()
                out = "ok"
            except CheckpointExistsError:
                out = "exists"
            except CheckpointError as e:
                out = f"error:{type(e).__name__}:{e}"
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
                out = f"crash:{e!r}"
            finally:
                os.write(res_w, out.encode()[:4000])
                os._exit(0)
        os.close(res_w)
        os.close(hit_w)
        os.close(go_r)

    def paused(self, timeout: float = 30.0) -> list[str] | None:
        """The files the child created, once it reached its k-th write (None: it finished or died first)."""
        import select

        got = b""
        while not got.endswith(b"\n"):
            ready, _, _ = select.select([self.hit_r, self.res_r], [], [], timeout)
            if self.hit_r not in ready:
                return None
            b = os.read(self.hit_r, 65536)
            if not b:
                return None
            got += b
        return [str(p) for p in json.loads(got)]

    def resume(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.go_w, b"g")

    def result(self) -> str:
        self.resume()
        chunks = []
        while b := os.read(self.res_r, 4096):
            chunks.append(b)
        _, status = os.waitpid(self.pid, 0)
        for fd in (self.res_r, self.hit_r, self.go_w):
            os.close(fd)
        if not chunks:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == KILLED, status
            return "killed"
        return b"".join(chunks).decode()


# --- machine 1: a manager root ----------------------------------------------------------------------

STEPS = st.integers(1, 6)
STEP_FOREIGN = ["notes.tmp.42", "results.csv.tmp.7.1", "manifest.msgpack.bak", "manifest.msgpack.orig",
                "data/train.jsonl", "data/00000-0123456789ab.safetensors.tmp", "data/00001-xyz.safetensors",
                "zarr/notes.md", "zarr-0123456789ab/README", ".reshard/notes.done", ".writing-notes", "README.md"]
ROOT_FOREIGN = ["notes.txt", "step-0000000009.tmp", "step-0000000003.bak/data/00000-0123456789ab.safetensors",
                "step-x/manifest.msgpack"]
LINKS = ["data/00000-abcdef012345.safetensors", "zarr-abcdef012345/zarr.json", "data/extra", "notes", "data",
         "manifest.msgpack.tmp.1.2"]
TARGETS = ["file", "dir", "sibling"]
WRITERS = ["save", "async", "zarr", "manager"]


def write_job(kind: str, url: str, seed: int, root: str, overwrite: bool) -> Callable[[], Any]:
    """One writer of ``state(seed)`` at ``url`` (a step directory of ``root``)."""
    def job() -> Any:
        if kind == "save":
            return ckpt.save(state(seed), url, step=seed, overwrite=overwrite)
        if kind == "async":
            return ckpt.async_save(state(seed), url, step=seed, overwrite=overwrite).done(timeout=60)
        if kind == "zarr":
            return ckpt.save(state(seed), url, step=seed, overwrite=overwrite, data_format="zarr")
        mgr = ckpt.CheckpointManager(root, keep_last=None, async_save=False, gc_on_start=False)
        try:
            return mgr.save(int(os.path.basename(url).split("-")[1]), state(seed), overwrite=overwrite)
        finally:
            mgr.close()
    return job


class RootAudit(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = Surroundings("ckpt-audit-root-")
        self.root = self.s.path("root")
        self.committed: dict[int, int] = {}  # step -> seed of what its committed checkpoint holds
        self.protected: dict[int, str] = {}  # damaged ("flip") or newer-format ("newer") steps: kept as they are
        self.seed = 100
        self.others: list[lease.Lease] = []  # live leases of "another writer" (this process)

    def teardown(self) -> None:
        for held in self.others:
            held.release()
        self.s.close()

    def url(self, step: int) -> str:
        return os.path.join(self.root, step_dir(step))

    def _next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def _settle(self, result: Any, step: int, seed: int) -> None:
        """Record what a writer of ``seed`` at ``step`` did (a manifest or a handle's: committed)."""
        if isinstance(result, CheckpointError):
            return
        assert isinstance(result, ckpt.Manifest) or result == "ok", result
        self.committed[step] = seed
        self.protected.pop(step, None)

    def _held(self) -> set[str]:
        """The files now in the directories another live writer holds a lease on (gc keeps all of them)."""
        out: set[str] = set()
        for held in self.others:
            out |= {os.path.join(held.url, f) for f in tree(held.url) if os.path.isfile(os.path.join(held.url, f))}
        return out

    def _gc(self, keep_last: int | None) -> None:
        held = self._held()
        typed(lambda: gc(self.root, keep_last=keep_last))
        gone = sorted(f for f in held if not os.path.lexists(f))
        assert not gone, f"gc deleted files in a directory a live writer holds: {gone}"

    def _dropped(self, keep_last: int | None) -> None:
        """After gc / retention: committed steps may be gone only when retention dropped them (never the
        newest one); protected ones never."""
        newest = max(self.committed) if self.committed else None
        for step in sorted(self.committed):
            if not os.path.exists(os.path.join(self.url(step), MANIFEST_NAME)):
                assert keep_last is not None and step != newest, (step, keep_last)
                del self.committed[step]
        for step in self.protected:
            assert os.path.lexists(os.path.join(self.url(step), MANIFEST_NAME)), step

    # -- writers

    @rule(kind=st.sampled_from(WRITERS), step=STEPS, overwrite=st.booleans())
    def write(self, kind: str, step: int, overwrite: bool) -> None:
        if step in self.protected:
            overwrite = False  # (write_over_damaged replaces one)
        seed = self._next_seed()
        got = typed(write_job(kind, self.url(step), seed, self.root, overwrite))
        if step in self.protected:
            assert isinstance(got, CheckpointError), got
        self._settle(got, step, seed)

    @rule(step=STEPS, keep_last=st.integers(1, 3), async_save=st.booleans())
    def manager_save(self, step: int, keep_last: int, async_save: bool) -> None:
        seed = self._next_seed()

        def run() -> Any:
            mgr = ckpt.CheckpointManager(self.root, keep_last=keep_last, async_save=async_save)
            try:
                out = mgr.save(step, state(seed), overwrite=step not in self.protected)
                return out if isinstance(out, ckpt.Manifest) else out.done(timeout=60)
            finally:
                mgr.close()

        got = typed(run)
        self._settle(got, step, seed)
        self._dropped(keep_last)

    @rule(keep_last=st.none() | st.integers(1, 3))
    def run_gc(self, keep_last: int | None) -> None:
        self._gc(keep_last)
        self._dropped(keep_last)
        for c in list_checkpoints(self.root):  # what gc cannot prove ours is reported, and kept
            assert c.status in ("committed", "incomplete", "unreadable", "foreign", "link"), c

    @rule(kind=st.sampled_from(WRITERS), step=STEPS, overwrite=st.booleans(), k=st.integers(1, 8))
    def failed_writer(self, kind: str, step: int, overwrite: bool, k: int) -> None:
        """A writer's k-th file write raises: it removes what it created, and nothing else."""
        seed = self._next_seed()
        with failing(k) as made:
            got = typed(write_job(kind, self.url(step), seed, self.root, overwrite and step not in self.protected))
        if isinstance(got, CheckpointError):
            left = [p for p in made if os.path.lexists(p)]
            assert not left, f"a failed {kind} left its files: {left}"
        self._settle(got, step, seed)

    @rule(kind=st.sampled_from(WRITERS), step=STEPS, overwrite=st.booleans(), k=st.integers(1, 8))
    def killed_writer(self, kind: str, step: int, overwrite: bool, k: int) -> None:
        """A writer dies at its k-th file write; gc runs afterwards, from this process."""
        seed = self._next_seed()
        child = Forked(write_job(kind, self.url(step), seed, self.root, overwrite and step not in self.protected),
                       k, "kill")
        got = child.result()
        assert not got.startswith("crash"), got
        if got == "ok":
            self.committed[step] = seed
            self.protected.pop(step, None)
        self._gc(None)
        self._dropped(None)

    @rule(kind=st.sampled_from(WRITERS), step=STEPS, k=st.integers(1, 4), keep_last=st.none() | st.integers(1, 3))
    def paused_writer(self, kind: str, step: int, k: int, keep_last: int | None) -> None:
        """gc runs while a writer (another process) is between two of its file writes."""
        if step in self.committed or step in self.protected:
            return  # a new step: retention may drop an old committed one, not the save in flight
        seed = self._next_seed()
        child = Forked(write_job(kind, self.url(step), seed, self.root, False), k, "pause")
        gone: list[str] = []
        try:
            made = child.paused()
            if made is not None:
                self._gc(keep_last)
                gone = [p for p in made if not os.path.exists(p)]
        finally:
            got = child.result()  # (always: never leave the child paused)
        assert not gone, f"gc deleted the files of a writer that is still running: {gone}"
        assert got in ("ok", "exists") or got.startswith("error:"), got
        if got == "ok":
            assert loads(self.url(step), seed), "a save gc ran beside committed a checkpoint that misses data"
            self.committed[step] = seed
        self._dropped(keep_last)

    # -- surroundings

    @rule(step=STEPS, name=st.sampled_from(STEP_FOREIGN), aged=st.booleans())
    def plant_in_step(self, step: int, name: str, aged: bool) -> None:
        self.s.plant_file(os.path.join(self.url(step), name), f"user file {name}".encode(), aged=aged)

    @rule(name=st.sampled_from(ROOT_FOREIGN), aged=st.booleans())
    def plant_in_root(self, name: str, aged: bool) -> None:
        self.s.plant_file(os.path.join(self.root, name), b"user file", aged=aged)

    @rule(step=STEPS, name=st.sampled_from(LINKS), to=st.sampled_from(TARGETS))
    def plant_link(self, step: int, name: str, to: str) -> None:
        where = {"file": os.path.join(self.s.outside, "precious.bin"), "dir": os.path.join(self.s.outside, "dir"),
                 "sibling": os.path.join(self.root, step_dir(step % 6 + 1), "data")}[to]
        self.s.plant_link(os.path.join(self.url(step), name), where)

    @rule(step=st.integers(7, 8), to_checkpoint=st.booleans())
    def plant_linked_step(self, step: int, to_checkpoint: bool) -> None:
        self.s.plant_link(self.url(step), os.path.join(self.s.outside, "ckpt" if to_checkpoint else "dir"))

    @rule(step=STEPS)
    def plant_live_lease(self, step: int) -> None:
        """Another writer (alive: this process) holds a lease on the step: gc leaves all of it alone."""
        held = lease.acquire(self.url(step), 7)
        self.others.append(held)
        self.s.foreign[os.path.join(self.url(step), held.name)] = entry(os.path.join(self.url(step), held.name))

    @precondition(lambda self: bool(self.committed))
    @rule(data=st.data(), kind=st.sampled_from(["flip", "newer"]))
    def damage(self, data: st.DataObject, kind: str) -> None:
        step = data.draw(st.sampled_from(sorted(self.committed)))
        url = self.url(step)
        if kind == "newer":
            edit_manifest(url, lambda d: d.update(version=[9, 0]))
        else:
            p = os.path.join(url, MANIFEST_NAME)
            with open(p, "rb") as f:
                raw = bytearray(f.read())
            raw[len(raw) // 2] ^= 0x10
            with open(p, "wb") as f:
                f.write(bytes(raw))
        del self.committed[step]
        self.protected[step] = kind
        self.s.freeze(url)

    @precondition(lambda self: bool(self.protected))
    @rule(data=st.data(), kind=st.sampled_from(WRITERS))
    def write_over_damaged(self, data: st.DataObject, kind: str) -> None:
        """An overwrite of a damaged checkpoint replaces its manifest (its data files stay: nothing can
        prove them unreferenced); one of a newer format is refused and left exactly as it is."""
        step = data.draw(st.sampled_from(sorted(self.protected)))
        manifest = os.path.join(self.url(step), MANIFEST_NAME)
        frozen = self.s.foreign.pop(manifest)
        seed = self._next_seed()
        got = typed(write_job(kind, self.url(step), seed, self.root, True))
        if self.protected[step] == "newer" or isinstance(got, CheckpointError):
            assert self.protected[step] == "flip" or isinstance(got, CheckpointError), got
            self.s.foreign[manifest] = frozen
            return
        self._settle(got, step, seed)
        # the replaced checkpoint's data files are leftovers of ours now (retention may take them with
        # the step); files of anyone else in the directory stay frozen
        for p in [p for p in self.s.foreign if p.startswith(self.url(step) + os.sep)]:
            if transaction.is_ours(os.path.relpath(p, self.url(step))) and not os.path.islink(p):
                del self.s.foreign[p]

    @invariant()
    def nothing_foreign_touched_and_committed_loads(self) -> None:
        self.s.check()
        for step, seed in self.committed.items():
            assert loads(self.url(step), seed), step


# --- machine 2: output directories of reshard and the Hugging Face export ---------------------------

_SOURCES: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The machines' sources, made once: a small checkpoint (reshard) and the tiny MoE (HF export)."""
    from tests.resharders.moe_states import save_single

    base = tmp_path_factory.mktemp("audit-src")
    _SOURCES["small"] = str(base / "small")
    ckpt.save(state(7), _SOURCES["small"], step=7)
    _SOURCES["moe"] = str(base / "moe")
    save_single(_SOURCES["moe"])
    yield


OUT_FOREIGN = ["README.md", "adapter_model.safetensors", "data/train.jsonl", "zarr/notes.md", "notes.tmp.3",
               "model.safetensors.index.json.bak", "data/00000-0123456789ab.safetensors.partial"]
OUT_LINKS = ["data/00000-abcdef012345.safetensors", "model-00001-of-00001.safetensors", "data", "extra",
             "manifest.msgpack.tmp.1.2"]


class OutputAudit(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = Surroundings("ckpt-audit-out-")
        self.n = 0
        self.outputs: dict[str, str] = {}  # output dir -> what was committed there: "reshard" | "hf"

    def teardown(self) -> None:
        self.s.close()

    def out(self, i: int) -> str:
        return self.s.path("out", f"o{i}")

    @rule(i=st.integers(0, 3), name=st.sampled_from(OUT_FOREIGN))
    def plant_user_file(self, i: int, name: str) -> None:
        self.s.plant_file(os.path.join(self.out(i), name), f"user {name}".encode())

    @rule(i=st.integers(0, 3), name=st.sampled_from(OUT_LINKS), to_dir=st.booleans())
    def plant_link(self, i: int, name: str, to_dir: bool) -> None:
        to = os.path.join(self.s.outside, "dir" if to_dir else "precious.bin")
        self.s.plant_link(os.path.join(self.out(i), name), to)

    @rule(i=st.integers(0, 3), overwrite=st.booleans())
    def run_reshard(self, i: int, overwrite: bool) -> None:
        got = typed(lambda: reshard(_SOURCES["small"], self.out(i), Layout.parse("dp=2"), overwrite=overwrite))
        if isinstance(got, ckpt.Manifest):
            self.outputs[self.out(i)] = "reshard"

    @rule(i=st.integers(0, 3), k=st.integers(1, 6), export=st.booleans())
    def failed_writer(self, i: int, k: int, export: bool) -> None:
        """A reshard or an export whose k-th write raises: a reshard keeps only its finished files and
        their markers (to resume), an export nothing it created; neither deletes what it did not create."""
        with failing(k) as made:
            got = typed(lambda: export_hf(_SOURCES["moe"], self.out(i)) if export else
                        reshard(_SOURCES["small"], self.out(i), Layout.parse("dp=2"), workers=1))
        if isinstance(got, CheckpointError):
            left = [os.path.relpath(p, self.out(i)) for p in made if os.path.lexists(p)]
            assert all(not export and (transaction.in_data_area(f) or f.startswith(".reshard/")) for f in left), left
        elif export:
            self.outputs[self.out(i)] = "hf"
        else:
            self.outputs[self.out(i)] = "reshard"

    @rule(i=st.integers(0, 3), k=st.integers(1, 6))
    def killed_reshard(self, i: int, k: int) -> None:
        """A reshard dies at its k-th write; a re-run resumes (adopting only what it may)."""
        child = Forked(lambda: reshard(_SOURCES["small"], self.out(i), Layout.parse("dp=2"), workers=1), k, "kill")
        got = child.result()
        assert not got.startswith("crash"), got
        if isinstance(typed(lambda: reshard(_SOURCES["small"], self.out(i), Layout.parse("dp=2"))), ckpt.Manifest):
            self.outputs[self.out(i)] = "reshard"

    @rule(i=st.integers(0, 3), overwrite=st.booleans())
    def run_export(self, i: int, overwrite: bool) -> None:
        got = typed(lambda: export_hf(_SOURCES["moe"], self.out(i), overwrite=overwrite))
        if not isinstance(got, CheckpointError):
            self.outputs[self.out(i)] = "hf"

    @invariant()
    def nothing_foreign_touched_and_outputs_load(self) -> None:
        self.s.check()
        for d, kind in self.outputs.items():
            if kind == "reshard" and os.path.exists(os.path.join(d, MANIFEST_NAME)):
                assert loads(d, 7), d
            elif kind == "hf":
                from safetensors import safe_open

                with open(os.path.join(d, INDEX_NAME)) as f:
                    index = json.load(f)
                for name in set(index["weight_map"].values()):
                    with safe_open(os.path.join(d, name), "pt") as sf:
                        assert set(sf.keys()) <= set(index["weight_map"])


# --- machine 3: the memory tier ---------------------------------------------------------------------

TIER_LINKS = ["node-0/rank-0/STEP/data", "node-0/rank-0/STEP/manifest.msgpack", "node-0/rank-0/notes",
              "node-0/rank-0/.slots/slot-9", "node-0/rank-0/STEP/data/00000-abcdef012345.safetensors"]


def tier_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(32, 16, generator=g)}, "train": {"step": step}}


class TierAudit(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        from ckpt.tier import MemoryTier, TierConfig
        from ckpt.tier.nodes import run_id_for

        self.s = Surroundings("ckpt-audit-tier-")
        self.shm = self.s.path("shm")
        self.root = self.s.path("root")
        self.run = os.path.join(self.shm, f"ckpt-{run_id_for(self.root)}")
        self.tier: Any = MemoryTier(TierConfig(self.root, shm_dir=self.shm, replicas=0, keep=1, timeout=10))
        self.tier.reset(None)
        self.step = 0

    def teardown(self) -> None:
        with contextlib.suppress(CheckpointError):
            self.tier.close()
        self.s.close()

    @rule()
    def save(self) -> None:
        self.step += 1
        typed(lambda: self.tier.save(self.step, tier_state(self.step)))

    @rule()
    def restore(self) -> None:
        target: dict[str, Any] = {"model": {"w": torch.zeros(32, 16)}, "train": {"step": 0}}
        got = typed(lambda: self.tier.restore(target))
        if got is not None and not isinstance(got, CheckpointError):
            assert torch.equal(target["model"]["w"], tier_state(got.step)["model"]["w"]), got.step

    @rule(keep=st.booleans())
    def evict(self, keep: bool) -> None:
        typed(lambda: self.tier.reset(self.step if keep else None))

    @rule()
    def collect(self) -> None:
        from ckpt.tier import gc_memory

        assert typed(lambda: gc_memory(None, self.shm, min_age=0)) == []  # a live run is never collected

    @rule(where=st.sampled_from(TIER_LINKS), to_dir=st.booleans(), ahead=st.booleans())
    def plant_link(self, where: str, to_dir: bool, ahead: bool) -> None:
        """A link in the tier (at the step written next when ``ahead``) to something outside."""
        from ckpt.tier.nodes import step_name

        rel = where.replace("STEP", step_name(self.step + 1 if ahead else max(self.step, 1)))
        path = os.path.join(self.run, rel)
        if not self.s._free(path):
            return
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.symlink(os.path.join(self.s.outside, "dir" if to_dir else "precious.bin"), path)  # the tier's to remove

    @invariant()
    def outside_untouched(self) -> None:
        assert tree(self.s.outside) == self.s.outside_tree
        assert sorted(os.listdir(self.s.base)) == self.s.top


_FAST: dict[str, Any] = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
# AUDIT_N=300 explores longer (each machine well over a minute); the defaults keep each under ~5 s
_N = int(os.environ.get("AUDIT_N", 0))
TestRootAudit = pytest.mark.multiproc(RootAudit.TestCase)  # (killed and paused writers are forked)
TestRootAudit.settings = settings(max_examples=_N or 25, stateful_step_count=12, **_FAST)
TestOutputAudit = pytest.mark.multiproc(OutputAudit.TestCase)
TestOutputAudit.settings = settings(max_examples=_N or 14, stateful_step_count=10, **_FAST)
TestTierAudit = TierAudit.TestCase
TestTierAudit.settings = settings(max_examples=_N or 20, stateful_step_count=10, **_FAST)


# --- one example per bug the machines found ----------------------------------------------------------

def test_commit_never_writes_through_a_link_at_its_temp_name(tmp_path):
    """Bug: LocalStorage.commit wrote the manifest (and leases, markers) to ``<name>.tmp.<pid>.<thread id>``
    opened O_CREAT|O_TRUNC: a link planted at that guessable name made it truncate and overwrite the file
    outside the checkpoint the link points to (and hard-link it in as the manifest)."""
    outside = tmp_path / "precious.bin"
    outside.write_bytes(b"precious")
    url = tmp_path / "c"
    url.mkdir()
    planted = url / f"{MANIFEST_NAME}.tmp.{os.getpid()}.{threading.get_ident()}"
    planted.symlink_to(outside)
    ckpt.save(state(1), str(url))
    assert outside.read_bytes() == b"precious" and os.readlink(planted) == str(outside)
    assert loads(str(url), 1) and os.stat(url / MANIFEST_NAME).st_ino != os.stat(outside).st_ino


@pytest.mark.parametrize("name", ["notes.tmp.42", "results.csv.tmp.7.1"])
def test_gc_keeps_a_users_file_whose_name_looks_like_a_temp_file(tmp_path, name):
    """Bug: any ``*.tmp.<digits>`` counted as the temp file of a commit in flight, so gc took a step
    directory holding only such a file for an unfinished save of ours and deleted it once a day old
    (in a committed step that retention drops, too)."""
    root = tmp_path / "root"
    for s in (1, 2):
        ckpt.save(state(s), str(root / step_dir(s)), step=s)
    (root / step_dir(5)).mkdir()
    for f in (root / step_dir(5) / name, root / step_dir(1) / name):
        f.write_bytes(b"mine")
        os.utime(f, (time.time() - 3 * DAY,) * 2)
    infos = {c.step: c for c in list_checkpoints(str(root))}
    assert infos[5].status == "foreign" and name in infos[5].note
    assert [c.step for c in gc(str(root), keep_last=1)] == [1]  # retention drops step 1's checkpoint ...
    assert (root / step_dir(5) / name).read_bytes() == b"mine"
    assert (root / step_dir(1) / name).read_bytes() == b"mine"  # ... and keeps the user's file in it
    assert not lease.is_temp(name) and lease.is_temp(f"{MANIFEST_NAME}.tmp.12.345")


def test_files_in_a_zarr_named_directory_are_ours_only_as_zarr_writes_them(tmp_path):
    """Bug: every file below ``zarr/`` or ``zarr-<hex>/`` counted as a data file of ours: gc deleted a
    user's ``zarr/notes.md`` (the directory taken for an unfinished save), and so did retention in a
    committed step and the clean-up after an overwrite whose old manifest listed it."""
    assert not transaction.in_data_area("zarr/notes.md") and not transaction.in_data_area("zarr-0123456789ab/x")
    assert transaction.in_data_area("zarr-0123456789ab/w/c/0/1") and transaction.in_data_area("zarr/w/zarr.json")
    root = tmp_path / "root"
    ckpt.save(state(1), str(root / step_dir(1)), step=1, data_format="zarr")
    ckpt.save(state(2), str(root / step_dir(2)), step=2)
    mine = [root / step_dir(5) / "zarr" / "notes.md", root / step_dir(1) / "zarr-0123456789ab" / "README"]
    for f in mine:
        f.parent.mkdir(parents=True)
        f.write_bytes(b"mine")
    assert [c.step for c in gc(str(root), keep_last=1)] == [1]
    assert all(f.read_bytes() == b"mine" for f in mine)
    url = str(tmp_path / "c")  # an overwrite whose old manifest lists a user's file there
    ckpt.save(state(3), url)
    (tmp_path / "c" / "zarr").mkdir()
    (tmp_path / "c" / "zarr" / "notes.md").write_bytes(b"mine")
    edit_manifest(url, lambda d: d["files"].update({"zarr/notes.md": {"size": 4}}))
    ckpt.save(state(4), url, overwrite=True)
    assert loads(url, 4) and (tmp_path / "c" / "zarr" / "notes.md").read_bytes() == b"mine"


def test_gc_never_deletes_a_link_and_a_step_holding_one_is_not_ours(tmp_path):
    """Bug: gc deleted a user's link named like a data file of ours (``data/00000-<hex>.safetensors``)
    when it led inside the root (one leading outside was kept, but everything beside it went)."""
    root = tmp_path / "root"
    ckpt.save(state(1), str(root / step_dir(1)), step=1)
    link = root / step_dir(2) / "data" / "00000-abcdef012345.safetensors"
    link.parent.mkdir(parents=True)
    link.symlink_to(root / step_dir(1) / "data")
    (root / step_dir(2) / "data" / "00001-0123456789ab.safetensors").write_bytes(b"x")
    assert {c.step: c.status for c in list_checkpoints(str(root))} == {1: "committed", 2: "foreign"}
    assert gc(str(root)) == [] and os.path.islink(link) and loads(str(root / step_dir(1)), 1)


def test_hf_export_overwrite_replaces_the_model_and_keeps_other_safetensors(tmp_path):
    """Bug: ``export_hf(overwrite=True)`` deleted every top-level ``*.safetensors`` it did not write,
    e.g. a LoRA ``adapter_model.safetensors`` beside the model (its docstring: other files are kept)."""
    out = tmp_path / "hf"
    export_hf(_SOURCES["moe"], str(out), max_shard_size=200_000)
    old = {p.name for p in out.glob("model-*.safetensors")}
    (out / "adapter_model.safetensors").write_bytes(b"lora")
    (out / "model.safetensors").write_bytes(b"an older single-file model")
    got = export_hf(_SOURCES["moe"], str(out), overwrite=True)
    assert (out / "adapter_model.safetensors").read_bytes() == b"lora"
    assert {p.name for p in out.glob("*.safetensors")} == set(got.files) | {"adapter_model.safetensors"}
    assert len(old) > 1 and not old & set(got.files)


def test_a_writer_never_writes_through_a_link_at_its_file_name(tmp_path):
    """Bug: files were created O_CREAT|O_TRUNC, following a link at the name: an export with overwrite
    into a directory whose ``model-00001-of-00001.safetensors`` linked to a user's file truncated it."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "weights.bin").write_bytes(b"user weights")
    (out / "model-00001-of-00001.safetensors").symlink_to("weights.bin")
    with pytest.raises(StorageError, match="symbolic link"):
        export_hf(_SOURCES["moe"], str(out), overwrite=True)
    assert (out / "weights.bin").read_bytes() == b"user weights"


def _pause_first_data_write(url: str, job: Callable[[], Any], during: Callable[[], None]) -> Any:
    """Run ``job`` on a thread, run ``during()`` while its first write under ``url`` waits (its data file
    open, nothing in it yet), return its result."""
    real = local.LocalWriter.write
    paused, go = threading.Event(), threading.Event()
    box: list[Any] = []

    def write(w: Any, data: Any) -> None:
        if w.full.startswith(url + os.sep) and not go.is_set():
            paused.set()
            go.wait(30)
        real(w, data)

    def run() -> None:
        box.append(typed(job))

    t = threading.Thread(target=run)
    local.LocalWriter.write = write  # type: ignore[method-assign,assignment]
    try:
        t.start()
        assert paused.wait(30)
        during()
    finally:
        go.set()
        t.join(60)
        local.LocalWriter.write = real  # type: ignore[method-assign]
    return box[0]


@pytest.mark.parametrize("kind", ["save", "async", "zarr", "reshard", "import_hf"])
def test_gc_spares_every_writer_in_progress(tmp_path, kind):
    """Bug: only the manager leased a step directory; a plain save, async save, zarr save, reshard or
    import writing into ``ROOT/step-N`` had no lease, and ``ckpt gc ROOT`` running meanwhile deleted its
    files (the save then failed, or, with another rank's file still there, committed a manifest listing
    files gc had deleted). Every writer now leases before its first byte (ckpt.save.take_lease)."""
    from ckpt.hf.convert import import_hf

    root = tmp_path / "root"
    root.mkdir()
    url = str(root / step_dir(3))
    if kind == "import_hf":
        export_hf(_SOURCES["moe"], str(tmp_path / "hf"))
    job = {"save": lambda: ckpt.save(state(3), url, step=3),
           "async": lambda: ckpt.async_save(state(3), url, step=3).done(timeout=60),
           "zarr": lambda: ckpt.save(state(3), url, step=3, data_format="zarr"),
           "reshard": lambda: reshard(_SOURCES["small"], url, Layout.parse("dp=2"), workers=1),
           "import_hf": lambda: import_hf(str(tmp_path / "hf"), url)}[kind]
    removed: list[Any] = []
    got = _pause_first_data_write(url, job, lambda: removed.extend(gc(str(root))))
    assert removed == [] and not isinstance(got, CheckpointError), got
    assert ckpt.verify(url, deep=True).ok
    if kind != "import_hf":
        assert loads(url, 7 if kind == "reshard" else 3)
    assert not [f for f in os.listdir(url) if lease.is_lease(f)]  # the lease went with the save


def test_a_failed_save_leaves_a_users_empty_destination_as_it_was(tmp_path):
    """With leases in every writer: a failed save removes the directory only when its lease made it."""
    (tmp_path / "mine").mkdir()
    for url in (tmp_path / "mine", tmp_path / "new"):
        with failing(2), pytest.raises(StorageError, match="injected"):  # the lease goes in, the data file fails
            ckpt.save(state(1), str(url))
    assert (tmp_path / "mine").is_dir() and not tree(str(tmp_path / "mine")).keys() - {"data"}
    assert not (tmp_path / "new").exists() or not tree(str(tmp_path / "new")).keys() - {"data"}


@pytest.fixture
def s3_root(s3_bucket: tuple[str, dict[str, Any]], s3_admin: Any) -> tuple[str, dict[str, Any], Any]:
    """``(s3://bucket/run, storage_options, botocore client)``: a bucket of this test alone (tests/conftest.py)."""
    bucket, options = s3_bucket
    return f"{bucket}/run", options, s3_admin


def test_gc_on_s3_keeps_foreign_keys_and_live_writers(s3_root):
    """The same rules on an object store (no links, no mtimes): retention and gc delete only our
    files, never keys named like a temp file or in a zarr-named prefix, nor anything a live lease holds."""
    root, opts, client = s3_root
    bucket = root.split("/")[2]
    for s in (1, 2, 3):
        ckpt.save(state(s), f"{root}/{step_dir(s)}", step=s, storage_options=opts)
    foreign = {f"run/{step_dir(1)}/zarr-0123456789ab/README": b"mine", f"run/{step_dir(1)}/notes.tmp.4": b"mine",
               f"run/{step_dir(5)}/zarr/notes.md": b"mine", f"run/{step_dir(5)}/results.csv.tmp.7.1": b"mine",
               "run/notes.txt": b"mine"}
    for key, body in foreign.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    held = lease.acquire(f"{root}/{step_dir(2)}", 3, opts)  # another writer, alive, overwriting step 2
    try:
        infos = {c.step: c for c in list_checkpoints(root, opts)}
        assert infos[5].status == "foreign" and infos[2].live
        assert [c.step for c in gc(root, keep_last=1, storage_options=opts)] == [1]
    finally:
        held.release()
    for key, body in foreign.items():
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == body, key
    got = ckpt.load({"w": torch.zeros(8, 6), "b": torch.zeros(6)}, f"{root}/{step_dir(2)}", storage_options=opts)
    assert torch.equal(got["w"], state(2)["w"])
    assert [c.step for c in gc(root, keep_last=1, storage_options=opts)] == [2]  # its writer is gone now
