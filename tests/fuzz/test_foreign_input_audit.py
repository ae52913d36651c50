"""Audit of the "Foreign input" rule (docs/DESIGN.md): real files other tools wrote, mutated, through
ckpt's public entry points.

Seeds are real: the committed Megatron-Core ``torch_dist`` checkpoint (DCP ``.metadata``, ``.distcp``
items, ``metadata.json``) and DeepSpeed ZeRO-2 checkpoint (tests/fixtures), and files written here by
the real libraries: ``torch.save``, ``torch.distributed.checkpoint.save`` with its safetensors
serialization, ``safetensors.torch.save_file`` beside a Hugging Face ``config.json``, ``ckpt.save``.
Mutations are structure-aware: truncation at every record boundary of a zip (local headers, names,
data, central directory, end record) and of a pickle (its opcodes), length / count / offset fields
of zip records and pickle opcodes set to huge values, bit flips, every numeric, string and key field
of DCP's metadata replaced by a wrong type, a negative, an int64 overflow or a float, deep JSON,
duplicate keys, lone surrogates, shapes whose product overflows int64, layer counts of 2**40.

Each case runs in a forked child under ``RLIMIT_AS`` (what it maps now plus 2 GiB) and a timeout, and
must: end in success or a ``CheckpointError`` subclass naming the input (a bare ``CheckpointError``
chaining a raw exception, and a ``verify`` report's "internal" problem, count as raw escapes), within
``SLOW_S``, with its peak resident memory growing by at most ``MAX_GROWTH`` (a memory bomb fails this
long before the limit); and leave the input files byte-identical with nothing written beside them.

The bugs this audit found each have an explicit test below (``test_bug_*``), run in-process.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import pickle
import pickletools
import re
import shutil
import struct
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.convert import import_checkpoint, torch_save_manifest, unstack_layers
from ckpt.errors import CheckpointError, ConfigError, ForeignFormatError, IntegrityError, ManifestError
from ckpt.formats import budget, foreign_json
from ckpt.formats import torch_pickle as tp
from ckpt.formats.safetensors_header import parse_header
from ckpt.storage import get_storage
from tests.fuzz.contain import Storage, Tensor, TorchPickler
from tests.fuzz.contain import contained as run_contained

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MEGATRON = FIXTURES / "megatron" / "core016" / "tp1"  # Megatron-Core 0.16 torch_dist: DCP + metadata.json + common.pt
DEEPSPEED = FIXTURES / "deepspeed" / "zero2"

TIMEOUT_S = 60.0  # a hang; far above SLOW_S so that a loaded machine reports slowness, not a kill
SLOW_S = 10.0  # the inputs are under 300 KB: every case takes ~50 ms
EXTRA_AS = 2 << 30
MAX_GROWTH = 256 << 20  # peak RSS growth of the child over its start

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SETTINGS = settings(deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def examples(n: int) -> settings:
    """:data:`SETTINGS` with ``n`` examples (derandomized: the same cases, so the same run time, each run)."""
    return settings(SETTINGS, max_examples=n)


# ---- running one case under watch ---------------------------------------------------------------


class _Escaped(Exception):
    """A failure an entry point reported instead of raising (``verify``'s "internal" problem)."""


def _classify(e: BaseException) -> tuple[str, str]:
    """``("typed" | "raw", description)`` of an exception an entry point let out."""
    if isinstance(e, CheckpointError):
        cause = e.__cause__
        text = f"{type(e).__name__}: {e}"
        if type(e) is CheckpointError and cause is not None and not isinstance(cause, CheckpointError):
            return "raw", f"a bare CheckpointError wrapping {type(cause).__name__}: {e}"
        if re.search(r"\b(MemoryError|RecursionError)\b", str(e)):  # a budget that did not hold, relabelled
            return "raw", text
        return "typed", text
    return "raw", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"


def contained(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` in a forked child under RLIMIT_AS and a timeout (:func:`tests.fuzz.contain.contained`);
    its outcome (``kind``: ok, typed, raw), message, seconds and peak memory growth."""
    return run_contained(fn, _classify, timeout=TIMEOUT_S, extra_as=EXTRA_AS)


def _snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` with a digest of its bytes."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root)] = "dir"
        for n in files:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    return out


def audit(fn: Callable[[], Any], inputs: Path, case: Any) -> dict[str, Any]:
    """:func:`contained` ``fn`` and check the rule; ``inputs``: the directory holding the input files."""
    before = _snapshot(inputs)
    got = contained(fn)
    assert got["kind"] != "raw", f"{case}: {got['msg']}"
    assert got["seconds"] < SLOW_S, f"{case}: {got['seconds']:.1f} s"
    assert got["grew"] < MAX_GROWTH, f"{case}: peak memory grew by {got['grew'] >> 20} MiB"
    if got["kind"] == "typed":  # names the file, or the field (a tensor's key: errors of the resharder)
        named = str(inputs) in got["msg"] or re.search(r"\b(tensor|object|key|field|entry) '", got["msg"])
        assert named, f"{case}: the error names neither the input nor a field: {got['msg']}"
    after = _snapshot(inputs)
    assert after == before, f"{case}: the inputs changed: {sorted(set(after.items()) ^ set(before.items()))[:6]}"
    return got


def _verify(path: Path) -> None:
    report = ckpt.verify(str(path))
    internal = [p.message for p in report.problems if p.kind == "internal"]
    if internal:
        raise _Escaped(internal[0])


def _import(src: Path, out: Path, **kw: Any) -> Callable[[], Any]:
    return lambda: import_checkpoint(str(src), str(out), **kw)


ENTRY_POINTS: dict[str, Callable[[Path, Path], Callable[[], Any]]] = {
    "inspect": lambda src, out: lambda: ckpt.inspect(str(src)),
    "verify": lambda src, out: lambda: _verify(src),
    "import": lambda src, out: _import(src, out),
    "import --unstack": lambda src, out: _import(src, out, unstack=True),
}


# ---- mutations ------------------------------------------------------------------------------------

HOSTILE_INTS = [-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**40, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70, 10**30]
HOSTILE = st.one_of(st.sampled_from(HOSTILE_INTS), st.sampled_from(
    [None, True, 0.5, 2.0, float("inf"), float("nan"), "3", "\udc80", b"\x00", [], [1, -1], {"a": 1}, (1,) * 65,
     [[[[[[[[[[1]]]]]]]]]]]))


def zip_fields(data: bytes) -> tuple[list[int], list[tuple[int, int]]]:
    """Of a zip archive: the record boundaries (each local header, its name, its data, each central
    directory record, the end record) and its length/count/offset fields as ``(position, width)``."""
    bounds, fields = {0, len(data)}, []
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            h = info.header_offset
            nlen, xlen = struct.unpack_from("<HH", data, h + 26)
            bounds |= {h, h + 30, h + 30 + nlen, h + 30 + nlen + xlen, h + 30 + nlen + xlen + info.compress_size}
            fields += [(h + 8, 2), (h + 18, 4), (h + 22, 4), (h + 26, 2), (h + 28, 2)]
    eocd = data.rfind(b"PK\x05\x06")
    count, cd_size, cd_offset = struct.unpack_from("<10xHII", data, eocd)
    if b"PK\x06\x06" in data[cd_offset:]:  # zip64: its end record and locator
        z64 = data.rfind(b"PK\x06\x06")
        bounds |= {z64, z64 + 56, z64 + 76}
        fields += [(z64 + 24, 8), (z64 + 32, 8), (z64 + 40, 8), (z64 + 48, 8), (z64 + 64, 8)]
    pos = cd_offset
    while data[pos:pos + 4] == b"PK\x01\x02":
        nlen, xlen, clen = struct.unpack_from("<HHH", data, pos + 28)
        bounds.add(pos)
        fields += [(pos + 10, 2), (pos + 20, 4), (pos + 24, 4), (pos + 28, 2), (pos + 30, 2), (pos + 32, 2),
                   (pos + 42, 4)]
        for xp in range(pos + 46 + nlen, pos + 46 + nlen + xlen - 3):  # zip64 extra: its 8-byte values
            if data[xp:xp + 2] == b"\x01\x00":
                fields += [(xp + 4 + 8 * i, 8) for i in range(struct.unpack_from("<H", data, xp + 2)[0] // 8)]
                break
        pos += 46 + nlen + xlen + clen
    bounds |= {eocd, eocd + 22}
    fields += [(eocd + 8, 2), (eocd + 10, 2), (eocd + 12, 4), (eocd + 16, 4), (eocd + 20, 2)]
    return sorted(bounds), fields


def pickle_fields(data: bytes) -> tuple[list[int], list[tuple[int, int]]]:
    """Of a pickle: every opcode's position, and the length fields of its counted opcodes."""
    bounds, fields = [], []
    widths = {"BINUNICODE": 4, "BINBYTES": 4, "BINSTRING": 4, "SHORT_BINUNICODE": 1, "SHORT_BINBYTES": 1,
              "SHORT_BINSTRING": 1, "BINUNICODE8": 8, "BINBYTES8": 8, "LONG1": 1, "LONG4": 4, "FRAME": 8,
              "BININT": 4, "BININT1": 1, "BININT2": 2, "BINGET": 1, "LONG_BINGET": 4, "BINPUT": 1, "LONG_BINPUT": 4}
    for op, _, pos in pickletools.genops(data):
        bounds.append(pos)
        if op.name in widths:
            fields.append((pos + 1, widths[op.name]))
    return bounds + [len(data)], fields


@st.composite
def mutated(draw: st.DrawFn, data: bytes, layout: Callable[[bytes], tuple[list[int], list[tuple[int, int]]]],
            lo: int = 0, hi: int | None = None, truncate: bool = True) -> bytes:
    """``data`` with 1-3 edits in ``[lo, hi)``: truncation at (or one byte around) a record boundary,
    a length/count/offset field set to an extreme, or a bit flip."""
    hi = len(data) if hi is None else hi
    bounds, fields = layout(data[lo:hi])
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["field", "field", "flip"] + (["truncate"] if truncate else [])))
        if op == "truncate":
            at = lo + draw(st.sampled_from(bounds)) + draw(st.sampled_from([-1, 0, 0, 1]))
            return bytes(out[:max(lo, min(at, len(out)))])
        if op == "field" and fields:
            pos, width = draw(st.sampled_from(fields))
            top = (1 << 8 * width) - 1
            old = int.from_bytes(out[lo + pos:lo + pos + width], "little")
            value = draw(st.sampled_from([0, 1, top, top - 1, top >> 1, (top >> 1) + 1, hi - lo, hi - lo + 1,
                                          old + 1, max(old - 1, 0), old * 2]))
            out[lo + pos:lo + pos + width] = (value & top).to_bytes(width, "little")
        else:
            pos = draw(st.integers(lo, max(lo, hi - 1)))
            out[pos] ^= 1 << draw(st.integers(0, 7))
    return bytes(out)


# ---- seeds ------------------------------------------------------------------------------------------


def _torch_save_bytes() -> bytes:
    g = torch.Generator().manual_seed(3)
    buf = io.BytesIO()
    torch.save({"model": {"w": torch.randn(3, 4, generator=g), "b": torch.zeros(4).bfloat16()}, "step": 7,
                "cfg": {"lr": 0.1, "betas": (0.9, 0.95), "name": "x"}}, buf)
    return buf.getvalue()


TORCH_SAVE = _torch_save_bytes()


def _case(tmp_path_factory: pytest.TempPathFactory, src: Path | None = None) -> tuple[Path, Path]:
    """A fresh case directory: ``in/`` (a copy of ``src``, or empty) and the path ``out`` beside it."""
    case = tmp_path_factory.mktemp("case")
    if src is not None:
        shutil.copytree(src, case / "in")
    else:
        (case / "in").mkdir()
    return case / "in", case / "out"


def _dcp_safetensors(root: Path) -> Path:
    """A DCP checkpoint written with DCP's safetensors serialization (torch's own writer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    if not (root / ".metadata").exists():
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), "v": torch.ones(4)}, no_dist=True,
                 storage_writer=FileSystemWriter(str(root), serialization_format=SerializationFormat.SAFETENSORS))
    return root


def _rewrite_header(path: Path, header: bytes) -> None:
    """Replace the safetensors header of ``path`` (its data kept after it)."""
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


def _header_of(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n])  # type: ignore[no-any-return]


# ---- generated cases ----------------------------------------------------------------------------------


@pytest.mark.multiproc
@examples(20)
@given(data=mutated(TORCH_SAVE, zip_fields))
def test_torch_save_zip_records_mutated(tmp_path_factory, data):
    """``ckpt import`` of a torch.save file whose zip records are cut or whose fields are extreme."""
    src, out = _case(tmp_path_factory)
    (src / "m.pt").write_bytes(data)
    audit(_import(src / "m.pt", out), src, "torch.save zip")


def _records_file(path: Path, state: dict[Any, Any], numel: int = 8) -> None:
    """A torch.save archive (zip, stored records) around ``state``'s pickle and one float storage."""
    buf = io.BytesIO()
    TorchPickler(buf, protocol=2).dump(state)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", struct.pack(f"<{numel}f", *range(numel)))
        z.writestr("archive/version", "3\n")


def _contiguous(size: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``size``: a record ckpt's import takes (it refuses non-contiguous ones by name)."""
    out, n = [], 1
    for d in reversed(size):
        out.append(n)
        n *= d
    return tuple(reversed(out))


DIM = st.one_of(st.integers(0, 4), st.sampled_from([2**31, 2**62, 2**63 - 1, 2**63, 2**64, 2**70, -1]))
KEYS = st.sampled_from(["w", "a.b", "", "tensor", "\udc80", "x" * 70_000, 1, "1", "a"])


@pytest.mark.multiproc
@examples(16)
@given(size=st.lists(DIM, max_size=4), zero=st.booleans(), keys=st.lists(KEYS, min_size=1, max_size=3),
       nested=st.booleans())
def test_torch_save_records_and_keys(tmp_path_factory, size, zero, keys, nested):
    """Tensor records of extreme sizes (an empty dimension beside a 2**70 one, products past int64)
    under hostile keys (lone surrogates, keys that flatten alike: 'a.b' and {'a': {'b'}}, 1 and '1')."""
    src, out = _case(tmp_path_factory)
    if zero:
        size = [0, *size]
    t = Tensor(Storage(8), 0, tuple(size), _contiguous(size))
    state: dict[Any, Any] = {k: t for k in keys}
    if nested:
        state["a"] = {"b": Tensor(Storage(8), 0, (2,), (1,))}
    _records_file(src / "m.pt", state)
    got = audit(_import(src / "m.pt", out), src, (size, keys, nested))
    if got["kind"] == "ok":  # ckpt imports only records torch.load reads too
        torch.load(src / "m.pt", weights_only=True)


# what a numeric field of a record may hold instead of a number in range: it is where a missing check shows
NUMERIC = st.sampled_from([-1, 0, 0.5, 2.0, float("inf"), float("nan"), 2**63, 2**64, 2**70, "3", None, True])


def _dcp_mutations() -> st.SearchStrategy[tuple[str, Any]]:
    numeric = st.tuples(st.sampled_from(["size", "chunk offsets", "chunk sizes", "item offset", "item length",
                                         "index offset"]), NUMERIC)
    other = st.tuples(st.sampled_from(["dtype", "item path", "key", "version", "properties", "size", "chunk sizes"]),
                      HOSTILE)
    return st.one_of(numeric, other)


def _inside(old: Any, value: Any, rnd: int) -> Any:
    """``value`` as one element of the sequence ``old`` (a list or tuple ``value`` replaces it whole)."""
    if isinstance(value, (list, tuple)) or not old:
        return value
    i = rnd % len(old)
    return (*old[:i], value, *old[i + 1:])


def _frozen(v: Any) -> Any:
    """``v`` with its lists and dicts as tuples (hashable)."""
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return tuple(sorted(v.items())) if isinstance(v, dict) else v


def _mutate_metadata(md: Any, field: str, value: Any, rnd: int) -> None:
    """Set one field of a DCP Metadata (frozen dataclasses too: a pickle sets fields as it likes)."""
    keys = [k for k, m in md.state_dict_metadata.items() if type(m).__name__ == "TensorStorageMetadata"]
    key = keys[rnd % len(keys)]
    meta = md.state_dict_metadata[key]
    idx = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[idx]
    if field == "size":
        object.__setattr__(meta, "size", _inside(meta.size, value, rnd))
    elif field in ("chunk offsets", "chunk sizes"):
        attr = field.split()[1]
        object.__setattr__(meta.chunks[0], attr, _inside(getattr(meta.chunks[0], attr), value, rnd))
    elif field == "dtype":
        object.__setattr__(meta.properties, "dtype", value)
    elif field == "properties":
        object.__setattr__(meta, "properties", value)
    elif field == "item offset":
        object.__setattr__(info, "offset", value)
    elif field == "item length":
        object.__setattr__(info, "length", value)
    elif field == "item path":
        object.__setattr__(info, "relative_path", value)
    elif field == "index offset":  # the chunk's own offsets changed alike, so that it is still found
        offsets = _frozen(_inside(idx.offset, value, rnd))  # a dict key: hashable, as a pickle can make it
        object.__setattr__(idx, "offset", offsets)
        object.__setattr__(meta.chunks[0], "offsets", offsets)
        md.storage_data = dict(md.storage_data.items())  # re-hashed under the new offsets
    elif field == "key":  # renamed in both tables, so that it is still found
        name = value if isinstance(value, str) else str(value)
        md.state_dict_metadata[name] = md.state_dict_metadata.pop(key)
        md.storage_data = {(type(i)(name, i.offset, i.index) if i.fqn == key else i): v
                           for i, v in md.storage_data.items()}
    else:
        object.__setattr__(md, field, value)


METADATA = (MEGATRON / ".metadata").read_bytes()


@pytest.mark.multiproc
@examples(30)
@given(change=_dcp_mutations(), rnd=st.integers(0, 100), entry=st.sampled_from(sorted(ENTRY_POINTS)))
def test_dcp_metadata_fields_mutated(tmp_path_factory, change, rnd, entry):
    """Every field of the Megatron checkpoint's DCP ``.metadata`` replaced by a hostile value."""
    src, out = _case(tmp_path_factory, MEGATRON)
    md = pickle.loads(METADATA)  # noqa: S301 - the committed fixture, not a hostile file
    _mutate_metadata(md, *change, rnd)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    audit(ENTRY_POINTS[entry](src, out), src, (change, entry))


@pytest.mark.multiproc
@examples(15)
@given(data=mutated(METADATA, pickle_fields), entry=st.sampled_from(["inspect", "verify"]))
def test_dcp_metadata_pickle_mutated(tmp_path_factory, data, entry):
    """The ``.metadata`` pickle cut at an opcode, its length fields extreme, its bits flipped."""
    src, out = _case(tmp_path_factory, MEGATRON)
    (src / ".metadata").write_bytes(data)
    audit(ENTRY_POINTS[entry](src, out), src, entry)


def _distcp_items() -> list[tuple[str, int, int]]:
    md = pickle.loads(METADATA)  # noqa: S301 - the committed fixture
    return sorted({(i.relative_path, i.offset, i.length) for i in md.storage_data.values()})


@st.composite
def _distcp_mutation(draw: st.DrawFn) -> tuple[str, bytes]:
    name, offset, length = draw(st.sampled_from(_distcp_items()))
    data = (MEGATRON / name).read_bytes()
    # inside one item (the others around it intact): DCP packs many torch.save zips into one file
    return name, draw(mutated(data, zip_fields, offset, offset + length, truncate=False))


@pytest.mark.multiproc
@examples(12)
@given(change=_distcp_mutation(), entry=st.sampled_from(["inspect", "import"]))
def test_dcp_items_mutated(tmp_path_factory, change, entry):
    """One torch.save item inside a ``.distcp`` file with its zip fields extreme or bits flipped."""
    src, out = _case(tmp_path_factory, MEGATRON)
    (src / change[0]).write_bytes(change[1])
    audit(ENTRY_POINTS[entry](src, out), src, entry)


def _json_doc() -> st.SearchStrategy[bytes]:
    leaf = st.one_of(st.sampled_from(["1", "-1", "18446744073709551616", "1" + "0" * 5000, "1e999", "NaN", "0.5",
                                      '"\\udc80"', '"torch_dist"', "null", "true", "[]", "{}"]),
                     st.integers(-(2**70), 2**70).map(str))
    key = st.sampled_from(['"sharded_backend"', '"sharded_backend_version"', '"\\ud800"', '"x"', '""'])
    flat = st.lists(st.tuples(key, leaf), max_size=4).map(lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}")
    deep = st.integers(20, 200_000).map(lambda n: '{"sharded_backend": "torch_dist", "x": ' + "[" * n + "]" * n + "}")
    return st.one_of(flat, flat, deep, st.just('{"sharded_backend": "torch_dist"')).map(str.encode)


@pytest.mark.multiproc
@examples(12)
@given(doc=_json_doc(), entry=st.sampled_from(["inspect", "verify", "import"]))
def test_megatron_metadata_json(tmp_path_factory, doc, entry):
    """Megatron's ``metadata.json``: deep, huge integers, lone surrogates, NaN, wrong types, cut short."""
    src, out = _case(tmp_path_factory, MEGATRON)
    (src / "metadata.json").write_bytes(doc)
    audit(ENTRY_POINTS[entry](src, out), src, doc[:200])


@st.composite
def _sharding_info(draw: st.DrawFn) -> Any:
    saved = draw(st.one_of(st.lists(st.sampled_from([0, 1, -1, 2**63, 2**64, 0.5, None, "0"]), max_size=3),
                           st.sampled_from([None, 5, "ab", {"a": 1}])))
    doc = draw(st.sampled_from(["ok", "deep", "text", "list", "object"]))
    if doc == "deep":
        n = draw(st.integers(9, 100_000))
        return "[" * n + "]" * n
    if doc == "text":
        return draw(st.sampled_from(["", "{", "NaN", '{"w": {"saved_offsets": [1e999, 0]}}', 5, None, ["x"]]))
    if doc == "list":
        return json.dumps([saved])
    return json.dumps({"w": {"saved_offsets": saved}, "v": {"saved_offsets": [0]}})


@pytest.mark.multiproc
@examples(16)
@given(meta=st.one_of(_sharding_info().map(lambda s: {"DCP_SHARDING_INFO": s}),
                      st.sampled_from([[1], "x", 5, None, {"DCP_SHARDING_INFO": "{}", "k": [[[[[[[[1]]]]]]]]}])),
       shape=st.sampled_from([None, [2**63, 0], [2**64, 0], [-1, 3], [1] * 65, [2, 3.0]]),
       entry=st.sampled_from(["inspect", "verify"]))
def test_dcp_safetensors_metadata(tmp_path_factory, meta, shape, entry):
    """A DCP checkpoint in safetensors: its ``__metadata__`` and the JSON inside it (DCP_SHARDING_INFO)
    deep, of wrong types, with extreme offsets; shapes past int64."""
    base = _dcp_safetensors(tmp_path_factory.getbasetemp() / "dcp-safetensors")
    src, out = _case(tmp_path_factory, base)
    name = next(p.name for p in src.iterdir() if p.name.endswith(".distcp"))
    header = _header_of(src / name)
    header["__metadata__"] = meta
    if shape is not None:
        header["w"]["shape"] = shape
    _rewrite_header(src / name, json.dumps(header).encode())
    audit(ENTRY_POINTS[entry](src, out), src, (meta, shape))


def _deepspeed_files() -> list[Path]:
    return sorted(p.relative_to(DEEPSPEED) for p in DEEPSPEED.rglob("*.pt"))


@st.composite
def _deepspeed_mutation(draw: st.DrawFn) -> tuple[Path, bytes]:
    rel = draw(st.sampled_from(_deepspeed_files()))
    return rel, draw(mutated((DEEPSPEED / rel).read_bytes(), zip_fields))


@pytest.mark.multiproc
@examples(12)
@given(change=_deepspeed_mutation(), entry=st.sampled_from(["inspect", "verify"]))
def test_deepspeed_files_mutated(tmp_path_factory, change, entry):
    """A DeepSpeed ZeRO-2 rank or model file cut at a zip record boundary or with extreme fields."""
    src, out = _case(tmp_path_factory, DEEPSPEED)
    (src / change[0]).write_bytes(change[1])
    audit(ENTRY_POINTS[entry](src, out), src, (str(change[0]), entry))


HF_CONFIG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-6,
             "rope_theta": 10000.0, "max_position_embeddings": 128, "hidden_act": "silu"}


def _hf_model_bytes() -> bytes:
    """A tiny Hugging Face llama's ``model.safetensors``, written by safetensors' own writer."""
    from safetensors.torch import save

    from ckpt.hf.adapters import ADAPTERS

    a = ADAPTERS["llama"]
    g = torch.Generator().manual_seed(0)
    return save({n: torch.randn(t.shape, generator=g) for n, t in a.hf_map(a.complete(HF_CONFIG, where="t")).items()},
                metadata={"format": "pt"})


HF_MODEL = _hf_model_bytes()


@st.composite
def _hf_header(draw: st.DrawFn, header: dict[str, Any]) -> bytes:
    h = copy.deepcopy(header)
    names = sorted(k for k in h if k != "__metadata__")
    for _ in range(draw(st.integers(1, 2))):
        field = draw(st.sampled_from(["shape", "data_offsets", "dtype", "__metadata__", "extra"]))
        name = draw(st.sampled_from(names))
        value = draw(st.one_of(HOSTILE, st.sampled_from([[2**63, 0], [0, 2**64], [2**40, 2**40, 0], [1] * 65,
                                                         [0, 10**9], ["F32"], "F33"])))
        if field == "__metadata__":
            h["__metadata__"] = value
        elif field == "extra":
            h["\udc80" if draw(st.booleans()) else "x"] = {"dtype": "F32", "shape": value, "data_offsets": [0, 0]}
        else:
            h[name][field] = value
    text = json.dumps(h)
    if draw(st.booleans()):  # the same name twice: JSON keeps the last one
        text = text[:-1] + ", " + json.dumps(names[0]) + ": " + json.dumps(h[names[0]]) + "}"
    return text.encode()


_HF_HEADER = json.loads(HF_MODEL[8:8 + struct.unpack_from("<Q", HF_MODEL)[0]])


@pytest.mark.multiproc
@examples(12)
@given(header=_hf_header(_HF_HEADER), entry=st.sampled_from(["import-hf", "inspect"]))
def test_hf_safetensors_header_mutated(tmp_path_factory, header, entry):
    """A Hugging Face model's safetensors header with extreme shapes, offsets, dtypes, duplicate names."""
    from ckpt.hf.convert import import_hf

    src, out = _case(tmp_path_factory)
    (src / "config.json").write_text(json.dumps(HF_CONFIG))
    (src / "model.safetensors").write_bytes(HF_MODEL)
    _rewrite_header(src / "model.safetensors", header)
    fn = (lambda: import_hf(str(src), str(out))) if entry == "import-hf" else (lambda: ckpt.inspect(str(src)))
    audit(fn, src, entry)


def _ckpt_manifest(root: Path) -> Path:
    if not (root / "manifest.msgpack").exists():
        ckpt.save({"w": torch.arange(6.0).reshape(2, 3), "step": 3, "cfg": {"lr": 0.1}}, str(root))
    return root


@pytest.mark.multiproc
@examples(8)
@given(cut=st.integers(0, 10_000), flips=st.lists(st.integers(0, 10_000), max_size=3),
       entry=st.sampled_from(["load", "verify"]))
def test_ckpt_manifest_mutated(tmp_path_factory, cut, flips, entry):
    """ckpt's own manifest read back from disk, cut short or with flipped bits (its checksum and
    schema stop it), through ``ckpt.load`` and ``ckpt.verify``."""
    src, out = _case(tmp_path_factory, _ckpt_manifest(tmp_path_factory.getbasetemp() / "ckpt-seed"))
    data = bytearray((src / "manifest.msgpack").read_bytes())
    for f in flips:
        data[f % len(data)] ^= 1 << (f % 8)
    (src / "manifest.msgpack").write_bytes(bytes(data[:cut % (len(data) + 1)]))
    if entry == "load":
        fn = lambda: ckpt.load({"w": torch.zeros(2, 3)}, str(src), strict=False)  # noqa: E731
    else:
        fn = lambda: _verify(src)  # noqa: E731
    audit(fn, src, entry)


# ---- the bugs found, each named ----------------------------------------------------------------------


def _copy(tmp_path: Path, src: Path) -> Path:
    shutil.copytree(src, tmp_path / "in")
    return tmp_path / "in"


def _nested(n: int) -> bytes:
    return b'{"sharded_backend": "torch_dist", "x": ' + b"[" * n + b"]" * n + b"}"


@pytest.mark.parametrize("doc", [_nested(200_000), b"[" * 300_000, _nested(50)])
def test_bug_megatron_metadata_json_is_read_under_budget(tmp_path, doc):
    """Bug: metadata.json was decoded by a bare json.loads: a 1 MiB document of brackets raised
    RecursionError (load/inspect: a bare CheckpointError wrapping it; verify: an "internal" problem)."""
    src = _copy(tmp_path, MEGATRON)
    (src / "metadata.json").write_bytes(doc)
    with pytest.raises(ConfigError, match=re.escape(str(src / "metadata.json")) + ": not valid JSON for this file"):
        ckpt.inspect(str(src))
    assert [p.kind for p in ckpt.verify(str(src)).problems] == ["manifest"]


@pytest.mark.parametrize(("doc", "field"), [
    (b'{"sharded_backend": "torch_dist", "v": 18446744073709551616}', "'megatron'/'v'"),
    (b'{"sharded_backend": "torch_dist", "\\ud800": 1}', "'megatron'/'\\ud800'"),
    (b'{"sharded_backend": "\\udc80"}', "'source'/'format'"),
])
def test_bug_unrecordable_metadata_values_are_named(tmp_path, doc, field):
    """Bug: values no manifest can record (an integer of 65 bits, a lone surrogate, which JSON escapes
    and pickles can carry) reached msgpack: a raw OverflowError / UnicodeEncodeError, wrapped."""
    src = _copy(tmp_path, MEGATRON)
    (src / "metadata.json").write_bytes(doc)
    with pytest.raises(ForeignFormatError, match=f"{re.escape(str(src))}: the value at .*{re.escape(field)}"):
        ckpt.inspect(str(src))
    with pytest.raises(ForeignFormatError, match="cannot be recorded in a ckpt manifest"):
        import_checkpoint(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_bug_unrecordable_keys_of_torch_save_files_and_common_pt(tmp_path):
    """Bug: ``ckpt import`` of a torch.save file with a lone surrogate in a key let a raw
    UnicodeEncodeError out (its manifest never went through an encoder before the commit)."""
    (tmp_path / "a").mkdir()
    torch.save({"\udc80": torch.ones(2), "ok": 1}, tmp_path / "a" / "m.pt")
    with pytest.raises(ForeignFormatError, match=r"m\.pt: the value at 'tensors'/'\\udc80'"):
        import_checkpoint(str(tmp_path / "a" / "m.pt"), str(tmp_path / "out"))
    # a value msgpack cannot hold (an int of 2**64) is the file's fault, named with it (it was a StateError)
    (tmp_path / "b").mkdir()
    torch.save({"big": 2**64, "w": torch.ones(2)}, tmp_path / "b" / "m.pt")
    with pytest.raises(ForeignFormatError, match=r"m\.pt.*'big'"):
        import_checkpoint(str(tmp_path / "b" / "m.pt"), str(tmp_path / "out2"))
    src = _copy(tmp_path, MEGATRON)
    torch.save({"\udc80": 1, "iteration": 3}, src / "common.pt")
    with pytest.raises(ForeignFormatError, match=r"'objects'/'common\.\\udc80'"):
        ckpt.load({}, str(src), strict=False)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("size", 2.5, r"size is 2\.5 \(float\)"),  # int() truncated it, silently
    ("size", float("inf"), r"size is inf \(float\)"),  # OverflowError
    ("size", 2**70, r"size is 1180591620717411303424"),  # OverflowError at the encoder
    ("chunk sizes", (2**70, 0), r"chunk 0 sizes is 1180591620717411303424"),
    ("chunk sizes", (2**40, 2**40, 0), r"more than 2\*\*63 - 1 elements"),
    ("item offset", 0.5, r"the offset of an item in '__0_\d\.distcp' is 0\.5 \(float\)"),  # read at int(0.5)
    ("item length", -5, r"the length of an item .* is -5"),
    ("dtype", "float32", r"has dtype 'float32', not a torch dtype"),
    ("dtype", torch.qint8, r"\.metadata: tensor .*: dtype torch\.qint8 is not supported"),  # was a StateError
    ("index offset", (0,), r"chunk 0 has offsets \[0\] and sizes \[64, 32\]"),  # numpy's reshape ValueError
])
def test_bug_dcp_metadata_numbers_and_types_are_checked(tmp_path, field, value, match):
    """Bug: DCP's sizes, chunk offsets and item ranges went through ``int()`` unchecked: floats were
    truncated, inf overflowed (a bare CheckpointError wrapping OverflowError; verify: "internal")."""
    src = _copy(tmp_path, MEGATRON)
    md = pickle.loads(METADATA)  # noqa: S301 - the committed fixture
    _mutate_metadata(md, field, value, 0)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ManifestError if field in ("dtype", "index offset") else ForeignFormatError, match=match):
        ckpt.inspect(str(src))
    assert [p.kind for p in ckpt.verify(str(src)).problems] == ["manifest"]


@pytest.mark.parametrize(("meta", "error", "match"), [
    ({"DCP_SHARDING_INFO": "[" * 100_000 + "]" * 100_000}, ManifestError, "nested 100000 levels deep"),
    ({"DCP_SHARDING_INFO": '{"w": {"saved_offsets": [1e999, 0]}}'}, ManifestError, "1e999 is not a finite number"),
    ({"DCP_SHARDING_INFO": '{"w": {"saved_offsets": [0.5, 0]}}'}, ManifestError, r"saved_offsets is 0\.5 \(float\)"),
    ({"DCP_SHARDING_INFO": '{"w": {"saved_offsets": [null, 0]}}'}, ManifestError, "saved_offsets is None"),
    ({"DCP_SHARDING_INFO": 5}, ManifestError, "is not JSON text"),
    ([1], ManifestError, "__metadata__ is list"),
])
def test_bug_dcp_safetensors_metadata_is_decoded_under_budget(tmp_path, meta, error, match):
    """Bug: DCP_SHARDING_INFO (JSON inside the safetensors header's metadata) was decoded by a bare
    json.loads: 100k brackets raised RecursionError; inf offsets an OverflowError."""
    src = _dcp_safetensors(tmp_path / "dcp")
    name = next(p.name for p in src.iterdir() if p.name.endswith(".distcp"))
    header = _header_of(src / name)
    header["__metadata__"] = meta
    _rewrite_header(src / name, json.dumps(header).encode())
    with pytest.raises(error, match=match):
        ckpt.inspect(str(src))
    assert [p.kind for p in ckpt.verify(str(src)).problems] == ["manifest"]


@pytest.mark.parametrize("size", [(2**70, 0), (2**63, 0), (0, 2**64), (2**40, 2**40, 0)])
def test_bug_tensor_records_beyond_int64_are_refused(tmp_path, size):
    """Bug: a torch.save tensor record with an empty dimension beside a 2**63+ one (or dimensions whose
    product overflows int64) passed the storage check and reached torch as a raw TypeError /
    RuntimeError at ``ckpt import``; torch.load refuses such a record too."""
    _records_file(tmp_path / "m.pt", {"t": Tensor(Storage(8), 0, size, _contiguous(size))})
    with pytest.raises(Exception):  # noqa: B017 - torch's own refusal, of its own type
        torch.load(tmp_path / "m.pt", weights_only=True)
    with pytest.raises(ForeignFormatError, match=r"m\.pt: a tensor record: size"):
        import_checkpoint(str(tmp_path / "m.pt"), str(tmp_path / "out"))


@pytest.mark.parametrize("state", [{"a.b": 1, "a": {"b": 2}}, {1: 1, "1": 2}, {"": 1, "tensor": 2}])
def test_bug_keys_that_flatten_alike_are_refused(tmp_path, state):
    """Bug: ``ckpt import`` flattens nested keys with '.': {'a.b': x, 'a': {'b': y}} imported one of
    the two tensors and silently dropped the other."""
    t = {k: (torch.ones(2) if v == 1 else {"b": torch.zeros(3)} if isinstance(v, dict) else torch.zeros(3))
         for k, v in state.items()}
    torch.save(t, tmp_path / "m.pt")
    with pytest.raises(ForeignFormatError, match=r"two values of the file flatten to the key"):
        torch_save_manifest(get_storage(str(tmp_path)), "m.pt")


def test_bug_unstack_of_2_40_layers_is_refused(tmp_path):
    """Bug: ``ckpt import --unstack`` of a Megatron checkpoint whose stacked tensor claims 2**40 layers
    (with an empty dimension: no bytes to back them) looped 2**40 times building per-layer entries."""
    src = _copy(tmp_path, MEGATRON)
    md = pickle.loads(METADATA)  # noqa: S301 - the committed fixture
    key = "decoder.layers.self_attention.linear_proj.weight"
    meta = md.state_dict_metadata[key]
    object.__setattr__(meta, "size", torch.Size([2**40, 0, *meta.size[2:]]))
    for chunk in meta.chunks:  # each layer's chunk emptied (found by its offsets still): no bytes anywhere
        object.__setattr__(chunk, "sizes", torch.Size([1, 0, *chunk.sizes[2:]]))
    (src / ".metadata").write_bytes(pickle.dumps(md))
    m = ckpt.inspect(str(src))
    assert m.tensors[key].shape[0] == 2**40  # a valid manifest: nothing stored
    got = contained(lambda: unstack_layers(m, what="x"))
    assert got["kind"] == "typed" and "x: tensor 'decoder.layers.self_attention.linear_proj.weight': its leading " \
        "(layer) dimension is 1099511627776" in got["msg"], got


def test_bug_zip_local_headers_are_read_only_inside_their_item():
    """Bug: a central directory naming a local header past the item's end made the reader fetch 30
    bytes there (a neighbouring item of a .distcp file, or past the file) before refusing."""
    name = next(n for n in zipfile.ZipFile(io.BytesIO(TORCH_SAVE)).namelist() if n.endswith("/data.pkl")).encode()
    data = bytearray(TORCH_SAVE)
    pos = TORCH_SAVE.index(b"PK\x01\x02")  # data.pkl's central directory record
    while TORCH_SAVE[pos + 46:pos + 46 + len(name)] != name:
        pos = TORCH_SAVE.index(b"PK\x01\x02", pos + 4)
    struct.pack_into("<I", data, pos + 42, len(TORCH_SAVE) + 1000)  # the local header offset, past the item
    pad = 4096
    whole = b"\xaa" * pad + bytes(data) + b"\xbb" * pad

    def read(offset: int, n: int) -> bytes:
        assert pad <= offset and offset + n <= pad + len(data), f"read [{offset - pad}, +{n}) outside the item"
        return whole[offset:offset + n]

    with pytest.raises(IntegrityError, match="local header at .* lies beyond the item"):
        tp.load_torch(read, pad, len(data), what="x")


def test_bug_safetensors_shapes_past_int64_are_malformed():
    """The header parser bounds shapes as budget.dims does (int64 dimensions, at most 64 of them)."""
    for shape in ([2**63, 0], [1] * 65):
        body = json.dumps({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
        body += b" " * (-len(body) % 8)
        with pytest.raises(IntegrityError, match="'a' is malformed"):
            parse_header(len(body).to_bytes(8, "little") + body, 8 + len(body), path="f")


def test_bug_json_numbers_that_overflow_are_refused_where_infinity_is():
    """Bug: budgets that refuse NaN / Infinity (indexes, names files, safetensors headers, DCP's
    sharding info) let ``1e999`` through as inf: json decodes an overflowing literal to a float."""
    for doc in (b'{"a": 1e999}', b'[-1e400]'):
        with pytest.raises(ConfigError, match="is not a finite number"):
            foreign_json.loads(doc, where="x", budget=foreign_json.INDEX)
    assert foreign_json.loads(b'{"a": 1e999}', where="x", budget=foreign_json.CONFIG)["a"] == float("inf")
    assert foreign_json.loads(b'[1.5e3, 2]', where="x", budget=foreign_json.INDEX) == [1500.0, 2]


def test_budget_integer_and_dims():
    """The shared checks: type first (no bool, float, str), then range; a huge int is described, not
    printed (repr refuses over 4300 digits)."""
    assert budget.integer(torch.Size([5])[0], "f", "x") == 5
    for bad in (True, 2.0, "3", None, -1, 2**63, 10**5000, float("inf")):
        with pytest.raises(ForeignFormatError, match="f: x is "):
            budget.integer(bad, "f", "x")
    assert budget.dims(torch.Size([2**62, 0]), "f", "s") == (2**62, 0)
    for bad in ([2**40, 2**40, 0], [1] * 65, "ab", [3, -1]):
        with pytest.raises(ForeignFormatError, match="f: s"):
            budget.dims(bad, "f", "s")
    with pytest.raises(IntegrityError):
        budget.dims([2**63], "f", "s", IntegrityError)
