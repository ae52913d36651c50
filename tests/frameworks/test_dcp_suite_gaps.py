"""Gaps PyTorch's own DCP tests found in ``ckpt.dcp`` (issue 31 item 3, second round; see docs/INTEROP.md):

* DCP's ``_api_bc_check``: ``dcp.save(state_dict, writer)`` / ``dcp.load(state_dict, reader)`` (the storage
  object as the second positional argument) still works in DCP, with a warning
  (test_compatibility.py::test_sharded_tensor_dependency);
* DCP code matches DCP's message text on ``CheckpointException`` ("Missing key in checkpoint",
  "Size mismatch"; test_planner.py::TestLoadPlanner): ckpt's errors through ``ckpt.dcp`` carry DCP's
  words after ckpt's own message.
"""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import ckpt.dcp as cdcp
from ckpt import errors
from ckpt._dcp_compat import as_dcp_exception, dcp_wording
from tests.helpers import assert_same_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning",
                                        "ignore::DeprecationWarning", "ignore::FutureWarning")

_BC = "The argument order of {} has been changed"


def test_storage_object_as_second_positional_argument_saves_and_loads_with_dcps_warning(tmp_path):
    path = str(tmp_path / "ck")
    saved = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": 7}
    with pytest.warns(UserWarning, match=_BC.format("save")):
        cdcp.save(saved, FileSystemWriter(path))
    assert sorted(os.listdir(path)) == ["data", "manifest.msgpack"]  # ckpt's checkpoint, not DCP's .metadata
    into = {"a": torch.zeros(2, 3), "n": 0}
    with pytest.warns(UserWarning, match=_BC.format("load")):
        cdcp.load(into, FileSystemReader(path))
    assert_same_state(into, saved)
    with pytest.warns(UserWarning, match=_BC.format("async_save")):
        fut = cdcp.async_save({"a": torch.ones(3)}, FileSystemWriter(str(tmp_path / "ck2")))
    fut.result()
    into2 = {"a": torch.zeros(3)}
    cdcp.load(into2, checkpoint_id=str(tmp_path / "ck2"))
    assert torch.equal(into2["a"], torch.ones(3))


def test_keyword_calls_do_not_warn_and_misuse_is_a_type_error(tmp_path):
    path = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        cdcp.save({"a": torch.ones(2)}, checkpoint_id=path)
        cdcp.load({"a": torch.zeros(2)}, storage_reader=FileSystemReader(path))
    with pytest.raises(TypeError, match="storage_writer"), pytest.warns(UserWarning):
        cdcp.save({"a": torch.ones(2)}, FileSystemWriter(path), storage_writer=FileSystemWriter(path))
    with pytest.raises(TypeError):
        cdcp.load({"a": torch.ones(2)}, FileSystemReader(path), None)  # type: ignore[misc]


_names = st.text(alphabet="abcdefghij_", min_size=1, max_size=8)


@settings(max_examples=20, deadline=None)
@given(have=_names, extra=_names, rows=st.integers(1, 4), cols=st.integers(1, 4), more=st.integers(1, 3))
def test_missing_key_and_size_mismatch_carry_dcps_words(tmp_path_factory, have, extra, rows, cols, more):
    path = str(tmp_path_factory.mktemp("ck"))
    cdcp.save({"m": {have: torch.ones(rows, cols)}}, checkpoint_id=path)
    if extra != have:
        with pytest.raises(CheckpointException, match="Missing key in checkpoint") as ei:
            cdcp.load({"m": {have: torch.zeros(rows, cols), extra: torch.zeros(1)}}, checkpoint_id=path)
        assert isinstance(ei.value, errors.MismatchError)
        assert str(ei.value).endswith(f"; DCP: Missing key in checkpoint state_dict: m.{extra}.")
        assert "\n" not in str(ei.value)
        # allow_partial_load: the missing key is left as it is, the rest loads
        into = {"m": {have: torch.zeros(rows, cols), extra: torch.full((1,), 5.0)}}
        cdcp.load(into, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
        assert torch.equal(into["m"][have], torch.ones(rows, cols))
        assert torch.equal(into["m"][extra], torch.full((1,), 5.0))
    with pytest.raises(CheckpointException, match="Size mismatch") as ei:
        cdcp.load({"m": {have: torch.zeros(rows, cols + more)}}, checkpoint_id=path)
    assert isinstance(ei.value, errors.MismatchError)
    assert str(ei.value).endswith(f"; DCP: Size mismatch between saved torch.Size([{rows}, {cols}]) and current: "
                                  f"torch.Size([{rows}, {cols + more}]) for m.{have}")


def test_other_errors_keep_ckpts_message_alone_and_the_wording_survives_pickling(tmp_path):
    plain = as_dcp_exception(errors.CheckpointExistsError("x: exists; pass overwrite=True"))
    assert str(plain) == "x: exists; pass overwrite=True"
    assert dcp_wording(plain) == ""
    worded = as_dcp_exception(errors.MismatchError(
        "tensor 'w': checkpoint has global shape [2], the target expects [3]"))
    back = pickle.loads(pickle.dumps(worded))
    assert type(back) is type(worded)
    assert str(back) == str(worded)
    assert str(back).endswith("; DCP: Size mismatch between saved torch.Size([2]) and current: torch.Size([3]) for w")
