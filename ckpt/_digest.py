"""Digests of tensor bytes for ``delta`` transfers: did a piece change since the last version?

A missed change would serve stale weights, so a digest is 128 bits, never a 32-bit CRC; and it is
computed where the tensor lives, in one pass over its bytes. Why: BLAKE2b ran at ~0.7 GB/s on one
core (and needed a device-to-host copy for GPU tensors: ~6 s at that rate for a 4 GB model whose
transfer takes ~17 ms on 2 x H100; an earlier on-device scheme of int64 weighted sums took 37 ms), so
``delta`` cost more than it saved. This one: 7.8 ms for that model's 170 pieces, 2.4 ms for one 4 GiB
tensor (docs/BENCHMARKS.md, "Delta refits").

The fingerprint: the tensor's bytes, as int8, are cut into rows of :data:`ROW` bytes (the last
partial row padded with zeros); an int8 matrix product with a fixed pseudo-random ``[ROW, 8]``
matrix ``B`` of odd entries (``torch._int_mm``: exact int32 sums, on tensor cores on a GPU, ~10 GB/s
for the product on one CPU core) gives 8 sums per row; the rows' sums are then combined with fixed pseudo-random odd
int64 weights ``v`` mod 2**64 (chunks of :data:`CHUNK` rows folded in by Horner's rule with an odd
constant). The 8 results and the byte count are hashed into 16 bytes.

Why a change is seen: one changed byte changes its row's 8 sums by ``d * B[k, j]``, non-zero
(``0 < |d| < 256`` and ``B`` odd) and below 2**15, so never a multiple of 2**64 once multiplied by an
odd ``v`` (invertible mod 2**64): every one-byte change changes all 8 results. Changes of several
bytes cancel only by coincidence (each of the 8 sums of a row must cancel, then the rows' weighted
sums: ~2**-64 for the changes training makes). Not a defence against someone crafting collisions.
The same numbers on every device and in every process (exact integer arithmetic, fixed seeds).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

ROW = 1024  # bytes per row of the int8 product (a multiple of 8, as torch._int_mm wants)
SUMS = 8  # sums per row (torch._int_mm wants a multiple of 8 columns)
CHUNK = 1 << 20  # rows weighted by one slice of ``v`` (longer tensors fold chunks in by Horner's rule)
MIN_MM_ROWS = 32  # fewer rows (a GPU's int8 product wants more than 16): the same sums, in int64
_K = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: odd
_CONST: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}


def constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``B`` (int8 ``[ROW, SUMS]``, odd entries) and ``v`` (int64 ``[CHUNK]``, odd) on ``device``: the
    same values everywhere (fixed seed, made on the host, then copied)."""
    key = (device.type, device.index)
    if key not in _CONST:
        g = torch.Generator().manual_seed(0x5EED)
        b = (torch.randint(-64, 64, (ROW, SUMS), generator=g, dtype=torch.int64) * 2 + 1).to(torch.int8)
        v = torch.randint(-(1 << 62), 1 << 62, (CHUNK,), generator=g, dtype=torch.int64) * 2 + 1
        # B column-major: on H100 the int8 product over 4 GiB took 8.2 ms with B row-major and 1.8 ms
        # with B column-major (the layout cuBLASLt's int8 kernels take without a transposing copy)
        b = b.t().contiguous().t()
        _CONST[key] = (b.to(device), v.to(device))
    return _CONST[key]


def fingerprint_sums(t: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The 8 fingerprint sums of ``t``'s bytes (see the module): an int64 tensor on ``t``'s device, no
    host synchronisation. ``chunk``: rows per weight slice (tests make it small)."""
    b = t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
    bm, v = constants(b.device)
    n = b.numel()
    full = n // ROW
    body = b[: full * ROW].view(torch.int8).view(full, ROW)
    tail = b[full * ROW:].view(torch.int8) if n % ROW else None  # a partial last row (its padding adds 0)
    total = full + (tail is not None)
    # one block of ``chunk`` rows at a time: the rows' sums of a block at most (a 10 GB piece made
    # 320 MB of them at once, on a GPU an inference engine may have filled)
    s: torch.Tensor | None = None
    for at in range(0, max(total, 1), chunk):
        blk = body[at: at + chunk]
        rows = _product(blk, bm) if blk.shape[0] >= MIN_MM_ROWS else (
            blk.to(torch.int64).unsqueeze(-1) * bm.to(torch.int64)).sum(1)
        if tail is not None and at + chunk >= total:  # the last row, ``full``, is in this block
            last = (tail.to(torch.int64).unsqueeze(-1) * bm[: tail.numel()].to(torch.int64)).sum(0, keepdim=True)
            rows = torch.cat([rows.to(torch.int64), last])
        part = (rows * v[: rows.shape[0]].unsqueeze(-1)).sum(0)  # (int32 rows promote to int64)
        s = part if s is None else s * _K + part
    assert s is not None
    return s


def _product(body: torch.Tensor, bm: torch.Tensor) -> torch.Tensor:
    """``body @ bm`` (int8 ``[rows, ROW]`` by ``[ROW, SUMS]``), exactly (int32 or int64).

    ``torch._int_mm`` where it runs: cuBLASLt's int8 kernels want 16-byte aligned rows (a piece may
    be a view at any byte offset: such a body is copied first) and refuse some shapes
    (CUBLAS_STATUS_NOT_SUPPORTED); then float64 products of row blocks, exact as well (every sum is
    below 1024 * 128 * 128 = 2**24, far inside float64's 53 bits)."""
    if body.device.type == "cuda" and body.data_ptr() % 16:
        body = body.clone()
    try:
        return torch._int_mm(body, bm)  # (int32: promoted to int64 by the weights)
    except RuntimeError:
        b64 = bm.to(torch.float64)
        step = 1 << 16  # rows per block: 64 MiB of bytes, 512 MiB as float64
        return torch.cat([(body[i: i + step].to(torch.float64) @ b64).to(torch.int64)
                          for i in range(0, body.shape[0], step)])


def digests(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """A 16-byte digest of each tensor's bytes (its fingerprint and byte count), computed on its own
    device; one copy to the host for all of them."""
    if not tensors:
        return []
    sums = [fingerprint_sums(t) for t in tensors]
    devices = {s.device for s in sums}
    host = (torch.stack(sums) if len(devices) == 1 else torch.stack([s.cpu() for s in sums])).cpu().tolist()
    return [hashlib.blake2b(f"fp1:{t.numel() * t.element_size()}:{s}".encode(), digest_size=16).digest()
            for t, s in zip(tensors, host, strict=True)]


__all__ = ["ROW", "SUMS", "CHUNK", "constants", "fingerprint_sums", "digests"]
