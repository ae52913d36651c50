"""The memory tier's in-place write (slots committed by hard link) and its one-pass verified restore:
checksums equal zlib's, a corrupt piece is named and falls back, a state the fast path cannot serve
goes through ``ckpt.load``, a full shared memory is an ENOSPC before anything is mapped, and a
restore whose every copy failed after loading began never passes for a fresh start."""

from __future__ import annotations

import errno
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt._checksum import crc32_parallel
from ckpt.errors import IntegrityError, MismatchError
from ckpt.tier import MemoryTier, TierConfig, fastload
from ckpt.tier.slots import Slot, plan_layout
from tests.tier.slot_states import data_file, flip, same, state_of, zeros

ROOT = "/tier-tests/slots"


def _saved(shm: str, steps: tuple[int, ...] = (1,), **kw: Any) -> tuple[MemoryTier, str]:
    """A one-process tier (no peer copies) with ``steps`` saved; the newest one's directory."""
    tier = MemoryTier(TierConfig(ROOT, shm_dir=shm, replicas=0, **kw))
    tier.reset(None)
    for step in steps:
        assert tier.save(step, state_of(step)).complete
    return tier, tier.store.own(steps[-1])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(max_size=5000), max_size=6), st.integers(1, 4), st.sampled_from([1, 7, 64, 4096]))
def test_parallel_checksums_equal_zlib(bufs: list[bytes], workers: int, chunk: int) -> None:
    seen: list[int] = []
    got = crc32_parallel(bufs, workers, chunk=chunk, nice=5, before=seen.append)
    assert got == [zlib.crc32(b) for b in bufs]
    assert {i for i, b in enumerate(bufs) if b} <= set(seen) <= set(range(len(bufs)))  # each one announced


def test_a_memory_checkpoint_is_its_slot_linked_and_restores_bitwise(shm: str) -> None:
    tier, url = _saved(shm, (1, 2, 3))
    data = data_file(url)
    assert data.stat().st_nlink == 2  # the slot and the step: no byte was written twice
    assert data.stat().st_ino in {p.stat().st_ino for p in Path(tier.store.own_root(), ".slots").iterdir()}
    assert ckpt.verify(tier.store.own(3), deep=True).ok  # an ordinary, checksummed checkpoint
    target = zeros()
    stats: dict[str, Any] = {}
    tier.load_local(target, tier.store.own(3), stats=stats)
    assert same(target, state_of(3)) and stats["bytes_read"] == stats["bytes_verified"] > 6 << 20
    tier.clear()


def test_a_corrupt_piece_is_named_and_marked_partial(shm: str) -> None:
    tier, url = _saved(shm)
    flip(url, "model.big", -5)  # one flipped byte in the last chunk of the 6 MiB piece
    planned = fastload.plan_pieces({"model.big": torch.zeros(3 << 19)}, url)
    assert planned is not None
    with pytest.raises(IntegrityError, match="model.big") as e:
        fastload.load_pieces(planned[1], workers=3)
    assert getattr(e.value, "partial", False)
    target = zeros()
    with pytest.raises(IntegrityError, match="model.big"):
        tier.load_local(target, url)
    tier.clear()


def test_a_target_the_fast_path_cannot_serve_goes_through_ckpt_load(shm: str) -> None:
    tier, url = _saved(shm)
    wrong = zeros()
    wrong["model"]["h"] = torch.zeros(64, 33)  # float32 target, bfloat16 stored: not a whole-piece copy
    assert fastload.plan_pieces({"model.h": wrong["model"]["h"]}, url) is None
    with pytest.raises(MismatchError, match="model.h"):
        tier.load_local(wrong, url)
    strided = zeros()
    strided["model"]["h"] = torch.zeros(33, 64, dtype=torch.bfloat16).t()  # not contiguous: ckpt.load fills it
    tier.load_local(strided, url)
    assert same(strided, state_of(1))
    tier.clear()


def test_a_plan_that_does_not_match_the_slot_writes_an_ordinary_file(shm: str, monkeypatch: Any) -> None:
    import ckpt.tier.inplace as inplace

    monkeypatch.setattr(inplace, "matches", lambda prep, slot: False)
    tier, url = _saved(shm)
    assert data_file(url).stat().st_nlink == 1  # a file of its own, written by ckpt.save
    target = zeros()
    assert tier.restore(target) is not None and same(target, state_of(1))
    tier.clear()


def test_matches_refuses_tensors_that_are_not_the_slots_bytes(shm: str) -> None:
    from ckpt._comm import Comm
    from ckpt.save import prepare
    from ckpt.storage import get_storage
    from ckpt.tier.inplace import matches

    flat = {"a": torch.arange(10.0), "b": torch.ones(3, 4, dtype=torch.bfloat16)}
    slot = Slot(os.path.join(shm, "slot-0"))
    slot.shape_for(plan_layout(flat), pin=False)
    views = {k: slot.views[k] for k in flat}
    storage = get_storage(os.path.join(shm, "ck"))
    assert matches(prepare(Comm(None), storage, views), slot)
    assert not matches(prepare(Comm(None), storage, flat), slot)  # the caller's tensors, not the slot's
    swapped = {"a": views["a"], "b": slot.views["b"].clone()}
    assert not matches(prepare(Comm(None), storage, swapped), slot)
    slot.close()


def test_shared_memory_full_is_an_enospc_before_anything_is_mapped(shm: str, monkeypatch: Any) -> None:
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    slot = Slot(os.path.join(shm, "slot-0"))
    with pytest.raises(OSError, match="No space left"):
        slot.shape_for(plan_layout({"a": torch.ones(1000)}), pin=False)
    assert not os.path.exists(slot.path) and slot.base is None  # its bytes given back, nothing mapped


def test_every_copy_failing_after_loading_began_is_not_a_fresh_start(shm: str, tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=shm, replicas=0, memory_timeout=30)
    assert mgr.memory is not None
    mgr.save_memory(1, state_of(1)).result()
    flip(mgr.memory.store.own(1), "model.big", 3 << 20)
    target = zeros()
    with pytest.raises(IntegrityError, match="no persistent checkpoint"):
        mgr.restore(target)  # the memory copy failed its checksum after part of it was copied
    assert mgr.memory.restore_clobbered
    # the failed copy is gone: the restarted job starts fresh, as it should (the first job's process is gone:
    # its tier gives the run id back, see ckpt.tier.runlock)
    mgr.memory.close()
    again = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=shm, replicas=0)
    assert again.restore(zeros()) is None
    # with a persistent checkpoint to fall back on, the same failure restores it, bitwise
    again.save(1, state_of(1))
    assert again.memory is not None
    again.save_memory(2, state_of(2)).result()
    flip(again.memory.store.own(2), "model.big", 3 << 20)
    target = zeros()
    assert again.restore(target) == 1 and same(target, state_of(1))
    again.close()


def test_staged_is_idempotent_and_harmless_without_gpu_copies(shm: str) -> None:
    tier = MemoryTier(TierConfig(ROOT, shm_dir=shm, replicas=0))
    tier.reset(None)
    state = state_of(1)
    h = tier.save_async(1, state, deferred=True)
    h.staged()
    h.staged()
    for v in state["model"].values():
        v.zero_()
    assert h.result().complete
    target = zeros()
    assert tier.restore(target) is not None and same(target, state_of(1))
    tier.clear()


def test_a_job_keeping_fewer_copies_gives_back_the_extra_slots(shm: str) -> None:
    tier, _url = _saved(shm, (1, 2, 3), keep=2)
    slots = Path(tier.store.own_root(), ".slots")
    assert sorted(p.name for p in slots.iterdir()) == ["slot-0", "slot-1", "slot-2"]
    tier.close()  # (its process is gone: the run id is free again)
    again = MemoryTier(TierConfig(ROOT, shm_dir=shm, replicas=0, keep=1))  # the restarted job keeps 1
    got = again.restore(zeros())
    assert got is not None and got.step == 3
    again.reset(3)
    assert again.save(4, state_of(4)).complete
    # at most keep + 1 slots: step 3's (linked until step 4 was complete) and step 4's
    assert len(list(slots.iterdir())) <= 2
    target = zeros()
    assert again.restore(target) is not None and same(target, state_of(4))
    again.clear()


def test_a_manifest_naming_a_file_outside_the_copy_is_not_read_by_the_fast_path(shm: str) -> None:
    from ckpt.formats.msgpack_codec import decode_manifest, encode_manifest

    tier, url = _saved(shm)
    path = Path(url, "manifest.msgpack")
    m = decode_manifest(path.read_bytes())
    outside = "../../outside.safetensors"
    (size,) = m.files.values()  # one data file: this rank's
    m.files = {outside: size}
    for t in m.tensors.values():
        for s in t.shards:
            s.file = outside
    path.write_bytes(encode_manifest(m))
    assert fastload.plan_pieces({"model.big": torch.zeros(3 << 19)}, url) is None
    with pytest.raises(ckpt.CheckpointError):
        tier.load_local(zeros(), url)
    tier.clear()


class _Ev:
    """A CUDA event's ``synchronize()`` for :class:`ckpt.tier.snapshot.Landing`: returns once ``go``
    is set, or raises ``fail``; counts its waits."""

    def __init__(self, fail: BaseException | None = None, go: bool = True):
        self.fail, self.waits, self.go = fail, 0, threading.Event()
        if go:
            self.go.set()

    def synchronize(self) -> None:
        self.waits += 1
        self.go.wait()
        if self.fail is not None:
            raise self.fail


def test_the_background_waits_for_the_first_copy_to_land_and_no_more() -> None:
    from ckpt.tier.snapshot import Snapshot

    first, later = _Ev(), _Ev(go=False)
    snap = Snapshot({}, landed={"a": first, "b": first, "c": later})
    snap.first_landed()  # returns although "c" has not landed
    snap.wait_piece("b")
    assert first.waits == 1  # one wait per event, however many pieces it covers
    done = threading.Event()
    t = threading.Thread(target=lambda: (snap.wait_piece("c"), done.set()), daemon=True)
    t.start()
    assert not done.wait(0.05)  # "c" waits for its own event
    ready = threading.Event()
    threading.Thread(target=lambda: (snap.ready(), ready.set()), daemon=True).start()
    assert not ready.wait(0.05)  # ready(): every copy, "c" too
    later.go.set()
    assert done.wait(5) and ready.wait(5) and later.waits == 1
    Snapshot({}).first_landed()  # CPU pieces: no events, nothing to wait for
    Snapshot({}).wait_piece("x")
    Snapshot({}).ready()


def test_pieces_waited_for_at_once_share_one_waiting_thread() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from ckpt.tier.snapshot import Snapshot

    evs = [_Ev(go=False) for _ in range(4)]
    snap = Snapshot({}, landed={f"k{i}": ev for i, ev in enumerate(evs)})
    with ThreadPoolExecutor(8) as ex:
        waits = [ex.submit(snap.wait_piece, f"k{i % 4}") for i in range(16)]
        for ev in evs:
            ev.go.set()
        for w in waits:
            w.result(timeout=5)
    assert [ev.waits for ev in evs] == [1, 1, 1, 1]  # one Landing: each event waited for once


def test_a_failing_copy_wait_raises_for_its_pieces_and_the_later_ones_only() -> None:
    from ckpt.tier.snapshot import Snapshot

    boom = RuntimeError("CUDA error: an illegal memory access was encountered")
    evs = [_Ev(), _Ev(fail=boom), _Ev()]
    snap = Snapshot({}, landed={"a": evs[0], "b": evs[1], "c": evs[2]})
    snap.wait_piece("a")  # landed before the failure
    for key in ("b", "c"):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            snap.wait_piece(key)
    assert evs[2].waits == 0  # nothing waited for after the failure
    snap.first_landed()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        snap.ready()


@pytest.mark.parametrize("where", ["first copy", "a later copy, while the first ones are checksummed"])
def test_a_copy_that_never_lands_skips_the_step_and_keeps_the_last(shm: str, monkeypatch: Any, where: str) -> None:
    from ckpt.tier.snapshot import HostSnapshots, Snapshot

    tier, _url = _saved(shm, (1,))
    boom = RuntimeError("CUDA error: an illegal memory access was encountered")
    if where == "first copy":
        def broken(self: Snapshot) -> None:
            raise boom

        monkeypatch.setattr(Snapshot, "first_landed", broken)
    else:  # CPU pieces have no copy events: give them some, the second one failing
        take = HostSnapshots.take

        def with_events(self: HostSnapshots, flat: dict[str, Any], **kw: Any) -> Snapshot:
            snap = take(self, flat, **kw)
            keys = [k for k, v in snap.flat.items() if isinstance(v, torch.Tensor)]
            snap.landed = {k: _Ev(fail=boom if i == 1 else None) for i, k in enumerate(keys)}
            return snap

        monkeypatch.setattr(HostSnapshots, "take", with_events)
    with pytest.warns(RuntimeWarning, match="skipped on every rank"):
        got = tier.save(2, state_of(2))
    assert not got.complete and "illegal memory access" in (got.warning or "")
    monkeypatch.undo()
    target = zeros()
    restored = tier.restore(target)
    assert restored is not None and restored.step == 1 and same(target, state_of(1))
    tier.clear()
