"""Gaps PyTorch's own DCP tests found in ``ckpt.dcp`` (issue 31 item 3, second round; see docs/INTEROP.md):

* DCP's ``_api_bc_check``: ``dcp.save(state_dict, writer)`` / ``dcp.load(state_dict, reader)`` (the storage
  object as the second positional argument) still works in DCP, with a warning
  (test_compatibility.py::test_sharded_tensor_dependency);
* DCP code matches DCP's message text on ``CheckpointException`` ("Missing key in checkpoint",
  "Size mismatch"; test_planner.py::TestLoadPlanner): ckpt's errors through ``ckpt.dcp`` carry DCP's
  words after ckpt's own message;
* DCP's Hugging Face storage (test_hf_safetensor_e2e.py::TestSingleRankSaveLoad): ``HuggingFaceStorageWriter`` /
  ``HuggingFaceStorageReader`` write and read HF's format, so ``ckpt.dcp`` hands those calls to DCP's own
  function; a subclass of them, or any other storage class, is still refused.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
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


# --- DCP's Hugging Face storage: handed to DCP itself -------------------------------------------------------------

_HF_FILES = ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8]


def _hf_state(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(len(shapes))
    return {f"layer{i}.w": (torch.randn(shape, generator=g) * 50).to(dt) for i, (shape, dt) in
            enumerate(zip(shapes, dtypes, strict=False))}


def _safetensors_parts(path: str) -> tuple[dict[str, object], bytes]:
    """(header with its metadata's JSON values decoded, data bytes): safetensors writes the
    ``__metadata__`` map in no fixed order, so DCP's own two saves differ there byte-wise, never in content."""
    import struct

    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = {k: json.loads(v) if v.startswith("{") else v for k, v in header.pop("__metadata__", {}).items()}
    return {"__metadata__": meta, **header}, raw[8 + n:]


def _hf_save(entry: str, state: dict[str, torch.Tensor], path: str) -> None:
    writer = cdcp.HuggingFaceStorageWriter(path=path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own no-process-group / deprecation / argument-order warnings
        if entry == "save":
            cdcp.save(state_dict=state, storage_writer=writer)
        elif entry == "save positional":
            cdcp.save(state, writer)
        elif entry == "async_save":
            cdcp.async_save(state, storage_writer=writer).result()
        else:  # DCP's legacy call needs no_dist=True without a process group (DCP's own rule)
            cdcp.save_state_dict(state, writer, no_dist=True)


@settings(max_examples=20, deadline=None)
@given(entry=st.sampled_from(["save", "save positional", "async_save", "save_state_dict"]),
       shapes=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3),
       dtypes=st.lists(st.sampled_from(_DTYPES), min_size=3, max_size=3))
def test_hf_writer_through_ckpt_dcp_writes_exactly_what_dcps_own_save_writes(tmp_path_factory, entry, shapes,
                                                                              dtypes):
    from safetensors.torch import load_file

    state = _hf_state(shapes, dtypes)
    ours, theirs = str(tmp_path_factory.mktemp("ckpt_dcp")), str(tmp_path_factory.mktemp("dcp"))
    _hf_save(entry, state, ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(state_dict=state, storage_writer=tdcp.HuggingFaceStorageWriter(path=theirs))
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs)) == _HF_FILES  # HF's files, no ckpt manifest
    tensors = _HF_FILES[0]
    assert _safetensors_parts(os.path.join(ours, tensors)) == _safetensors_parts(os.path.join(theirs, tensors))
    with open(os.path.join(ours, _HF_FILES[1]), "rb") as a, open(os.path.join(theirs, _HF_FILES[1]), "rb") as b:
        assert a.read() == b.read()
    back = load_file(os.path.join(ours, _HF_FILES[0]))
    assert sorted(back) == sorted(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


@pytest.mark.parametrize("entry", ["load", "load positional", "load_state_dict", "quantized reader"])
def test_hf_reader_through_ckpt_dcp_fills_the_state_in_place_bitwise(tmp_path, entry):
    from safetensors.torch import save_file

    saved = _hf_state([(3, 4), (5,), (2, 2)], [torch.float32, torch.bfloat16, torch.int64])
    save_file(saved, str(tmp_path / _HF_FILES[0]))
    quantized = entry == "quantized reader"  # DCP's reader of HF fp8 checkpoints reads plain tensors as they are
    if quantized:  # it finds tensors through HF's index file
        with open(tmp_path / _HF_FILES[1], "w") as f:
            json.dump({"weight_map": dict.fromkeys(saved, _HF_FILES[0])}, f)
    into = {k: torch.zeros_like(v) for k, v in saved.items()}
    before = {k: v.data_ptr() for k, v in into.items()}
    reader = (cdcp.QuantizedHuggingFaceStorageReader if quantized else cdcp.HuggingFaceStorageReader)(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if entry == "load positional":
            cdcp.load(into, reader)
        elif entry == "load_state_dict":
            cdcp.load_state_dict(into, reader, no_dist=True)
        else:
            cdcp.load(state_dict=into, storage_reader=reader)
    assert sorted(into) == sorted(saved)
    for k, v in saved.items():
        assert into[k].dtype == v.dtype and torch.equal(into[k], v)
        assert into[k].data_ptr() == before[k]  # filled in place, as DCP does
    assert sorted(os.listdir(tmp_path)) == _HF_FILES[:1 + quantized]  # a load writes nothing


def test_dcps_own_failure_on_a_delegated_call_is_dcps_checkpoint_exception(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException) as ours:
            cdcp.load({"w": torch.zeros(2)}, storage_reader=cdcp.HuggingFaceStorageReader(path=str(tmp_path)))
        with pytest.raises(CheckpointException) as theirs:
            tdcp.load({"w": torch.zeros(2)}, storage_reader=tdcp.HuggingFaceStorageReader(path=str(tmp_path)))
    assert type(ours.value) is type(theirs.value) is CheckpointException  # as is: DCP's, no ckpt class around it
    assert list(ours.value.failures) == list(theirs.value.failures) == [0]


class _MyHFWriter(tdcp.HuggingFaceStorageWriter):
    pass


class _MyHFReader(tdcp.HuggingFaceStorageReader):
    pass


class _OtherStorage:  # any storage object of another tool: has a path, is no DCP class
    def __init__(self, path: str) -> None:
        self.path = path


@pytest.mark.parametrize("make", [_MyHFWriter, _MyHFReader, _OtherStorage], ids=["hf_writer_subclass",
                                                                                    "hf_reader_subclass", "other"])
def test_a_subclass_of_the_hf_classes_or_another_storage_class_is_still_refused(tmp_path, make):
    path = str(tmp_path / "c")
    obj = make(path)
    calls = [lambda: cdcp.save({"t": torch.ones(2)}, storage_writer=obj),
             lambda: cdcp.async_save({"t": torch.ones(2)}, storage_writer=obj),
             lambda: cdcp.save_state_dict({"t": torch.ones(2)}, obj),
             lambda: cdcp.load({"t": torch.zeros(2)}, storage_reader=obj),
             lambda: cdcp.load_state_dict({"t": torch.zeros(2)}, obj)]
    for call in calls:
        with pytest.raises(cdcp.UnsupportedDCPObjectError, match=type(obj).__qualname__) as ei:
            call()
        assert isinstance(ei.value, CheckpointException)  # wrapped as DCP's exception, as every ckpt.dcp error
        assert "\n" not in str(ei.value)
    assert not os.path.exists(path)


def test_saving_over_a_committed_checkpoint_says_checkpoint_already_exists_as_dcp_does(tmp_path):
    # PyTorch's test_fsspec::test_overwrite: assertRaisesRegex(CheckpointException, ".*Checkpoint already exists.*")
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # as test_fsspec imports it

    path = str(tmp_path / "ck")
    first, second = torch.arange(4.0), torch.arange(4.0) + 10
    cdcp.save({"random": first}, storage_writer=FsspecWriter(path, overwrite=False))
    cdcp.save({"random": second}, storage_writer=FsspecWriter(path, overwrite=True))
    for writer in (FsspecWriter(path, overwrite=False), FileSystemWriter(path, overwrite=False)):
        with pytest.raises(CheckpointException, match=".*Checkpoint already exists.*") as ei:
            cdcp.save({"random": first}, storage_writer=writer)
        assert isinstance(ei.value, errors.CheckpointExistsError)
        assert str(ei.value).startswith(f"{path}: already holds a committed checkpoint")
        assert str(ei.value).endswith("; DCP: Checkpoint already exists and self.overwrite=False.")
    into = {"random": torch.zeros(4)}
    cdcp.load(into, checkpoint_id=path)
    assert torch.equal(into["random"], second)  # the refused saves left the committed checkpoint as it was
