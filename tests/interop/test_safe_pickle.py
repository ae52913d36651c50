"""The restricted unpickler against real DCP metadata and against pickles that try to change the
process rather than run code: BUILD (fill in the object under it) aimed at a global the allowlist
handed out, at an enum member it returned, or at a stand-in class, is refused and undone, whatever
the target, attribute and value (generated), and a good file read afterwards still reads right."""

from __future__ import annotations

import io
import pickle
import struct
import warnings
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties

from ckpt.errors import IntegrityError
from ckpt.formats import torch_pickle as tp

STATE = {
    "w": torch.randn(3, 4), "i": torch.arange(5), "bf": torch.randn(2).bfloat16(), "empty": torch.zeros(0, 3),
    "p": torch.nn.Parameter(torch.ones(2)), "obj": {"step": 3, "cfg": {"a": [1, 2]}, "raw": b"\x00\xff"},
}
STUBS = ("argparse.Namespace",)


def _dcp_save(path: Path, fmt: SerializationFormat) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save(STATE, storage_writer=FileSystemWriter(path, serialization_format=fmt))
    return (path / ".metadata").read_bytes()


class _Recorder(pickle.Unpickler):
    """Plain unpickler noting every global: only used on files this test just wrote."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.names: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.names.add(f"{module}.{name}")
        return super().find_class(module, name)


@pytest.mark.parametrize("fmt", [SerializationFormat.TORCH_SAVE, SerializationFormat.SAFETENSORS])
def test_dcp_metadata_reads_back_equal_to_torchs_reader(tmp_path, fmt):
    raw = _dcp_save(tmp_path, fmt)
    rec = _Recorder(raw)
    rec.load()
    assert "torch.distributed.checkpoint.filesystem._StorageInfo" in rec.names
    assert sorted(rec.names - set(tp._allowed(tp.DCP_GLOBALS, ()))) == []  # everything this torch writes
    ours = tp.loads(raw, what=".metadata", extra=tp.DCP_GLOBALS)
    theirs = dcp.FileSystemReader(tmp_path).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data
    # DCP pickles the directory as PosixPath("/", "tmp", ...): the same text, not "//tmp/..."
    assert ours.storage_meta.checkpoint_id == str(theirs.storage_meta.checkpoint_id) == str(tmp_path)


def test_paths_keep_their_text():
    for p in (PurePosixPath("/ckpt/run/step_10"), PurePosixPath("rel/dir"), PureWindowsPath("C:/ckpt/step_10")):
        assert tp.loads(pickle.dumps(p), what="p") == str(p)


# ---- BUILD aimed at what the allowlist hands out ----------------------------------------------------

def _text(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _global(name: str) -> bytes:
    module, _, attr = name.rpartition(".")
    return b"c" + module.encode() + b"\n" + attr.encode() + b"\n"


def _poison(target: bytes, attr: str, value: bytes, *, slot: bool) -> bytes:
    """A protocol-2 pickle: push ``target``, BUILD it with ``{attr: value}`` as its dict state or
    (``slot``) as its slot state (which BUILD applies with setattr)."""
    state = b"}" + _text(attr) + value + b"s"
    return b"\x80\x02" + target + (b"N" + state + b"\x86" if slot else state) + b"b."


ENUM_MEMBER = _global("torch.distributed.checkpoint.planner.WriteItemType") + b"K\x01\x85R"
TARGETS = {
    "storage marker": _global("torch.FloatStorage"),
    "ckpt function": _global("torch._utils._rebuild_tensor_v2"),
    "torch class": _global("torch.distributed.checkpoint.metadata.MetadataIndex"),
    "dataclass": _global("torch.distributed.checkpoint.metadata.TensorProperties"),
    "enum class": _global("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"),
    "enum member": ENUM_MEMBER,
    "stand-in class": _global("argparse.Namespace"),
    "dtype": _global("torch.float32"),
    "torch.Size": _global("torch.Size"),
}
ATTRS = ["__hash__", "__eq__", "dtype", "fn", "__defaults__", "_value_", "qualname", "x", "__init__",
         "__class__", "__doc__"]
VALUES = {"None": b"N", "int": b"K\x05", "float64": _global("torch.float64"),
          "a DCP class": _global("torch.distributed.checkpoint.metadata.Metadata"),
          "tuple": b"\x88\x88\x88\x87", "enum member": ENUM_MEMBER}


def _state_of(v: Any) -> Any:
    """Everything a BUILD could have changed on ``v``, compared by identity."""
    slots = tuple(getattr(v, s, None) for s in getattr(type(v), "__slots__", ()) if isinstance(s, str))
    d = vars(v) if isinstance(v, type) else getattr(v, "__dict__", None)
    return (type(v), tuple(d.items()) if d is not None else None, slots, getattr(v, "__defaults__", None),
            getattr(v, "__bases__", None))


def _everything() -> list[Any]:
    allowed = tp._allowed(tp.DCP_GLOBALS, STUBS)
    out = list(allowed.values())
    out += [m for v in allowed.values() if isinstance(v, type) and hasattr(v, "__members__")
            for m in v.__members__.values()]
    return out


def _unchanged(before: list[Any]) -> bool:
    return all(_state_of(v) == s for v, s in zip(_everything(), before, strict=True))


def _good_file_still_reads() -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, buf)
    data = buf.getvalue()

    def read(offset: int, n: int) -> bytes:
        return data[offset:offset + n]

    ((_, ref),) = tp.load_torch(read, 0, len(data), what="good", extra=tp.DCP_GLOBALS).tensors()
    assert ref.dtype == torch.float32 and not ref.requires_grad
    assert torch.equal(tp.materialize(ref, read), torch.arange(4, dtype=torch.float32))
    assert hash(MetadataIndex("w")) == hash(MetadataIndex("w"))
    assert TensorProperties(dtype=torch.float32) == TensorProperties(dtype=torch.float32)


@pytest.mark.parametrize("kind,attr,value,slot", [
    ("storage marker", "dtype", "float64", False),  # float32 files would decode as float64
    ("torch class", "__hash__", "None", True),  # DCP's MetadataIndex unhashable for the whole process
    ("ckpt function", "__defaults__", "tuple", True),
    ("enum member", "_value_", "int", False),
    ("enum class", "__eq__", "a DCP class", True),
])
def test_build_on_an_allowed_global_is_refused_and_undone(kind, attr, value, slot):
    before = [_state_of(v) for v in _everything()]
    with pytest.raises(IntegrityError, match="evil: the pickle tries to change .* refused and undone"):
        tp.loads(_poison(TARGETS[kind], attr, VALUES[value], slot=slot), what="evil", extra=tp.DCP_GLOBALS,
                 stubs=STUBS)
    assert _unchanged(before)
    _good_file_still_reads()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(TARGETS)), st.sampled_from(ATTRS), st.sampled_from(sorted(VALUES)), st.booleans())
def test_generated_builds_never_change_the_process(kind, attr, value, slot):
    before = [_state_of(v) for v in _everything()]
    with pytest.raises(IntegrityError):  # refused as tampering, or BUILD itself fails: never accepted
        tp.loads(_poison(TARGETS[kind], attr, VALUES[value], slot=slot), what="evil", extra=tp.DCP_GLOBALS,
                 stubs=STUBS)
    assert _unchanged(before), (kind, attr, value, slot)
    _good_file_still_reads()


def test_ordinary_build_still_fills_in_objects_the_pickle_made():
    # DCP's dataclasses are NEWOBJ + BUILD, stand-ins get their state through BUILD: both still work
    props = TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    out = tp.loads(pickle.dumps({"p": props, "i": MetadataIndex("k", torch.Size([2]), 1)}), what="m",
                   extra=tp.DCP_GLOBALS)
    assert out == {"p": props, "i": MetadataIndex("k", torch.Size([2]), 1)}
    import argparse

    ns = tp.loads(pickle.dumps(argparse.Namespace(lr=0.1)), what="ns", stubs=STUBS)
    assert isinstance(ns, tp.Stub) and ns.state == {"lr": 0.1}
