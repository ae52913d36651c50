"""``ckpt.dcp`` holds for a code base where ``torch.distributed.checkpoint`` was replaced by
``ckpt.dcp`` everywhere (PyTorch's own DCP tests, issue 31 item 3): DCP's submodules are importable
under ``ckpt.dcp`` with DCP's own objects, the save/load entry points in them are ckpt's, and every
error a ckpt.dcp call raises is also DCP's ``CheckpointException`` (what DCP code catches)."""

from __future__ import annotations

import importlib
import os
import pickle
import pkgutil
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.api import CheckpointException

import ckpt
import ckpt.dcp as cdcp
from ckpt import errors
from ckpt._dcp_compat import UnsupportedDCPObjectError, dcp_wording
from tests.helpers import assert_same_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning",
                                        "ignore::DeprecationWarning", "ignore::FutureWarning")

_ENTRY = {"state_dict_saver": {"save", "async_save", "save_state_dict"},
          "state_dict_loader": {"load", "load_state_dict"}}


def _dcp_submodules() -> list[str]:
    """Every top-level submodule of torch.distributed.checkpoint that imports here."""
    out = []
    for info in pkgutil.iter_modules(tdcp.__path__):
        try:
            importlib.import_module(f"torch.distributed.checkpoint.{info.name}")
        except ImportError:  # an optional dependency missing: no code base can use it here either
            continue
        out.append(info.name)
    return out


@pytest.mark.parametrize("name", _dcp_submodules())
def test_each_dcp_submodule_under_ckpt_dcp_has_dcps_objects_and_ckpts_entry_points(name):
    real = importlib.import_module(f"torch.distributed.checkpoint.{name}")
    view = importlib.import_module(f"ckpt.dcp.{name}")
    assert view is getattr(cdcp, name)  # `import ckpt.dcp.x` and `ckpt.dcp.x` are one module
    public = [n for n in dir(real) if not n.startswith("__")]
    entry = _ENTRY.get(name, set())
    assert entry <= set(public)
    for n in public:
        if n in entry:
            assert getattr(view, n) is getattr(cdcp, n), (name, n)  # ckpt's, never DCP's
        else:
            assert getattr(view, n) is getattr(real, n), (name, n)
    with pytest.raises(AttributeError):
        _ = view.no_such_name_here


def test_nested_and_missing_submodules(tmp_path):
    from ckpt.dcp._experimental.staging import CheckpointStager  # type: ignore[import-not-found]
    from torch.distributed.checkpoint._experimental.staging import CheckpointStager as Real

    assert CheckpointStager is Real
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ckpt.dcp.no_such_submodule")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ckpt.dcp.planner.no_such")  # planner is no package


def test_saver_and_loader_submodules_write_and_read_a_ckpt_checkpoint(tmp_path):
    from ckpt.dcp.state_dict_loader import load  # type: ignore[import-not-found]
    from ckpt.dcp.state_dict_saver import save  # type: ignore[import-not-found]

    path = str(tmp_path / "c")
    sd = {"w": torch.randn(3, 2), "meta": {"step": 3, "dt": torch.bfloat16}}
    save(sd, checkpoint_id=path)
    assert set(ckpt.inspect(path).tensors) == {"w"}
    assert not any(f.endswith(".distcp") or f == ".metadata" for f in os.listdir(path))
    out = {"w": torch.zeros(3, 2), "meta": {"step": 0, "dt": None}}
    load(out, checkpoint_id=path)
    assert_same_state(out, sd)


def _exists(path: str) -> None:
    cdcp.save({"t": torch.ones(2)}, checkpoint_id=path)
    cdcp.save({"t": torch.ones(2)}, storage_writer=cdcp.FileSystemWriter(path, overwrite=False))


def _missing_key(path: str) -> None:
    cdcp.save({"t": torch.ones(2)}, checkpoint_id=path)
    cdcp.load({"t": torch.zeros(2), "u": torch.zeros(2)}, checkpoint_id=path)


def _wrong_shape(path: str) -> None:
    cdcp.save({"t": torch.ones(2)}, checkpoint_id=path)
    cdcp.load_state_dict({"t": torch.zeros(3)}, storage_reader=cdcp.FileSystemReader(path), no_dist=True)


def _no_checkpoint(path: str) -> None:
    cdcp.load({"t": torch.zeros(2)}, checkpoint_id=path)


def _custom_planner(path: str) -> None:
    class Mine(tdcp.DefaultSavePlanner):
        pass

    cdcp.save({"t": torch.ones(2)}, checkpoint_id=path, planner=Mine())


def _async_exists(path: str) -> None:
    cdcp.save({"t": torch.ones(2)}, checkpoint_id=path)
    fut = cdcp.async_save({"t": torch.ones(2)}, storage_writer=cdcp.FileSystemWriter(path, overwrite=False))
    fut.result()


def _optimizer_helper(path: str) -> None:
    cdcp.load_sharded_optimizer_state_dict({}, "optim", cdcp.FileSystemReader(path))


_FAILURES = [(_exists, errors.CheckpointExistsError), (_missing_key, errors.MismatchError),
             (_wrong_shape, errors.MismatchError), (_no_checkpoint, errors.ManifestError),
             (_custom_planner, UnsupportedDCPObjectError), (_async_exists, errors.CheckpointExistsError),
             (_optimizer_helper, UnsupportedDCPObjectError)]


@pytest.mark.parametrize("fail,kind", _FAILURES, ids=[f.__name__ for f, _ in _FAILURES])
def test_every_error_is_both_ckpts_typed_error_and_dcps_checkpoint_exception(tmp_path, fail, kind):
    with pytest.raises(CheckpointException) as ei:
        fail(str(tmp_path / "c"))
    e: Any = ei.value
    assert isinstance(e, kind) and isinstance(e, Exception) and isinstance(e, errors.CheckpointError)
    # DCP's shape: failures maps the failing rank to (exception, traceback); the message stays ckpt's one line
    # (with DCP's words after it where DCP code matches them: a missing key, a size mismatch)
    assert list(e.failures) == [0] and isinstance(e.failures[0][0], kind)
    assert str(e) == str(e.failures[0][0]) + dcp_wording(e)
    assert bool(dcp_wording(e)) == (fail in (_missing_key, _wrong_shape, _exists, _async_exists))
    assert "\n" not in str(e) and "CheckpointException ranks" not in str(e)
    again = pickle.loads(pickle.dumps(e))  # crosses processes as DCP's does
    assert type(again) is type(e) and str(again) == str(e)
    try:  # and plain `except <ckpt error>` code is not affected
        fail(str(tmp_path / "d"))
    except kind as caught:
        assert caught.__traceback__ is not None


def _exists_on_every_rank(rank: int, world: int, path: str) -> None:
    cdcp.save({"t": torch.arange(4.0)}, checkpoint_id=path)
    try:
        cdcp.save({"t": torch.zeros(4)}, storage_writer=cdcp.FileSystemWriter(path, overwrite=False))
    except CheckpointException as e:
        assert isinstance(e, errors.CheckpointExistsError) and list(e.failures) == [rank], e.failures
    else:
        raise AssertionError(f"rank {rank}: overwrite=False saved over a committed checkpoint")
    out = {"t": torch.zeros(4)}
    cdcp.load(out, checkpoint_id=path)  # the committed checkpoint is untouched
    assert torch.equal(out["t"], torch.arange(4.0)), out


@pytest.mark.multiproc
def test_checkpoint_exception_failures_name_the_failing_rank_on_a_gloo_group(tmp_path):
    from tests.dist_utils import run_ranks

    run_ranks(2, _exists_on_every_rank, str(tmp_path / "c"))
