"""The manager's loop API (``maybe_wait_for_staging``, ``maybe_save``, ``restore``) and the rule that the
trainer's loop uses only it: ckpt/trainer/train.py imports nothing private of ckpt."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager, SaveReport
from ckpt.manifest import MANIFEST_NAME
from tests.helpers import file_imports

PUBLIC = {"ckpt", "ckpt.errors", "ckpt.manager", "ckpt.layout"}  # and ckpt.trainer.*


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((4, 8), float(step)), "b": torch.full((8,), float(step), dtype=torch.bfloat16)},
            "step": step}


def _run(root: str, shm: str, steps: int, every: int | None, memory_every: int | None, async_save: bool
         ) -> list[SaveReport]:
    mgr = CheckpointManager(root, keep_last=None, save_every=every, memory_every=memory_every, shm_dir=shm,
                            replicas=0, async_save=async_save)
    state = _state(0)
    built: list[int] = []
    reports = []
    for step in range(1, steps + 1):
        mgr.maybe_wait_for_staging()
        for v in state["model"].values():
            v.fill_(step)  # the optimizer step, in place
        state["step"] = step

        def build(step: int = step) -> dict:
            built.append(step)
            return state

        reports.append(mgr.maybe_save(step, build, last_step=step == steps))
    # the state is built only for the steps that save something
    assert built == [r.step for r in reports if r.saved is not None or r.memory is not None]
    return reports


@settings(max_examples=25, deadline=None)
@given(steps=st.integers(1, 7), every=st.one_of(st.none(), st.integers(1, 4)),
       memory_every=st.one_of(st.none(), st.integers(1, 3)), async_save=st.booleans())
def test_maybe_save_commits_exactly_the_due_steps(steps: int, every: int | None, memory_every: int | None,
                                                  async_save: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        root, shm = os.path.join(d, "ckpts"), os.path.join(d, "shm")
        os.makedirs(shm)
        reports = _run(root, shm, steps, every, memory_every, async_save)
        due = {s for s in range(1, steps + 1) if (every and s % every == 0) or s == steps}
        mem_due = {s for s in range(1, steps) if memory_every and s % memory_every == 0}
        assert {r.step for r in reports if r.saved is not None} == due
        assert {r.step for r in reports if r.memory is not None} == mem_due
        infos = ckpt.CheckpointManager(root, keep_last=None, gc_on_start=False).list()
        assert {c.step for c in infos} == due and all(c.committed for c in infos)  # committed on return
        for s in due:  # each holds its own step's state, bitwise
            got = _state(-1)
            out = ckpt.load(got, os.path.join(root, f"step-{s:010d}"))
            assert all(torch.equal(got["model"][k], v) for k, v in _state(s)["model"].items())
            assert out["step"] == s
        # the last step gave the memory tier back: nothing is left in shared memory
        assert not [f for _, _, fs in os.walk(shm) for f in fs]


def test_maybe_wait_for_staging_returns_at_once_with_nothing_in_flight(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "c"), save_every=2)
    t = time.perf_counter()
    for _ in range(100):
        assert mgr.maybe_wait_for_staging() == pytest.approx(0.0, abs=0.01)
    assert time.perf_counter() - t < 0.5
    rep = mgr.maybe_save(1, _state(1))  # not due: nothing started, still nothing to wait for
    assert rep.saved is None and rep.memory is None
    assert mgr.maybe_wait_for_staging() == pytest.approx(0.0, abs=0.01)
    rep = mgr.maybe_save(2, _state(2))
    assert isinstance(rep.saved, ckpt.SaveHandle)
    mgr.maybe_wait_for_staging()  # staged: the state may change now
    mgr.wait()
    assert mgr.maybe_wait_for_staging() == pytest.approx(0.0, abs=0.01)


def test_restore_skips_a_damaged_newest_checkpoint_and_maybe_save_redoes_it(tmp_path: Path) -> None:
    root = str(tmp_path / "c")
    mgr = CheckpointManager(root, keep_last=None, save_every=1, async_save=False)
    for s in (1, 2, 3):
        mgr.maybe_save(s, _state(s), last_step=s == 3)
    step3 = tmp_path / "c" / "step-0000000003"
    data = _data_files(step3)
    assert data
    for p in data:
        p.unlink()  # the newest checkpoint lost its data
    again = CheckpointManager(root, keep_last=None, save_every=1, async_save=False)
    failures: list[dict] = []
    got = _state(-1)
    assert again.restore(got, fallback=True, on_failure=failures.append) == 2
    assert again.restored is not None and (again.restored.step, again.restored.tier) == (2, "storage")
    assert again.restored.skipped == 3 and again.redo_upto == 3
    assert [f["event"] for f in failures] == ["restore_failed"] and failures[0]["from"].endswith("step-0000000003")
    assert torch.equal(got["model"]["w"], _state(2)["model"]["w"])
    # the run redoes step 3: its save replaces the damaged checkpoint (no CheckpointExistsError)
    again.maybe_save(3, _state(3), last_step=True)
    assert ckpt.verify(str(step3), deep=True).ok
    # without fallback the newest checkpoint's error is raised, as before
    for p in _data_files(step3):
        p.unlink()
    with pytest.raises(CheckpointError):
        CheckpointManager(root, keep_last=None).restore(_state(-1))


def _data_files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith(".")]


def test_restore_takes_the_memory_tier_when_it_is_at_least_as_new(tmp_path: Path) -> None:
    root, shm = str(tmp_path / "c"), str(tmp_path / "shm")
    os.makedirs(shm)
    mgr = CheckpointManager(root, keep_last=None, save_every=2, memory_every=1, shm_dir=shm, replicas=0)
    for s in (1, 2, 3):
        mgr.maybe_wait_for_staging()
        mgr.maybe_save(s, _state(s))  # not the last step: the memory tier keeps step 3
    mgr.close()  # gives the run id back: a restarted manager of the same run may take it
    again = CheckpointManager(root, keep_last=None, save_every=2, memory_every=1, shm_dir=shm, replicas=0)
    got = _state(-1)
    assert again.restore(got) == 3
    assert again.restored is not None and again.restored.step == 3 and again.restored.tier.startswith("memory")
    assert torch.equal(got["model"]["w"], _state(3)["model"]["w"]) and got["step"] == 3
    assert "value" not in repr(again.restored) and "tensor(" not in repr(again.restored)  # the state is not printed
    again.maybe_save(4, _state(4), last_step=True)
    again.close()


def test_the_trainer_loop_imports_only_public_ckpt_names() -> None:
    import ckpt.trainer.train as train

    path = Path(train.__file__)
    private = [f"{path.name}:{line}: {mod}" for line, mod in file_imports(path)
               if (mod == "ckpt" or mod.startswith("ckpt.")) and mod not in PUBLIC
               and not mod.startswith("ckpt.trainer.")]
    assert not private, f"the trainer reaches into ckpt internals: {private}; expose what it needs on the manager"
