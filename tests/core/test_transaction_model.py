"""Model-based tests of the commit transaction and of gc (hypothesis stateful testing).

A model keeps what must hold whatever the sequence of saves, overwrites, injected failures at each
phase, hostile manifests, planted user files, damaged / newer-format / symlinked checkpoints and
gc runs: the newest committed checkpoint loads bitwise (verified); no user file and no
checkpoint gc cannot prove is ours ever changes; a failed save leaves no file behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ckpt
from ckpt.manager import gc, list_checkpoints, step_dir
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage import local as local_mod
from tests.helpers import random_state
from tests.manifest_edit import read_manifest, write_manifest

FAILURES = ["none", "write", "close", "commit", "header", "cleanup"]


def _state(seed: int) -> dict[str, Any]:
    n = 3 + seed % 4  # the structure changes between saves too
    return random_state(seed, {"w": (n, 5)}, meta={"seed": seed, "t": (seed, (seed, "x"))})


def _load(url: str, seed: int) -> dict[str, Any]:
    n = 3 + seed % 4
    return ckpt.load({"w": torch.zeros(n, 5), "meta": None}, url, verify=True)


def _files(d: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, d)] = fh.read()
    return out


@contextmanager
def _fail(kind: str):
    """Inject a failure at one phase of the save (``cleanup``: after the commit)."""
    err = ckpt.StorageError("injected failure")
    targets = {"write": (local_mod.LocalWriter, "write"), "close": (local_mod.LocalWriter, "close"),
               "commit": (local_mod.LocalStorage, "commit"), "cleanup": (local_mod.LocalStorage, "delete")}
    if kind not in targets:
        yield
        return
    owner, name = targets[kind]
    real = getattr(owner, name)

    def boom(self, path=None, *a, **k):
        if kind == "commit" and path != MANIFEST_NAME:
            return real(self, path, *a, **k)
        raise err

    setattr(owner, name, boom)
    try:
        yield
    finally:
        setattr(owner, name, real)


class SaveMachine(RuleBasedStateMachine):
    """One checkpoint URL, saved over and over under failures and hostile edits."""

    def __init__(self) -> None:
        super().__init__()
        self.base = tempfile.mkdtemp(prefix="ckpt-model-")
        self.url = os.path.join(self.base, "c")
        self.committed: int | None = None
        self.user: dict[str, bytes] = {}

    def teardown(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)

    @rule(seed=st.integers(0, 1000), overwrite=st.booleans(), fail=st.sampled_from(FAILURES))
    def save(self, seed: int, overwrite: bool, fail: str) -> None:
        before = _files(self.url) if os.path.isdir(self.url) else {}
        step: Any = "bad" if fail == "header" else seed
        try:
            with _fail(fail):
                ckpt.save(_state(seed), self.url, step=step, overwrite=overwrite)
        except ckpt.CheckpointExistsError:
            assert self.committed is not None and not overwrite
            assert _files(self.url) == before
            return
        except ckpt.CheckpointError:
            assert fail in ("write", "close", "commit", "header"), fail
            assert _files(self.url) == before  # nothing lost, nothing left behind
            return
        assert fail in ("none", "cleanup") and (overwrite or self.committed is None)
        self.committed = seed

    @rule(name=st.sampled_from(["notes.txt", "data/train.jsonl", "sub/x.bin"]), data=st.binary(max_size=16))
    def plant_user_file(self, name: str, data: bytes) -> None:
        p = os.path.join(self.url, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
        self.user[name] = data

    @precondition(lambda self: self.committed is not None)
    @rule(extra=st.lists(st.sampled_from([MANIFEST_NAME, "notes.txt", "data/train.jsonl", "../outside"]),
                         min_size=1, max_size=3, unique=True))
    def hostile_manifest_lists(self, extra: list[str]) -> None:
        d = read_manifest(self.url)
        for f in extra:
            if f == "../outside":
                continue  # the decoder refuses paths that escape: that manifest cannot be written back
            d["files"][f] = {"size": 0}
        write_manifest(self.url, d)

    @invariant()
    def newest_committed_loads_and_user_files_intact(self) -> None:
        if self.committed is not None:
            got = _load(self.url, self.committed)
            want = _state(self.committed)
            assert torch.equal(got["w"], want["w"]) and got["meta"] == want["meta"]
        files = _files(self.url) if os.path.isdir(self.url) else {}
        for name, data in self.user.items():
            assert files.get(name) == data, name


class GcMachine(RuleBasedStateMachine):
    """A manager root with committed, unfinished, damaged, newer-format, foreign and linked entries."""

    def __init__(self) -> None:
        super().__init__()
        self.base = tempfile.mkdtemp(prefix="ckpt-gcmodel-")
        self.root = os.path.join(self.base, "root")
        os.makedirs(self.root)
        self.outside = os.path.join(self.base, "outside")
        ckpt.save(_state(999), self.outside, step=999)
        self.outside_files = _files(self.outside)
        self.good: set[int] = set()
        self.protected: dict[int, dict[str, bytes]] = {}  # steps gc must never change
        self.step = 0

    def teardown(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)

    def _next(self) -> int:
        self.step += 1
        return self.step

    @rule()
    def committed(self) -> None:
        s = self._next()
        ckpt.save(_state(s), os.path.join(self.root, step_dir(s)), step=s)
        self.good.add(s)

    @rule(kind=st.sampled_from(["flip", "newer", "foreign", "link", "fifo"]))
    def odd_entry(self, kind: str) -> None:
        s = self._next()
        d = os.path.join(self.root, step_dir(s))
        if kind == "link":
            os.symlink(self.outside, d)
            self.protected[s] = {}
            return
        if kind == "foreign":
            os.makedirs(os.path.join(d, "data"))
            with open(os.path.join(d, "data", "results.csv"), "w") as f:
                f.write("a,b\n")
        else:
            ckpt.save(_state(s), d, step=s)
            m = os.path.join(d, MANIFEST_NAME)
            if kind == "flip":
                with open(m, "rb") as fh:
                    raw = bytearray(fh.read())
                raw[len(raw) // 3] ^= 0x04
                with open(m, "wb") as fh:
                    fh.write(bytes(raw))
            elif kind == "newer":
                dd = read_manifest(d)
                dd["version"] = [7, 0]
                write_manifest(d, dd)
            else:
                os.unlink(m)
                os.mkfifo(m)
        self.protected[s] = _files(d) if kind != "fifo" else {}

    @rule()
    def unfinished(self) -> None:
        s = self._next()
        d = os.path.join(self.root, step_dir(s), "data")
        os.makedirs(d)
        with open(os.path.join(d, "00001-0123456789ab.safetensors"), "wb") as f:
            f.write(b"partial")

    @rule(keep=st.integers(1, 3))
    def run_gc(self, keep: int) -> None:
        removed = {c.step for c in gc(self.root, keep_last=keep)}
        assert not removed & set(self.protected)
        self.good -= removed
        newest = sorted(self.good)[-keep:]
        assert set(newest) <= self.good

    @invariant()
    def protected_entries_unchanged_and_newest_loads(self) -> None:
        for s, files in self.protected.items():
            d = os.path.join(self.root, step_dir(s))
            assert os.path.lexists(d), s
            if files:
                assert _files(d) == files, s
        assert _files(self.outside) == self.outside_files
        infos = [c for c in list_checkpoints(self.root) if c.committed]
        assert {c.step for c in infos} == self.good
        if self.good:
            s = max(self.good)
            got = _load(os.path.join(self.root, step_dir(s)), s)
            assert torch.equal(got["w"], _state(s)["w"])


_SETTINGS = settings(max_examples=12, stateful_step_count=12, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestSaveModel = SaveMachine.TestCase
TestSaveModel.settings = _SETTINGS
TestGcModel = GcMachine.TestCase
TestGcModel.settings = _SETTINGS


def test_fifo_manifest_does_not_hang_listing(tmp_path):
    d = tmp_path / "root" / step_dir(1)
    d.mkdir(parents=True)
    os.mkfifo(d / MANIFEST_NAME)
    infos = list_checkpoints(str(tmp_path / "root"))
    assert [c.status for c in infos] == ["unreadable"]
    assert gc(str(tmp_path / "root")) == []


pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
