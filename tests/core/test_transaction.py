"""The commit transaction's rules (ckpt/_transaction.py), one regression test per way the audit lost data.

1. validate and encode everything before writing any byte; 2. create exclusively; 3. write new data
under fresh names; 4. commit by one atomic step; 5. delete only replaced data-area files, after it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

import ckpt
from ckpt import _transaction as transaction
from ckpt.errors import CheckpointExistsError, StateError
from ckpt.layout import Layout
from ckpt.manager import gc, list_checkpoints, step_dir
from ckpt.manifest import MANIFEST_NAME
from ckpt.resharders.reshard import reshard
from tests.dist_utils import run_ranks
from tests.helpers import random_state
from tests.manifest_edit import edit_manifest, read_manifest, write_manifest


def _files(d: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, d)] = fh.read()
    return out


def _state(seed: int) -> dict:
    return random_state(seed, {"w": (4, 6), "b": (6,)}, step=seed)


def _assert_loads(url: str, seed: int) -> None:
    want = _state(seed)
    got = ckpt.load({"w": torch.zeros(4, 6), "b": torch.zeros(6), "step": 0}, url, verify=True)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["step"] == seed


# --- rule 5: the data area ---------------------------------------------------------------------

@pytest.mark.parametrize("path,ok", [
    ("data/00000-0123456789ab.safetensors", True), ("zarr/w/c/0/0", True), ("zarr-0123456789ab/zarr.json", True),
    (MANIFEST_NAME, False), ("data", False), ("data/", False), ("../data/x", False), ("/data/x", False),
    ("zarrx/w", False), ("train.jsonl", False), ("data/../manifest.msgpack", False), ("zarr-XYZ/a", False),
    ("data/train.jsonl", False), ("data/00000-0123456789ab.safetensors.tmp", False),
])
def test_data_area(path: str, ok: bool) -> None:
    assert transaction.in_data_area(path) is ok


# --- 1. reshard into a directory that is not a checkpoint -------------------------------------

def test_reshard_refuses_a_directory_with_user_files_and_deletes_nothing(tmp_path, moe_checkpoint):
    dst = tmp_path / "dst"
    (dst / "data").mkdir(parents=True)
    (dst / "data" / "train.jsonl").write_text('{"text": "mine"}\n')
    (dst / "notes.txt").write_text("keep me")
    before = _files(str(dst))
    with pytest.raises(StateError, match="not part of a ckpt checkpoint"):
        reshard(moe_checkpoint, str(dst), Layout.parse("tp=2"))
    assert _files(str(dst)) == before


def test_reshard_over_a_checkpoint_keeps_user_files_beside_it(tmp_path, moe_checkpoint):
    dst = str(tmp_path / "dst")
    reshard(moe_checkpoint, dst, Layout.parse("tp=2"))
    with open(os.path.join(dst, "README.md"), "w") as f:
        f.write("mine")
    # a foreign file in the root is not the reshard's to judge once a checkpoint is there with --overwrite
    with pytest.raises(StateError, match="README.md"):
        reshard(moe_checkpoint, dst, Layout.parse("ep=2"), overwrite=True)
    os.unlink(os.path.join(dst, "README.md"))
    m = reshard(moe_checkpoint, dst, Layout.parse("ep=2"), overwrite=True)
    assert set(m.files) == {f for f in _files(dst) if f != MANIFEST_NAME}


@pytest.fixture
def moe_checkpoint(tmp_path) -> str:
    from tests.resharders.moe_states import save_single  # the embedded MoE, saved under one layout

    url = str(tmp_path / "src")
    save_single(url)
    return url


# --- 2. ranks with different non-tensor keys ---------------------------------------------------

def _per_rank_keys(rank: int, world: int, url: str) -> None:
    state = {"w": torch.arange(8.0), "dataloader": {f"dp_rank_{rank}": bytes([rank] * 3)}, "step": 5}
    ckpt.save(state, url, step=5)
    got = ckpt.load({"w": torch.zeros(8), "dataloader": {f"dp_rank_{rank}": b""}, "step": 0}, url, strict=False)
    assert got["dataloader"][f"dp_rank_{rank}"] == bytes([rank] * 3)
    # conflicting values of one global key: refused, naming the key and both ranks; nothing committed
    with pytest.raises(StateError, match=r"'lr'.*ranks 0 and 1.*PerRank"):
        ckpt.save({"w": torch.arange(8.0), "lr": 0.1 * (rank + 1)}, url + "-bad")
    assert not os.path.exists(os.path.join(url + "-bad", MANIFEST_NAME))


@pytest.mark.multiproc
def test_union_of_rank_specific_global_keys_and_conflicts_refused(tmp_path):
    url = str(tmp_path / "c")
    run_ranks(2, _per_rank_keys, url)
    # once every rank is done (each drops its own lease after the refusal, not in step with the others)
    assert not [f for f in _files(url + "-bad") if f.startswith("data/") or f.startswith(".writing")]
    m = ckpt.inspect(url)
    assert {"dataloader.dp_rank_0", "dataloader.dp_rank_1", "step"} <= set(m.objects)


# --- 3. zarr overwrite never touches the committed chunks ---------------------------------------

def _grid(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 4, generator=g), "v": torch.randn(3, generator=g)}


def _load_grid(url: str) -> dict:
    return ckpt.load({"w": torch.zeros(4, 4), "v": torch.zeros(3)}, url, verify=True)


def test_zarr_overwrite_crash_keeps_old_checkpoint_exact(tmp_path, monkeypatch):
    url = str(tmp_path / "z")
    ckpt.save(_grid(1), url, data_format="zarr")
    old = _files(url)
    from ckpt.storage.local import LocalStorage

    real = LocalStorage.open_writer

    def full_disk(self, path):  # the second chunk cannot be written
        if "/w/c/" in path:
            raise ckpt.StorageError(f"{path}: No space left on device")
        return real(self, path)

    monkeypatch.setattr(LocalStorage, "open_writer", full_disk)
    with pytest.raises(ckpt.StorageError):
        ckpt.save(_grid(2), url, data_format="zarr", overwrite=True)
    monkeypatch.setattr(LocalStorage, "open_writer", real)
    assert _files(url) == old  # every old byte intact, and the failed save left nothing
    got = _load_grid(url)
    assert torch.equal(got["w"], _grid(1)["w"]) and torch.equal(got["v"], _grid(1)["v"])
    m = ckpt.save(_grid(3), url, data_format="zarr", overwrite=True)
    assert torch.equal(_load_grid(url)["w"], _grid(3)["w"])
    assert all(f.startswith("zarr-") for f in m.files)
    assert {f for f in _files(url) if f != MANIFEST_NAME} == set(m.files)  # old tree and crash leftovers gone


# --- 4. nothing undecodable is ever committed; bad headers are refused before any write ----------

@pytest.mark.parametrize("kwargs", [
    {"step": 2.0}, {"step": "5"}, {"step": True}, {"user_metadata": {"x": {1, 2}}},
    {"user_metadata": {"x": object()}}, {"user_metadata": {"\udc80": 1}}, {"user_metadata": [1]},
])
def test_bad_header_refused_before_any_write_and_previous_intact(tmp_path, kwargs):
    url = str(tmp_path / "c")
    ckpt.save(_state(1), url)
    before = _files(url)
    with pytest.raises(StateError):
        ckpt.save(_state(2), url, overwrite=True, **kwargs)
    assert _files(url) == before
    _assert_loads(url, 1)
    with pytest.raises(StateError):
        ckpt.save(_state(2), str(tmp_path / "new"), **kwargs)
    assert not _files(str(tmp_path / "new")) if os.path.exists(tmp_path / "new") else True


def test_numpy_and_torch_integer_steps_are_ints(tmp_path):
    np = pytest.importorskip("numpy")
    m = ckpt.save(_state(1), str(tmp_path / "a"), step=np.int64(3))
    assert m.step == 3 and type(m.step) is int
    m = ckpt.save(_state(1), str(tmp_path / "b"), step=torch.tensor(4))
    assert m.step == 4


@pytest.mark.parametrize("key", ["a\\b", "a/b", ".a", "a\x00b"])
def test_zarr_keys_refused_before_writing(tmp_path, key):
    url = str(tmp_path / "z")
    ckpt.save(_grid(1), url, data_format="zarr")
    before = _files(url)
    with pytest.raises(StateError):
        ckpt.save({key: torch.zeros(2, 2)}, url, data_format="zarr", overwrite=True)
    assert _files(url) == before


def test_commit_refuses_bytes_our_decoder_rejects(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save(_state(1), url)
    st = ckpt.storage.get_storage(url)
    with open(os.path.join(url, MANIFEST_NAME), "rb") as f:
        good = f.read()
    with pytest.raises(StateError, match="refusing to commit"):
        transaction.commit_manifest(st, good[:-3] + b"xyz", overwrite=True, written=[])
    _assert_loads(url, 1)


# --- 6. exclusive creation ------------------------------------------------------------------------

def _racer(url: str, seed: int, go, out) -> None:
    torch.set_num_threads(1)
    go.wait()
    try:
        ckpt.save(_state(seed), url)
        out.put((seed, "ok"))
    except CheckpointExistsError:
        out.put((seed, "exists"))
    except BaseException as e:  # noqa: BLE001
        out.put((seed, repr(e)))


@pytest.mark.multiproc
@pytest.mark.parametrize("trial", range(5))
def test_two_processes_saving_one_url_exactly_one_wins(tmp_path, trial):
    url = str(tmp_path / "c")
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(url, s, go, out)) for s in (10 + trial, 20 + trial)]
    for p in procs:
        p.start()
    time.sleep(0.05)
    go.set()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert sorted(results.values()) == ["exists", "ok"], results
    winner = next(s for s, r in results.items() if r == "ok")
    _assert_loads(url, winner)
    m = ckpt.inspect(url)
    assert {f for f in _files(url) if f != MANIFEST_NAME} == set(m.files)  # the loser left nothing


def test_exclusive_local_commit_never_replaces(tmp_path):
    st = ckpt.storage.get_storage(str(tmp_path))
    st.commit("m", b"one", exclusive=True)
    with pytest.raises(CheckpointExistsError):
        st.commit("m", b"two", exclusive=True)
    assert (tmp_path / "m").read_bytes() == b"one"
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no temp file left


# --- 7. a hostile manifest cannot make clean-up delete the manifest or anything outside data/ -----

def test_overwrite_of_hostile_manifest_never_deletes_manifest_or_outside_files(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save(_state(1), url)
    (tmp_path / "c" / "notes.txt").write_text("mine")
    d = read_manifest(url)
    d["files"][MANIFEST_NAME] = {"size": 1}
    d["files"]["notes.txt"] = {"size": 4}
    write_manifest(url, d)
    m = ckpt.save(_state(2), url, overwrite=True)
    _assert_loads(url, 2)
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"
    assert MANIFEST_NAME not in m.files


# --- 5. gc deletes only what is provably an unfinished save of ours ----------------------------------

def _root_with(tmp_path) -> str:
    root = str(tmp_path / "root")
    for s in (1, 2, 3):
        ckpt.save(_state(s), os.path.join(root, step_dir(s)), step=s)
    return root


def test_gc_keeps_damaged_newer_and_symlinked_checkpoints(tmp_path):
    root = _root_with(tmp_path)
    flip = os.path.join(root, step_dir(1), MANIFEST_NAME)
    with open(flip, "rb") as fh:
        raw = bytearray(fh.read())
    raw[len(raw) // 2] ^= 0x10
    with open(flip, "wb") as fh:
        fh.write(bytes(raw))
    edit_manifest(os.path.join(root, step_dir(2)), lambda d: d.update(version=[9, 0]))
    outside = str(tmp_path / "elsewhere")
    ckpt.save(_state(7), outside, step=7)
    os.symlink(outside, os.path.join(root, step_dir(7)))
    os.makedirs(os.path.join(root, step_dir(8), "data"))
    (tmp_path / "root" / step_dir(8) / "data" / "mine.txt").write_text("user file")
    before = {s: _files(os.path.join(root, step_dir(s))) for s in (1, 2, 8)}
    outside_before = _files(outside)
    infos = {c.step: c for c in list_checkpoints(root)}
    assert (infos[1].status, infos[2].status, infos[3].status) == ("unreadable", "unreadable", "committed")
    assert (infos[7].status, infos[8].status) == ("link", "foreign")
    removed = gc(root, keep_last=1)
    assert removed == []  # step 3 is the newest readable one; everything else is not provably ours to drop
    assert {s: _files(os.path.join(root, step_dir(s))) for s in (1, 2, 8)} == before
    assert _files(outside) == outside_before and os.path.islink(os.path.join(root, step_dir(7)))
    _assert_loads(outside, 7)


def test_gc_removes_unfinished_saves_of_ours_and_old_committed_ones(tmp_path):
    root = _root_with(tmp_path)
    d = os.path.join(root, step_dir(9))
    os.makedirs(os.path.join(d, "data"))
    with open(os.path.join(d, "data", "00000-0123456789ab.safetensors"), "wb") as fh:
        fh.write(b"partial")
    os.makedirs(os.path.join(root, step_dir(10)))  # a crash between mkdir and the first write
    removed = {c.step for c in gc(root, keep_last=2)}
    assert removed == {1, 9, 10}
    assert sorted(os.listdir(root)) == [step_dir(2), step_dir(3)]


def test_ls_and_gc_of_a_missing_root_are_errors(tmp_path):
    with pytest.raises(ckpt.StorageError, match="does not exist"):
        list_checkpoints(str(tmp_path / "nope"))
    with pytest.raises(ckpt.StorageError, match="does not exist"):
        gc(str(tmp_path / "nope"))
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ckpt.StorageError, match="not a directory"):
        list_checkpoints(str(f))


def test_retention_failure_after_commit_is_a_warning(tmp_path, monkeypatch):
    import ckpt.manager as manager_mod

    mgr = ckpt.CheckpointManager(str(tmp_path / "r"), keep_last=1)
    h = mgr.save(1, _state(1))
    h.done()

    def broken(*a, **k):
        raise ckpt.StorageError("listing failed")

    monkeypatch.setattr(manager_mod, "gc", broken)
    with pytest.warns(RuntimeWarning, match="retention"):
        h = mgr.save(2, _state(2))
        m = h.done()
    assert m is not None and m.step == 2 and h.error is None
    assert mgr.retention_errors
    monkeypatch.undo()
    mgr.save(3, _state(3)).done()  # the next save is not refused
    mgr.close()
    _assert_loads(mgr.url_for(3), 3)


def test_failure_after_the_manifest_is_in_place_keeps_the_data(tmp_path, monkeypatch):
    """A commit that fails after the rename (e.g. the directory fsync) must not delete the data
    files the now-visible manifest references."""
    from ckpt.storage.local import LocalStorage

    real = LocalStorage.commit

    def fsync_fails(self, path, data, **k):
        real(self, path, data, **k)
        raise ckpt.StorageError(f"{path}: committed, but fsync of its directory failed")

    url = str(tmp_path / "c")
    monkeypatch.setattr(LocalStorage, "commit", fsync_fails)
    with pytest.raises(ckpt.StorageError, match="fsync"):
        ckpt.save(_state(4), url)
    monkeypatch.undo()
    _assert_loads(url, 4)
