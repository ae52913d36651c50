"""A restore that reads the memory checkpoint from the slot mapped ahead of it (``pin_ahead``; pinned
on a GPU): the same bytes and checks as the ``pread`` path, for any piece sizes and chunking, a
corrupt byte named on either path, a slot file replaced under its mapping never read through it, and
the slot mapped ahead reused by the snapshots that follow."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import IntegrityError
from ckpt.tier import MemoryTier, TierConfig, fastload
from tests.tier.slot_states import data_file, flip, same, state_of, zeros

ROOT = "/tier-tests/pin-ahead"
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]


def _tier(shm: str, **kw: Any) -> MemoryTier:
    return MemoryTier(TierConfig(ROOT, shm_dir=shm, replicas=0, **kw))


def _saved(shm: str, steps: tuple[int, ...], **kw: Any) -> MemoryTier:
    tier = _tier(shm, **kw)
    tier.reset(None)
    for step in steps:
        assert tier.save(step, state_of(step)).complete
    tier.close()  # as a killed process leaves it: files in shared memory, nothing mapped
    return tier


def test_pin_ahead_maps_the_newest_committed_step_and_the_restore_reads_it_there(shm: str) -> None:
    _saved(shm, (1, 2, 3), keep=2)
    again = _tier(shm, keep=2)
    os.unlink(os.path.join(again.store.own(3), "manifest.msgpack"))  # step 3 never committed
    again.pin_ahead("cpu")
    again.drain()
    data = data_file(again.store.own(2))
    assert again.pin_stats["step"] == 2 and again.pin_stats["bytes"] == data.stat().st_size
    assert again.pin_stats["pinned"] is False  # nothing to pin for a CPU job
    target, stats = zeros(), {}
    again.load_local(target, again.store.own(2), stats=stats)
    assert same(target, state_of(2))
    assert stats["bytes_mapped"] == stats["bytes_read"] == sum(t.numel() * t.element_size()
                                                               for t in state_of(2)["model"].values())
    again.clear()


def test_pin_ahead_with_nothing_to_map_leaves_restore_as_it_was(shm: str) -> None:
    tier = _tier(shm)
    tier.reset(None)
    tier.pin_ahead("cpu")
    assert tier.restore(zeros()) is None
    assert tier.pin_stats["step"] is None and tier.pin_stats["bytes"] == 0
    tier.clear()


def test_a_slot_file_replaced_under_its_mapping_is_not_read_through_it(shm: str) -> None:
    _saved(shm, (1,))
    again = _tier(shm)
    again.pin_ahead("cpu")
    again.drain()
    url = again.store.own(1)
    data = data_file(url)
    slot_bytes = again._slots.mapped()  # the mapping of the slot that step 1 links
    assert len(slot_bytes) == 1
    copy = data.with_suffix(".tmp")
    shutil.copyfile(data, copy)
    os.replace(copy, data)  # the step's data file is another inode now, with the same bytes
    (mapping,) = slot_bytes.values()
    mapping[mapping.numel() // 2 :] = 0  # the old inode's bytes: wrong for the step now
    target, stats = zeros(), {}
    again.load_local(target, url, stats=stats)
    assert same(target, state_of(1)) and stats["bytes_mapped"] == 0  # read from the file, through pread
    again.clear()


def test_the_snapshots_after_the_restore_reuse_the_slot_mapped_ahead(shm: str) -> None:
    _saved(shm, (1, 2))
    again = _tier(shm)
    again.pin_ahead("cpu")
    again.drain()
    (slot,) = [s for s in again._slots._slots.values() if s.base is not None]
    ptr = slot.base_ptr
    got = again.restore(zeros())
    assert got is not None and got.step == 2
    again.reset(2)
    for step in (3, 4):  # step 3's slot is the free one; step 4 gets step 2's once 3 is complete
        assert again.save(step, state_of(step)).complete
    assert slot.base is not None and slot.base_ptr == ptr  # the same mapping: nothing mapped again
    assert data_file(again.store.own(4)).stat().st_ino == os.stat(slot.path).st_ino
    target = zeros()
    assert again.restore(target) is not None and same(target, state_of(4))
    again.clear()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.sampled_from(DTYPES)), min_size=1, max_size=5),
       st.sampled_from([4, 64, 4096]), st.sampled_from([8, 256, 1 << 16]), st.data())
def test_mapped_and_pread_paths_load_the_same_bytes_and_catch_the_same_flip(
        specs: list[tuple[int, torch.dtype]], chunk: int, mapped_chunk: int, data: st.DataObject) -> None:
    g = torch.Generator().manual_seed(len(specs))
    state = {f"t{i}": (torch.randn(n, generator=g) * 1000).to(dt) for i, (n, dt) in enumerate(specs)}
    shm = tempfile.mkdtemp(prefix="ckpt-test-pin-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    old = fastload.CHUNK, fastload.MAPPED
    fastload.CHUNK, fastload.MAPPED = chunk, mapped_chunk  # (module globals read at call time)
    try:
        tier = _tier(shm)
        tier.reset(None)
        assert tier.save(1, state).complete
        url = tier.store.own(1)
        st_ = data_file(url).stat()
        mapped = tier._slots.mapped()
        # the step's slot, and the spare one shaped ahead for the next memory checkpoint
        assert len(mapped) == 2 and (st_.st_dev, st_.st_ino) in mapped
        mapped = {k: v for k, v in mapped.items() if k == (st_.st_dev, st_.st_ino)}
        for m in (mapped, None):
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            planned = fastload.plan_pieces(target, url)
            assert planned is not None
            stats: dict[str, Any] = {}
            fastload.load_pieces(planned[1], workers=3, mapped=m, stats=stats)
            assert all(torch.equal(target[k], state[k]) for k in state)
            assert stats["bytes_mapped"] == (sum(p.length for p in planned[1]) if m else 0)
        sized = [k for k, v in state.items() if v.numel()]
        if sized:  # one flipped byte anywhere in a piece: named on both paths
            key = data.draw(st.sampled_from(sized))
            length = ckpt.inspect(url).tensors[key].shards[0].length
            flip(url, key, data.draw(st.integers(0, length - 1)), mask=0x21)
            for m in (mapped, None):
                target = {k: torch.zeros_like(v) for k, v in state.items()}
                planned = fastload.plan_pieces(target, url)
                assert planned is not None
                with pytest.raises(IntegrityError, match=key) as e:
                    fastload.load_pieces(planned[1], workers=3, mapped=m)
                assert getattr(e.value, "partial", False)
        tier.clear()
    finally:
        fastload.CHUNK, fastload.MAPPED = old
        shutil.rmtree(shm, ignore_errors=True)
