"""The restricted unpickler and torch.save zip reader: exact values without torch.load, every
dtype and view kind, any byte offset, both index paths (local-header scan and central directory),
and hostile input refused before anything runs."""

from __future__ import annotations

import io
import os
import pickle
from collections import OrderedDict
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.errors import IntegrityError
from ckpt.formats import torch_pickle as tp


def _blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _reader(data: bytes):
    def read(offset: int, n: int) -> bytes:
        assert offset >= 0 and offset + n <= len(data), (offset, n, len(data))
        return data[offset:offset + n]
    return read


def _same(a: Any, b: Any) -> None:
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape

        def raw(x: torch.Tensor) -> torch.Tensor:
            return x.detach().contiguous().reshape(-1).view(torch.uint8) if x.numel() else x

        assert torch.equal(raw(a), raw(b))
    elif isinstance(b, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in b:
            _same(a[k], b[k])
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def _load(data: bytes, start: int = 0, length: int | None = None) -> Any:
    read = _reader(data)
    z = tp.load_torch(read, start, len(data) - start if length is None else length, what="t")

    def build(v: Any) -> Any:
        if isinstance(v, tp.TensorRef):
            return tp.materialize(v, read)
        if isinstance(v, dict):
            return type(v)((k, build(x)) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return type(v)(build(x) for x in v)
        return v

    return build(z.obj)


def test_every_dtype_and_view_kind_matches_torch_load():
    base = torch.arange(60.0).reshape(6, 10)
    obj = OrderedDict(
        f32=torch.randn(3, 4), bf16=torch.randn(5).bfloat16(), f16=torch.randn(2, 2).half(),
        f64=torch.randn(3).double(), i64=torch.arange(7), i8=torch.tensor([-3, 4], dtype=torch.int8),
        u8=torch.tensor([255, 1], dtype=torch.uint8), b=torch.tensor([True, False]),
        c64=torch.randn(2, dtype=torch.complex64), scalar=torch.tensor(3.5), empty=torch.zeros(0, 4),
        view=base[2:4, 3:7], col=base[:, 5], t=base.t(), shared=base, param=torch.nn.Parameter(torch.ones(2)),
        meta={"step": 3, "name": "x", "b": b"\x00\xff", "t": (1, 2.5), "s": {1, 2}, "n": None},
        size=torch.Size([2, 3]), dtype=torch.bfloat16,
    )
    data = _blob(obj)
    _same(_load(data), torch.load(io.BytesIO(data), weights_only=True))
    refs = dict((p[0], r) for p, r in tp.load_torch(_reader(data), 0, len(data), what="t").tensors())
    assert refs["view"].data_offset == refs["shared"].data_offset  # one storage, read once
    assert refs["view"].storage_offset == 23 and not refs["t"].contiguous and refs["f32"].contiguous


def test_a_blob_inside_a_bigger_file_and_both_index_paths(monkeypatch):
    obj = {"w": torch.randn(9, 3), "v": torch.arange(5)}
    data = b"\x01" * 1001 + _blob(obj) + b"\x02" * 77
    blob_len = len(data) - 1001 - 77
    _same(_load(data, 1001, blob_len), obj)
    monkeypatch.setattr(tp, "_scan_head", lambda read, start, length: None)  # the central directory path
    _same(_load(data, 1001, blob_len), obj)


@settings(max_examples=40, deadline=None)
@given(st.recursive(
    st.one_of(st.integers(-5, 5).map(lambda n: torch.arange(abs(n) + 1, dtype=torch.float32) * n),
              st.sampled_from([torch.float16, torch.bfloat16, torch.int32, torch.bool]).map(
                  lambda d: torch.ones(3, 2, dtype=d)),
              st.integers(), st.text(max_size=5), st.none()),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=4), kids, max_size=3)),
    max_leaves=12))
def test_generated_objects_round_trip(obj):
    data = _blob(obj)
    _same(_load(data), torch.load(io.BytesIO(data), weights_only=True))


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_globals_are_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    for data in (pickle.dumps({"x": _Boom(str(marker))}), pickle.dumps(_Boom(str(marker)), protocol=2)):
        with pytest.raises(IntegrityError, match=r"evil: refusing to unpickle global '(posix|os)\.system'"):
            tp.loads(data, what="evil")
    blob = _blob({"w": torch.ones(2), "x": _Boom(str(marker))})
    with pytest.raises(IntegrityError, match=r"refusing to unpickle global '(posix|os)\.system'"):
        tp.load_torch(_reader(blob), 0, len(blob), what="evil")
    import collections
    with pytest.raises(IntegrityError, match="'collections.Counter'"):
        tp.loads(pickle.dumps(collections.Counter("ab")), what="evil")
    with pytest.raises(IntegrityError, match="'subprocess.Popen'"):
        tp.loads(b"csubprocess\nPopen\n(S'true'\ntR.", what="evil")
    assert not marker.exists()


def test_damaged_input_is_an_integrity_error():
    data = _blob({"w": torch.randn(50)})
    for bad in (data[: len(data) // 2], data[:-30], b"not a zip at all" * 10, pickle.dumps({"w": 1})):
        with pytest.raises(IntegrityError):
            tp.load_torch(_reader(bad), 0, len(bad), what="bad")
    with pytest.raises(IntegrityError, match="cannot read the pickle"):
        tp.loads(b"\x80\x02}q\x00(", what="bad")
    # a storage that claims more elements than its record holds
    refs = tp.load_torch(_reader(data), 0, len(data), what="ok").tensors()
    assert refs[0][1].byte_range()[1] == 200


def test_stubs_record_without_importing():
    # {"cfg": somelib.config.Cfg() with state {"stage": 2}}, as protocol 2 writes it; somelib does not exist
    data = (b"\x80\x02}X\x03\x00\x00\x00cfgcsomelib.config\nCfg\n)\x81}X\x05\x00\x00\x00stageK\x02sbs.")
    with pytest.raises(IntegrityError, match="somelib.config.Cfg"):
        tp.loads(data, what="s")
    out = tp.loads(data, what="s", stubs=["somelib.config.Cfg"])
    assert isinstance(out["cfg"], tp.Stub) and out["cfg"].state == {"stage": 2}
    assert out["cfg"].qualname == "somelib.config.Cfg"


def test_allowed_callables_cannot_be_turned_into_memory_bombs():
    # bytearray(0x7f000000) would allocate 2 GB for a number the file chose; only given bytes are built
    bomb = b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x7f\x85R."
    with pytest.raises(IntegrityError, match="cannot read the pickle"):
        tp.loads(bomb, what="bomb")
    assert tp.loads(pickle.dumps(bytearray(b"ab"), protocol=2), what="ok") == bytearray(b"ab")
    assert tp.loads(pickle.dumps(bytearray(b"ab"), protocol=4), what="ok") == bytearray(b"ab")
