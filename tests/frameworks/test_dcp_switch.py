"""The one-line switch: a DCP training script, unmodified apart from its import, runs on ckpt.dcp
with the same results as on torch.distributed.checkpoint (2 forked gloo ranks, real FSDP2)."""

from __future__ import annotations

import os
import pathlib
import types
from typing import Any

import pytest
import torch

import ckpt
from tests.dist_utils import run_ranks

SCRIPT = pathlib.Path(__file__).with_name("dcp_train_script.py")
DCP_IMPORT = "import torch.distributed.checkpoint as dcp"
CKPT_IMPORT = "import ckpt.dcp as dcp"


def _module(switch: bool) -> types.ModuleType:
    src = SCRIPT.read_text()
    assert src.count(DCP_IMPORT) == 1
    if switch:
        src = src.replace(DCP_IMPORT, CKPT_IMPORT)
    mod = types.ModuleType("dcp_train_script_ckpt" if switch else "dcp_train_script_dcp")
    exec(compile(src, str(SCRIPT), "exec"), mod.__dict__)
    return mod


def _job(rank: int, world: int, out: str, switch: bool, mode: str) -> None:
    mod = _module(switch)
    d = os.path.join(out, "ckpt" if switch else "dcp")
    if mode == "resume":
        mod.run(d, 2, resume=False)
        full, pos = mod.run(d, 2, resume=True)  # a fresh model and loader restored from the checkpoint
    else:
        full, pos = mod.run(d + "-ref", 4, resume=False)
    torch.save({"full": full, "pos": pos}, os.path.join(out, f"{mode}-{'ckpt' if switch else 'dcp'}-{rank}.pt"))


def _result(out: str, mode: str, which: str, rank: int) -> dict[str, Any]:
    return torch.load(os.path.join(out, f"{mode}-{which}-{rank}.pt"))


def test_the_switch_is_one_line():
    src = SCRIPT.read_text()
    switched = src.replace(DCP_IMPORT, CKPT_IMPORT)
    diff = [(a, b) for a, b in zip(src.splitlines(), switched.splitlines(), strict=True) if a != b]
    assert diff == [(DCP_IMPORT, CKPT_IMPORT)]


@pytest.mark.slow
@pytest.mark.multiproc
def test_dcp_script_on_ckpt_matches_dcp_and_an_uninterrupted_run(tmp_path):
    out = str(tmp_path)
    for switch in (False, True):
        run_ranks(2, _job, out, switch, "resume")
    run_ranks(2, _job, out, True, "ref")
    for rank in range(2):
        ours, theirs, ref = (_result(out, "resume", "ckpt", rank), _result(out, "resume", "dcp", rank),
                             _result(out, "ref", "ckpt", rank))
        assert ours["pos"] == theirs["pos"] == ref["pos"] == 4  # the per-rank loader state came back
        for k in ref["full"]:
            assert torch.equal(ours["full"][k], theirs["full"][k]), k
            assert torch.equal(ours["full"][k], ref["full"][k]), k
    m = ckpt.inspect(os.path.join(out, "ckpt"))
    assert {"dataloader.dp_rank_0", "dataloader.dp_rank_1"} <= set(m.objects)
    assert any(k.startswith("app.optim.state.net1.weight") for k in m.tensors)


def test_dcp_objects_are_refused_with_a_clear_error(tmp_path):
    import torch.distributed.checkpoint as tdcp

    import ckpt.dcp as cdcp

    class CustomWriter(tdcp.FileSystemWriter):  # DCP's own FileSystemWriter is accepted (test_dcp_api.py)
        pass

    with pytest.raises(ckpt.StateError, match="checkpoint_id"):
        cdcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "a"),
                  storage_writer=CustomWriter(str(tmp_path / "a")))
    with pytest.raises(ckpt.StateError, match="checkpoint_id is required"):
        cdcp.load({"w": torch.zeros(2)})


def test_async_save_future_and_stateful_round_trip(tmp_path):
    import ckpt.dcp as cdcp

    class Counter:
        def __init__(self, n: int) -> None:
            self.n = n

        def state_dict(self) -> dict[str, Any]:
            return {"n": self.n, "t": torch.full((3,), float(self.n))}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.n = sd["n"]
            assert torch.equal(sd["t"], torch.full((3,), float(self.n)))

    w = torch.arange(6.0)
    fut = cdcp.async_save({"w": w, "c": Counter(7)}, checkpoint_id=str(tmp_path / "a"))
    w.zero_()  # staged before async_save returned: the checkpoint keeps the old values
    m = fut.result()
    assert fut.done() and fut.exception() is None and m is not None
    c, target = Counter(0), torch.zeros(6)
    cdcp.load({"w": target, "c": c}, checkpoint_id=str(tmp_path / "a"))
    assert c.n == 7 and torch.equal(target, torch.arange(6.0))


def test_ckpt_save_and_load_take_stateful_values(tmp_path):
    class Sched:
        def __init__(self, last: int) -> None:
            self.last = last

        def state_dict(self) -> dict[str, Any]:
            return {"last_epoch": self.last}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.last = sd["last_epoch"]

    model = torch.nn.Linear(3, 2)
    ckpt.save({"model": model, "sched": Sched(5)}, str(tmp_path / "c"))  # a module is Stateful too
    model2, sched = torch.nn.Linear(3, 2), Sched(0)
    ckpt.load({"model": model2, "sched": sched}, str(tmp_path / "c"))
    assert sched.last == 5 and torch.equal(model2.weight, model.weight)


def _no_dist(rank: int, world: int, out: str) -> None:
    import ckpt.dcp as dcp

    if rank == 1:
        return  # never calls ckpt: no_dist=True must not wait for it
    w = torch.arange(12.0).reshape(3, 4) + rank
    dcp.save({"w": w, "step": 7}, checkpoint_id=out, no_dist=True)
    got: dict[str, Any] = {"w": torch.zeros(3, 4), "step": 0}
    dcp.load(got, checkpoint_id=out, no_dist=True)
    assert torch.equal(got["w"], w) and got["step"] == 7
    from ckpt.formats.msgpack_codec import decode_manifest

    with open(os.path.join(out, "manifest.msgpack"), "rb") as f:  # (ckpt.inspect is collective here)
        assert decode_manifest(f.read()).world_size == 1  # this process's state alone


@pytest.mark.multiproc
def test_no_dist_inside_a_process_group_saves_this_process_alone(tmp_path):
    run_ranks(2, _no_dist, str(tmp_path / "rank0-only"))
