"""Deterministic reference tensors and the pieces each rank holds of them under several shardings."""

from __future__ import annotations

from typing import Any

import torch

import ckpt


def reference() -> dict[str, torch.Tensor]:
    """The global tensors every test rank regenerates identically (fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    return {
        "w32": torch.randn(13, 10, generator=g),
        "wbf16": torch.randn(9, 6, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (11, 3), generator=g, dtype=torch.int64),
        "f8": torch.randn(8, 12, generator=g).to(torch.float8_e4m3fn),
        "vec": torch.randn(17, generator=g),
        "cube": torch.randn(5, 4, 6, generator=g),
    }


def chunks(n: int, k: int) -> list[tuple[int, int]]:
    """Uneven split of n into k contiguous (start, length) pieces, torch.chunk style."""
    size = -(-n // k) if n else 0
    out = []
    for i in range(k):
        s = min(i * size, n)
        out.append((s, min(s + size, n) - s))
    return out


def piece(ref: torch.Tensor, kind: str, rank: int, world: int) -> Any:
    """What rank ``rank`` holds of ``ref`` under sharding ``kind``, as the public API types."""
    shape = tuple(ref.shape)
    if kind == "replicated" or world == 1 and kind != "flat":
        return ref.clone()
    if kind in ("rows", "cols"):
        d = 0 if kind == "rows" or ref.dim() < 2 else 1
        s, n = chunks(shape[d], world)[rank]
        offs = [0] * ref.dim()
        offs[d] = s
        return ckpt.Shard(ref.narrow(d, s, n).clone(), shape, tuple(offs))
    if kind == "flat":
        s, n = chunks(ref.numel(), world)[rank]
        return ckpt.FlatShard(ref.reshape(-1)[s : s + n].clone(), shape, s)
    if kind == "grid":  # 2-D blocks over a (2, world // 2) grid; falls back to rows
        if ref.dim() < 2 or world % 2:
            return piece(ref, "rows", rank, world)
        r, c = divmod(rank, world // 2)
        rs, rn = chunks(shape[0], 2)[r]
        cs, cn = chunks(shape[1], world // 2)[c]
        offs = (rs, cs) + (0,) * (ref.dim() - 2)
        return ckpt.Shard(ref[rs : rs + rn, cs : cs + cn].clone(), shape, offs)
    raise ValueError(kind)


def empty_like_piece(p: Any) -> Any:
    """The same piece with zeroed data, as a load target."""
    if isinstance(p, ckpt.Shard):
        return ckpt.Shard(torch.zeros_like(p.local), p.global_shape, p.offsets)
    if isinstance(p, ckpt.FlatShard):
        return ckpt.FlatShard(torch.zeros_like(p.local), p.global_shape, p.start)
    return torch.zeros_like(p)


def expected_local(ref: torch.Tensor, p: Any) -> torch.Tensor:
    """The slice of ``ref`` that piece ``p`` must hold."""
    if isinstance(p, ckpt.Shard):
        return ref[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.local.shape, strict=True))]
    if isinstance(p, ckpt.FlatShard):
        return ref.reshape(-1)[p.start : p.start + p.local.numel()]
    return ref


def local_of(p: Any) -> torch.Tensor:
    return p.local if isinstance(p, ckpt.Shard | ckpt.FlatShard) else p


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view comparable bitwise (float8 has no equality kernel everywhere)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ"
