"""Failure semantics across ranks (DESIGN.md): any exception on any rank, typed or not, reaches every
rank of the collective within ``timeout`` as a typed CheckpointError naming the rank and the cause;
no rank blocks in a send, receive or broadcast past its timeout.

Real gloo groups on forked processes. After a timeout gloo closes the group's connections, so the
ranks here never run a final barrier (tests/dist/forked.py's runner). A stalled rank stays silent until
its peers have reported (:func:`~tests.dist.forked.stall`), not for a fixed time that races them.
"""

from __future__ import annotations

import importlib
import os
import random
import time
from typing import Any

import pytest
import torch

import ckpt
from ckpt import errors
from ckpt._comm import Comm, error_payload, raise_payload
from ckpt.save import _SYNC_CACHES
from tests.dist.forked import SLACK, assert_typed, outcome, run_forked, stall

# The timeout of loads whose error must reach every rank by propagation: an error that arrives in
# under it came from the failing rank, not from waiting it out (generous for a loaded machine).
PROPAGATE_S = 60.0


@pytest.fixture
def saved(tmp_path) -> str:
    path = str(tmp_path / "c")
    ckpt.save({"w": torch.arange(12.0).reshape(3, 4), "step": 3}, path)  # single process
    return path


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(3, 4), "step": 0}


# --- (a) a stalled coordinator: a non-coordinator's first send is bounded -------------------------

def _save_coordinator_stalls(rank: int, world: int, path: str, timeout: float) -> dict[str, Any]:
    if rank == 0:
        stall(rank, world)
    return outcome(lambda: ckpt.save({"w": ckpt.Shard(torch.ones(1, 4), (world, 4), (rank, 0))}, path,
                                     timeout=timeout))


@pytest.mark.slow
@pytest.mark.multiproc
def test_save_coordinator_stalls_before_planning(tmp_path):
    _SYNC_CACHES.clear()
    path, timeout = str(tmp_path / "c"), 3.0
    r0, r1 = run_forked(2, _save_coordinator_stalls, path, timeout)
    assert_typed(r1, timeout + SLACK, cls="CollectiveError", has=("rank 0", "rank 1", "not committed"))
    assert r1["elapsed"] > timeout - 0.5, r1  # it did wait for the coordinator, then gave up
    assert_typed(r0, timeout + SLACK, cls="CollectiveError")  # the coordinator finds the group closed
    assert not os.path.exists(os.path.join(path, "manifest.msgpack"))


# --- (b) load: a stalled coordinator before the manifest exchange ---------------------------------

def _load_coordinator_stalls(rank: int, world: int, path: str, timeout: float) -> dict[str, Any]:
    if rank == 0:
        stall(rank, world)
    return outcome(lambda: ckpt.load(_target(), path, timeout=timeout))


@pytest.mark.multiproc
def test_load_coordinator_stalls_before_manifest(saved):
    timeout = 2.0
    results = run_forked(3, _load_coordinator_stalls, saved, timeout)
    for r, res in enumerate(results):
        assert_typed(res, timeout + SLACK, cls="CollectiveError", has=(f"rank {r}",))
    for res in results[1:]:
        assert "rank 0" in res["msg"] and "nothing was loaded" in res["msg"], res


# --- (c) a raw (untyped) exception in load's manifest phase reaches every rank --------------------

def _raw_manifest_read() -> None:
    """From now on, in this process, reading a manifest raises a raw OSError (as an unwrapped
    backend would: a path below a regular file)."""
    mod = importlib.import_module("ckpt.load")
    real = mod.get_storage

    def opened(url: str, **kw: Any) -> Any:
        st = real(url, **kw)

        def read_file(path: str) -> bytes:
            raise NotADirectoryError(20, "Not a directory", f"{url}/{path}")
        st.read_file = read_file
        return st
    mod.get_storage = opened  # type: ignore[attr-defined]


def _load_rank0_read_raw(rank: int, world: int, path: str) -> dict[str, Any]:
    if rank == 0:
        _raw_manifest_read()
    return outcome(lambda: ckpt.load(_target(), path, timeout=PROPAGATE_S))


@pytest.mark.multiproc
def test_raw_manifest_error_on_coordinator_reaches_every_rank(saved):
    results = run_forked(3, _load_rank0_read_raw, saved)
    for res in results:
        assert_typed(res, PROPAGATE_S, cls="CheckpointError", has=("rank 0: NotADirectoryError",))
    assert results[0]["cause"] == "NotADirectoryError"  # chained on the rank where it happened


def _load_rank0_url_below_a_file(rank: int, world: int, path: str, bad: str) -> dict[str, Any]:
    return outcome(lambda: ckpt.load(_target(), bad if rank == 0 else path, timeout=PROPAGATE_S))


@pytest.mark.multiproc
def test_url_below_a_file_on_coordinator_reaches_every_rank(saved, tmp_path):
    (tmp_path / "afile").write_bytes(b"x")
    bad = str(tmp_path / "afile" / "c")  # a path below a regular file (the storage may type it)
    results = run_forked(2, _load_rank0_url_below_a_file, saved, bad)
    for res in results:
        assert_typed(res, PROPAGATE_S, has=("rank 0: ", "Not a directory"))
    assert results[0]["type"] == results[1]["type"]  # the same class on every rank


def _load_rank1_open_fails(rank: int, world: int, path: str) -> dict[str, Any]:
    if rank == 1:
        def broken(url: str, **kw: Any) -> Any:
            raise RuntimeError("injected: cannot open the storage")
        importlib.import_module("ckpt.load").get_storage = broken  # type: ignore[attr-defined]
    return outcome(lambda: ckpt.load(_target(), path, timeout=PROPAGATE_S))


@pytest.mark.multiproc
def test_raw_error_on_a_non_coordinator_reaches_every_rank(saved):
    results = run_forked(3, _load_rank1_open_fails, saved)
    for res in results:
        assert_typed(res, PROPAGATE_S, cls="CheckpointError", has=("rank 1: RuntimeError: injected",))
    assert results[1]["cause"] == "RuntimeError"


def _load_missing(rank: int, world: int, path: str, missing: str) -> dict[str, Any]:
    return outcome(lambda: ckpt.load(_target(), missing if rank == 0 else path, timeout=PROPAGATE_S))


@pytest.mark.multiproc
def test_typed_manifest_error_keeps_its_class_on_every_rank(saved, tmp_path):
    results = run_forked(2, _load_missing, saved, str(tmp_path / "nothing"))
    for res in results:
        assert_typed(res, PROPAGATE_S, cls="ManifestError", has=("rank 0:", "no committed checkpoint"))


def _load_ok(rank: int, world: int, path: str) -> dict[str, Any]:
    t = _target()
    out = ckpt.load(t, path, timeout=PROPAGATE_S)
    return {"ok": bool(torch.equal(t["w"], torch.arange(12.0).reshape(3, 4))) and out["step"] == 3}


@pytest.mark.multiproc
def test_load_succeeds_on_every_rank(saved):
    assert all(r["ok"] for r in run_forked(3, _load_ok, saved))


def test_single_process_load_raises_only_checkpoint_errors(saved, tmp_path, monkeypatch):
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(ckpt.CheckpointError, match="Not a directory"):
        ckpt.load(_target(), str(tmp_path / "afile" / "c"))
    mod = importlib.import_module("ckpt.load")
    monkeypatch.setattr(mod, "get_storage", mod.get_storage)  # undone after the test
    _raw_manifest_read()
    with pytest.raises(ckpt.CheckpointError, match="^NotADirectoryError: ") as ei:
        ckpt.load(_target(), saved)
    assert isinstance(ei.value.__cause__, NotADirectoryError)
    monkeypatch.undo()
    with pytest.raises(ckpt.ManifestError, match="no committed checkpoint"):
        ckpt.load(_target(), str(tmp_path / "nothing"))
    with pytest.raises(ckpt.CheckpointError, match="ValueError: manifest_read"):
        ckpt.load(_target(), saved, manifest_read="bogus")
    t = _target()
    assert ckpt.load(t, saved, timeout=None)["step"] == 3 and t["w"][2, 3] == 11


# --- (d) the Comm helpers, each wait bounded -------------------------------------------------------

def _comm_case(rank: int, world: int, case: str, timeout: float) -> dict[str, Any]:
    comm = Comm(None)
    idle = {"gather": 1, "send_each": 1, "recv_one": 0, "send": 0, "broadcast": 0, "broadcast_src": 1}.get(case)
    if rank == idle:  # alive but silent past the peer's timeout (an exited rank closes its connections)
        stall(rank, world)
        return {}
    if case == "gather":  # rank 1 never sends: the coordinator names it
        return outcome(lambda: comm.gather({"r": rank}, timeout=timeout, what="save test"))
    if case == "send_each":  # rank 1 never receives
        return outcome(lambda: comm.send_each([0, 1], timeout=timeout, what="save test"))
    if case == "recv_one":  # the coordinator never sends
        return outcome(lambda: comm.recv_one(timeout=timeout, what="save test"))
    if case == "send":  # the coordinator never receives: the first send is bounded
        return outcome(lambda: comm.gather({"r": rank}, timeout=timeout, what="save test"))
    if case == "commit_reply":  # rank 1 reports, then never takes the coordinator's verdict
        if rank == 1:
            comm.gather({"r": rank}, timeout=timeout, what="save commit")
            stall(rank, world)
            return {}
        return outcome(lambda: comm.exchange({"r": 0}, lambda objs: objs, timeout=timeout, what="save commit"))
    if case == "broadcast":  # the source never sends
        return outcome(lambda: comm.broadcast(None, timeout=timeout, what="load test"))
    if case == "broadcast_src":  # nobody receives
        return outcome(lambda: comm.broadcast({"x": 1}, timeout=timeout, what="load test"))
    assert case == "happy"
    got = comm.exchange({"r": rank}, lambda objs: [{"to": i, "n": len(objs)} for i in range(world)],
                        timeout=timeout, what="test")
    big = comm.broadcast(b"\x01" * 100_000 if rank == 0 else None, timeout=timeout)
    empty = comm.broadcast_bytes(b"" if rank == 0 else None, timeout=timeout)
    everyone = comm.gather(rank, timeout=timeout)
    return {"got": got, "big": len(big), "empty": len(empty), "all": everyone, "sent": comm.sent,
            "received": comm.received}


@pytest.mark.parametrize("case,failing,peer,what", [
    ("gather", 0, "rank(s) [1] did not report within 1 s", "not committed"),
    ("send_each", 0, "could not send to rank 1 within 1 s", "not committed"),
    ("recv_one", 1, "rank(s) [0] did not report within 1 s", "not committed"),
    ("send", 1, "could not send to rank 0 within 1 s", "not committed"),
    ("commit_reply", 0, "save commit reply: rank 0 could not send to rank 1 within 1 s", "may be committed"),
    ("broadcast", 1, "rank(s) [0] did not report within 1 s", "nothing was loaded"),
    ("broadcast_src", 0, "could not send to rank 1 within 1 s", "nothing was loaded"),
])
@pytest.mark.slow
@pytest.mark.multiproc
def test_comm_waits_are_bounded(case, failing, peer, what):
    res = run_forked(2, _comm_case, case, 1.0)[failing]
    assert_typed(res, 1.0 + SLACK, cls="CollectiveError", has=(peer, what, "restart the job"))
    assert res["elapsed"] > 0.5, res


@pytest.mark.multiproc
def test_comm_happy_path_on_three_ranks():
    res = run_forked(3, _comm_case, "happy", 5.0)
    for r, x in enumerate(res):
        assert x["got"] == {"to": r, "n": 3} and x["big"] == 100_000 and x["empty"] == 0
        assert x["all"] == ([0, 1, 2] if r == 0 else None)
    assert res[0]["sent"] > 2 * 100_000 and res[1]["received"] > 100_000


def test_comm_single_process_and_payloads():
    comm = Comm(None)
    assert comm.single and comm.who is None
    assert comm.gather(5) == [5] and comm.send_each([7]) == 7 and comm.broadcast({"a": 1}) == {"a": 1}
    assert comm.exchange(3, lambda objs: [o + 1 for o in objs]) == 4
    p = error_payload(NotADirectoryError(20, "Not a directory"), 1)
    assert p["type"] == "CheckpointError" and p["err"].startswith("rank 1: NotADirectoryError: ")
    cause = OSError("x")
    with pytest.raises(ckpt.CheckpointError) as ei:
        raise_payload(p, cause)
    assert type(ei.value) is errors.CheckpointError and ei.value.__cause__ is cause
    with pytest.raises(ckpt.IntegrityError, match="^rank 2: bad crc$"):
        raise_payload(error_payload(errors.IntegrityError("bad crc"), 2))
    with pytest.raises(ckpt.CheckpointError, match="^TypeError: t$"):  # single process: no rank
        raise_payload(error_payload(TypeError("t"), None))
    with pytest.raises(ckpt.CheckpointError):  # an unknown or foreign type name never escapes untyped
        raise_payload({"err": "e", "type": "ValueError"})


# --- randomized: a random rank fails or stalls at a random phase of load --------------------------

PHASES = ("stall", "crash", "open", "read")


def _scenarios(n: int = 6) -> list[tuple[int, str, int]]:
    """``n`` (world, phase, culprit rank) draws; every phase at least once. CKPT_FAILURE_SEED varies them."""
    rng = random.Random(int(os.environ.get("CKPT_FAILURE_SEED", "20240611")))
    phases = list(PHASES) + [rng.choice(PHASES) for _ in range(n - len(PHASES))]
    rng.shuffle(phases)
    out = []
    for phase in phases:
        world = rng.choice((2, 3))
        out.append((world, phase, 0 if phase == "read" else rng.randrange(world)))  # only rank 0 reads it
    return out


def _random_failure(rank: int, world: int, path: str, phase: str, culprit: int, timeout: float) -> dict[str, Any]:
    if rank == culprit:
        if phase == "stall":
            stall(rank, world)
        elif phase == "crash":
            os._exit(0)  # gone without a word, before the manifest exchange
        elif phase == "open":
            def broken(url: str, **kw: Any) -> Any:
                raise TypeError("injected: unexpected storage option")
            importlib.import_module("ckpt.load").get_storage = broken  # type: ignore[attr-defined]
        else:
            _raw_manifest_read()
    return outcome(lambda: ckpt.load(_target(), path, timeout=timeout))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("world,phase,culprit", _scenarios())
def test_random_rank_fails_at_random_phase_of_load(saved, world, phase, culprit):
    timeout = 2.0
    t0 = time.monotonic()
    results = run_forked(world, _random_failure, saved, phase, culprit, timeout)
    assert time.monotonic() - t0 < timeout + 2 * SLACK + 60  # bounds a hang only (forks, gloo, a loaded machine)
    for r, res in enumerate(results):
        if phase == "crash" and r == culprit:
            assert res.get("crashed"), res
            continue
        if phase in ("stall", "crash"):
            assert_typed(res, timeout + SLACK, cls="CollectiveError")
        elif phase == "open":
            assert_typed(res, timeout + SLACK, cls="CheckpointError", has=(f"rank {culprit}: TypeError: injected",))
        else:
            assert_typed(res, timeout + SLACK, cls="CheckpointError", has=("rank 0: NotADirectoryError",))



# --- ckpt.async_save and ckpt.dcp take a timeout: a coordinator that never comes is waited for that long ---

def _front_coordinator_stalls(rank: int, world: int, path: str, front: str, timeout: float) -> dict[str, Any]:
    state = {"w": ckpt.Shard(torch.ones(1, 4), (world, 4), (rank, 0))}
    if front == "async_save":  # a first save together: the commit group exists (forming one has its own bound)
        ckpt.async_save(state, path + "-first", timeout=timeout).done()
    if rank == 0:
        stall(rank, world)
    calls = {
        "async_save": lambda: ckpt.async_save(state, path, timeout=timeout).done(),
        "dcp_save": lambda: importlib.import_module("ckpt.dcp").save(state, checkpoint_id=path, timeout=timeout),
        "dcp_load": lambda: importlib.import_module("ckpt.dcp").load(state, checkpoint_id=path, timeout=timeout),
    }
    return outcome(calls[front])


@pytest.mark.multiproc
@pytest.mark.parametrize("front", ["async_save", "dcp_save", "dcp_load"])
def test_async_save_and_dcp_are_bounded_by_their_timeout(tmp_path, front):
    path, timeout = str(tmp_path / "c"), 2.0
    _, r1 = run_forked(2, _front_coordinator_stalls, path, front, timeout)
    assert_typed(r1, timeout + SLACK, has=("rank 0",))
    assert r1["elapsed"] > timeout - 0.5, r1  # it did wait for the coordinator, then gave up


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True])
def test_async_save_and_dcp_refuse_a_timeout_that_is_not_positive(tmp_path, bad):
    dcp = importlib.import_module("ckpt.dcp")
    state = {"w": torch.ones(2)}
    for call in (lambda: ckpt.async_save(state, str(tmp_path / "a"), timeout=bad),
                 lambda: dcp.save(state, checkpoint_id=str(tmp_path / "b"), timeout=bad)):
        with pytest.raises(errors.CheckpointError, match="timeout must be a positive number"):
            call()
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
