"""ckpt.dcp against torch.distributed.checkpoint itself, over generated state dicts: whatever DCP's
own load gives back, ckpt.dcp gives back the same (type for type, tensors bitwise, NaNs included),
or refuses THAT key with a typed error naming it while the other keys load. Two paths: (a) DCP
saves, ckpt.dcp loads (ckpt's DCP reader); (b) ckpt.dcp saves and loads. Single process (no_dist)."""

from __future__ import annotations

import collections
import datetime as dt
import fractions
import math
import re
import struct
import tempfile
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt.dcp as cdcp
from ckpt._dtypes import _TORCH_DTYPES
from ckpt.errors import CheckpointError, ManifestError, StateError
from ckpt.formats import torch_pickle
from ckpt.formats.objects import TAG, decode_value, encode_value

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore::UserWarning",
                                        "ignore::hypothesis.errors.HypothesisWarning")

DTYPES = sorted(_TORCH_DTYPES.values(), key=str)  # every dtype ckpt's own format carries
# dtypes torch.save writes through _rebuild_tensor_v3: readable from DCP files once the restricted
# unpickler knows it (until then such a key is refused alone, with a typed error naming it)
V3 = frozenset(d for d in DTYPES if d not in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                                              torch.complex64, torch.complex128))
V3_READ = "torch._utils._rebuild_tensor_v3" in torch_pickle._base_globals()
FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)


class Opaque:
    """A class no checkpoint reader of ours should rebuild (DCP pickles it; ckpt must refuse it)."""

    def __init__(self, x: int = 0):
        self.x = x

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and other.x == self.x

    __hash__ = None  # type: ignore[assignment]


REFUSED_TYPES = (np.str_, fractions.Fraction, Opaque)


# ---- generated state dicts ----------------------------------------------------------------------

@st.composite
def tensors(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    else:
        raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
        t = raw.view(dtype).reshape(shape)
    view = draw(st.sampled_from(["plain", "transpose", "slice", "channels_last"]))
    if view == "transpose" and ndim >= 2:  # stored as it is in memory by DCP (storage size == numel)
        t = t.transpose(0, ndim - 1).contiguous().transpose(0, ndim - 1)
    elif view == "slice" and ndim >= 1 and shape[0] > 1:
        t = t[::2]
    elif view == "channels_last" and ndim == 4 and dtype != torch.bool:
        t = t.contiguous(memory_format=torch.channels_last)
    return t


hashable = st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.text(max_size=5),
                     st.binary(max_size=5))
leaves = st.one_of(
    hashable,
    st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(allow_nan=True),
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
    st.sampled_from([np.float64(1.5), np.float32(-0.0), np.int64(-3), np.uint8(7), np.bool_(True), np.float16(2.0),
                     np.complex128(1 - 2j)]),
    st.sampled_from([np.arange(6, dtype=np.int16).reshape(2, 3), np.zeros((0, 2)), np.array(3.5),
                     np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.array([True, False])]),
    st.dates(),
    st.datetimes(timezones=st.sampled_from([None, dt.timezone.utc, dt.timezone(dt.timedelta(hours=-3))])),
    st.timedeltas(),
    st.binary(max_size=4).map(bytearray),
    # values ckpt refuses: a numpy string, a class not on any allowlist
    st.sampled_from([np.str_("x"), fractions.Fraction(1, 3), Opaque(2)]),
)


def containers(children: Any) -> Any:
    # lists hold no dicts (DCP would flatten such a list into keys; a structural difference, not
    # an object one); tuples, OrderedDicts and sets are objects whole in both
    no_dict = st.one_of(leaves, st.tuples(children))
    return st.one_of(
        st.lists(no_dict, max_size=3),
        st.tuples(children, children),
        st.builds(collections.OrderedDict, st.dictionaries(st.text(max_size=3), children, max_size=2)).map(
            lambda d: (d,)),
        st.frozensets(hashable, max_size=3),
        st.tuples(st.dictionaries(st.text(max_size=3), children, min_size=1, max_size=2)),
        st.tuples(st.just(TAG), children),  # a user tuple that starts like ckpt's own tag
    )


objects = st.recursive(leaves, containers, max_leaves=6)
names = st.text("abcxyz_", min_size=1, max_size=4)
state_dicts = st.recursive(
    st.dictionaries(names, st.one_of(tensors(), objects), min_size=1, max_size=4),
    lambda inner: st.dictionaries(names, st.one_of(tensors(), objects, inner), min_size=1, max_size=3),
    max_leaves=8)


# ---- comparison ---------------------------------------------------------------------------------

def leaves_of(sd: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for k, v in sd.items():
        if isinstance(v, dict):
            out += leaves_of(v, (*prefix, k))
        else:
            out.append(((*prefix, k), v))
    return out


def template(path: tuple[str, ...], v: Any) -> dict[str, Any]:
    leaf = _zeros_like(v) if isinstance(v, torch.Tensor) else None
    for k in reversed(path):
        leaf = {k: leaf}
    assert isinstance(leaf, dict)
    return leaf


def _zeros_like(v: torch.Tensor) -> torch.Tensor:
    try:
        return torch.zeros_like(v)
    except NotImplementedError:  # float4: no fill kernel; zero its bytes
        t = torch.empty_like(v)
        t.view(torch.uint8).zero_()
        return t


def get(sd: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        sd = sd[k]
    return sd


def refused(v: Any, path: str) -> bool:
    """Whether ckpt is expected to refuse value ``v`` (saved by DCP if ``path == 'dcp'``)."""
    if isinstance(v, torch.Tensor):
        return path == "dcp" and v.dtype in V3 and not V3_READ and v.numel() > 0
    if isinstance(v, REFUSED_TYPES) or (v is FLOAT4 and path == "dcp" and not V3_READ):
        return True
    if isinstance(v, list | tuple | set | frozenset):
        return any(refused(x, path) for x in v)
    if isinstance(v, dict):
        return any(refused(x, path) for kv in v.items() for x in kv)
    return False


def bits(t: torch.Tensor) -> bytes:
    t = t.detach().reshape(1) if t.dim() == 0 else t.detach()
    if t.dtype.itemsize == 1:
        u = t.view(torch.uint8)  # any strides
    else:
        u = torch.empty(t.shape, dtype=t.dtype)  # a fresh row-major copy: any strides in, none out
        u.copy_(t)
        u = u.view(torch.uint8)
    return torch.empty(u.shape, dtype=torch.uint8).copy_(u).numpy().tobytes()


def same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    if isinstance(a, np.ndarray | np.generic):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def dcp_load(path: tuple[str, ...], v: Any, url: str) -> Any:
    sd = template(path, v)
    tdcp.load(sd, checkpoint_id=url, no_dist=True)
    return get(sd, path)


def check_key(path: tuple[str, ...], v: Any, url: str, ref: Any, expect_refused: bool) -> None:
    """Load ``path`` alone through ckpt.dcp: DCP's value, or a typed error naming the key."""
    sd = template(path, v)
    key = ".".join(path)
    if expect_refused:
        with pytest.raises(CheckpointError, match=re.escape(repr(key))):
            cdcp.load(sd, checkpoint_id=url, no_dist=True)
        return
    cdcp.load(sd, checkpoint_id=url, no_dist=True)
    got = get(sd, path)
    assert same(got, ref), (key, got, ref)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(state_dicts)
def test_ckpt_dcp_gives_back_what_dcp_gives_back(sd: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = f"{d}/dcp", f"{d}/ckpt"
        tdcp.save(sd, checkpoint_id=a, no_dist=True)
        items = leaves_of(sd)
        refs = {p: dcp_load(p, v, a) for p, v in items}  # DCP's own answer, key by key
        # (a) DCP wrote it, ckpt.dcp reads it: each key alone, then all together
        if not V3_READ and any(isinstance(v, torch.Tensor) and v.dtype == FLOAT4 for _, v in items):
            # DCP's .metadata names the dtype: the whole file is refused until torch_pickle knows it
            with pytest.raises(CheckpointError, match="float4_e2m1fn_x2"):
                cdcp.load(template(*items[0]), checkpoint_id=a, no_dist=True)
            items_a: list[tuple[tuple[str, ...], Any]] = []
        else:
            items_a = items
        for p, v in items_a:
            check_key(p, v, a, refs[p], refused(v, "dcp"))
        ok = [(p, v) for p, v in items_a if not refused(v, "dcp")]
        if ok:
            whole: dict[str, Any] = {}
            for p, v in ok:
                _merge(whole, template(p, v))
            cdcp.load(whole, checkpoint_id=a, no_dist=True)
            for p, _ in ok:
                assert same(get(whole, p), refs[p]), p
        # (b) ckpt.dcp writes and reads: a value it cannot store exactly stops the save, naming it
        bad = [".".join(p) for p, v in items if refused(v, "ckpt")]
        if bad:
            with pytest.raises(StateError, match="object '") as e:
                cdcp.save(sd, checkpoint_id=b, no_dist=True)
            assert any(repr(k) in str(e.value) for k in bad), (bad, str(e.value))
        keep: dict[str, Any] = {}
        for p, v in items:
            if not refused(v, "ckpt"):
                _merge(keep, template(p, v))
                _set(keep, p, v)
        if not keep:
            return
        cdcp.save(keep, checkpoint_id=b, no_dist=True)
        for p, v in items:
            if not refused(v, "ckpt"):
                check_key(p, v, b, refs[p], False)


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def _set(sd: dict[str, Any], path: tuple[str, ...], v: Any) -> None:
    for k in path[:-1]:
        sd = sd[k]
    sd[path[-1]] = v


# ---- the listed instances, and the mapping on its own --------------------------------------------

@pytest.mark.xfail(not V3_READ, strict=True, reason="ckpt.formats.torch_pickle does not read _rebuild_tensor_v3 yet "
                   "(patch: /tmp/notes/D-torch_pickle-v3.patch); such keys are refused alone meanwhile")
def test_dcp_written_float8_and_wide_uint_tensors_load_bitwise(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randint(0, 256, (3, 4 * d.itemsize), generator=g, dtype=torch.uint8).view(d)
          for i, d in enumerate(sorted(V3, key=str))}
    sd.update({f"T{k}": v.t() for k, v in list(sd.items())})
    tdcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    cdcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    assert all(same(out[k], sd[k]) for k in sd)


def test_dcp_written_strided_tensors_load_bitwise_and_a_refused_key_spares_the_others(tmp_path):
    x = torch.randn(5, 7)
    sd = {"T": x.t(), "cl": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
          "f8": torch.zeros(3, dtype=torch.float8_e4m3fn), "obj": Opaque(1), "dtype": torch.bfloat16,
          "np": np.float64(2.5)}
    tdcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    out: dict[str, Any] = {"T": torch.zeros(5, 7).t(), "cl": torch.zeros(2, 3, 4, 5), "dtype": None, "np": None}
    cdcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(out["T"], sd["T"]) and torch.equal(out["cl"], sd["cl"])
    assert out["dtype"] is torch.bfloat16 and type(out["np"]) is np.float64 and out["np"] == 2.5
    with pytest.raises(CheckpointError, match=r"'obj'.*refusing to unpickle global .*Opaque"):
        cdcp.load({"obj": None}, checkpoint_id=str(tmp_path), no_dist=True)
    if not V3_READ:
        with pytest.raises(CheckpointError, match=r"'f8'.*_rebuild_tensor_v3"):
            cdcp.load({"f8": torch.zeros(3, dtype=torch.float8_e4m3fn)}, checkpoint_id=str(tmp_path), no_dist=True)


@settings(max_examples=200, deadline=None)
@given(objects)
def test_the_object_mapping_is_exact_or_refuses(v: Any) -> None:
    if refused(v, "ckpt"):
        with pytest.raises(StateError, match="object 'k'"):
            encode_value(v, key="k")
        return
    from ckpt.formats.msgpack_codec import decode_object, encode_object

    got = decode_value(decode_object(encode_object(encode_value(v, key="k"), key="k"), key="k"), key="k")
    assert same(got, v)


@pytest.mark.parametrize("stored", [(TAG, "dtype", "nope"), (TAG, "int", "x"), (TAG, "ndarray", ("O8", (1,), b"")),
                                    (TAG, "ndarray", ("<f8", (2,), b"\0" * 8)), (TAG, "martian", 1),
                                    (TAG, "device", 3), (TAG, "datetime", (1, 2))])
def test_malformed_stored_values_are_manifest_errors(stored: Any) -> None:
    with pytest.raises(ManifestError, match="object 'k'"):
        decode_value(stored, key="k")
