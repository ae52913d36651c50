"""Crash safety and concurrency of ``export_hf(overwrite=True)`` (ckpt.hf.publish; docs/HF.md).

An overwrite killed (``os._exit`` in a forked child) or failing (an injected ``OSError``) before any one of
its file operations in the output directory (a file created or opened for writing, a file completed, a
link, a rename, an unlink, a directory made or removed) leaves a directory that loads, through the index as
transformers resolves it and through ckpt's HF import reader, bit for bit as the previous export, or as the
new one once its index was renamed into place; the user's files and links beside it are untouched; a
failure before the commit leaves the directory exactly as it was; and the next export recovers (a killed
export's lock and staging files are taken over / removed). Then: clean-up removes only what the export
created; a second concurrent export fails at once; object stores say clearly what a failed overwrite left.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from ckpt.errors import CheckpointError, DirectoryInUseError, ManifestError, StorageError
from ckpt.hf import publish
from ckpt.hf.convert import export_hf, read_hf_source
from ckpt.hf.directory import CONFIG_NAME, INDEX_NAME, SINGLE_NAME
from ckpt.storage import get_storage, local
from tests.integrity.sample import memory_dir
from tests.resharders.moe_states import save_single

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the kills run in forked children")

KILLED = 87
SHARDS = {1: None, 2: "400KB", 3: "300KB"}  # files of the tiny MoE's export (0.7 MB) -> max_shard_size
TOKENIZER = "tokenizer.json"
_SRC: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def sources() -> Iterator[None]:
    """Two tiny-MoE checkpoints (different weights and tokenizers) and an ``outside`` file users link to."""
    base = memory_dir("ckpt-export-crash-")  # tmpfs: fsync is free, a kill loses nothing a disk would keep
    for seed in (0, 1):
        url = os.path.join(base, f"src{seed}")
        save_single(url, seed=seed)
        with open(os.path.join(url, TOKENIZER), "w") as f:  # copied into the export (ckpt.hf.files)
            json.dump({"version": seed}, f)
        _SRC[f"src{seed}"] = url
    os.makedirs(os.path.join(base, "outside"))
    with open(os.path.join(base, "outside", "precious.bin"), "wb") as f:
        f.write(b"precious " * 64)
    _SRC["base"] = base
    yield
    shutil.rmtree(base, ignore_errors=True)


# --- what a directory holds ---------------------------------------------------------------------


def loaded(d: str) -> dict[str, torch.Tensor]:
    """The tensors of the model directory ``d`` as transformers resolves its files (``model.safetensors``
    first, else every file the index names, each tensor from the file the index gives); ckpt's HF import
    reader (config, index and headers, checked against each other) must accept it too."""
    read_hf_source(get_storage(d))
    if os.path.exists(os.path.join(d, SINGLE_NAME)):
        files, wmap = [SINGLE_NAME], None
    else:
        with open(os.path.join(d, INDEX_NAME)) as f:
            wmap = json.load(f)["weight_map"]
        files = sorted(set(wmap.values()))
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(d, name), "pt") as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if wmap is None or wmap[key] == name:
                    out[key] = sf.get_tensor(key)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def entry(path: str) -> tuple[Any, ...]:
    """What must not change about a user's entry: a file's bytes and mtime, a link's target."""
    s = os.lstat(path)
    if stat.S_ISLNK(s.st_mode):
        return ("link", os.readlink(path))
    return ("file", read(path), s.st_mtime_ns)


def everything(d: str) -> dict[str, bytes | str]:
    """Every entry under ``d``: files' bytes, links' targets."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(d):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            if os.path.islink(p):
                out[os.path.relpath(p, d)] = os.readlink(p)
            elif not os.path.isdir(p):
                out[os.path.relpath(p, d)] = read(p) or b""
    return out


USER_FILES = {"README.md": b"my notes", "adapter_model.safetensors": b"a LoRA", "data/train.jsonl": b"{}\n"}
USER_LINKS = ["notes.lnk", "model-00009-of-00009.safetensors"]  # the second: a weight name no index lists


def plant_user_entries(d: str) -> dict[str, tuple[Any, ...]]:
    for name, data in USER_FILES.items():
        os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    for name in USER_LINKS:
        os.symlink(os.path.join(_SRC["base"], "outside", "precious.bin"), os.path.join(d, name))
    return {n: entry(os.path.join(d, n)) for n in [*USER_FILES, *USER_LINKS]}


# --- every step of an export: a hook before each file operation in the output directory -------------------

_OPS = ("open", "link", "rename", "replace", "unlink", "rmdir", "mkdir")
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT


@contextlib.contextmanager
def each_step(root: str, act: Callable[[int], None]) -> Iterator[list[tuple[str, str]]]:
    """Call ``act(n)`` before the n-th file operation under ``root``; yields the log ``(op, path)``."""
    log: list[tuple[str, str]] = []
    real = {name: getattr(os, name) for name in _OPS}
    real_close = local.LocalWriter.close

    def step(op: str, path: Any) -> None:
        p = os.path.abspath(os.fsdecode(path))
        if p == root or p.startswith(root + os.sep):
            log.append((op, os.path.relpath(p, root)))
            act(len(log))

    def wrap(name: str) -> Callable[..., Any]:
        fn = real[name]

        def op(*a: Any, **k: Any) -> Any:
            flags = a[1] if len(a) > 1 else k.get("flags", 0)
            if name == "open" and not flags & _WRITING or name == "mkdir" and os.path.isdir(a[0]):
                return fn(*a, **k)  # reads, and os.makedirs of a directory that is there
            step(name, a[1] if name in ("link", "rename", "replace") else a[0])
            return fn(*a, **k)
        return op

    def close(w: Any) -> int:
        if w.fd is not None:
            try:
                step("close", w.full)  # the file is complete (fsync, close)
            except OSError as e:  # as LocalWriter.close reports a failed fsync
                raise StorageError(f"{w.full}: fsync failed ({e.strerror})") from e
        return real_close(w)

    for name in _OPS:
        setattr(os, name, wrap(name))
    local.LocalWriter.close = close  # type: ignore[method-assign]
    try:
        yield log
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)
        local.LocalWriter.close = real_close  # type: ignore[method-assign]


def killed_at(k: int, job: Callable[[], Any], root: str) -> None:
    """Run ``job`` in a forked child killed (``os._exit``) before its k-th file operation under ``root``."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            torch.set_num_threads(1)

            def act(n: int) -> None:
                if n == k:
                    os._exit(KILLED)
            with each_step(root, act):
                job()
            code = 0
        except BaseException:  # noqa: BLE001 - reported through the exit code
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == KILLED, f"step {k} was not reached: {status}"


def failed_at(k: int, job: Callable[[], Any], root: str) -> CheckpointError | None:
    """Run ``job`` with an OSError injected at its k-th file operation under ``root``; its typed error."""
    def act(n: int) -> None:
        if n == k:
            raise OSError(errno.EIO, "injected I/O error")
    with each_step(root, act):
        try:
            job()
        except CheckpointError as e:  # anything else fails the test
            return e
    return None


# --- the generated test -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiproc
@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(old=st.sampled_from(sorted(SHARDS)), new=st.sampled_from(sorted(SHARDS)), bf16=st.booleans(),
       mode=st.sampled_from(["kill", "fail"]))
@example(old=3, new=3, bf16=False, mode="kill")  # every name in use: the staging index path
@example(old=2, new=3, bf16=True, mode="fail")  # no name in use: files moved into place, then the index
def test_an_overwrite_interrupted_at_any_step_leaves_a_loadable_export(old: int, new: int, bf16: bool,
                                                                       mode: str) -> None:
    base = memory_dir("ckpt-export-steps-")
    try:
        pristine = os.path.join(base, "pristine")
        export_hf(_SRC["src0"], pristine, max_shard_size=SHARDS[old] or "5GB")
        users = plant_user_entries(pristine)
        before = everything(pristine)
        kw: dict[str, Any] = {"max_shard_size": SHARDS[new] or "5GB", "dtype": "bf16" if bf16 else None,
                              "overwrite": True, "workers": 1}
        # the steps, counted on a copy; the commit is the first rename onto the index
        scratch = os.path.join(base, "scratch")
        shutil.copytree(pristine, scratch, symlinks=True)
        with each_step(scratch, lambda n: None) as log:
            export_hf(_SRC["src1"], scratch, **kw)
        commit = 1 + next(i for i, (op, p) in enumerate(log) if op in ("replace", "rename", "link") and p == INDEX_NAME)
        old_state, new_state = ((loaded(d), read(os.path.join(d, CONFIG_NAME)), read(os.path.join(d, TOKENIZER)))
                                for d in (pristine, scratch))
        clean = everything(scratch)
        assert not [p for p in clean if p.startswith(".ckpt-export")], clean
        assert len(log) > 5 and not same(old_state[0], new_state[0])

        for k in range(1, len(log) + 1):
            work = os.path.join(base, f"k{k}")
            shutil.copytree(pristine, work, symlinks=True)

            def job(work: str = work) -> Any:
                return export_hf(_SRC["src1"], work, **kw)
            if mode == "kill":
                killed_at(k, job, work)
                done, err = False, None
            else:
                err = failed_at(k, job, work)
                done = err is None
            where = f"{mode} at step {k} of {len(log)} ({log[k - 1]}; commit at {commit}): {err}"
            tensors = loaded(work)
            if k <= commit and not done:
                assert same(tensors, old_state[0]), where  # the previous export, bit for bit
            else:
                assert same(tensors, new_state[0]), where
            for i, name in ((1, CONFIG_NAME), (2, TOKENIZER)):  # replaced just before the index (the window)
                got = read(os.path.join(work, name))
                assert got == new_state[i] or (k <= commit and not done and got == old_state[i]), (where, name)
            if err is not None and k <= commit:
                assert everything(work) == before, where  # a failure puts everything back, leaves nothing
            assert {n: entry(os.path.join(work, n)) for n in users} == users, where
            if not done or everything(work) != clean:
                # the next export recovers: a killed one's lock is free, its staging files go
                export_hf(_SRC["src1"], work, **kw)
            assert everything(work) == clean, where
            shutil.rmtree(work)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --- explicit cases -----------------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_transformers_loads_an_export_killed_right_after_its_staging_index(tmp_path) -> None:
    """Every file name in use: killed right after the staging index was renamed into place, the directory is
    the new model, read by transformers from the export's staging directory (before that rename it is the
    previous model: the generated test above)."""
    transformers = pytest.importorskip("transformers")

    def logits(d: str) -> torch.Tensor:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
        with torch.no_grad():
            return model(torch.arange(12).reshape(1, 12)).logits

    kw: dict[str, Any] = {"max_shard_size": "300KB", "overwrite": True, "workers": 1}
    first, second, d = str(tmp_path / "first"), str(tmp_path / "second"), str(tmp_path / "killed")
    export_hf(_SRC["src0"], first, **kw)
    export_hf(_SRC["src1"], second, **kw)
    shutil.copytree(first, d)
    with each_step(d, lambda n: None) as log:  # (counted on the copy, which is exported over again below)
        export_hf(_SRC["src1"], d, **kw)
    commit = 1 + next(i for i, (op, p) in enumerate(log) if op == "replace" and p == INDEX_NAME)
    shutil.rmtree(d)
    shutil.copytree(first, d)
    killed_at(commit + 1, lambda: export_hf(_SRC["src1"], d, **kw), d)
    with open(os.path.join(d, INDEX_NAME)) as f:
        assert all(v.startswith(publish.STAGE_PREFIX) for v in json.load(f)["weight_map"].values())
    assert same(loaded(d), loaded(second)) and not same(loaded(d), loaded(first))
    assert torch.equal(logits(d), logits(second))


def test_a_failed_export_removes_only_what_it_created(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: the clean-up after a failure deleted every name the export had recorded, created or not; with
    overwrite that included a user's file at a shard name (here a file opened, or refused, at that name)."""
    out = tmp_path / "hf"
    export_hf(_SRC["src0"], str(out))  # one file: model-00001-of-00001
    mine = out / "model-00003-of-00004.safetensors"  # a user's file at a name the next export writes
    mine.write_bytes(b"my own weights")
    before = everything(str(out))
    real_init = local.LocalWriter.__init__

    def init(w: Any, full: str) -> None:  # the 3rd shard cannot be created
        if os.path.basename(full) == mine.name:
            raise StorageError(f"{full}: injected: cannot create file")
        real_init(w, full)

    with monkeypatch.context() as mp:
        mp.setattr(local.LocalWriter, "__init__", init)
        with pytest.raises(StorageError, match="injected"):
            export_hf(_SRC["src1"], str(out), max_shard_size="200KB", overwrite=True)
    assert everything(str(out)) == before
    # a failure later on (config.json committed, then a side file fails): the config is put back too
    real_put = publish._put_local

    def put(root: str, stage: str, name: str, data: bytes) -> None:
        if name == TOKENIZER:
            raise StorageError("injected: commit failed")
        real_put(root, stage, name, data)

    with monkeypatch.context() as mp:
        mp.setattr(publish, "_put_local", put)
        with pytest.raises(StorageError, match="injected"):
            export_hf(_SRC["src1"], str(out), max_shard_size="200KB", overwrite=True, dtype="bf16")
    assert everything(str(out)) == before
    # with no failure, the model's weight names are the export's to replace (the user's file there included)
    export_hf(_SRC["src1"], str(out), max_shard_size="200KB", overwrite=True)
    assert mine.read_bytes() != b"my own weights" and same(loaded(str(out)), _export_of("src1", tmp_path, "200KB"))


def _export_of(src: str, tmp_path: Any, size: str) -> dict[str, torch.Tensor]:
    d = str(tmp_path / f"ref-{src}-{size}")
    export_hf(_SRC[src], d, max_shard_size=size)
    return loaded(d)


def _pause_first_write(out: str) -> tuple[threading.Event, threading.Event, Callable[[], None]]:
    """Make the first data-file write under ``out`` wait; (paused, go, undo)."""
    real = local.LocalWriter.write
    paused, go = threading.Event(), threading.Event()

    def write(w: Any, data: Any) -> None:
        if w.full.startswith(out + os.sep) and not go.is_set():
            paused.set()
            go.wait(30)
        real(w, data)

    local.LocalWriter.write = write  # type: ignore[method-assign]
    return paused, go, lambda: setattr(local.LocalWriter, "write", real)


def test_a_second_concurrent_export_fails_at_once_and_deletes_nothing(tmp_path) -> None:
    out = str(tmp_path / "hf")
    export_hf(_SRC["src0"], out, max_shard_size="200KB")
    paused, go, undo = _pause_first_write(out)
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(export_hf(_SRC["src1"], out, max_shard_size="300KB",
                                                             overwrite=True)))
    try:
        t.start()
        assert paused.wait(30)
        staged = [p for p in everything(out) if p.startswith(publish.STAGE_PREFIX)]
        assert staged, "the first export writes under its own staging names"
        listing = everything(out)
        for kw in ({"overwrite": True}, {"overwrite": True, "max_shard_size": "300KB"}):
            t0 = time.monotonic()
            with pytest.raises(DirectoryInUseError, match="another export into this directory is running"):
                export_hf(_SRC["src0"], out, **kw)
            assert time.monotonic() - t0 < 5
        assert everything(out) == listing  # nothing of the first one deleted, nothing added
    finally:
        go.set()
        t.join(60)
        undo()
    assert box and same(loaded(out), _export_of("src1", tmp_path, "300KB"))
    assert publish.LOCK_NAME not in os.listdir(out)
    assert not [p for p in os.listdir(out) if p.startswith(publish.STAGE_PREFIX)]


@pytest.mark.multiproc
def test_an_export_in_another_process_holds_the_directory_until_it_dies(tmp_path) -> None:
    out = str(tmp_path / "hf")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: holds the lock (paused at its first write) until killed
        try:
            os.close(r)
            torch.set_num_threads(1)
            real = local.LocalWriter.write

            def write(wr: Any, data: Any) -> None:
                os.write(w, b"x")
                time.sleep(600)
                real(wr, data)
            local.LocalWriter.write = write  # type: ignore[method-assign]
            export_hf(_SRC["src0"], out)
        finally:
            os._exit(1)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x"
        for overwrite in (False, True):  # (its files are under its staging names: nothing looks like a model yet)
            with pytest.raises(DirectoryInUseError, match=rf"pid {pid} "):
                export_hf(_SRC["src1"], out, overwrite=overwrite)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    export_hf(_SRC["src1"], out, overwrite=True)  # the kernel dropped its lock; its staging files go
    assert sorted(os.listdir(out)) == sorted(["config.json", "model-00001-of-00001.safetensors", INDEX_NAME,
                                              TOKENIZER])


def test_the_lock_never_takes_a_users_file_or_link(tmp_path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    lock = out / publish.LOCK_NAME
    lock.write_bytes(b"my file")
    with pytest.raises(StorageError, match="did not write"):
        export_hf(_SRC["src0"], str(out))
    assert lock.read_bytes() == b"my file" and sorted(os.listdir(out)) == [publish.LOCK_NAME]
    lock.unlink()
    target = tmp_path / "precious.bin"
    target.write_bytes(b"precious")
    lock.symlink_to(target)
    with pytest.raises(StorageError, match="symbolic link"):
        export_hf(_SRC["src0"], str(out))
    assert lock.is_symlink() and target.read_bytes() == b"precious"


def test_object_store_overwrite_is_refused_while_held_and_says_what_a_failure_left(tmp_path, monkeypatch) -> None:
    """fsspec (no rename): files go under their final names, the index last; replacing files of the same names
    first puts a tombstone index, so that a failure leaves a directory ckpt names as incomplete."""
    from ckpt import _transaction as transaction
    from ckpt.storage import fsspec_backend

    url = f"memory://export-crash-{tmp_path.name}"
    export_hf(_SRC["src0"], url, max_shard_size="200KB")
    st_ = get_storage(url)
    with transaction.live_writer() as me, publish.ExportLock(st_, me), pytest.raises(DirectoryInUseError):
        export_hf(_SRC["src1"], url, max_shard_size="200KB", overwrite=True)  # held by a live writer: refused
    real = fsspec_backend.FsspecWriter.write
    n = [0]

    def write(w: Any, data: Any) -> None:
        n[0] += 1
        if n[0] == 3:
            raise StorageError("injected write failure")
        real(w, data)

    with monkeypatch.context() as mp:
        mp.setattr(fsspec_backend.FsspecWriter, "write", write)
        with pytest.raises(StorageError, match="injected"):
            export_hf(_SRC["src1"], url, max_shard_size="200KB", overwrite=True)
    with pytest.raises(ManifestError, match="run the export again"):
        read_hf_source(st_)
    export_hf(_SRC["src1"], url, max_shard_size="200KB", overwrite=True)
    assert publish.LOCK_NAME not in st_.list()
    read_hf_source(st_)
    with open(os.path.join(str(tmp_path), "ref-index.json"), "wb") as f:
        f.write(st_.read_file(INDEX_NAME))
    export_hf(_SRC["src1"], str(tmp_path / "ref"), max_shard_size="200KB")
    assert (tmp_path / "ref-index.json").read_bytes() == (tmp_path / "ref" / INDEX_NAME).read_bytes()
    assert all(st_.read_file(n) == (tmp_path / "ref" / n).read_bytes() for n in os.listdir(tmp_path / "ref"))
    # a killed export's lock (a writer that is gone) is taken over
    gone = {"host": "h", "machine": "m", "pid": 1, "start": None, "token": "0" * 12, "time": 0.0}
    st_.commit(publish.LOCK_NAME, json.dumps({"ckpt": publish.LOCK_TAG, **gone}).encode())
    export_hf(_SRC["src0"], url, max_shard_size="200KB", overwrite=True)
    assert publish.LOCK_NAME not in st_.list()
