"""The memory tier's background budget (:mod:`ckpt.tier.pace`) and the device staging of snapshots
(:mod:`ckpt.tier.snapshot`): the pacer never lets more bytes through than its rate allows (generated
request sequences on a fake clock), the settings refuse bad values by name, the peer copy pays for
every byte it reads, and on a GPU a staged snapshot holds the values of the moment it was taken
while the state changes after the fence (bitwise), paced or not, falling back with a warning when
the device cannot hold the stage."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import StateError
from ckpt.testing.ranks import gpu_count
from ckpt.tier import TierConfig, localcopy, pace, safefs
from ckpt.tier.pace import BURST_S, Pacer, budget_from_env
from ckpt.tier.snapshot import STAGE_ALIGN, DeviceStage, HostSnapshots, stage_layout

cuda = pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA device")  # (no CUDA call at collection)


class _Clock:
    """time.monotonic / time.sleep of a fake clock (sleeping advances it)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        assert s > 0
        self.t += s


@settings(max_examples=200, deadline=None)
@given(gbps=st.floats(0.01, 100), reqs=st.lists(st.tuples(st.floats(0, 0.5), st.integers(0, 2 * 10**9)),
                                                 min_size=1, max_size=30))
def test_a_pacer_never_lets_more_through_than_its_rate_and_one_burst(gbps: float, reqs: list[tuple[float, int]]
                                                                     ) -> None:
    clock = _Clock()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pace.time, "monotonic", clock.monotonic)
        mp.setattr(Pacer, "_wait", lambda self, s: clock.sleep(s))
        _paced(gbps, reqs, clock)


def _paced(gbps: float, reqs: list[tuple[float, int]], clock: _Clock) -> None:
    p = Pacer(gbps)
    t0 = clock.t
    before = 0  # bytes accounted for before the current request
    for gap, n in reqs:
        clock.t += gap  # the caller's own work between requests
        p.take(n)
        # when take() lets bytes go, those of earlier requests have been paid for, less one burst
        assert n == 0 or before <= gbps * 1e9 * (clock.t - t0 + BURST_S) * (1 + 1e-9) + 1
        before += n
    assert p.taken == sum(n for _g, n in reqs)
    # and it never waits longer than the bytes take at its rate, nor at all for the first burst's worth
    assert p.waited_s <= before / (gbps * 1e9) + 1e-9
    if before - reqs[-1][1] <= gbps * 1e9 * BURST_S:
        assert p.waited_s == 0


def test_a_pacer_sleeps_for_real_and_none_never_sleeps() -> None:
    p = Pacer(0.5)  # 0.5 GB/s: 0.3 GB take >= 0.6 s less one burst
    t = time.monotonic()
    for _ in range(6):
        p.take(50_000_000)
    assert time.monotonic() - t >= 0.6 - 0.1 - BURST_S - 0.01  # (the last take waits for the others only)
    assert p.waited_s > 0.4 and p.taken == 300_000_000
    free = Pacer(None)
    free.take(10**12)
    assert free.waited_s == 0 and free.taken == 10**12


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "2", True])
def test_bad_budgets_are_refused_by_name(bad: Any) -> None:
    with pytest.raises(StateError, match="max_gbps"):
        TierConfig("/tmp/x", max_gbps=bad)


def test_release_lifts_the_budget_and_wakes_a_waiting_take() -> None:
    import threading

    p = Pacer(0.0001)  # 100 kB/s
    p.take(1_000_000)  # the burst: no wait
    t = time.monotonic()
    th = threading.Thread(target=p.take, args=(10_000_000,))  # would wait ~10 s for the first MB
    th.start()
    time.sleep(0.1)
    p.release()
    th.join(8)
    assert not th.is_alive() and time.monotonic() - t < 5
    p.take(10**12)  # no budget any more
    assert p.rate is None


def test_the_environment_overrides_the_budget_and_the_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_TIER_MAX_GBPS", "2.5")
    assert budget_from_env(None) == 2.5 and budget_from_env(7) == 2.5
    monkeypatch.setenv("CKPT_TIER_MAX_GBPS", "0")
    assert budget_from_env(7) is None  # 0: no budget
    for bad in ("fast", "-2", "nan"):
        monkeypatch.setenv("CKPT_TIER_MAX_GBPS", bad)
        with pytest.raises(StateError, match=f"CKPT_TIER_MAX_GBPS='{bad}'"):
            budget_from_env(None)
    monkeypatch.delenv("CKPT_TIER_MAX_GBPS")
    assert budget_from_env(3) == 3.0 and budget_from_env(None) is None
    cfg = TierConfig("/tmp/x", stage_on_device=False)
    monkeypatch.setenv("CKPT_TIER_STAGE_ON_DEVICE", "1")
    assert cfg.staging() is True
    monkeypatch.setenv("CKPT_TIER_STAGE_ON_DEVICE", "maybe")
    with pytest.raises(StateError, match="CKPT_TIER_STAGE_ON_DEVICE"):
        cfg.staging()
    monkeypatch.delenv("CKPT_TIER_STAGE_ON_DEVICE")
    assert TierConfig("/tmp/x", stage_on_device=True).staging() is True


DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64, torch.int16]


@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), max_size=3)), max_size=20))
def test_staged_pieces_are_aligned_disjoint_and_inside_the_buffer(pieces: list[tuple[torch.dtype, list[int]]]) -> None:
    shapes = [(d, tuple(s)) for d, s in pieces]
    places, size = stage_layout(shapes)
    end = 0
    for (dtype, shape), (off, n) in zip(shapes, places, strict=True):
        assert off % STAGE_ALIGN == 0 and off >= end
        assert n == dtype.itemsize * int(torch.Size(shape).numel())
        end = off + n
    assert size >= end and size % STAGE_ALIGN == 0


@pytest.mark.parametrize("threads", [1, 3])
def test_the_peer_copy_pays_the_budget_for_every_byte_it_reads(shm: str, threads: int) -> None:
    run = Path(safefs.trust_root(os.path.join(shm, "ckpt-pace"), create=True))
    g = torch.Generator().manual_seed(0)
    ckpt.save({"w": torch.randn(3000, 7, generator=g), "b": torch.randn(1000, generator=g)}, str(run / "s"))
    m = ckpt.inspect(str(run / "s"))
    files = sorted(m.files.items())
    out = [bytearray(size) for _rel, size in files]
    copies = [localcopy.FileCopy(rel, size, str(run / "s" / rel), memoryview(b))
              for (rel, size), b in zip(files, out, strict=True)]
    p = Pacer(None)
    localcopy.copy_verified(copies, m, threads=threads, unit=4096, pace=p.take)
    assert p.taken == sum(size for _rel, size in files)
    assert [bytes(b) for b in out] == [(run / "s" / rel).read_bytes() for rel, _ in files]


def test_a_paced_copy_never_runs_past_its_deadline(shm: str) -> None:
    """A budget too small for the copy's timeout: the copy is abandoned at its deadline (a StorageError
    the tier turns into a skipped memory checkpoint), never a wait the peers would take for a lost rank."""
    from ckpt.errors import StorageError

    run = Path(safefs.trust_root(os.path.join(shm, "ckpt-late"), create=True))
    ckpt.save({"w": torch.randn(3000, 7)}, str(run / "s"))
    m = ckpt.inspect(str(run / "s"))
    files = sorted(m.files.items())
    copies = [localcopy.FileCopy(rel, size, str(run / "s" / rel), memoryview(bytearray(size))) for rel, size in files]
    t = time.monotonic()
    with pytest.raises(StorageError, match="at its deadline"):
        localcopy.copy_verified(copies, m, threads=2, unit=4096, pace=Pacer(1e-6).take, deadline=t + 0.3)
    assert time.monotonic() - t < 3


def test_cpu_pieces_are_never_staged() -> None:
    snaps = HostSnapshots(stage_on_device=True)
    src = {"a": torch.arange(10.0), "n": 3}
    snap = snaps.take(src, deferred=True)
    src["a"].add_(1)
    snap.staged()
    snap.ready()
    assert torch.equal(snap.flat["a"], torch.arange(10.0)) and snaps.stage.nbytes == 0 and snap._waiter is None


class _FakeEvent:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.recorded = fail, False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "waited for an event never recorded"
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 7), data=st.data())
def test_a_drain_lands_every_group_before_a_failure_and_fails_every_later_one(n: int, data: st.DataObject) -> None:
    """The drain's order of failure, on CPU with fake events: a group whose copy cannot be queued,
    or whose wait fails, and every later group raise; every earlier one lands with its bytes."""
    from ckpt.tier.snapshot import Drain

    bad = data.draw(st.integers(-1, n - 1))  # -1: none fails
    how = data.draw(st.sampled_from(["queue", "wait"]))
    src = [torch.full((4,), float(i)) for i in range(n)]
    dst = [torch.zeros(3 if (i == bad and how == "queue") else 4) for i in range(n)]
    events = [_FakeEvent(fail=i == bad and how == "wait") for i in range(n)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "set_device", lambda dev: None)
        mp.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        d = Drain(events, [[(dst[i], src[i])] for i in range(n)], SimpleNamespace(device="cuda:0"), Pacer(None))
        d.settle()
    for i in range(n):
        if bad < 0 or i < bad:
            d.wait(i)
            assert torch.equal(dst[i], src[i])
        else:
            with pytest.raises(RuntimeError):
                d.wait(i)
    assert d._groups == []  # the device views are dropped once the drain is over


# --- on a GPU ---------------------------------------------------------------------------------------


def _gpu_state(seed: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"w": torch.randn(1 << 20, device="cuda", generator=g),  # 4 MiB
            "b": torch.randn(3, 1 << 19, device="cuda", generator=g).to(torch.bfloat16),
            "t": torch.randn(64, 64, device="cuda", generator=g).t(),  # not contiguous
            "e": torch.empty(0, device="cuda"), "c": torch.arange(7), "n": {"k": 1}}


@cuda
@pytest.mark.parametrize("gbps", [None, 0.02])
def test_a_staged_snapshot_keeps_the_values_it_was_taken_with(monkeypatch: pytest.MonkeyPatch,
                                                              gbps: float | None) -> None:
    monkeypatch.setattr("ckpt.tier.snapshot.LANDED_EVERY", 1 << 20)  # several drain groups
    p = Pacer(gbps)
    snaps = HostSnapshots(stage_on_device=True, pace=p)
    for step in range(3):
        state = _gpu_state(step)
        want = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        snap = snaps.take(state, deferred=True)
        snap.staged()  # the "optimizer step" below waits for the staging copy only
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel():
                v.mul_(-3)  # in place, right after the fence
        snap.ready()
        for k, v in want.items():
            got = snap.flat[k]
            assert (torch.equal(got.view(-1).view(torch.uint8), v.contiguous().view(-1).view(torch.uint8))
                    if isinstance(v, torch.Tensor) else got == v), k
    assert snaps.stage.allocations == 1 and snaps.allocations == 1
    assert snaps.stage.nbytes >= sum(v.numel() * v.element_size() for v in state.values()
                                     if isinstance(v, torch.Tensor) and v.is_cuda)
    assert p.taken == 3 * sum(v.numel() * v.element_size() for v in state.values()
                              if isinstance(v, torch.Tensor) and v.is_cuda)
    if gbps:
        assert p.waited_s > 0.5  # 3 x 7.3 MB at 0.02 GB/s (~1.1 s), less a burst of 0.05 s: the drain was paced
    snaps.stage.release()
    assert snaps.stage.nbytes == 0


@cuda
def test_a_device_that_cannot_hold_the_stage_copies_directly_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def oom(self: DeviceStage, dev: int, pieces: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.40 GiB")

    monkeypatch.setattr(DeviceStage, "views", oom)
    said: list[str] = []
    snaps = HostSnapshots(stage_on_device=True, warn=said.append)
    state = _gpu_state(0)
    want = state["w"].cpu()
    snap = snaps.take(state)  # not deferred: the update may follow at once
    state["w"].zero_()
    snap.ready()
    assert torch.equal(snap.flat["w"], want) and not snaps.stage_on_device
    assert len(said) == 1 and "cannot stage" in said[0] and "directly" in said[0]


@cuda
def test_a_drain_that_fails_wakes_its_waiters_with_the_error() -> None:
    from ckpt.tier.snapshot import Drain, landed_event

    stream = torch.cuda.Stream()
    good = (torch.empty(4, pin_memory=True), torch.arange(4.0, device="cuda"))
    bad = (torch.empty(3, pin_memory=True), torch.arange(4.0, device="cuda"))  # shapes differ: copy_ raises
    d = Drain([landed_event(), landed_event(), landed_event()], [[good], [bad], [good]], stream, Pacer(None))
    d.wait(0)
    assert torch.equal(good[0], torch.arange(4.0))
    for i in (1, 2):
        with pytest.raises(RuntimeError):
            d.wait(i)
    d.settle()  # never raises


def _paced_run(rank: int, world: int, shm: str, root: str, out: str) -> None:
    import json

    g = torch.Generator().manual_seed(rank)
    # 68 MB: two units of the peer copy (64 MiB each), the second one ~11 minutes behind the first at
    # the budget below (a pacer charges first and waits for what was taken before)
    state = {"w": torch.randn(17_000_000, generator=g)}
    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=shm, nodes=2, memory_timeout=60,
                                 memory_busy="skip", memory_max_gbps=1e-4, save_every=None)
    assert mgr.memory is not None and mgr.memory.pacer.rate == 1e5
    rep = mgr.maybe_save(1, state)
    assert rep.memory is not None  # started, its copy to the peer paced
    t = time.monotonic()
    mgr.maybe_save(2, state, last_step=True)  # waits for it: at full speed, training is over
    took = time.monotonic() - t
    done = rep.memory.result()
    with open(out, "a") as f:
        f.write(json.dumps({"rank": rank, "took": took, "complete": done.complete,
                            "taken": mgr.memory.pacer.taken, "replica_bytes": done.replica_bytes}) + "\n")


@pytest.mark.multiproc
def test_the_last_step_lifts_the_budget_of_the_memory_checkpoint_in_flight(shm: str, tmp_path: Path) -> None:
    """A budget of 100 kB/s would take ~11 minutes to copy 68 MB to the peer; the last step waits for
    that memory checkpoint at full speed instead (and it completes, its bytes paid for)."""
    import json

    from tests.dist_utils import run_ranks

    out = tmp_path / "out.jsonl"
    run_ranks(2, _paced_run, shm, str(tmp_path / "root"), str(out))
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == 2
    for r in got:
        assert r["complete"] and r["took"] < 10, r
        assert r["taken"] > 0  # the peer copy's reads went through the pacer
