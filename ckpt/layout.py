"""Parallel layouts: ``dp x tp x pp x ep x sp`` (+ ZeRO stage) and the rank <-> coordinate order.

Everything here is generated from one list of axes, the fields of :class:`Layout` that carry a
``rank_order`` (see :func:`axis`): coordinates, rank order, groups, ``parse`` / ``str`` /
``to_dict`` and the error messages. Adding an axis is one ``Layout`` field (plus the matching
``Coord`` field that typing needs; an import-time check keeps the two in step).

Rank order, fastest-varying first: **tp, sp, ep, dp, pp**::

    rank = tp_i + tp * (sp_i + sp * (ep_i + ep * (dp_i + dp * pp_i)))

so a TP group is a run of adjacent ranks (one node's NVLink domain in practice) and the sequence-
parallel peers come next: LASP-2H all-gathers K/V over ``sp`` once per layer, the heaviest traffic
after TP's, so ``sp`` peers sit as close as the layout allows. With ``sp=1`` the order is the old
``tp, ep, dp, pp``, so layouts without ``sp`` keep their rank numbering.

Who holds what: dense parameters are replicated over ``dp x ep x sp`` (EP is carved out of data
parallelism, as in Megatron and DeepSpeed-MoE; ``sp`` ranks hold the same weights but see other
tokens of the same sequences); expert parameters are split over ``ep`` and replicated over
``dp x sp``. ZeRO-1 shards optimizer state flat over each parameter's replica group. Ranks that
differ only in ``sp`` see the same samples (different slices of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ckpt.errors import LayoutError

__all__ = ["AXES", "RANK_ORDER", "Coord", "Layout", "axis"]


def axis(rank_order: int, doc: str, *, shown: bool = True) -> Any:
    """A :class:`Layout` field declaring a parallel axis (size >= 1, default 1).

    Args:
        rank_order: position in the rank order, 0 = fastest-varying.
        doc: one phrase for messages and help.
        shown: always printed by ``str(Layout)``; False: printed only when the size is not 1 (axes
            added later, so that the strings of older layouts stay what they were).
    """
    return field(default=1, metadata={"rank_order": rank_order, "doc": doc, "shown": shown})


@dataclass(frozen=True, slots=True)
class Coord:
    """A rank's position in a layout: one index per axis (fields in :data:`AXES` order)."""

    dp: int = 0
    tp: int = 0
    pp: int = 0
    ep: int = 0
    sp: int = 0

    def to_dict(self) -> dict[str, int]:
        """``{axis: index}`` in :data:`AXES` order."""
        return {a: getattr(self, a) for a in AXES}

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES)


@dataclass(frozen=True, slots=True)
class Layout:
    """A parallel layout. ``Layout.parse("sp=2,tp=2,ep=4,pp=2,dp=1,zero=1")``."""

    dp: int = axis(3, "data parallel")
    tp: int = axis(0, "tensor parallel")
    pp: int = axis(4, "pipeline parallel")
    ep: int = axis(2, "expert parallel")
    sp: int = axis(1, "sequence parallel", shown=False)
    zero: int = 0

    def __post_init__(self) -> None:
        for a in AXES:
            v = getattr(self, a)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LayoutError(f"layout: {a}={v!r} must be a positive integer")
        if self.zero not in (0, 1):
            raise LayoutError(f"layout: zero={self.zero!r} is not supported (0 or 1)")

    @property
    def world_size(self) -> int:
        """Number of ranks: the product of every axis."""
        n = 1
        for a in AXES:
            n *= getattr(self, a)
        return n

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parse ``"tp=2,ep=4,pp=2,dp=1,sp=2,zero=1"`` (any order; missing axes are 1, zero is 0).

        ``"single"`` or ``""`` means one process. Raises LayoutError naming the bad part.
        """
        text = text.strip()
        if text in ("", "single", "1"):
            return cls()
        known = ", ".join((*AXES, "zero"))
        vals: dict[str, int] = {}
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            if "=" not in part:
                raise LayoutError(f"layout {text!r}: {part!r} is not axis=N (axes: {known})")
            k, v = part.split("=", 1)
            if k not in (*AXES, "zero"):
                raise LayoutError(f"layout {text!r}: unknown axis {k!r} (axes: {known})")
            try:
                vals[k] = int(v)
            except ValueError:
                raise LayoutError(f"layout {text!r}: {k}={v!r} is not an integer") from None
        return cls(**vals)

    def shown_axes(self) -> tuple[str, ...]:
        """The axes ``str`` prints: every axis except a later one (``sp``) of size 1."""
        return tuple(a for a in AXES if _SHOWN[a] or getattr(self, a) != 1)

    def __str__(self) -> str:
        return ",".join([*(f"{a}={getattr(self, a)}" for a in self.shown_axes()), f"zero={self.zero}"])

    def coord_str(self, rank: int) -> str:
        """``"dp=0,tp=1,pp=0,ep=1"`` (the axes of :meth:`shown_axes`) for ``rank``."""
        c = self.coord(rank)
        return ",".join(f"{a}={getattr(c, a)}" for a in self.shown_axes())

    def to_dict(self) -> dict[str, Any]:
        """Plain data: every axis and ``zero`` (what checkpoint metadata stores)."""
        return {**{a: getattr(self, a) for a in AXES}, "zero": self.zero}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        """Inverse of :meth:`to_dict`; axes missing from ``d`` (older checkpoints: ``sp``) are 1."""
        return cls(**{k: int(d[k]) for k in (*AXES, "zero") if k in d})

    def _strides(self) -> dict[str, int]:
        out, s = {}, 1
        for a in RANK_ORDER:
            out[a] = s
            s *= getattr(self, a)
        return out

    def coord(self, rank: int) -> Coord:
        """The coordinate of ``rank`` (rank order :data:`RANK_ORDER`, tp fastest)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"layout {self}: rank {rank} is outside world size {self.world_size}")
        idx: dict[str, int] = {}
        for a in RANK_ORDER:
            rank, idx[a] = divmod(rank, getattr(self, a))
        return Coord(**idx)

    def rank(self, c: Coord) -> int:
        """Inverse of :meth:`coord`."""
        strides = self._strides()
        return sum(getattr(c, a) * strides[a] for a in AXES)

    def group(self, rank: int, axes: tuple[str, ...]) -> list[int]:
        """Ranks that differ from ``rank`` only along ``axes`` (sorted). ``("dp", "ep", "sp")`` is the
        dense-parameter replica group."""
        c = self.coord(rank)
        out = []
        for r in range(self.world_size):
            o = self.coord(r)
            if all(getattr(o, a) == getattr(c, a) for a in AXES if a not in axes):
                out.append(r)
        return out

    def group_size(self, axes: tuple[str, ...]) -> int:
        """Number of ranks in a group along ``axes``."""
        n = 1
        for a in axes:
            n *= getattr(self, a)
        return n

    def group_index(self, c: Coord, axes: tuple[str, ...]) -> int:
        """Position of ``c`` in its group along ``axes`` (the rank order restricted to ``axes``, so it
        is the index in :meth:`group`'s sorted list)."""
        idx, s = 0, 1
        for a in RANK_ORDER:
            if a in axes:
                idx += getattr(c, a) * s
                s *= getattr(self, a)
        return idx

    def all_groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every distinct group along ``axes``, in rank order (what ``new_group`` needs on all ranks)."""
        seen: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            g = tuple(self.group(r, axes))
            seen.setdefault(g, list(g))
        return list(seen.values())


_AXIS_FIELDS = [f for f in fields(Layout) if "rank_order" in f.metadata]
# The one list of axes, in display order (``str``, ``to_dict``, messages).
AXES: tuple[str, ...] = tuple(f.name for f in _AXIS_FIELDS)
# Fastest-varying first.
RANK_ORDER: tuple[str, ...] = tuple(f.name for f in sorted(_AXIS_FIELDS, key=lambda f: f.metadata["rank_order"]))
AXIS_DOC: dict[str, str] = {f.name: f.metadata["doc"] for f in _AXIS_FIELDS}
_SHOWN: dict[str, bool] = {f.name: f.metadata["shown"] for f in _AXIS_FIELDS}

if tuple(f.name for f in fields(Coord)) != AXES or sorted(f.metadata["rank_order"] for f in _AXIS_FIELDS) != list(
        range(len(AXES))):
    raise ImportError("ckpt.layout: Coord's fields must equal Layout's axes, and rank_order must number them 0..n-1")
