"""``ckpt.dcp`` accepts what DCP's public API accepts: the legacy names, DCP's own writer/reader
objects (file system and fsspec), its default planners, ShardedTensor state dicts, and assigns
loaded top-level keys as DCP does; what it cannot honour is refused with a typed error, before
anything is written."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import ckpt
import ckpt.dcp as cdcp
from ckpt._dcp_compat import UnsupportedCompressionError, UnsupportedDCPObjectError
from ckpt.errors import CheckpointExistsError, MismatchError
from tests.dist_utils import run_ranks
from tests.helpers import assert_same_state, zeros_like_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.arange(5, dtype=torch.int64), "step": 7,
            "sub": {"x": torch.randn(2, generator=g).to(torch.bfloat16), "name": "run"}}


def test_every_public_dcp_name_is_there_and_save_load_are_ckpts():
    public = [n for n in dir(tdcp) if not n.startswith("_")]
    assert {"FileSystemWriter", "DefaultSavePlanner", "Metadata", "state_dict_saver"} <= set(public)
    assert [n for n in public if not hasattr(cdcp, n)] == []
    for name in ("save", "load", "async_save", "save_state_dict", "load_state_dict"):
        assert getattr(cdcp, name).__module__ == "ckpt.dcp", name
    assert cdcp.FileSystemWriter is tdcp.FileSystemWriter and cdcp.Metadata is tdcp.Metadata
    with pytest.raises(AttributeError):
        _ = cdcp.no_such_name  # type: ignore[attr-defined]


def test_legacy_names_with_filesystem_writer_and_reader_write_a_ckpt_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    sd = _state()
    w = cdcp.FileSystemWriter(path, thread_count=3, sync_files=False, single_file_per_rank=False)
    cdcp.save_state_dict(sd, storage_writer=w, no_dist=True, planner=cdcp.DefaultSavePlanner())
    m = ckpt.inspect(path)  # a ckpt checkpoint, at the writer's path
    assert set(m.tensors) == {"w", "b", "sub.x"} and not any(f.endswith(".distcp") for f in os.listdir(path))
    out = zeros_like_state(sd)
    cdcp.load_state_dict(out, storage_reader=cdcp.FileSystemReader(path), no_dist=True,
                         planner=cdcp.DefaultLoadPlanner())
    assert_same_state(out, sd)


def test_checkpoint_id_wins_over_the_writers_path_as_in_dcp(tmp_path):
    cdcp.save(_state(), checkpoint_id=str(tmp_path / "id"), storage_writer=cdcp.FileSystemWriter(str(tmp_path / "w")))
    assert os.path.isdir(tmp_path / "id") and not os.path.exists(tmp_path / "w")
    out = zeros_like_state(_state())
    cdcp.load(out, checkpoint_id=str(tmp_path / "id"), storage_reader=cdcp.FileSystemReader(str(tmp_path / "w")))
    assert_same_state(out, _state())


def test_fsspec_writer_and_reader_go_to_ckpts_fsspec_backend():
    url = f"memory://ckpt-dcp-api/{random.getrandbits(32)}"
    sd = _state()
    cdcp.save(sd, storage_writer=FsspecWriter(url), planner=tdcp.DefaultSavePlanner())
    assert set(ckpt.inspect(url).tensors) == {"w", "b", "sub.x"}
    out = zeros_like_state(sd)
    cdcp.load(out, storage_reader=FsspecReader(url), planner=tdcp.DefaultLoadPlanner())
    assert_same_state(out, sd)


def test_writer_overwrite_false_refuses_an_existing_checkpoint_and_keeps_it(tmp_path):
    path = str(tmp_path / "c")
    cdcp.save({"t": torch.ones(3)}, storage_writer=cdcp.FileSystemWriter(path, overwrite=False))
    before = sorted(os.listdir(path))
    with pytest.raises(CheckpointExistsError):
        cdcp.save({"t": torch.zeros(3)}, storage_writer=cdcp.FileSystemWriter(path, overwrite=False))
    assert sorted(os.listdir(path)) == before
    cdcp.save({"t": torch.full((3,), 2.0)}, storage_writer=cdcp.FileSystemWriter(path))  # overwrite=True default
    out = {"t": torch.zeros(3)}
    cdcp.load(out, checkpoint_id=path)
    assert torch.equal(out["t"], torch.full((3,), 2.0))


def test_default_load_planner_allow_partial_load_leaves_missing_keys(tmp_path):
    path = str(tmp_path / "c")
    cdcp.save({"a": torch.ones(2)}, checkpoint_id=path)
    keep = torch.full((2,), 5.0)
    out = {"a": torch.zeros(2), "extra": keep, "obj": "mine"}
    cdcp.load(out, checkpoint_id=path, planner=tdcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["a"], torch.ones(2)) and out["extra"] is keep and out["obj"] == "mine"
    with pytest.raises(MismatchError, match="extra"):
        cdcp.load({"a": torch.zeros(2), "extra": torch.zeros(2)}, checkpoint_id=path)


class _MyPlanner(tdcp.DefaultSavePlanner):
    pass


class _MyLoadPlanner(tdcp.DefaultLoadPlanner):
    pass


class _MyWriter(tdcp.FileSystemWriter):
    pass


class _MyReader(tdcp.FileSystemReader):
    pass


class _MyHFWriter(tdcp.HuggingFaceStorageWriter):  # DCP's own HF writer is handed to DCP; a subclass is refused
    pass


def _refused_save_kwargs(path: str) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return [{"planner": _MyPlanner(), "checkpoint_id": path},
            {"storage_writer": _MyWriter(path)},
            {"storage_writer": _MyHFWriter(path)},
            {"checkpoint_id": path, "planner": tdcp.DefaultLoadPlanner()},  # a load planner given to save
            {"checkpoint_id": path, "async_stager": BlockingAsyncStager()}]


@pytest.mark.parametrize("case", range(5))
def test_objects_ckpt_cannot_honour_are_refused_before_anything_is_written(tmp_path, case):
    path = str(tmp_path / "c")
    kwargs = _refused_save_kwargs(path)[case]
    fn = cdcp.async_save if "async_stager" in kwargs else cdcp.save
    with pytest.raises(UnsupportedDCPObjectError) as ei:
        fn({"t": torch.ones(2)}, **kwargs)
    assert isinstance(ei.value, ckpt.CheckpointError) and "torch.distributed.checkpoint" in str(ei.value)
    assert not os.path.exists(path)
    cdcp.save({"t": torch.ones(2)}, checkpoint_id=path)
    for bad in ({"planner": _MyLoadPlanner()}, {"storage_reader": _MyReader(path)},
                {"planner": tdcp.DefaultSavePlanner()}):
        with pytest.raises(UnsupportedDCPObjectError):
            cdcp.load({"t": torch.zeros(2)}, **({"checkpoint_id": path} | bad))


def test_extensions_are_refused_as_unsupported_compression(tmp_path):
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example

    path = str(tmp_path / "c")
    w = cdcp.FileSystemWriter(path, _extensions=[Rot13Example()])
    with pytest.raises(UnsupportedCompressionError, match="compression"):
        cdcp.save({"t": torch.ones(2)}, storage_writer=w)
    assert not os.path.exists(path)
    cdcp.save({"t": torch.ones(2)}, storage_writer=cdcp.FileSystemWriter(path, _extensions=[]))  # empty is fine


class _Recorder(dict):  # type: ignore[type-arg]
    """A dict subclass logging every assignment (DCP users rely on __setitem__ hooks)."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.log: list[str] = []

    def __setitem__(self, k: str, v: Any) -> None:
        self.log.append(k)
        super().__setitem__(k, v)


_leaf = st.one_of(st.integers(-5, 5), st.text(max_size=3),
                  st.integers(0, 3).map(lambda n: torch.arange(n, dtype=torch.float32)))
_tree = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]),
                        st.one_of(_leaf, st.dictionaries(st.sampled_from(["x", "y"]), _leaf, max_size=2)),
                        min_size=1, max_size=4)


def _blank(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _blank(x) for k, x in v.items()}
    return torch.zeros_like(v) if isinstance(v, torch.Tensor) else None


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sd=_tree)
def test_loaded_top_level_keys_are_assigned_exactly_as_dcp_does(tmp_path_factory, sd):
    """Whatever the state, a dict subclass sees the same assignments (each top-level key once, in
    the same order) and ends with the same values under ckpt.dcp as under DCP."""
    d = tmp_path_factory.mktemp("rec")
    results = []
    for mod in (tdcp, cdcp):
        path = str(d / mod.__name__)
        mod.save(sd, checkpoint_id=path, no_dist=True)
        target = _Recorder(_blank(sd))
        inner = {k: v for k, v in target.items() if isinstance(v, torch.Tensor)}
        mod.load(target, checkpoint_id=path, no_dist=True)
        for k, v in inner.items():
            assert target[k] is v  # filled in place, the same object handed back
        results.append(target)
    theirs, ours = results
    assert sorted(ours.log) == sorted(theirs.log) == sorted(sd) and len(set(ours.log)) == len(ours.log)
    assert_same_state(dict(ours), dict(theirs))
    assert_same_state(dict(ours), sd)


# --- ShardedTensor (FSDP1 SHARDED_STATE_DICT) on a real 2-rank gloo group ---------------------------

def _layout(rng: random.Random, rows: int, world: int) -> list[tuple[int, int, int]]:
    """Random row blocks [(start, stop, owner rank)]: several per rank, possibly none on a rank."""
    cuts = sorted(rng.sample(range(1, rows), rng.randint(0, 4)))
    bounds = [0, *cuts, rows]
    return [(a, b, rng.randrange(world)) for a, b in zip(bounds, bounds[1:], strict=False)]


def _sharded(full: torch.Tensor, layout: list[tuple[int, int, int]], rank: int, fill: bool) -> Any:
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    shards = [Shard.from_tensor_and_offsets(full[a:b].clone() if fill else torch.zeros(b - a, full.shape[1]),
                                            [a, 0], rank) for a, b, r in layout if r == rank]
    return init_from_local_shards(shards, *full.shape)


def _sharded_job(rank: int, world: int, root: str) -> None:
    full = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    bias = torch.arange(4, dtype=torch.float64)
    rng = random.Random(1234)  # the same layouts on every rank
    for trial in range(4):
        src, dst = _layout(rng, 10, world), _layout(rng, 10, world)
        path = os.path.join(root, str(trial))
        cdcp.save({"model": {"w": _sharded(full, src, rank, True), "b": bias}, "step": trial}, checkpoint_id=path)
        target = {"model": {"w": _sharded(full, dst, rank, False), "b": torch.zeros(4, dtype=torch.float64)},
                  "step": -1}
        w = target["model"]["w"]
        cdcp.load(target, checkpoint_id=path)
        assert target["model"]["w"] is w and target["step"] == trial
        for s in w.local_shards():  # each local shard filled in place with its block of the global tensor
            a = s.metadata.shard_offsets[0]
            assert torch.equal(s.tensor, full[a:a + s.tensor.shape[0]]), (trial, src, dst)
        assert torch.equal(target["model"]["b"], bias)
        # a ckpt checkpoint: any reader gets the whole tensor back, no ShardedTensor needed
        whole = ckpt.load({"model": {"w": torch.zeros(10, 3)}}, path)
        assert torch.equal(whole["model"]["w"], full)


@pytest.mark.multiproc
def test_sharded_tensors_save_and_reshard_on_load_over_two_ranks(tmp_path):
    run_ranks(2, _sharded_job, str(tmp_path))
