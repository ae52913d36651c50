"""Save on N ranks, load on M ranks under another sharding: bitwise equal (real gloo groups, forked)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckpt
from tests.dist_utils import run_ranks
from tests.layouts import assert_bitwise, empty_like_piece, expected_local, local_of, piece, reference

pytestmark = pytest.mark.multiproc

SAVE_KINDS = {"w32": "rows", "wbf16": "cols", "i64": "flat", "f8": "grid", "vec": "replicated", "cube": "cols"}
LOAD_KINDS = {"w32": "cols", "wbf16": "flat", "i64": "rows", "f8": "rows", "vec": "flat", "cube": "grid"}


def _save(rank: int, world: int, path: str) -> None:
    ref = reference()
    state = {"model": {k: piece(v, SAVE_KINDS[k], rank, world) for k, v in ref.items()},
             "step": 7, "rng": ckpt.PerRank([rank, "r"])}
    m = ckpt.save(state, path, step=7)
    assert m.world_size == world and m.step == 7
    if rank == 0:  # the coordinator gets the whole manifest, the others the pieces they wrote
        assert not m.partial and set(m.tensors) == {f"model.{k}" for k in ref}
    else:
        assert m.partial and set(m.tensors) <= {f"model.{k}" for k in ref}


def _load(rank: int, world: int, path: str, saved_world: int) -> None:
    ref = reference()
    pieces = {k: piece(v, LOAD_KINDS[k], rank, world) for k, v in ref.items()}
    targets = {k: empty_like_piece(p) for k, p in pieces.items()}
    out = ckpt.load({"model": targets, "step": 0, "rng": None}, path, strict=rank < saved_world)
    for k, t in targets.items():
        assert_bitwise(local_of(t), expected_local(ref[k], t), f"rank {rank} {k}")
    assert out["step"] == 7
    if rank < saved_world:
        assert out["rng"] == [rank, "r"]


@pytest.mark.parametrize("save_world,load_world", [(2, 3), (3, 4), (4, 2)])
def test_save_n_load_m(tmp_path, save_world, load_world):
    path = str(tmp_path / "c")
    run_ranks(save_world, _save, path)
    assert ckpt.verify(path, deep=True).ok
    run_ranks(load_world, _load, path, save_world)


def test_save_4_load_single_process(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(4, _save, path)
    ref = reference()
    targets = {k: torch.zeros_like(v) for k, v in ref.items()}
    out = ckpt.load({"model": targets, "step": 0, "rng": None}, path, strict=False)
    for k, v in ref.items():
        assert_bitwise(targets[k], v, k)
    assert out["step"] == 7


def test_single_process_save_loads_on_3_ranks(tmp_path):
    path = str(tmp_path / "c")
    ref = reference()
    ckpt.save({"model": ref, "step": 7, "rng": ckpt.PerRank([0, "r"])}, path)
    run_ranks(3, _load, path, 1)


def _replicas_balanced(rank: int, world: int, path: str) -> None:
    # Every rank holds the same 8 replicated tensors: writing is spread, not all on rank 0.
    state = {f"t{i}": torch.full((256,), float(i)) for i in range(8)}
    m = ckpt.save(state, path)
    if rank != 0:
        return
    per_file: dict[str, int] = {}
    for t in m.tensors.values():
        assert len(t.shards) == 1
        per_file[t.shards[0].file] = per_file.get(t.shards[0].file, 0) + t.shards[0].length
    assert len(per_file) == world
    assert max(per_file.values()) == min(per_file.values()) == 8 * 256 * 4 // world


def test_replicas_written_once_and_balanced(tmp_path):
    run_ranks(4, _replicas_balanced, str(tmp_path / "c"))


def _dtensor_save(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    ref = reference()
    state = {
        "rows": distribute_tensor(ref["w32"], mesh, [Shard(0)]),  # 13 rows over 4: 4,4,4,1 (uneven)
        "cols": distribute_tensor(ref["wbf16"], mesh, [Shard(1)]),
        "rep": distribute_tensor(ref["vec"], mesh, [Replicate()]),
        "tiny": distribute_tensor(torch.arange(3.0), mesh, [Shard(0)]),  # 3 over 4: one rank holds nothing
    }
    ckpt.save(state, path)


def _dtensor_load(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2))
    ref = reference()
    targets = {
        "rows": distribute_tensor(torch.zeros(13, 10), mesh, [Shard(1), Shard(0)]),
        "cols": distribute_tensor(torch.zeros(9, 6, dtype=torch.bfloat16), mesh, [Shard(0), Shard(0)]),
        "rep": distribute_tensor(torch.zeros(17), mesh, [Shard(0), Shard(0)]),
        "tiny": distribute_tensor(torch.zeros(3), mesh, [Shard(0), Shard(0)]),
    }
    ckpt.load(targets, path)
    expect = {"rows": ref["w32"], "cols": ref["wbf16"], "rep": ref["vec"], "tiny": torch.arange(3.0)}
    for k, t in targets.items():
        assert_bitwise(t.full_tensor(), expect[k], k)  # collective: every rank calls it


@pytest.mark.slow
def test_dtensor_shard0_saved_loaded_as_2d_mesh(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(4, _dtensor_save, path)
    assert ckpt.verify(path, deep=True).ok
    run_ranks(4, _dtensor_load, path)


def _failing_rank(rank: int, world: int, path: str) -> None:
    ref = reference()
    state = {"w": piece(ref["w32"], "rows", rank, world)}
    if rank == 1:  # this rank declares a piece that overlaps rank 0's
        state = {"w": ckpt.Shard(ref["w32"][2:7].clone(), (13, 10), (2, 0))}
    with pytest.raises(ckpt.LayoutError, match="overlap"):
        ckpt.save(state, path)
    dist.barrier()


def test_bad_layout_fails_on_every_rank_and_writes_nothing(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(3, _failing_rank, path)
    assert not os.path.exists(os.path.join(path, "manifest.msgpack"))
    assert not os.path.exists(os.path.join(path, "data")) or not os.listdir(os.path.join(path, "data"))


def _disagree(rank: int, world: int, path: str) -> None:
    shape = (4, 4) if rank == 0 else (4, 5)
    with pytest.raises(ckpt.StateError, match="rank 0 declares"):
        ckpt.save({"w": ckpt.Shard(torch.zeros(2, 4), shape, (2 * rank, 0))}, path)


def test_ranks_disagreeing_on_shape(tmp_path):
    run_ranks(2, _disagree, str(tmp_path / "c"))


def _zero_over_tp_save(rank: int, world: int, path: str) -> None:
    # tp=2 splits rows; within each TP block, dp=2 ranks split its flattening (ZeRO-1 over TP).
    g = reference()["w32"]  # (13, 10): TP blocks of 7 and 6 rows, flattenings of 70 and 60
    tp, dp = divmod(rank, 2)
    rs, rn = (0, 7) if tp == 0 else (7, 6)
    block = g[rs : rs + rn].reshape(-1)
    half = -(-block.numel() // 2)
    s, e = dp * half, min((dp + 1) * half, block.numel())
    ckpt.save({"exp_avg": ckpt.FlatShard(block[s:e].clone(), (13, 10), s, box=((rs, 0), (rn, 10)))}, path)


def test_zero1_flat_over_tp_blocks_loads_as_any_layout(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(4, _zero_over_tp_save, path)
    m = ckpt.inspect(path)
    assert len(m.tensors["exp_avg"].shards) == 4 and ckpt.verify(path, deep=True).ok
    g = reference()["w32"]
    full = torch.zeros(13, 10)
    ckpt.load({"exp_avg": full}, path)
    assert torch.equal(full, g)
    cols = ckpt.Shard(torch.zeros(13, 4), (13, 10), (0, 3))
    ckpt.load({"exp_avg": cols}, path)
    assert torch.equal(cols.local, g[:, 3:7])
    flat = ckpt.FlatShard(torch.zeros(50), (13, 10), 33)
    ckpt.load({"exp_avg": flat}, path)
    assert torch.equal(flat.local, g.reshape(-1)[33:83])


def _subgroup_saves(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    from ckpt.async_save import AsyncSaver

    sub = dist.new_group([0, 1])  # collective: every rank creates it, only 0 and 1 use it
    if rank < 2:
        st = {"w": torch.arange(32.0).view(4, 8), "b": torch.arange(8.0)}  # replicated over 0 and 1
        # ckpt's own groups (the background commit's) are created by the members alone: ranks 2
        # and 3 never call into ckpt, and the save must neither wait for them nor hang
        h = AsyncSaver(group=sub, timeout=30).save(st, os.path.join(root, "a"), step=1)
        assert h.done(timeout=60) is not None
        ckpt.save(st, os.path.join(root, "s"), group=sub)
    # ...nor shift the names of the groups the job creates afterwards (new_group names groups by a
    # per-process counter: a group created by ranks 0 and 1 alone would make their next one differ)
    import datetime

    after = dist.new_group([0, 1, 2, 3], timeout=datetime.timedelta(seconds=20))
    t = torch.ones(1)
    dist.all_reduce(t, group=after)
    assert t.item() == 4
    # and a save over the world after ranks joined different subgroups (torch's per-process group
    # counts now differ between ranks 0-1 and 2-3: names derived from them would not match)
    h = AsyncSaver(timeout=30).save({"x": torch.arange(4.0)}, os.path.join(root, "w"), step=2)
    assert h.done(timeout=60) is not None


def test_saves_on_a_subgroup_need_no_call_from_other_ranks(tmp_path):
    run_ranks(4, _subgroup_saves, str(tmp_path))
    assert ckpt.verify(str(tmp_path / "w"), deep=True).ok
    for name in ("a", "s"):
        assert ckpt.verify(str(tmp_path / name), deep=True).ok
        dst = {"w": torch.zeros(4, 8), "b": torch.zeros(8)}
        ckpt.load(dst, str(tmp_path / name))
        assert torch.equal(dst["w"], torch.arange(32.0).view(4, 8)) and torch.equal(dst["b"], torch.arange(8.0))


def _side_group_alone(rank: int, world: int) -> None:
    import time

    from ckpt._comm import side_group

    if rank == 0:  # rank 1 never joins: a typed error naming the ranks, within the timeout
        t = time.monotonic()
        with pytest.raises(ckpt.CollectiveError, match=r"rank 0: could not create ckpt's probe \(gloo\) group of "
                                                       r"ranks \[0, 1\]"):
            side_group([0, 1], "probe", timeout=2)
        assert time.monotonic() - t < 30


@pytest.mark.slow
def test_a_side_group_whose_member_never_arrives_is_a_typed_error_in_time():
    run_ranks(2, _side_group_alone)
