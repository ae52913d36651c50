"""FSDP2 x TP (2-D) and HSDP x TP states from real fully_shard / parallelize_module / DeviceMesh on 4
forked gloo ranks: saved by ckpt, loaded on 2, 3 and 1 rank(s) and on another 2-D mesh, model and
AdamW state bitwise equal to the originals gathered to full tensors; DCP side by side on one."""

from __future__ import annotations

import os

import pytest
import torch

import ckpt
from tests.dist_utils import run_ranks
from tests.frameworks import fsdp_tp as F

pytestmark = pytest.mark.multiproc

LAYOUTS = {
    "dp2_tp2": ((2, 2), ("dp", "tp")),
    "hsdp_tp": ((1, 2, 2), ("dp_replicate", "dp_shard", "tp")),
    "dp1_tp4": ((1, 4), ("dp", "tp")),
    "dp2": ((2,), ("dp",)),
    "dp3": ((3,), ("dp",)),
    "tp2": ((2,), ("tp",)),
    "single": ((), ()),
}


def _save(rank: int, world: int, out: str, layout: str, how: str) -> None:
    model, opt = F.build(*LAYOUTS[layout])
    sd = F.state(model, opt)
    if how == "ckpt":
        ckpt.save(sd, os.path.join(out, "ckpt"))
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, checkpoint_id=os.path.join(out, "dcp"))
    ref = F.full(sd)
    if rank == 0:
        torch.save(ref, os.path.join(out, "ref.pt"))


def _load(rank: int, world: int, out: str, layout: str, how: str) -> None:
    model, opt = F.build(*LAYOUTS[layout], train=False)
    sd = F.state(model, opt)
    if how == "ckpt":
        got = ckpt.load(sd, os.path.join(out, "ckpt"))
    else:
        import torch.distributed.checkpoint as dcp

        dcp.load(sd, checkpoint_id=os.path.join(out, "dcp"))
        got = sd
    F.equal(F.full(got), torch.load(os.path.join(out, "ref.pt")))
    # the model itself was updated in place: its gathered parameters are the saved ones
    ref = torch.load(os.path.join(out, "ref.pt"))["model"]
    F.equal(F.full(dict(model.state_dict())), ref)


def _world(layout: str) -> int:
    shape = LAYOUTS[layout][0]
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.slow
@pytest.mark.parametrize("src", ["dp2_tp2", "hsdp_tp"])
def test_fsdp_tp_saved_on_4_loads_on_other_layouts_bitwise(tmp_path, src):
    out = str(tmp_path)
    run_ranks(4, _save, out, src, "ckpt")
    m = ckpt.inspect(os.path.join(out, "ckpt"))
    assert "model.up.weight" in m.tensors and "optim.state.up.weight.exp_avg" in m.tensors
    targets = ["dp2", "dp3", "single", "dp1_tp4", "tp2"] if src == "dp2_tp2" else ["dp2", "dp3", "single", "dp2_tp2"]
    for dst in targets:
        run_ranks(_world(dst), _load, out, dst, "ckpt")


@pytest.mark.slow
def test_dcp_side_by_side_gives_identical_tensors(tmp_path):
    out = str(tmp_path)
    run_ranks(4, _save, out, "dp2_tp2", "dcp")
    run_ranks(2, _load, out, "dp2", "dcp")   # DCP's own round trip to 2 ranks
    run_ranks(4, _save, out, "dp2_tp2", "ckpt")
    run_ranks(2, _load, out, "dp2", "ckpt")  # ckpt's: both equal the same gathered originals


def _ep(rank: int, world: int, out: str, save: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)  # experts x hidden x inter
    if save:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))
        dt = distribute_tensor(full, mesh, [Shard(0), Shard(1)])  # EP over experts, FSDP within
        ckpt.save({"experts.w": dt}, out)
        return
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    dt = distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])
    ckpt.load({"experts.w": dt}, out)
    assert torch.equal(dt.full_tensor(), full)


@pytest.mark.slow
def test_ep_sharded_experts_round_trip(tmp_path):
    url = str(tmp_path / "ep")
    run_ranks(4, _ep, url, True)
    run_ranks(2, _ep, url, False)
    run_ranks(1, _ep, url, False)


def _partial(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    dt = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    with pytest.raises(ckpt.StateError, match="'p'.*Partial.*reduce"):
        ckpt.save({"p": dt}, out)


@pytest.mark.slow
def test_partial_placement_is_refused_naming_the_tensor(tmp_path):
    run_ranks(2, _partial, str(tmp_path / "p"))


def _tied(rank: int, world: int, out: str, save: bool, layout: str = "", tie: bool = True) -> None:
    names = LAYOUTS[layout][1] if layout else (("dp",) if world > 1 else ())
    shape = LAYOUTS[layout][0] if layout else ((world,) if world > 1 else ())
    model, opt = F.build(shape, names, train=save, tie=tie)
    assert (model.out.weight is model.emb.weight) == tie
    sd = F.state(model, opt, flatten_optimizer_state_dict=True)
    if save:
        ckpt.save(sd, out)
        ref = F.full(sd)  # a collective: every rank gathers
        if rank == 0:
            torch.save(ref, out + ".ref.pt")
        return
    ref = torch.load(out + ".ref.pt")
    if tie:
        F.equal(F.full(ckpt.load(sd, out)), ref)
    else:  # an untied model's optimizer has state the tied run never had: load the weights
        F.equal(F.full(ckpt.load({"model": sd["model"]}, out)), {"model": ref["model"]})
    # tied: still one tensor, loaded once; untied: both tensors hold the saved values
    assert torch.equal(F.full(model.out.weight), ref["model"]["emb.weight"])
    assert torch.equal(F.full(model.emb.weight), ref["model"]["emb.weight"])


def _shared_bytes(url: str) -> None:
    m = ckpt.inspect(url)
    emb, out = m.tensors["model.emb.weight"], m.tensors["model.out.weight"]
    where = {(s.file, s.offset, s.length, s.checksum) for s in emb.shards}
    assert where == {(s.file, s.offset, s.length, s.checksum) for s in out.shards}  # saved once
    stored = {(s.file, s.offset, s.length) for t in m.tensors.values() for s in t.shards}
    # every byte range is stored once: the alias adds none
    assert sum(n for _, _, n in stored) == sum(t.nbytes for t in m.tensors.values()) - out.nbytes
    assert ckpt.verify(url, deep=True).ok


@pytest.mark.slow
def test_tied_embedding_and_flattened_optimizer_state(tmp_path):
    url = str(tmp_path / "tied")
    run_ranks(2, _tied, url, True)
    m = ckpt.inspect(url)
    assert "model.out.weight" in m.tensors and "model.emb.weight" in m.tensors
    assert any(k.startswith("optim.state.emb.weight") for k in m.tensors)  # flattened optimizer keys
    _shared_bytes(url)
    run_ranks(1, _tied, url, False)


@pytest.mark.slow
def test_tied_weights_on_a_2d_mesh_save_once_and_load_tied_or_untied(tmp_path):
    url = str(tmp_path / "tied2d")
    run_ranks(4, _tied, url, True, "dp2_tp2")
    _shared_bytes(url)
    run_ranks(2, _tied, url, False, "dp2")                # tied on another mesh
    run_ranks(3, _tied, url, False, "dp3", False)         # into an untied model: both keys filled


def _half_tied(rank: int, world: int, out: str) -> None:
    w = torch.arange(12.0).reshape(3, 4)
    # rank 0 ties the two keys, rank 1 holds two separate (equal) copies: stored twice, nothing lost
    state = {"a": w, "b": w if rank == 0 else w.clone()}
    m = ckpt.save(state, out)
    if rank == 0:
        where = [{(s.file, s.offset) for s in m.tensors[k].shards} for k in ("a", "b")]
        assert where[0] != where[1]
    a, b = torch.zeros(3, 4), torch.zeros(3, 4)
    ckpt.load({"a": a, "b": b}, out)
    assert torch.equal(a, w) and torch.equal(b, w)


def test_a_key_tied_on_one_rank_only_is_stored_apart(tmp_path):
    run_ranks(2, _half_tied, str(tmp_path / "half"))
