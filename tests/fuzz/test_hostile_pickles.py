"""Hostile pickles and binary records through every entry point that decodes them (issue 36, class 4).

The rule (docs/RELIABILITY.md, "Foreign input"): every decoder of bytes another tool wrote runs under
explicit budgets; over budget or malformed is a CheckpointError naming the file, in bounded time and
memory. Each input here runs in a forked child under an address-space limit (RLIMIT_AS: what it
already maps plus 2 GiB) and a timeout; the child must succeed or raise a CheckpointError subclass.
A hang, a MemoryError, a RecursionError or any other raw exception fails the test.

Hostile values (generated): shared-reference DAG bombs (``a = [a, a]`` 60 times: a few hundred
bytes, 2**60 nodes as a tree) of lists, tuples, dicts and DCP dataclasses; reference cycles; nesting
far deeper than Python's stack; one long string referenced many times; huge integers; path-join
amplification. They are fed through ``ckpt import`` / ``torch_save_manifest`` of a torch.save file,
``ckpt.inspect`` of a DCP checkpoint (in ``.metadata``, as Megatron's ``all_local_plans``, and in a
bytes item), Megatron's ``common.pt``, and DeepSpeed ZeRO rank files (with hostile counts too:
``partition_count`` of 10**12, negative or absurd shapes and paddings). Tensor records with
negative or overlong storage offsets, sizes and strides are compared with ``torch.load``: ckpt
accepts only what torch accepts, and then reads exactly torch's bytes.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.convert import import_checkpoint, torch_save_manifest
from ckpt.errors import CheckpointError, ForeignFormatError
from ckpt.formats import torch_pickle as tp
from ckpt.formats.budget import Budget, check
from ckpt.storage import get_storage
from tests.fuzz.contain import Storage, Tensor, TorchPickler, contained

REFUSED = ("ManifestError", "ForeignFormatError", "IntegrityError")  # typed, naming the file and field
TIMEOUT_S = 30.0  # generous for a loaded 2-core machine; a hang is minutes or forever
EXTRA_AS = 2 << 30

pytestmark = [pytest.mark.multiproc, pytest.mark.filterwarnings("ignore::UserWarning")]
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---- running an input under limits -------------------------------------------------------------

def _kind(e: BaseException) -> tuple[str, str]:
    return ("typed" if isinstance(e, CheckpointError) else "raw"), f"{type(e).__name__}: {e}"


def bounded(fn: Callable[[], Any], timeout: float = TIMEOUT_S) -> str:
    """Run ``fn`` in a forked child under RLIMIT_AS (current + 2 GiB) and ``timeout``
    (:func:`tests.fuzz.contain.contained`); return ``"ok"`` or the CheckpointError's class name; fail on
    a hang, a crash or any other exception."""
    out = contained(fn, _kind, timeout=timeout, extra_as=EXTRA_AS)
    if out["kind"] == "raw":
        pytest.fail(f"on hostile input: {out['msg']}")
    return "ok" if out["kind"] == "ok" else str(out["type"])


# ---- hostile values ----------------------------------------------------------------------------

class _Join:
    """Pickles as ``pathlib.PosixPath(prev, prev)``: each level doubles the joined string."""

    def __init__(self, prev: Any) -> None:
        self.prev = prev

    def __reduce__(self):  # noqa: D105 - the test's own hostile object
        return (pathlib.PosixPath, (self.prev, self.prev))


def _bomb(depth: int, fan: int, kind: str) -> Any:
    a: Any = 0
    for i in range(depth):
        if kind == "list":
            a = [a] * fan
        elif kind == "tuple":
            a = (a,) * fan
        elif kind == "dict":
            a = {f"k{j}": a for j in range(fan)}
        elif kind == "ordered":
            a = collections.OrderedDict((j, a) for j in range(fan))
        elif kind == "join":
            a = _Join(a if i else "ab")
        else:  # DCP's own dataclasses, as Megatron's plans hold them
            from torch.distributed.checkpoint.planner import SavePlan
            a = SavePlan([a] * fan, planner_data=a)
    return a


def _cycle(kind: str) -> Any:
    if kind == "list":
        a: Any = []
        a.append(a)
        return a
    if kind == "dict":
        d: dict[str, Any] = {}
        d["self"] = {"up": d}
        return d
    from torch.distributed.checkpoint.planner import SavePlan
    items: list[Any] = []
    plan = SavePlan(items)
    items.append(plan)
    return plan


hostile_values = st.one_of(
    st.builds(_bomb, st.integers(30, 64), st.integers(2, 3),
              st.sampled_from(["list", "tuple", "dict", "ordered", "plan"])),
    st.builds(_bomb, st.integers(20, 40), st.just(1), st.just("join")),
    st.builds(_cycle, st.sampled_from(["list", "dict", "plan"])),
    st.integers(40_000, 200_000).map(lambda n: [("x" * n)] * 100_000),
    st.integers(9000, 200_000).map(lambda bits: {"seed": 1 << bits}),
)


def _deep_pickle(n: int, kind: bytes) -> bytes:
    """A protocol-2 pickle of ``n`` nested lists (``]``+APPEND) or dicts (``}``+SETITEM with key 0):
    the unpickler builds it without recursion; a recursive walker overflows."""
    if kind == b"]":
        return b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"."
    return b"\x80\x02" + b"}K\x00" * (n - 1) + b"}" + b"s" * (n - 1) + b"."


deep_pickles = st.builds(_deep_pickle, st.integers(2_000, 300_000), st.sampled_from([b"]", b"}"]))


# ---- files --------------------------------------------------------------------------------------

def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)


def _zip(path: Path, pkl: bytes, storages: dict[str, bytes] | None = None) -> None:
    """A torch.save archive around ``pkl`` (its own data.pkl), written with zipfile: stored records."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        for k, v in (storages or {}).items():
            z.writestr(f"archive/data/{k}", v)
        z.writestr("archive/version", "3\n")


def _dcp(path: Path, *, plans: Any = None) -> None:
    """A real DCP checkpoint (one tensor, one bytes item) whose planner keeps ``plans`` in its metadata,
    as Megatron-Core 0.16 keeps ``all_local_plans``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
            g, md = super().create_global_plan(all_plans)
            md.all_local_plans = all_plans if plans is None else plans
            return g, md

    dcp.save({"w": torch.arange(6.0), "extra": 5}, checkpoint_id=str(path), planner=Planner(), no_dist=True)


def _replace_item(path: Path, key: str, blob: bytes) -> None:
    """Point DCP's bytes item ``key`` at ``blob``, appended to its data file (the test's own metadata)."""
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    for idx, info in md.storage_data.items():
        if idx.fqn == key:
            data = path / info.relative_path
            offset = data.stat().st_size
            with open(data, "ab") as f:
                f.write(blob)
            info.offset, info.length = offset, len(blob)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _deepspeed(root: Path, *, pc: Any = 2, shape: Any = (4,), padding: Any = 0, extra: Any = None,
               model_extra: Any = None, stage: Any = 1) -> None:
    """A minimal DeepSpeed ZeRO-1 checkpoint over 2 ranks (one parameter ``w`` of 4 elements), built
    with torch.save: what ckpt's reader needs of DeepSpeed's layout, with hostile fields on request."""
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    full = torch.arange(4.0)
    _save({"module": {}, "buffer_names": [], "param_shapes": [collections.OrderedDict(w=shape)], "global_steps": 1,
           "ds_version": "0.0", "extra": model_extra}, tag / "mp_rank_00_model_states.pt")
    for r in range(2):
        part = full[2 * r:2 * r + 2].clone()
        osd = {"zero_stage": stage, "partition_count": pc, "single_partition_of_fp32_groups": [part],
               "base_optimizer_state": {"state": {0: {"exp_avg": part * 2, "exp_avg_sq": part * 3, "step": 3}},
                                        "param_groups": [{"lr": 0.1, "params": [0]}]},
               "param_alignment_paddings": [[padding]], "extra": extra}
        _save({"optimizer_state_dict": osd, "ds_config": {}}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


# ---- the entry points ---------------------------------------------------------------------------

def _import_pt(path: Path, out: Path) -> None:
    torch_save_manifest(get_storage(str(path.parent)), path.name)
    import_checkpoint(str(path), str(out))


def _inspect_and_import(src: Path, out: Path) -> None:
    ckpt.inspect(str(src))
    import_checkpoint(str(src), str(out))


def test_budget_check_is_linear_in_unique_objects():
    """The shared walker: a 2**60 expansion, a cycle and 10**5 levels are refused at once; real
    values of the same sizes pass."""
    a: Any = [0]
    for _ in range(60):
        a = [a, a]
    with pytest.raises(ForeignFormatError, match=r"x: the pickled value expands to more than \d+ nodes"):
        check(a, "x", 1000)
    c: list[Any] = []
    c.append([c])
    with pytest.raises(ForeignFormatError, match="contains itself"):
        check(c, "x", 1000)
    deep = pickle.loads(_deep_pickle(100_000, b"]"))
    with pytest.raises(ForeignFormatError, match="nests deeper than 100 levels"):
        check(deep, "x", 1000)
    shared = [{"k": 1}] * 1000  # modest sharing (torch.Size offsets in DCP metadata) is fine
    check(shared, "x", 100)
    check({f"p{i}": {"exp_avg": [1, 2], "step": 3} for i in range(10_000)}, "x", 100_000)
    with pytest.raises(ForeignFormatError, match="nests deeper than 3 levels"):
        check([[[[1]]]], "x", 100, Budget(max_depth=3))


def test_budgets_are_overridable(monkeypatch):
    """Per call (``budget=``) and per process (``CKPT_FOREIGN_*``); a bad override is named."""
    data = pickle.dumps([[[[1]]]], protocol=2)
    assert tp.loads(data, what="x") == [[[[1]]]]
    with pytest.raises(ForeignFormatError, match="x: the pickled value nests deeper than 2"):
        tp.loads(data, what="x", budget=Budget(max_depth=2))
    monkeypatch.setenv("CKPT_FOREIGN_MAX_DEPTH", "3")
    with pytest.raises(ForeignFormatError, match="nests deeper than 3"):
        tp.loads(data, what="x")
    monkeypatch.setenv("CKPT_FOREIGN_MAX_BYTES", "10")
    with pytest.raises(ForeignFormatError, match=f"x: the pickle claims {len(data)} bytes, over ckpt.s budget of 10"):
        tp.loads(data, what="x")
    monkeypatch.setenv("CKPT_FOREIGN_MAX_BYTES", "lots")
    with pytest.raises(ForeignFormatError, match="CKPT_FOREIGN_MAX_BYTES='lots' is not a number"):
        tp.loads(data, what="x")


def test_benign_inputs_pass_every_entry_point(tmp_path):
    """The fixtures the hostile tests mutate are read, so that a refusal below is the hostile part's."""
    _save({"w": torch.arange(3.0), "meta": {"step": 3}}, tmp_path / "m.pt")
    assert bounded(lambda: _import_pt(tmp_path / "m.pt", tmp_path / "o1")) == "ok"
    _dcp(tmp_path / "dcp")
    assert bounded(lambda: _inspect_and_import(tmp_path / "dcp", tmp_path / "o2")) == "ok"
    _deepspeed(tmp_path / "ds")
    m = ckpt.inspect(str(tmp_path / "ds"))
    got = ckpt.load({"model.w": torch.zeros(4), "optim.state.w.exp_avg_sq": torch.zeros(4)}, str(tmp_path / "ds"),
                    strict=False)
    assert torch.equal(got["model.w"], torch.arange(4.0)) and torch.equal(got["optim.state.w.exp_avg_sq"],
                                                                       torch.arange(4.0) * 3)
    assert m.user_metadata["source"]["world_size"] == 2


@SETTINGS
@given(value=hostile_values)
def test_hostile_values_in_a_torch_save_file(tmp_path_factory, value):
    d = tmp_path_factory.mktemp("pt")
    _save({"w": torch.ones(2), "meta": value}, d / "m.pt")
    assert bounded(lambda: _import_pt(d / "m.pt", d / "out")) in ("ForeignFormatError", "IntegrityError")


@pytest.mark.slow
@SETTINGS
@given(data=deep_pickles)
def test_deep_nesting_in_every_pickle_reader(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("deep")
    _zip(d / "m.pt", data)
    assert bounded(lambda: _import_pt(d / "m.pt", d / "out")) == "ForeignFormatError"
    assert bounded(lambda: tp.loads(data, what="deep")) == "ForeignFormatError"
    _dcp(d / "dcp")
    (d / "dcp" / ".metadata").write_bytes(data)
    assert bounded(lambda: ckpt.inspect(str(d / "dcp"))) == "ForeignFormatError"


@SETTINGS
@given(value=hostile_values, where=st.sampled_from(["plans", "item", "common"]))
def test_hostile_values_in_dcp_and_megatron(tmp_path_factory, value, where):
    d = tmp_path_factory.mktemp("dcp") / "c"
    _dcp(d, plans=value if where == "plans" else None)
    if where == "item":
        _replace_item(d, "extra", _blob(value))
    if where == "common":
        (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        _save({"args": value, "iteration": 3}, d / "common.pt")
    got = bounded(lambda: _inspect_and_import(d, d.parent / "out"))
    # a hostile bytes item is kept raw (DCP's bytes items are opaque to ckpt); the rest is refused
    assert got == ("ok" if where == "item" else "ForeignFormatError")


@SETTINGS
@given(pc=st.sampled_from([10**12, 2**70, 0, -1, 3, True, "2", [2, 10**12], [], None, 2.0]),
       value=st.one_of(st.none(), hostile_values))
def test_hostile_deepspeed_rank_files(tmp_path_factory, pc, value):
    d = tmp_path_factory.mktemp("ds")
    _deepspeed(d, pc=pc, extra=value)
    # named refusals only: not a generic CheckpointError wrapping the MemoryError of a 10**12 loop
    assert bounded(lambda: _inspect_and_import(d, d / "out")) in REFUSED


@pytest.mark.parametrize("stage", [7, -1, True, "1", 2**80, None, 1.0])
def test_hostile_zero_stage(tmp_path, stage):
    _deepspeed(tmp_path, stage=stage)
    assert bounded(lambda: _inspect_and_import(tmp_path, tmp_path / "out")) in REFUSED


@SETTINGS
@given(shape=st.one_of(st.lists(st.integers(-(2**70), 2**70), max_size=3), st.just([2**62, 2**62, 0]),
                       st.just([-4, 0])),
       padding=st.sampled_from([0, -3, 2**64, "x"]))
def test_hostile_deepspeed_shapes_and_paddings(tmp_path_factory, shape, padding):
    d = tmp_path_factory.mktemp("ds")
    _deepspeed(d, shape=torch.Size([]) if not shape else tuple(shape), padding=padding)
    got = bounded(lambda: _inspect_and_import(d, d / "out"))
    assert got in ("ok", *REFUSED)
    if got == "ok":  # a shape that fits the 4 elements
        t = ckpt.inspect(str(d)).tensors["model.w"]
        assert all(n >= 0 for n in t.shape) and t.numel <= 4


# ---- tensor records against their storage -------------------------------------------------------

def _tensor_file(path: Path, record: int, claim: int, offset: int, size: tuple[int, ...],
                 stride: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    TorchPickler(buf, protocol=2).dump({"t": Tensor(Storage(claim), offset, size, stride)})
    data = struct.pack(f"<{record}f", *range(record))
    _zip(path, buf.getvalue(), {"0": data})
    return data


dims = st.integers(-3, 12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(record=10, claim=10, offset=2, shape=[(3, 1)])  # a view: accepted, torch's elements
@example(record=12, claim=12, offset=0, shape=[(4, 1), (3, 4)])  # a transpose
@example(record=10, claim=10, offset=-2, shape=[(3, 1)])  # the audit's negative offset
@example(record=16, claim=8, offset=6, shape=[(3, 1)])  # past the storage, inside the record
@given(record=st.integers(0, 16), claim=st.one_of(st.integers(-2, 20), st.just(10**15)),
       offset=st.one_of(st.integers(-8, 20), st.just(-(2**62))),
       shape=st.lists(st.tuples(dims, dims), max_size=3))
def test_tensor_records_are_checked_against_their_storage(tmp_path, record, claim, offset, shape):
    """ckpt reads a tensor only where torch.load would, and then exactly torch.load's elements; it
    never takes a neighbouring record's bytes (negative offsets, extents past the storage)."""
    path = tmp_path / "t.pt"
    path.unlink(missing_ok=True)
    size, stride = tuple(s for s, _ in shape), tuple(s for _, s in shape)
    _tensor_file(path, record, claim, offset, size, stride)
    raw = path.read_bytes()

    def read(o: int, n: int) -> bytes:
        assert o >= 0 and o + n <= len(raw)
        return raw[o:o + n]

    try:
        want = torch.load(path, weights_only=True)["t"]
    except Exception:  # noqa: BLE001 - torch refuses: so must ckpt
        want = None
    try:
        ref = tp.load_torch(read, 0, len(raw), what="t").obj["t"]
    except CheckpointError:
        return
    assert want is not None, f"ckpt read a tensor torch.load refuses: {ref}"
    got = tp.materialize(ref, read)
    assert got.shape == want.shape and torch.equal(got, want)
    with zipfile.ZipFile(path) as z:  # the storage record's bytes in the file
        info = z.getinfo("archive/data/0")
    nlen, xlen = struct.unpack_from("<HH", raw, info.header_offset + 26)
    start = info.header_offset + 30 + nlen + xlen
    try:
        m = torch_save_manifest(get_storage(str(tmp_path)), "t.pt")
    except CheckpointError:
        return  # e.g. a non-contiguous tensor, which the import refuses by name
    for shard in m.tensors["t"].shards:  # imported from its own record only
        assert shard.length == 0 or start <= shard.offset and shard.offset + shard.length <= start + info.file_size
