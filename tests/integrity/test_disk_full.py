"""Disk full: a save into a filesystem that runs out of space (or inodes) fails with a clear
StorageError, leaves no manifest and no partial data file, and the previous checkpoint still verifies.

The filesystem is a size-limited tmpfs the test mounts (root only: skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

import ckpt
from ckpt.manifest import MANIFEST_NAME
from tests.helpers import assert_same_state, load_like, random_state

pytestmark = pytest.mark.multiproc

PAGE = 4096


def _mount(path: str, options: str) -> Iterator[str]:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root to mount a size-limited tmpfs (mount -t tmpfs -o size=4m tmpfs DIR)")
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) on this machine")
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); a container without "
                    "CAP_SYS_ADMIN cannot run this test")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


@pytest.fixture
def small_fs(tmp_path) -> Iterator[str]:
    yield from _mount(str(tmp_path / "small"), "size=4m")


@pytest.fixture
def few_inodes(tmp_path) -> Iterator[str]:
    yield from _mount(str(tmp_path / "inodes"), "size=4m,nr_inodes=12")


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path: str, leave: int) -> str:
    """A filler file that leaves ``leave`` bytes (rounded down to pages) free on ``path``'s filesystem."""
    filler = os.path.join(path, "filler")
    size = max(0, _free(path) - leave)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if size:
            os.posix_fallocate(fd, 0, size - size % PAGE)
    finally:
        os.close(fd)
    return filler


def _leftovers(url: str) -> list[str]:
    """Files a failed save left in its directory (none expected)."""
    return [os.path.relpath(os.path.join(d, f), url) for d, _, fs in os.walk(url) for f in fs]


def _state(step: int, n: int) -> dict:
    return random_state(step, {"w": (n,), "b": ((n // 8,), torch.bfloat16)}, step=step)


def _assert_same(url: str, state: dict) -> None:
    assert_same_state(load_like(url, state, verify=True), state)


def _stage(err: ckpt.StorageError) -> str:
    msg = str(err)
    if "atomic commit failed" in msg:
        return "manifest"
    if "write failed" in msg:
        return "data-write"
    if "cannot create" in msg:
        return "create"
    if "fsync" in msg:
        return "fsync"
    return "other: " + msg


def test_every_amount_of_free_space_fails_cleanly_or_saves_whole(small_fs: str):
    prev_state = _state(1, 4096)
    prev = os.path.join(small_fs, "prev")
    ckpt.save(prev_state, prev, step=1)
    state = _state(2, 64 * 1024)  # 256 KiB + 32 KiB of tensors
    need = 64 * 1024 * 4 + 8 * 1024 * 2
    stages: Counter[str] = Counter()
    saved = 0
    for i, leave in enumerate(range(0, need + 6 * PAGE, PAGE)):
        filler = _fill(small_fs, leave)
        url = os.path.join(small_fs, f"try{i}")
        try:
            ckpt.save(state, url, step=2)
        except ckpt.StorageError as e:
            assert "No space left on device" in str(e), e
            stages[_stage(e)] += 1
            assert not os.path.exists(os.path.join(url, MANIFEST_NAME))
            assert _leftovers(url) == [], f"a failed save left files behind: {_leftovers(url)}"
            with pytest.raises(ckpt.ManifestError, match="no committed checkpoint"):
                ckpt.load({"w": torch.zeros(1)}, url)
        else:
            saved += 1
            assert ckpt.verify(url, deep=True).ok
            _assert_same(url, state)
        finally:
            os.unlink(filler)
            shutil.rmtree(url, ignore_errors=True)
        assert ckpt.verify(prev, deep=True).ok
        _assert_same(prev, prev_state)
    # the sweep ran out of space in the data write and in the manifest commit, and saved once it fit
    assert stages["data-write"] > 0 and stages["manifest"] > 0, stages
    assert saved > 0 and not [s for s in stages if s.startswith("other")], stages
    print(f"disk-full sweep: {sum(stages.values())} failed saves by stage {dict(stages)}, {saved} saved")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_manager_on_a_full_disk_keeps_latest(small_fs: str, async_save: bool):
    root = os.path.join(small_fs, "run")
    mgr = ckpt.CheckpointManager(root, keep_last=2, async_save=async_save)
    first = _state(1, 4096)
    h = mgr.save(1, first)
    if async_save:
        h.done()
    big = _state(2, 512 * 1024)  # 2 MiB + 256 KiB: more than is left after the filler
    filler = _fill(small_fs, 1 << 20)
    with pytest.raises(ckpt.StorageError, match="No space left on device"):
        h = mgr.save(2, big)
        if async_save:
            h.done()
    os.unlink(filler)
    assert mgr.latest() == mgr.url_for(1)
    assert ckpt.verify(mgr.url_for(1), deep=True).ok
    _assert_same(mgr.url_for(1), first)
    assert not os.path.exists(os.path.join(mgr.url_for(2), MANIFEST_NAME))
    # with the space back, the next save commits and retention works as usual
    h = mgr.save(3, first)
    if async_save:
        h.done()
    assert mgr.latest() == mgr.url_for(3) and ckpt.verify(mgr.url_for(3), deep=True).ok


def test_out_of_inodes_is_a_storage_error(few_inodes: str):
    prev = os.path.join(few_inodes, "prev")
    ckpt.save(_state(1, 256), prev, step=1)
    i = 0
    while True:  # use up the remaining inodes
        try:
            os.mkdir(os.path.join(few_inodes, f"x{i}"))
        except OSError:
            break
        i += 1
    with pytest.raises(ckpt.StorageError, match="No space left on device"):
        ckpt.save(_state(2, 256), os.path.join(prev, "..", f"x{0}", "c"), step=2)
    assert ckpt.verify(prev, deep=True).ok
