"""Slots shaped ahead (``SlotPool.shape_ahead``): the next memory checkpoints find their slot
allocated, and a slot some step links is never written, whatever the order of events."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.tier.slots import SlotPool, raw_layout


@pytest.fixture
def root() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="ckpt-test-slots-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _flat(n: int) -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(n), "b": torch.zeros(n // 2 + 1, dtype=torch.bfloat16)}


def test_one_spare_slot_is_shaped_ahead_and_taken_without_allocating(root: str) -> None:
    pool = SlotPool(root, 3)
    layout = pool.layout(_flat(1000))
    first = pool.acquire(layout, pin=False)
    assert first is not None and pool.allocations == 1
    pool.shape_ahead(layout, first, pin=False)
    pool.join_ahead()
    assert pool.ahead_error is None and pool.allocations == 2  # one spare, not every free slot
    assert sorted(os.listdir(pool.dir)) == ["slot-0", "slot-1"]
    assert all(os.path.getsize(os.path.join(pool.dir, f)) == layout.size for f in os.listdir(pool.dir))
    pool.shape_ahead(layout, first, pin=False)  # a spare is ready: nothing to do
    assert pool._ahead is None and pool.allocations == 2
    first.link_as(os.path.join(root, "step-1", "data"))  # step 1 committed in the first slot
    second = pool.acquire(layout, pin=False)
    assert second is not None and second is not first and pool.allocations == 2  # nothing allocated
    pool.shape_ahead(layout, second, pin=False)  # the next spare
    pool.join_ahead()
    assert pool.allocations == 3 and sorted(os.listdir(pool.dir)) == ["slot-0", "slot-1", "slot-2"]
    second.link_as(os.path.join(root, "step-2", "data"))
    third = pool.acquire(layout, pin=False)
    assert third is not None and third not in (first, second) and pool.allocations == 3
    pool.shape_ahead(layout, third, pin=False)  # every other slot is linked: none to shape
    assert pool._ahead is None
    pool.close()


def test_an_acquire_while_shaping_ahead_waits_only_when_no_slot_is_ready(root: str) -> None:
    pool = SlotPool(root, 2)
    layout = pool.layout(_flat(1 << 16))
    first = pool.acquire(layout, pin=False)
    assert first is not None
    pool.shape_ahead(layout, first, pin=False)
    first.link_as(os.path.join(root, "step-1", "data"))
    second = pool.acquire(layout, pin=False)  # the only free one is being shaped: waited for, then taken
    assert second is not None and second is not first and second.layout == layout
    assert pool.allocations == 2
    pool.close()


# one event of a run: ("acquire", layout), ("ahead", layout), ("commit",), ("free", which), ("join",)
EVENTS = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from([300, 700])),
    st.tuples(st.just("ahead"), st.sampled_from([300, 700])),
    st.tuples(st.just("commit"), st.just(0)),
    st.tuples(st.just("free"), st.integers(0, 5)),
    st.tuples(st.just("join"), st.just(0))), min_size=1, max_size=14)


@settings(max_examples=40, deadline=None)
@given(EVENTS, st.integers(1, 3))
def test_a_linked_slot_keeps_its_bytes_whatever_is_shaped_ahead(events: list[tuple[str, int]], count: int) -> None:
    root = tempfile.mkdtemp(prefix="ckpt-test-slots-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        pool = SlotPool(root, count)
        held = None  # the slot being written (acquired, not committed yet)
        steps: dict[str, bytes] = {}  # committed data file -> its bytes at commit
        for n, (what, arg) in enumerate(events):
            if what in ("acquire", "ahead"):
                layout = pool.layout(_flat(arg)) if arg == 300 else raw_layout(arg * 8)
                if what == "acquire":
                    held = pool.acquire(layout, pin=False)
                    if held is not None:  # the snapshot fills it
                        assert held.base is not None and held.base.numel() == layout.size
                        held.base[len(layout.header):].fill_(n % 251)
                else:
                    pool.shape_ahead(layout, held, pin=False)
            elif what == "commit" and held is not None:
                path = os.path.join(root, f"step-{n}")
                held.link_as(path)
                with open(path, "rb") as f:
                    steps[path] = f.read()
                held = None
            elif what == "free" and steps:
                path = sorted(steps)[arg % len(steps)]
                os.unlink(path)
                del steps[path]
            elif what == "join":
                pool.join_ahead()
            for path, data in steps.items():  # the rule: what a step links is never written
                with open(path, "rb") as f:
                    assert f.read() == data, f"{path} changed after event {n} ({what})"
        pool.join_ahead()
        for path, data in steps.items():
            with open(path, "rb") as f:
                assert f.read() == data
        assert not os.path.exists(pool.dir) or len(os.listdir(pool.dir)) <= count  # at most count slot files
        assert pool.ahead_error is None
        pool.close(remove=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
