"""Parallel layouts: ``dp x ep x tp x pp`` (+ ZeRO stage) and the rank <-> coordinate order.

Rank order, fastest-varying first: **tp, ep, dp, pp**::

    rank = tp_i + tp * (ep_i + ep * (dp_i + dp * pp_i))

so a TP group is a run of adjacent ranks (one node's NVLink domain in practice). Dense parameters
are replicated over ``dp x ep`` (EP is carved out of data parallelism, as in Megatron and
DeepSpeed-MoE); expert parameters are split over ``ep`` and replicated over ``dp``. ZeRO-1 shards
optimizer state flat over each parameter's replica group (``dp x ep`` for dense, ``dp`` for experts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ckpt.errors import LayoutError

AXES = ("dp", "tp", "pp", "ep")


@dataclass(frozen=True, slots=True)
class Coord:
    """A rank's position in a layout."""

    dp: int
    tp: int
    pp: int
    ep: int


@dataclass(frozen=True, slots=True)
class Layout:
    """A parallel layout. ``Layout.parse("tp=2,ep=4,pp=2,dp=1,zero=1")``."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0

    def __post_init__(self) -> None:
        for a in AXES:
            v = getattr(self, a)
            if not isinstance(v, int) or v < 1:
                raise LayoutError(f"layout: {a}={v!r} must be a positive integer")
        if self.zero not in (0, 1):
            raise LayoutError(f"layout: zero={self.zero!r} is not supported (0 or 1)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.ep

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parse ``"tp=2,ep=4,pp=2,dp=1,zero=1"`` (any order; missing axes are 1, zero is 0).

        ``"single"`` or ``""`` means one process. Raises LayoutError naming the bad part.
        """
        text = text.strip()
        if text in ("", "single", "1"):
            return cls()
        vals: dict[str, int] = {}
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            if "=" not in part:
                raise LayoutError(f"layout {text!r}: {part!r} is not axis=N (axes: dp, tp, pp, ep, zero)")
            k, v = part.split("=", 1)
            if k not in (*AXES, "zero"):
                raise LayoutError(f"layout {text!r}: unknown axis {k!r} (axes: dp, tp, pp, ep, zero)")
            try:
                vals[k] = int(v)
            except ValueError:
                raise LayoutError(f"layout {text!r}: {k}={v!r} is not an integer") from None
        return cls(**vals)

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp},pp={self.pp},ep={self.ep},zero={self.zero}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        return cls(**{k: int(d[k]) for k in (*AXES, "zero") if k in d})

    def coord(self, rank: int) -> Coord:
        """The coordinate of ``rank`` (order tp, ep, dp, pp; tp fastest)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"layout {self}: rank {rank} is outside world size {self.world_size}")
        tp_i, r = rank % self.tp, rank // self.tp
        ep_i, r = r % self.ep, r // self.ep
        dp_i, pp_i = r % self.dp, r // self.dp
        return Coord(dp=dp_i, tp=tp_i, pp=pp_i, ep=ep_i)

    def rank(self, c: Coord) -> int:
        """Inverse of :meth:`coord`."""
        return c.tp + self.tp * (c.ep + self.ep * (c.dp + self.dp * c.pp))

    def group(self, rank: int, axes: tuple[str, ...]) -> list[int]:
        """Ranks that differ from ``rank`` only along ``axes`` (sorted). ``("dp", "ep")`` is the
        dense-parameter replica group."""
        c = self.coord(rank)
        out = []
        for r in range(self.world_size):
            o = self.coord(r)
            if all(getattr(o, a) == getattr(c, a) for a in AXES if a not in axes):
                out.append(r)
        return out

    def all_groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every distinct group along ``axes``, in rank order (what ``new_group`` needs on all ranks)."""
        seen: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            g = tuple(self.group(r, axes))
            seen.setdefault(g, list(g))
        return list(seen.values())
