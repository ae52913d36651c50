"""Fuzz targets for the parsers of untrusted bytes, and hypothesis strategies that feed them.

Targets (each takes bytes, returns nothing, may raise only ``CheckpointError`` subclasses):

- ``manifest``: ``decode_manifest`` (msgpack + schema validation);
- ``header``: ``parse_header`` (safetensors length prefix + JSON header), file size drawn too;
- ``object``: ``decode_object`` (user values: msgpack with numpy-scalar and tuple extensions);
- ``verify``: a whole checkpoint directory holding the manifest (and sparse data files of the sizes it
  claims) audited by ``ckpt.verify(deep=True)``: what runs after the parser on hostile metadata.

Inputs come from three strategies: random bytes, mutations of valid seeds (bit flips, interesting
bytes and integers, insertions, deletions, duplications, truncation, splices), and structure-aware
generation (maps that follow the manifest schema with hostile values; JSON headers with hostile values).

``run_one`` executes one input under watch: wall time and peak traced allocation (tracemalloc sees
Python objects and numpy buffers) are measured and compared with the bounds below. Escapes that match
a ``KNOWN_ESCAPES`` signature are reported bugs with their own strict-xfail tests (in
tests/integrity/test_hostile_input.py); the suite fails on any other.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
from hypothesis import strategies as st

import ckpt
from ckpt._checksum import crc32
from ckpt.errors import CheckpointError
from ckpt.formats.msgpack_codec import decode_manifest, decode_object, encode_object
from ckpt.formats.safetensors_header import parse_header

# An input may make the parser allocate this many bytes per input byte (Python objects for a
# msgpack map entry of 2 bytes cost ~100), plus a fixed allowance. Anything above is "larger than the
# file sizes justify".
ALLOC_PER_BYTE = 256
ALLOC_FIXED = 8 << 20
ALLOC_FIXED_VERIFY = 64 << 20  # verify also holds a 16 MiB read buffer and a 64 KiB header buffer
SLOW_S = 2.0  # an input that takes longer than this is a hang

# Reported bugs (see docs/RELIABILITY.md): (target, exception type name, message regex, bug id).
KNOWN_ESCAPES: list[tuple[str, str, str, str]] = [
    # Empty: every reported escape is fixed, so that a regression fails the suite (nested tuples
    # (SIGSEGV), overlong JSON integers (ValueError), integers >= 2**63 (OverflowError), 'U' scalars
    # (SystemError), mangled numpy dtype strings (SyntaxError); docs/RELIABILITY.md).
]


def known_bug(target: str, exc: BaseException) -> str | None:
    """The bug id when ``exc`` escaping ``target`` is a reported bug, else None."""
    for t, name, pattern, bug in KNOWN_ESCAPES:
        if t == target and type(exc).__name__ == name and re.search(pattern, str(exc)):
            return bug
    return None


# ------------------------------------------------------------------------------------------------
# targets


class ExtRecursion(Exception):
    """Raised by the fuzzing guard instead of letting ``decode_object`` recurse deeper.

    Each nested tuple extension costs one ``msgpack.unpackb`` call (~40 KiB of C stack); past ~170
    levels the process died of SIGSEGV on an 8 MiB stack (bug 1, found by this fuzzer; the codec now
    stops at 64 levels). A fuzzer cannot survive a crash, so ``guard_ext_recursion`` stays as a
    tripwire: past ``MAX_EXT_DEPTH`` it raises this, which counts as an unexpected escape.
    """


MAX_EXT_DEPTH = 100


def guard_ext_recursion() -> None:
    """Wrap ``msgpack_codec._ext_hook`` with a depth counter (idempotent; this process only)."""
    from ckpt.formats import msgpack_codec

    if getattr(msgpack_codec._ext_hook, "_guarded", False):
        return
    inner = msgpack_codec._ext_hook
    depth = [0]

    def hook(code: int, data: bytes) -> Any:
        depth[0] += 1
        try:
            if depth[0] > MAX_EXT_DEPTH:
                raise ExtRecursion(f"tuple extensions nested deeper than {MAX_EXT_DEPTH}")
            return inner(code, data)
        finally:
            depth[0] -= 1

    hook._guarded = True  # type: ignore[attr-defined]
    msgpack_codec._ext_hook = hook


def target_manifest(data: bytes) -> None:
    decode_manifest(data, url="fuzz")


def target_object(data: bytes) -> None:
    decode_object(data, key="fuzz")


def target_header(data: bytes) -> None:
    """The first 8 bytes of ``data`` pick the file size the header is checked against (the rest is
    the file's head), so the fuzzer controls both."""
    if len(data) < 8:
        parse_header(data, len(data), path="fuzz")
        return
    (extra,) = struct.unpack("<Q", data[:8])
    head = data[8:]
    parse_header(head, len(head) + extra % (1 << 20), path="fuzz")


class VerifyTarget:
    """A scratch checkpoint directory: each input becomes its manifest; every file it lists that fits
    (at most 1 TiB, a safe relative path) is created as a sparse file of the claimed size."""

    MAX_SPARSE = 1 << 40

    def __init__(self, root: str | None = None):
        self.root = root or tempfile.mkdtemp(prefix="ckpt-fuzz-")

    def __call__(self, data: bytes) -> None:
        d = os.path.join(self.root, "c")
        _rmtree(d)
        os.makedirs(os.path.join(d, "data"))
        with open(os.path.join(d, "manifest.msgpack"), "wb") as f:
            f.write(data)
        for path, size in _claimed_files(data):
            full = os.path.join(d, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.truncate(size)
        ckpt.verify(d, deep=True)


def _claimed_files(data: bytes) -> list[tuple[str, int]]:
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - any undecodable input simply claims no files
        return []
    files = d.get("files") if isinstance(d, dict) else None
    out = []
    if isinstance(files, dict):
        for p, f in list(files.items())[:8]:
            size = f.get("size") if isinstance(f, dict) else None
            if (isinstance(p, str) and re.fullmatch(r"data/[A-Za-z0-9._-]{1,64}", p) and ".." not in p
                    and isinstance(size, int) and 0 <= size <= VerifyTarget.MAX_SPARSE):
                out.append((p, size))
    return out


def _rmtree(d: str) -> None:
    import shutil

    shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# running one input under watch


@dataclass(slots=True)
class Stats:
    """Tallies of one fuzzing campaign."""

    inputs: int = 0
    accepted: int = 0  # parsed without error
    rejected: dict[str, int] = field(default_factory=dict)  # CheckpointError subclass -> count
    known: dict[str, int] = field(default_factory=dict)  # reported bug id -> count
    escapes: list[str] = field(default_factory=list)  # unexpected exceptions (first few)
    escape_count: int = 0
    slow: list[str] = field(default_factory=list)  # inputs over SLOW_S
    big_alloc: list[str] = field(default_factory=list)  # inputs over the allocation bound
    max_seconds: float = 0.0
    max_alloc_ratio: float = 0.0  # peak traced bytes / input bytes, over inputs of >= 64 bytes
    max_alloc: int = 0
    bytes_in: int = 0

    def merge(self, o: Stats) -> None:
        self.inputs += o.inputs
        self.accepted += o.accepted
        for k, v in o.rejected.items():
            self.rejected[k] = self.rejected.get(k, 0) + v
        for k, v in o.known.items():
            self.known[k] = self.known.get(k, 0) + v
        self.escapes += o.escapes[: max(0, 10 - len(self.escapes))]
        self.escape_count += o.escape_count
        self.slow += o.slow[:10]
        self.big_alloc += o.big_alloc[:10]
        self.max_seconds = max(self.max_seconds, o.max_seconds)
        self.max_alloc_ratio = max(self.max_alloc_ratio, o.max_alloc_ratio)
        self.max_alloc = max(self.max_alloc, o.max_alloc)
        self.bytes_in += o.bytes_in

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "accepted": self.accepted, "rejected": dict(sorted(self.rejected.items())),
                "known_bugs": dict(sorted(self.known.items())), "unexpected_escapes": self.escape_count,
                "escape_examples": self.escapes[:10], "slow_inputs": len(self.slow), "slow_examples": self.slow[:5],
                "over_alloc_bound": len(self.big_alloc), "alloc_examples": self.big_alloc[:5],
                "max_seconds": round(self.max_seconds, 4), "max_alloc_bytes": self.max_alloc,
                "max_alloc_per_input_byte": round(self.max_alloc_ratio, 1), "bytes_fuzzed": self.bytes_in}


TARGETS: dict[str, Callable[[bytes], None]] = {
    "manifest": target_manifest, "header": target_header, "object": target_object,
}


def run_one(name: str, fn: Callable[[bytes], None], data: bytes, stats: Stats, *, trace: bool = True) -> None:
    """Run ``fn(data)``; tally the outcome in ``stats``. Never raises (an escape is recorded)."""
    stats.inputs += 1
    stats.bytes_in += len(data)
    if trace:
        tracemalloc.start()
        tracemalloc.reset_peak()
    t0 = time.perf_counter()
    try:
        fn(data)
        stats.accepted += 1
    except CheckpointError as e:
        stats.rejected[type(e).__name__] = stats.rejected.get(type(e).__name__, 0) + 1
    except Exception as e:  # noqa: BLE001 - the point of fuzzing: record whatever escapes
        bug = known_bug(name, e)
        if bug is not None:
            stats.known[bug] = stats.known.get(bug, 0) + 1
        else:
            stats.escape_count += 1
            if len(stats.escapes) < 10:
                stats.escapes.append(f"{name}: {type(e).__name__}: {str(e)[:200]} <- {data[:200]!r}")
    finally:
        dt = time.perf_counter() - t0
        peak = 0
        if trace:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
    stats.max_seconds = max(stats.max_seconds, dt)
    if dt > SLOW_S and len(stats.slow) < 10:
        stats.slow.append(f"{name}: {dt:.1f} s for {len(data)} bytes <- {data[:120]!r}")
    if trace:
        stats.max_alloc = max(stats.max_alloc, peak)
        if len(data) >= 64:
            stats.max_alloc_ratio = max(stats.max_alloc_ratio, peak / len(data))
        fixed = ALLOC_FIXED_VERIFY if name == "verify" else ALLOC_FIXED
        if peak > ALLOC_PER_BYTE * len(data) + fixed and len(stats.big_alloc) < 10:
            stats.big_alloc.append(f"{name}: {peak / 2**20:.1f} MiB for {len(data)} bytes <- {data[:120]!r}")


# ------------------------------------------------------------------------------------------------
# seeds: valid inputs of every kind, from real saves


def seed_states() -> list[dict[str, Any]]:
    """Small states covering every manifest feature a single process can write."""
    import torch

    g = torch.Generator().manual_seed(7)
    return [
        {"a": torch.ones(3)},
        {"model": {"w": torch.randn(4, 5, generator=g), "b": torch.zeros(5).bfloat16(),
                   "i": torch.arange(6), "m": torch.rand(3, generator=g) > 0.5},
         "step": 12, "cfg": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "x"}, "scale": np.float16(2.0)},
        {"flat": ckpt.FlatShard(torch.randn(12, generator=g), (3, 4), 0),
         "boxflat": ckpt.FlatShard(torch.randn(24, generator=g), (4, 6), 0, box=((0, 0), (4, 6))),
         "part": ckpt.Shard(torch.randn(2, 3, generator=g), (2, 3), (0, 0)),
         "rng": ckpt.PerRank([1, 2, 3]), "c": torch.randn(2, dtype=torch.complex128, generator=g),
         "s": torch.tensor(1.0), "e": torch.zeros(0, 2)},
    ]


@dataclass(slots=True)
class Seeds:
    manifests: list[bytes]
    headers: list[bytes]  # whole head of a data file: prefix + JSON header (+ a few data bytes)
    objects: list[bytes]


def make_seeds() -> Seeds:
    """Save each seed state once and keep the bytes of its manifest, data-file header and objects."""
    manifests, headers, objects = [], [], []
    with tempfile.TemporaryDirectory(prefix="ckpt-seeds-") as root:
        for i, state in enumerate(seed_states()):
            url = os.path.join(root, f"s{i}")
            m = ckpt.save(state, url, step=i, user_metadata={"seed": i})
            with open(os.path.join(url, "manifest.msgpack"), "rb") as f:
                manifests.append(f.read())
            for rel, size in m.files.items():
                with open(os.path.join(url, rel), "rb") as f:
                    raw = f.read()
                (n,) = struct.unpack("<Q", raw[:8])
                headers.append(struct.pack("<Q", size - (8 + n)) + raw[: 8 + n])
            for o in m.objects.values():
                objects.extend([o.data] if o.data is not None else list((o.per_rank or {}).values()))
    objects += [encode_object(v) for v in ([1, (2, 3.5), {"k": b"\x00"}], np.int64(-5), np.float32(0.5),
                                           (("nested",),), "text", None, True, 2**63, -(2**63), 1e308)]
    return Seeds(manifests, headers, objects)


# ------------------------------------------------------------------------------------------------
# mutations


INTERESTING_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xC4, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE, 0xDF,
                     0x90, 0x9F, 0x80, 0x8F, 0xA0, 0xBF, ord("{"), ord("["), ord('"'), ord("\\"), ord("9"),
                     ord(" "), ord("-"), ord("e")]
INTERESTING_INTS = [0, 1, 2, 7, 8, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
                    2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes], max_ops: int = 4) -> bytes:
    """A seed with 1..max_ops random edits (byte-level and msgpack-integer-aware)."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "byte", "insert", "delete", "dup", "truncate", "splice", "int"]))
        n = len(data)
        pos = draw(st.integers(0, max(n - 1, 0)))
        if op == "flip" and n:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and n:
            data[pos] = draw(st.sampled_from(INTERESTING_BYTES))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete" and n:
            del data[pos : pos + draw(st.integers(1, 16))]
        elif op == "dup" and n:
            k = draw(st.integers(1, 64))
            data[pos:pos] = data[pos : pos + k] * draw(st.integers(1, 8))
        elif op == "truncate":
            del data[pos:]
        elif op == "splice":
            other = draw(st.sampled_from(seeds))
            q = draw(st.integers(0, len(other)))
            data = data[:pos] + bytearray(other[q:])
        elif op == "int":  # overwrite with a msgpack uint64 / int64 holding an interesting value
            v = draw(st.sampled_from(INTERESTING_INTS))
            data[pos : pos + 9] = b"\xcf" + struct.pack(">Q", v) if v >= 0 else b"\xd3" + struct.pack(">q", v)
    return bytes(data)


# ------------------------------------------------------------------------------------------------
# structure-aware generation


def _ints(small: bool = False) -> st.SearchStrategy[int]:
    if small:
        return st.one_of(st.integers(0, 9), st.sampled_from([0, 1, 2, 3, 4, 8, 16]))
    return st.one_of(st.integers(0, 64), st.sampled_from(INTERESTING_INTS), st.integers(-(2**63), 2**64 - 1))


_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                  st.text(max_size=8), st.binary(max_size=8))
_ANY = st.recursive(_LEAF, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=4), c,
                                                                                         max_size=3)),
                    max_leaves=6)
_PATHS = st.one_of(
    st.sampled_from(["data/00000-a.safetensors", "data/00001-a.safetensors", "/etc/passwd", "../x", "data/../../x",
                     "data/./x", "c:/x", "", ".", "data//x", "data\\x", "x\x00y", "manifest.msgpack", "data",
                     "s3://b/k", "data/.."]),
    st.text(max_size=12),
)
_DTYPES = st.one_of(st.sampled_from(["float32", "bfloat16", "int64", "bool", "uint8", "complex128",
                                     "float8_e4m3fn", "float4_e2m1fn_x2", "float33", "F32", ""]),
                    st.text(max_size=8))


def _maybe(draw: st.DrawFn, chaos: int, value: Any, other: st.SearchStrategy[Any] | None = None) -> Any:
    """``value`` most of the time; with probability ``chaos``% something else: a value from ``other``
    (or any msgpack value), or ``...`` (the field is left out)."""
    if draw(st.integers(0, 99)) >= chaos:
        return value
    r = draw(st.integers(0, 3))
    if r == 0:
        return ...
    return draw(other if other is not None and r > 1 else _ANY)


def _drop(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not ...}


@st.composite
def _tensor(draw: st.DrawFn, chaos: int, files: dict[str, int], big: bool) -> dict[str, Any]:
    """A tensor entry that is consistent unless chaos strikes (so validation runs deep and verify
    reaches the coverage and header checks), with hostile dimensions mixed in when ``big``."""
    from ckpt._dtypes import dtype_from_name, itemsize

    dtype = _maybe(draw, chaos, draw(st.sampled_from(["float32", "bfloat16", "int64", "bool", "uint8",
                                                      "complex128", "float4_e2m1fn_x2"])), _DTYPES)
    try:
        isz = itemsize(dtype_from_name(dtype))
    except (CheckpointError, TypeError):
        isz = 1
    ndim = draw(st.integers(0, 4))
    # big: dimensions up to 2**64 - 1, where coverage checks and int64 conversions get stressed (and
    # where verify's known allocation bug can take gigabytes: bench only, under an address-space limit)
    dim = _ints(small=True)
    if big:
        dim = st.one_of(dim, st.sampled_from([2**10, 2**20, 2**31, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]))
    shape = [draw(dim) for _ in range(ndim)]
    shards = []
    for _ in range(draw(st.integers(0, 3))):
        s: dict[str, Any] = {}
        kind = draw(st.sampled_from(["box", "flat", "boxflat"]))
        if kind in ("box", "boxflat"):
            offs = [draw(st.integers(0, d)) if d < 2**16 else draw(st.sampled_from([0, 1, d - 1, d])) for d in shape]
            lens = [draw(st.integers(0, d - o)) if d < 2**16 else draw(st.sampled_from([0, 1, d - o]))
                    for d, o in zip(shape, offs, strict=True)]
            s["box"] = [offs, lens]
            numel = math.prod(lens)
        else:
            numel = math.prod(shape)
        if kind in ("flat", "boxflat"):
            a = draw(st.integers(0, numel)) if numel < 2**16 else draw(st.sampled_from([0, 1, numel - 1, numel]))
            b = draw(st.integers(a, numel)) if numel < 2**16 else draw(st.sampled_from([a, min(a + 1, numel), numel]))
            s["flat"] = [a, b]
            numel = b - a
        path = draw(st.sampled_from(sorted(files)))
        s["file"] = _maybe(draw, chaos, path, _PATHS)
        s["offset"] = _maybe(draw, chaos, files[path], _ints())
        s["length"] = _maybe(draw, chaos, numel * isz, _ints())
        s["checksum"] = _maybe(draw, chaos, draw(st.integers(0, 2**32 - 1)), _ints())
        if isinstance(s["offset"], int) and isinstance(s["length"], int):
            files[path] = max(files[path], s["offset"] + s["length"])
        shards.append(_drop(s))
    return _drop({"dtype": dtype, "shape": _maybe(draw, chaos, shape), "shards": _maybe(draw, chaos, shards)})


@st.composite
def manifest_dicts(draw: st.DrawFn, big: bool = True) -> dict[str, Any]:
    """A decoded manifest that follows the schema, with a drawn amount of chaos (0-30% of the
    fields replaced or left out) and, with ``big``, hostile dimensions."""
    import zlib

    chaos = draw(st.sampled_from([0, 0, 2, 5, 10, 30]))
    names = draw(st.lists(st.sampled_from(["data/00000-a.safetensors", "data/00001-a.safetensors"]),
                          min_size=1, max_size=2, unique=True))
    files = {p: 64 for p in names}
    tensors = {}
    for _ in range(draw(st.integers(0, 3))):
        tensors[draw(st.text(min_size=1, max_size=6))] = draw(_tensor(chaos, files, big))
    if chaos:
        for p in draw(st.lists(_PATHS, max_size=1)):
            files[p] = 64
    objects: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 2))):
        if draw(st.integers(0, 3)):
            data = draw(st.one_of(st.builds(encode_object, _LEAF), object_bytes(), st.binary(max_size=16)))
            o: Any = _drop({"inline": _maybe(draw, chaos, data),
                            "checksum": _maybe(draw, chaos, zlib.crc32(data), _ints())})
        else:
            o = {"per_rank": draw(st.dictionaries(_ints(), st.one_of(object_bytes(), st.binary(max_size=8)),
                                                  max_size=3))}
        objects[draw(st.text(min_size=1, max_size=6))] = o
    d: dict[str, Any] = {
        "format": _maybe(draw, chaos, "ckpt"),
        "version": _maybe(draw, chaos, [1, draw(st.integers(0, 3))], st.lists(_ints(), max_size=3)),
        "step": _maybe(draw, chaos, draw(st.one_of(st.none(), st.integers(0, 10**6))), _ints()),
        "created": _maybe(draw, chaos, 1.7e9, st.floats()),
        "world_size": _maybe(draw, chaos, 1, _ints()),
        "layout": _maybe(draw, chaos, None),
        "hash": _maybe(draw, chaos, "crc32"),
        "tensors": tensors,
        "objects": objects,
        "files": {p: _drop({"size": _maybe(draw, chaos, size + 64, _ints())}) for p, size in files.items()},
        "user": _maybe(draw, chaos, {"model": "x"}),
    }
    return _drop(d)


def manifest_bytes(big: bool = True) -> st.SearchStrategy[bytes]:
    """Structure-aware manifests, encoded."""
    return manifest_dicts(big).map(lambda d: msgpack.packb(_clamp(d), use_bin_type=True))


def _clamp(v: Any) -> Any:
    """Integers squeezed into msgpack's range (products of hostile dimensions overflow it)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return min(max(v, -(2**63)), 2**64 - 1)
    if isinstance(v, dict):
        return {_clamp(k): _clamp(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clamp(x) for x in v]
    return v


_JSON_NUMBER = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["0", "-0", "1e400", "-1e400", "NaN", "Infinity", "1.5", "00", "01", "1" * 60, "9" * 5000,
                     "18446744073709551616", "9223372036854775808"]),
)


@st.composite
def header_bytes(draw: st.DrawFn) -> bytes:
    """A safetensors head (as ``target_header`` takes it) whose JSON follows the schema most of the
    time, with hostile numbers (huge, negative, overlong), types and names."""
    entries = []
    pos = 0
    for i in range(draw(st.integers(0, 4))):
        n = draw(st.integers(0, 64))
        shape = draw(st.lists(_JSON_NUMBER, max_size=3)) if draw(st.integers(0, 4)) == 0 else [str(n)]
        lo = draw(_JSON_NUMBER) if draw(st.integers(0, 5)) == 0 else str(pos)
        hi = draw(_JSON_NUMBER) if draw(st.integers(0, 5)) == 0 else str(pos + n)
        pos += n
        dt = json.dumps(draw(st.sampled_from(["U8", "F32", "BF16", "I64", "X"])))
        entries.append(f'{json.dumps(draw(st.one_of(st.just(f"t@{i}"), st.text(max_size=4))))}:'
                       f'{{"dtype":{dt},"shape":[{",".join(shape)}],"data_offsets":[{lo},{hi}]}}')
    if draw(st.booleans()):
        entries.insert(0, '"__metadata__":{"format":"ckpt"}')
    text = "{" + ",".join(entries) + "}"
    if draw(st.integers(0, 9)) == 0:
        text = draw(st.sampled_from(["[" * 3000 + "]" * 3000, '{"a":' * 500 + "1" + "}" * 500, "null", "[]", '""']))
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    data = b"\0" * min(pos, 64)
    return struct.pack("<Q", pos - len(data)) + struct.pack("<Q", len(raw)) + raw + data


# ------------------------------------------------------------------------------------------------
# campaigns: many inputs from one strategy into one target, driven by hypothesis

_NUMPY_DTYPES = st.one_of(st.sampled_from(["<f4", "|b1", "<i8", "O", "V8", "V0", "S0", "U1", "(2,)i4", "M8[ns]",
                                           "f16", "c32", "<U0", "i4,i4", "(1000000000000,)f8", "a", ",f4", "(,)f4",
                                           "f4,,", "(2,)i4,", "<f4,>i8", "((((f4"]),
                          st.text(alphabet="<>|=,()0123456789bfiucSUVOMm", max_size=8), st.text(max_size=6))


def object_bytes() -> st.SearchStrategy[bytes]:
    """msgpack values built around the two extension types ``decode_object`` understands."""
    numpy_payload = st.builds(lambda dt, raw: msgpack.packb([dt, raw], use_bin_type=True), _NUMPY_DTYPES,
                              st.binary(max_size=16))
    payload = st.one_of(numpy_payload, st.binary(max_size=32), _ANY.map(lambda v: msgpack.packb(v, use_bin_type=True)))
    ext = st.builds(lambda code, p: msgpack.packb(msgpack.ExtType(code, p), use_bin_type=True),
                    st.sampled_from([1, 2, 0, 3, 127]), payload)
    nested = st.builds(lambda depth, inner: _nest_tuple(inner, depth), st.integers(0, 600), ext)
    return st.one_of(ext, nested, _ANY.map(lambda v: msgpack.packb(v, use_bin_type=True)))


def _nest_tuple(inner: bytes, depth: int) -> bytes:
    out = inner
    for _ in range(depth):
        out = msgpack.packb(msgpack.ExtType(2, b"\x91" + out), use_bin_type=True)  # a 1-tuple holding `out`
    return out


def sealed(bodies: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Format-2 manifests around ``bodies`` with a valid checksum: the envelope's CRC stops every
    plain mutation at the door, so these reach the body's parser (the shard columns) too."""
    return bodies.map(lambda b: msgpack.packb({"format": "ckpt", "version": [2, 0], "hash": "crc32",
                                                "checksum": crc32(b), "body": b}, use_bin_type=True))


def seed_bodies(seeds: Seeds) -> list[bytes]:
    """The bodies of the seed manifests (format 2)."""
    return [msgpack.unpackb(m)["body"] for m in seeds.manifests]


def strategies(seeds: Seeds, *, big: bool = True) -> dict[str, list[tuple[str, st.SearchStrategy[bytes]]]]:
    """For each target, its (strategy name, strategy) list: random bytes, mutated seeds, structured."""
    return {
        "manifest": [("random", st.binary(max_size=4096)), ("mutated", mutated(seeds.manifests)),
                     ("mutated body, resealed", sealed(mutated(seed_bodies(seeds)))),
                     ("structured", manifest_bytes(big))],
        "header": [("random", st.binary(max_size=1024)), ("mutated", mutated(seeds.headers)),
                   ("structured", header_bytes())],
        "object": [("random", st.binary(max_size=256)), ("mutated", mutated(seeds.objects)),
                   ("structured", object_bytes())],
        "verify": [("mutated", mutated(seeds.manifests)),
                   ("mutated body, resealed", sealed(mutated(seed_bodies(seeds)))),
                   ("structured", manifest_bytes(big))],
    }


def campaign(name: str, fn: Callable[[bytes], None], strategy: st.SearchStrategy[bytes], n: int, *,
             seed: int = 0, trace: bool = True) -> Stats:
    """Feed ``n`` inputs drawn from ``strategy`` to ``fn``; return the tallies (never raises)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    guard_ext_recursion()
    stats = Stats()

    @hseed(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def drive(data: bytes) -> None:
        run_one(name, fn, data, stats, trace=trace)

    drive()
    return stats
