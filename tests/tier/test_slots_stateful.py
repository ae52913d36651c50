"""Memory checkpoints written into reused shared-memory slots never change a committed step's bytes.

The class of bug caught here: a *reused slot overwriting a committed memory checkpoint*. The tier
(:mod:`ckpt.tier.slots`) writes each snapshot into a slot file ``<rank dir>/.slots/slot-<i>`` and
commits it by hard-linking the slot into the step directory, so a committed step's data file and a
slot are the same inode. Reusing a slot that a step directory (or another holder: a resharding view
with its own hard link) still links would silently rewrite that step's bytes, or leave its checksums
wrong. A hypothesis state machine drives one single-process tier through synchronous saves,
asynchronous saves whose caller scribbles over its state right after the snapshot, extra hard links
taken and dropped on committed steps' data files, resets, and changes of the state's structure
(slot layouts re-planned and files resized), and after every rule checks that

* every committed step on disk loads (every checksum checked) bitwise equal to the state it was
  saved from, objects included;
* every extra link still holds exactly the bytes it held when it was taken;
* a rank has at most ``keep + 1`` slot files and at most ``keep + 1`` committed steps, and the
  committed steps are exactly those the tier reports complete (and the model expects).

A plain test covers the fallback: with every slot linked, a memory checkpoint still completes
through host buffers and an ordinary ``ckpt.save`` (a fresh data file, one link), the held file is
untouched, and the newest step restores bitwise.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ckpt.manifest import MANIFEST_NAME
from ckpt.tier import MemoryTier, TierConfig
from ckpt.tier.slots import SLOTS_DIR

ROOT = "/tier-tests/slots-stateful"
BIG = (4 << 20) // 4 + 4099  # float32 elements: a piece over 4 MiB, restored in several chunks
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def state_of(step: int, variant: int = 0) -> dict[str, Any]:
    """The training state saved at ``step``: a deterministic function of ``(step, variant)``, NaN-free.
    ``variant`` changes the structure (the big piece's length, one more tensor), hence the slot layout."""
    g = torch.Generator().manual_seed(1000 * step + variant)
    model: dict[str, Any] = {
        "big": torch.randn(BIG + 777 * variant, generator=g),
        "w": torch.randn(37, 19, generator=g).to(torch.bfloat16),
        "b": torch.randn(19, generator=g),
        "idx": torch.randint(-(1 << 40), 1 << 40, (23,), dtype=torch.int64, generator=g),
        "empty": torch.zeros(0),
    }
    if variant:
        model["extra"] = torch.arange(step, step + 11, dtype=torch.int64)
    return {"model": model,
            "train": {"step": step, "hist": [step, 2 * step, variant], "name": f"step-{step}", "lr": step / 8}}


@functools.cache
def _structure(variant: int) -> dict[str, torch.Tensor]:
    return tensors(state_of(0, variant))


def blank_of(variant: int) -> dict[str, Any]:
    """A target of ``state_of(_, variant)``'s structure holding none of its values."""
    model = {k: torch.full_like(v, 7) for k, v in _structure(variant).items()}
    return {"model": model, "train": blank_of_objects()}


def blank_of_objects() -> dict[str, Any]:
    return {"step": -5, "hist": [], "name": "", "lr": -1.0}


def tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (bitwise comparison: -0.0 differs from 0.0 here, as it should)."""
    return t.contiguous().view(-1).view(torch.uint8)


def assert_bitwise(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    g, w = tensors(got), tensors(want)
    assert g.keys() == w.keys(), what
    for k, t in w.items():
        assert g[k].dtype == t.dtype and g[k].shape == t.shape, f"{what}: {k}"
        assert torch.equal(raw(g[k]), raw(t)), f"{what}: tensor {k!r} differs from what was saved"


def scribble(state: dict[str, Any]) -> None:
    """What an optimizer step does right after a snapshot: change every tensor and object in place."""
    for t in tensors(state).values():
        t.fill_(-1)
    state["train"]["hist"].append(-1)  # in place: the snapshot must have deep-copied it
    state["train"]["step"] = -1
    state["train"]["name"] = "scribbled"


def data_files(step_dir: str) -> list[str]:
    d = os.path.join(step_dir, "data")
    return sorted(os.path.join(d, n) for n in os.listdir(d))


def digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def committed(tier: MemoryTier) -> dict[int, str]:
    """This rank's step directories on disk that hold a manifest (committed memory checkpoints)."""
    return {s: p for s, p in tier.store.own_steps() if os.path.isfile(os.path.join(p, MANIFEST_NAME))}


def slot_files(tier: MemoryTier) -> list[str]:
    d = os.path.join(tier.store.own_root(), SLOTS_DIR)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


class SlotMachine(RuleBasedStateMachine):
    """One tier per run; the model: which steps must be committed, what each was saved from, and
    the extra links held with the digest of their bytes when taken."""

    def __init__(self) -> None:
        super().__init__()
        self.tier: MemoryTier | None = None
        self.keep = 1
        self.base = tempfile.mkdtemp(prefix="ckpt-test-slots-", dir=SHM)
        self.shm = os.path.join(self.base, "shm")
        self.views = os.path.join(self.base, "views")  # the extra links live here (same file system)
        os.makedirs(self.shm)
        os.makedirs(self.views)
        self.next_step = 1
        self.variant: dict[int, int] = {}  # step -> the structure it was saved with
        self.expected: dict[tuple[int, int], dict[str, Any]] = {}  # never handed to the tier
        self.complete: list[int] = []  # the model of tier.complete_steps (and of the committed steps)
        self.links: list[tuple[str, str, int]] = []  # (link path, digest when taken, step)
        self.nlinks = 0
        self.targets: dict[int, dict[str, Any]] = {}  # variant -> a load target, reused

    @initialize(keep=st.integers(1, 3))
    def make_tier(self, keep: int) -> None:
        self.keep = keep
        self.tier = MemoryTier(TierConfig(ROOT, shm_dir=self.shm, replicas=0, keep=keep, timeout=60))
        self.tier.reset(None)

    def teardown(self) -> None:
        try:
            if self.tier is not None:
                self.tier.clear()
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    # --- helpers -------------------------------------------------------------------------------

    def _want(self, step: int) -> dict[str, Any]:
        key = (step, self.variant[step])
        if key not in self.expected:
            self.expected[key] = state_of(*key)
        return self.expected[key]

    def _blank(self, variant: int) -> dict[str, Any]:
        """:func:`blank_of`, its tensors reused from one load to the next (refilled)."""
        target = self.targets.get(variant)
        if target is None:
            target = self.targets[variant] = blank_of(variant)
        else:
            for t in tensors(target).values():
                t.fill_(7)
            target["train"] = blank_of_objects()
        return target

    def _saved(self, step: int) -> None:
        assert self.tier is not None
        self.complete = sorted({*self.complete, step})[-self.keep:]
        [f] = data_files(self.tier.store.own(step))
        event("written in a slot" if os.stat(f).st_nlink >= 2 else "written as a fresh file (every slot linked)")

    def _check_links(self) -> None:
        for path, want, step in self.links:
            assert digest(path) == want, f"the extra link to step {step}'s data ({path}) changed"

    # --- rules ---------------------------------------------------------------------------------

    @rule(variant=st.sampled_from([0, 0, 0, 1]))
    def save(self, variant: int) -> None:
        assert self.tier is not None
        step, self.next_step = self.next_step, self.next_step + 1
        self.variant[step] = variant
        r = self.tier.save(step, copy.deepcopy(self._want(step)))  # the expected values stay ours
        assert r.complete, (r.warning, r.errors)
        self._saved(step)

    @rule(variant=st.sampled_from([0, 0, 0, 1]))
    def save_async_then_scribble(self, variant: int) -> None:
        assert self.tier is not None
        step, self.next_step = self.next_step, self.next_step + 1
        self.variant[step] = variant
        state = copy.deepcopy(self._want(step))
        h = self.tier.save_async(step, state)
        scribble(state)  # the snapshot is taken: the caller may change its state at once
        self._check_links()  # the snapshot has landed in a slot: no held file may have been it
        r = h.result()
        assert r.complete, (r.warning, r.errors)
        self._saved(step)
        target = self._blank(variant)
        got = self.tier.restore(target)
        assert got is not None and got.step == step
        assert_bitwise(target, self._want(step), f"step {step} restored after the caller scribbled")
        assert got.value["train"] == self._want(step)["train"]

    @precondition(lambda self: self.tier is not None and bool(self.complete))
    @rule(data=st.data())
    def hold_link(self, data: st.DataObject) -> None:
        """A resharding view (or anything) takes its own hard link to a committed step's data."""
        assert self.tier is not None
        step = data.draw(st.sampled_from(self.complete), label="step")
        for f in data_files(self.tier.store.own(step)):
            self.nlinks += 1
            path = os.path.join(self.views, f"{self.nlinks}-{os.path.basename(f)}")
            os.link(f, path)
            self.links.append((path, digest(path), step))

    @precondition(lambda self: bool(self.links))
    @rule(data=st.data())
    def release_link(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.links) - 1), label="link")
        path, want, step = self.links.pop(i)
        assert digest(path) == want, f"the extra link to step {step}'s data changed before release"
        os.unlink(path)

    @precondition(lambda self: self.tier is not None)
    @rule(data=st.data())
    def reset_to(self, data: st.DataObject) -> None:
        assert self.tier is not None
        keep = data.draw(st.sampled_from([None, *self.complete]), label="keep_step")
        self.tier.reset(keep)
        self.complete = [keep] if keep is not None else []

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def committed_steps_load_bitwise(self) -> None:
        if self.tier is None:
            return
        for step, path in sorted(committed(self.tier).items()):
            target = self._blank(self.variant[step])
            out = self.tier.load_local(target, path)  # every checksum checked
            want = self._want(step)
            assert_bitwise(target, want, f"committed step {step}")
            assert out["train"] == want["train"], f"committed step {step}: objects"

    @invariant()
    def held_links_unchanged(self) -> None:
        self._check_links()

    @invariant()
    def bounded_and_consistent(self) -> None:
        if self.tier is None:
            return
        slots = slot_files(self.tier)
        assert len(slots) <= self.keep + 1, slots
        assert set(slots) <= {f"slot-{i}" for i in range(self.keep + 1)}, slots
        steps = sorted(committed(self.tier))
        assert len(steps) <= self.keep + 1, steps
        assert self.tier.complete_steps == self.complete, (self.tier.complete_steps, self.complete)
        assert steps == self.complete, (steps, self.complete)  # complete steps on disk, nothing else
        assert [s for s, _ in self.tier.store.own_steps()] == steps  # no uncommitted leftovers


TestSlotMachine = pytest.mark.slow(SlotMachine.TestCase)
TestSlotMachine.settings = settings(max_examples=30, stateful_step_count=20, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_every_slot_linked_falls_back_to_a_fresh_file_and_keeps_the_held_bytes(shm: str) -> None:
    tier = MemoryTier(TierConfig(ROOT, shm_dir=shm, replicas=0, keep=1))  # 2 slots
    tier.reset(None)
    views = tempfile.mkdtemp(prefix="ckpt-test-views-", dir=SHM)
    try:
        assert tier.save(1, state_of(1)).complete
        [f1] = data_files(tier.store.own(1))
        assert os.stat(f1).st_nlink == 2  # slot + step 1
        held = os.path.join(views, "held.safetensors")
        os.link(f1, held)  # a view holds step 1's data: its slot is not free after step 1 is freed
        before = digest(held)

        assert tier.save(2, state_of(2)).complete  # the other slot
        [f2] = data_files(tier.store.own(2))
        assert os.stat(f2).st_nlink == 2
        assert not os.path.exists(tier.store.own(1))  # keep=1: step 1 freed, its slot still held
        assert os.stat(held).st_nlink == 2  # slot + the view

        assert tier.save(3, state_of(3)).complete  # both slots linked: host buffers + ckpt.save
        [f3] = data_files(tier.store.own(3))
        assert os.stat(f3).st_nlink == 1  # a fresh file, no slot
        assert digest(held) == before
        assert len(slot_files(tier)) == 2

        target = blank_of(0)
        got = tier.restore(target)
        assert got is not None and got.step == 3
        assert_bitwise(target, state_of(3), "step 3 (written without a slot)")
        assert got.value["train"] == state_of(3)["train"]

        assert tier.save(4, state_of(4)).complete  # step 2's slot is free again (step 2 freed)
        [f4] = data_files(tier.store.own(4))
        assert os.stat(f4).st_nlink == 2
        assert digest(held) == before

        os.unlink(held)  # the view lets go: both slots may be reused
        assert tier.save(5, state_of(5)).complete
        [f5] = data_files(tier.store.own(5))
        assert os.stat(f5).st_nlink == 2
        target = blank_of(0)
        got = tier.restore(target)
        assert got is not None and got.step == 5
        assert_bitwise(target, state_of(5), "step 5")
        assert got.value["train"] == state_of(5)["train"]
        assert len(slot_files(tier)) == 2
        tier.clear()
    finally:
        shutil.rmtree(views, ignore_errors=True)
