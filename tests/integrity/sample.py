"""Sample checkpoints and the checks the integrity tests run against a (possibly damaged) checkpoint.

The samples are small on purpose: the corruption tests flip every byte of them.

``check(url, expected)`` runs ``ckpt.verify(deep=True)``, ``ckpt.load(verify=True)`` and a plain
``ckpt.load`` and returns what each did. Only ``CheckpointError`` subclasses are caught: anything
else escaping the library fails the calling test.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import ckpt
from ckpt.errors import CheckpointError

# Fields of the manifest that describe the save, not the data; there is no manifest checksum, so a
# flip inside them cannot be detected by design (docs/RELIABILITY.md).
METADATA_FIELDS = ("created", "step", "user", "layout", "stats", "world_size")


def memory_dir(prefix: str) -> str:
    """A fresh directory on tmpfs (/dev/shm) when there is one, else under $TMPDIR.

    The corruption and crash tests rewrite small files thousands of times; on a disk shared with
    write-heavy jobs, write-back throttling makes that ten times slower. Neither SIGKILL nor byte flips
    behave differently on tmpfs (power loss, which does, is out of scope: docs/RELIABILITY.md).
    """
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def single_file_state() -> dict[str, Any]:
    """Every kind of entry one data file can hold: several dtypes (one without a safetensors name,
    stored as U8), a 0-d and an empty tensor, a FlatShard, and objects (int, nested dict with a
    tuple, numpy scalar)."""
    g = torch.Generator().manual_seed(1234)
    return {
        "model": {
            "w": torch.randn(8, 6, generator=g),
            "h": torch.randn(5, 3, generator=g).bfloat16(),
            "i": torch.randint(-1000, 1000, (4,), generator=g),
            "b": torch.rand(7, generator=g) > 0.5,
            "c": torch.randn(2, dtype=torch.complex128, generator=g),  # U8 in the safetensors header
            "s": torch.tensor(3.25),  # 0-d
            "e": torch.zeros(0, 3),  # empty: a 0-byte entry
        },
        "flat": ckpt.FlatShard(torch.randn(12, generator=g), (3, 4), 0),
        "step": 7,
        "cfg": {"lr": 0.125, "name": "tiny", "dims": (4, 8)},
        "scale": np.float32(1.5),
    }


def plain(state: dict[str, Any]) -> dict[str, Any]:
    """The state as load returns it: wrappers replaced by their local tensors."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = plain(v)
        elif isinstance(v, ckpt.FlatShard):  # the samples' flat pieces cover their whole tensor
            out[k] = v.local.reshape(v.global_shape)
        elif isinstance(v, ckpt.Shard):
            out[k] = v.local
        else:
            out[k] = v
    return out


def blank(expected: dict[str, Any]) -> dict[str, Any]:
    """A load target shaped like ``expected``: zeroed tensors, ``None`` for every object (a nested
    dict of objects collapses to one ``None`` leaf, which load fills with the whole sub-dict)."""
    out: dict[str, Any] = {}
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif _has_tensor(v):
            out[k] = blank(v)
        else:
            out[k] = None
    return out


def _has_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    return False


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of loaded values: tensors by dtype, shape and bytes; objects by type and value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(_bytes(a), _bytes(b)))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.generic):
        return bool(a.dtype == b.dtype and a.tobytes() == b.tobytes())
    return bool(a == b)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass(slots=True)
class Outcome:
    """What verify and the two loads made of one checkpoint."""

    verify_ok: bool
    verify_kinds: list[str] = field(default_factory=list)
    verified_load: str = ""  # "same" | "different" | "<ErrorType>"
    plain_load: str = ""

    @property
    def verified_load_failed(self) -> bool:
        return self.verified_load not in ("same", "different")


def _load_outcome(url: str, expected: dict[str, Any], verify: bool, workers: int) -> str:
    try:
        out = ckpt.load(blank(expected), url, verify=verify, workers=workers)
    except CheckpointError as e:
        return type(e).__name__
    return "same" if same(out, expected) else "different"


def check(url: str, expected: dict[str, Any], *, workers: int = 4) -> Outcome:
    """Verify (deep) and load (with and without verification) the checkpoint at ``url``."""
    rep = ckpt.verify(url, deep=True)  # never raises for a damaged checkpoint: it reports
    return Outcome(rep.ok, sorted({p.kind for p in rep.problems}), _load_outcome(url, expected, True, workers),
                   _load_outcome(url, expected, False, workers))


def header_span(raw: bytes) -> tuple[int, int]:
    """``(8, 8 + N)``: the JSON header's byte range in a safetensors file."""
    (n,) = struct.unpack("<Q", raw[:8])
    return 8, 8 + n


def header_change(original: bytes, mutated: bytes) -> str:
    """How a mutated safetensors JSON header differs from the original one, by meaning:

    - ``"none"``: it parses to the same object (a padding space flipped to another JSON whitespace);
    - ``"metadata"``: only ``__metadata__`` differs (free-form strings, no bearing on any tensor);
    - ``"dtype-shape"``: same entries and byte ranges, but some entry's ``dtype`` or ``shape`` differs;
    - ``"invalid"``: not JSON any more;
    - ``"entries"``: entry names or byte ranges differ.
    """
    try:
        new = json.loads(mutated.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "invalid"
    old = json.loads(original.decode("utf-8"))
    if new == old:
        return "none"
    if not isinstance(new, dict):
        return "invalid"
    old_t = {k: v for k, v in old.items() if k != "__metadata__"}
    new_t = {k: v for k, v in new.items() if k != "__metadata__"}
    if old_t == new_t:
        return "metadata"
    if old_t.keys() == new_t.keys() and all(
        isinstance(new_t[k], dict) and new_t[k].get("data_offsets") == old_t[k]["data_offsets"] for k in old_t
    ):
        return "dtype-shape"
    return "entries"


def _two_rank_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return {"w": torch.randn(10, 6, generator=g), "bf": torch.randn(4, 8, generator=g).bfloat16(),
            "z": torch.randn(3, 5, generator=g), "rep": torch.arange(9, dtype=torch.int32)}


def _two_rank_save(rank: int, world: int, url: str) -> None:
    t = _two_rank_tensors()
    zf = t["z"].reshape(-1)
    half = zf.numel() // 2
    lo, hi = (0, half) if rank == 0 else (half, zf.numel())
    state = {
        "w": ckpt.Shard(t["w"][rank * 5 : rank * 5 + 5].clone(), (10, 6), (rank * 5, 0)),  # rows
        "bf": ckpt.Shard(t["bf"][:, rank * 4 : rank * 4 + 4].clone(), (4, 8), (0, rank * 4)),  # columns
        "z": ckpt.FlatShard(zf[lo:hi].clone(), (3, 5), lo),  # ZeRO-style flat ranges
        "rep": t["rep"],  # replicated: written once
        "step": 3,
        "rng": ckpt.PerRank([rank, "seed"]),
    }
    ckpt.save(state, url, step=3)


def save_two_rank_sample(url: str) -> dict[str, Any]:
    """Save a checkpoint from 2 forked gloo ranks (two data files, multi-shard tensors); return what
    a single-process load must give back."""
    from tests.dist_utils import run_ranks

    run_ranks(2, _two_rank_save, url)
    return {**_two_rank_tensors(), "step": 3, "rng": [0, "seed"]}


_DATA_FIELDS = ("format", "version", "hash", "checksum", "tensors", "objects", "files")


def _decode(raw: bytes) -> Any:
    import msgpack

    # Format 2: judge a flip by what it changes in the envelope or the body it wraps (the body's
    # checksum makes any such change detectable; the classes say what the change would have meant).
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        if isinstance(d, dict) and isinstance(d.get("body"), bytes):
            body = msgpack.unpackb(d.pop("body"), raw=False, strict_map_key=False)
            if not isinstance(body, dict):
                return None
            d = {**body, **d}
        return d
    except (ValueError, TypeError, UnicodeDecodeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError):
        return None


def _diff(a: Any, b: Any, path: tuple[Any, ...], out: list[tuple[Any, ...]]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() | b.keys():
            if k not in a or k not in b:
                out.append((*path, k))
            else:
                _diff(a[k], b[k], (*path, k), out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, (*path, i), out)
    elif type(a) is not type(b) or a != b:
        out.append(path)


def manifest_change(original: bytes, mutated: bytes) -> str:
    """How mutated manifest bytes differ from the original ones, by meaning:

    ``"undecodable"`` (not msgpack any more), ``"none"``, ``"metadata"`` (only fields that describe the
    save: step, creation time, user metadata, layout, stats, world size, the minor version, or unknown
    keys), ``"object-value"`` (only the bytes of objects: inline or per rank), ``"object-name"`` (an
    object's key changed), or ``"data"`` (anything that says where or what the data is: tensors, files, checksums,
    objects' checksums, format, major version).
    """
    a, b = _decode(original), _decode(mutated)
    if b is None:
        return "undecodable"
    paths: list[tuple[Any, ...]] = []
    _diff(a, b, (), paths)
    if not paths:
        return "none"
    if not isinstance(b, dict):
        return "data"
    if all(p and (p[0] in METADATA_FIELDS or p[0] not in _DATA_FIELDS or p == ("version", 1)) for p in paths):
        return "metadata"
    if all(len(p) >= 3 and p[0] == "objects" and p[2] in ("inline", "per_rank") for p in paths):
        return "object-value"
    if all(len(p) == 2 and p[0] == "objects" for p in paths):
        return "object-name"
    return "data"
