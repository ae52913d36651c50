"""Compare two checkpoints tensor by tensor, whatever their layouts (``ckpt diff A B``).

Each global tensor present in both is read from both in parts of bounded size (as global boxes,
whatever the stored shards) and compared: bitwise, and as the largest absolute difference. Objects
(step, data position) are compared after decoding; per-rank objects (RNG states) on the ranks both
checkpoints have, since the set of ranks is part of the layout. Memory stays bounded by a few
buffers of ``chunk_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt._chunks import split_region
from ckpt._dtypes import dtype_from_name, itemsize
from ckpt._io import ScratchReader, verify_shards
from ckpt._load_plan import LoadRequest, plan_load
from ckpt.errors import IntegrityError, StateError
from ckpt.formats.msgpack_codec import decode_object
from ckpt.load import fetch_manifest
from ckpt.manifest import Manifest, ObjectEntry
from ckpt.resharders.plan import narrowed
from ckpt.shards import Box, full_box
from ckpt.storage import get_storage

EQUAL = "equal"  # bitwise identical
CLOSE = "close"  # not bitwise identical, but every element within atol (NaNs in the same places)
DIFFERENT = "different"
MISMATCH = "mismatch"  # dtype or global shape differ: values not compared
ONLY_A = "only_in_a"
ONLY_B = "only_in_b"

DEFAULT_CHUNK = 32 << 20


@dataclass(slots=True)
class TensorDiff:
    """The comparison of one key. ``max_abs_diff`` is None when not computed (missing, mismatch,
    dtypes without arithmetic); ``differing`` counts elements that are not bitwise equal."""

    key: str
    status: str
    max_abs_diff: float | None = None
    differing: int = 0
    numel: int = 0
    a: str | None = None  # "dtype [shape]" on each side
    b: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in (EQUAL, CLOSE)

    def to_dict(self) -> dict[str, Any]:
        mad = self.max_abs_diff
        return {"key": self.key, "status": self.status, "ok": self.ok,
                "max_abs_diff": None if mad is None or math.isnan(mad) else mad,
                "max_abs_diff_is_nan": mad is not None and math.isnan(mad),
                "differing": self.differing, "numel": self.numel, "a": self.a, "b": self.b}


@dataclass(slots=True)
class DiffReport:
    """Result of :func:`diff`: ``ok`` only when every tensor and object is equal (within ``atol``)."""

    a: str
    b: str
    atol: float
    tensors: list[TensorDiff] = field(default_factory=list)
    objects: list[TensorDiff] = field(default_factory=list)  # status EQUAL / DIFFERENT / ONLY_*
    bytes_compared: int = 0
    bytes_verified: int = 0  # stored bytes whose CRC32 was checked (both sides)

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tensors) and all(o.ok for o in self.objects)

    @property
    def problems(self) -> list[TensorDiff]:
        return [t for t in self.tensors + self.objects if not t.ok]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.status] = out.get(t.status, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "atol": self.atol, "ok": self.ok, "counts": self.counts(),
                "bytes_verified": self.bytes_verified,
                "bytes_compared": self.bytes_compared, "tensors": [t.to_dict() for t in self.tensors],
                "objects": [o.to_dict() for o in self.objects]}


def diff(a_url: str, b_url: str, atol: float = 0.0, *, chunk_bytes: int = DEFAULT_CHUNK,
         storage_options: dict[str, Any] | None = None, verify: bool = True,
         progress: Callable[[int, int], None] | None = None) -> DiffReport:
    """Compare the checkpoints at ``a_url`` and ``b_url`` tensor by tensor, regardless of layouts.

    A tensor is ``equal`` when bitwise identical, ``close`` when every element differs by at most
    ``atol`` (and NaNs sit in the same places), else ``different``; ``mismatch`` when dtype or
    global shape differ; ``only_in_a`` / ``only_in_b`` when missing on one side. Objects are
    compared after decoding (per-rank objects on the ranks both sides have).

    ``verify`` (default): before a tensor's values are compared, every stored shard of it on both
    sides is checked against its CRC32, so a difference is never a corrupted byte in disguise.
    ``progress(done, total)``: called after each tensor, in bytes of tensors both sides hold (each
    counted once).

    Raises ManifestError / StorageError when either checkpoint cannot be read, IntegrityError
    (``verify``) when a shard of either does not match its checksum, naming the checkpoint, tensor,
    file and byte range (problems *in* the values are reported, not raised).

    Example::

        report = diff("/ckpt/step-100", "/ckpt/step-100-ep4")
        assert report.ok
    """
    if not atol >= 0:
        raise StateError(f"atol={atol!r}: pass a tolerance >= 0")
    sa = get_storage(a_url, **(storage_options or {}))
    sb = get_storage(b_url, **(storage_options or {}))
    try:
        ma, mb = fetch_manifest(sa), fetch_manifest(sb)
        report = DiffReport(a_url, b_url, float(atol))
        chunk_bytes = max(4096, int(chunk_bytes))
        ra, rb = ScratchReader(sa, chunk_bytes), ScratchReader(sb, chunk_bytes)
        bufs = (torch.empty(chunk_bytes, dtype=torch.uint8), torch.empty(chunk_bytes, dtype=torch.uint8))
        keys = sorted(set(ma.tensors) | set(mb.tensors))
        sizes = {k: _nbytes(ma, k) if k in mb.tensors else 0 for k in keys if k in ma.tensors}
        total, done = sum(sizes.values()), 0
        for key in keys:
            if verify:
                report.bytes_verified += _verify(key, (a_url, ma, sa), (b_url, mb, sb))
            report.tensors.append(_tensor(key, ma, mb, ra, rb, bufs, float(atol), chunk_bytes, report))
            if progress is not None:
                done += sizes.get(key, 0)
                progress(done, total)
        for key in sorted(set(ma.objects) | set(mb.objects)):
            report.objects.append(_object(key, ma.objects.get(key), mb.objects.get(key)))
        return report
    finally:
        sa.close()
        sb.close()


def _verify(key: str, *sides: tuple[str, Manifest, Any]) -> int:
    """CRC32 of every stored shard of ``key`` on each side, when both sides hold it with the same
    dtype and shape (otherwise its values are not compared). Returns the bytes hashed."""
    ts = [m.tensors.get(key) for _, m, _ in sides]
    if any(t is None for t in ts) or len({(t.dtype, tuple(t.shape)) for t in ts if t is not None}) != 1:
        return 0
    n = 0
    for url, m, storage in sides:
        t = m.tensors[key]
        try:
            n += verify_shards(storage, m, [LoadRequest(key, t.dtype, tuple(t.shape), full_box(tuple(t.shape)))])
        except IntegrityError as e:
            raise IntegrityError(f"{url}: {e}. Nothing was compared; pass verify=False (--no-verify) to compare "
                                 "the bytes as they are") from None
    return n


def _desc(m: Manifest, key: str) -> str | None:
    t = m.tensors.get(key)
    return None if t is None else f"{t.dtype} {list(t.shape)}"


def _nbytes(m: Manifest, key: str) -> int:
    t = m.tensors[key]
    return math.prod(t.shape) * itemsize(dtype_from_name(t.dtype, key=key))


def _tensor(key: str, ma: Manifest, mb: Manifest, ra: ScratchReader, rb: ScratchReader,
            bufs: tuple[torch.Tensor, torch.Tensor], atol: float, chunk: int, report: DiffReport) -> TensorDiff:
    ta, tb = ma.tensors.get(key), mb.tensors.get(key)
    d = TensorDiff(key, EQUAL, a=_desc(ma, key), b=_desc(mb, key))
    if ta is None or tb is None:
        d.status = ONLY_B if ta is None else ONLY_A
        return d
    if ta.dtype != tb.dtype or tuple(ta.shape) != tuple(tb.shape):
        d.status = MISMATCH
        return d
    dtype = dtype_from_name(ta.dtype, key=key)
    shape = tuple(ta.shape)
    d.numel = math.prod(shape)
    isz = itemsize(dtype)
    buf_a, buf_b = bufs
    mad: float | None = 0.0
    for part in split_region(full_box(shape), max(1, chunk // isz)):
        if part.numel == 0:
            continue
        nbytes = part.numel * isz
        lens = part.lengths if isinstance(part, Box) else (part.numel,)
        xa = buf_a[:nbytes].view(dtype).view(lens)
        xb = buf_b[:nbytes].view(dtype).view(lens)
        for m, reader, x in ((ma, ra, xa), (mb, rb, xb)):
            rp = plan_load(narrowed(m, key, part), [LoadRequest(key, ta.dtype, shape, part)],
                           contiguous_targets=[True], max_read=chunk)
            reader.run(rp, [x], [ta.dtype])
        report.bytes_compared += 2 * nbytes
        ua, ub = buf_a[:nbytes].view(-1, isz), buf_b[:nbytes].view(-1, isz)
        neq = (ua != ub).any(dim=1)
        n_diff = int(neq.sum())
        d.differing += n_diff
        if n_diff and mad is not None:
            pm = _max_abs_diff(xa.reshape(-1)[neq], xb.reshape(-1)[neq])
            if pm is None:
                mad = None
            elif math.isnan(pm) or math.isnan(mad):
                mad = math.nan
            else:
                mad = max(mad, pm)
    d.max_abs_diff = mad
    if d.differing == 0:
        d.status = EQUAL
    elif atol > 0 and mad is not None and not math.isnan(mad) and mad <= atol:
        d.status = CLOSE
    else:
        d.status = DIFFERENT
    return d


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Largest |a - b| over elements that differ bitwise; NaN where one side is NaN and the other
    not; None for dtypes without arithmetic."""
    try:
        if a.dtype.is_complex:
            fa, fb = a.to(torch.complex128), b.to(torch.complex128)
            return float((fa - fb).abs().max())
        if a.dtype == torch.bool:
            return 1.0
        fa, fb = a.to(torch.float64), b.to(torch.float64)
    except (RuntimeError, TypeError):
        return None
    both_nan = fa.isnan() & fb.isnan()  # NaNs with different payloads: equal for tolerance purposes
    delta = (fa - fb).abs()
    delta[both_nan] = 0.0
    if delta.isnan().any():
        return math.nan
    return float(delta.max()) if delta.numel() else 0.0


def _object(key: str, a: ObjectEntry | None, b: ObjectEntry | None) -> TensorDiff:
    d = TensorDiff(key, EQUAL, a=None if a is None else "object", b=None if b is None else "object")
    if a is None or b is None:
        d.status = ONLY_B if a is None else ONLY_A
        return d
    if (a.per_rank is None) != (b.per_rank is None):
        d.status = DIFFERENT
        d.a, d.b = _kind(a), _kind(b)
        return d
    if a.per_rank is not None and b.per_rank is not None:
        # Per-rank values belong to ranks, which differ between layouts: compare the ranks both have.
        common = sorted(set(a.per_rank) & set(b.per_rank))
        d.a, d.b = _kind(a), _kind(b)
        if any(decode_object(a.per_rank[r], key=key) != decode_object(b.per_rank[r], key=key) for r in common):
            d.status = DIFFERENT
        return d
    if decode_object(a.data or b"", key=key) != decode_object(b.data or b"", key=key):
        d.status = DIFFERENT
    return d


def _kind(o: ObjectEntry) -> str:
    return "object" if o.per_rank is None else f"per-rank object ({len(o.per_rank)} ranks)"


__all__ = ["diff", "DiffReport", "TensorDiff", "EQUAL", "CLOSE", "DIFFERENT", "MISMATCH", "ONLY_A", "ONLY_B"]
