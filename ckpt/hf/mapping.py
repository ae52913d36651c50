"""Element maps between name spaces: Hugging Face tensors, canonical parameters, stored keys.

Every conversion ckpt does between Hugging Face files and a checkpoint is a relabelling of elements:
per-expert tensors are rows of a stacked one, Megatron's fused ``linear_qkv`` interleaves q, k and v
per query group, torchtitan's ``wq`` permutes rows for its rotary embedding. All of these are
described the same way: a tensor of one space is the concatenation of :class:`Run` s (element
ranges of the row-major flattening) of the other space's tensors. Maps compose
(:func:`compose`: HF -> canonical -> stored), and a map inverts into per-tensor shards
(:func:`invert`), so the export streamer and the import manifest both come from one description.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from ckpt.errors import MismatchError


@dataclass(frozen=True, slots=True)
class Run:
    """Elements ``[start, start + numel)`` of the row-major flattening of tensor ``name``."""

    name: str
    start: int
    numel: int


@dataclass(slots=True)
class Target:
    """One tensor of a space: its shape and its elements as runs over another space, in order."""

    shape: tuple[int, ...]
    runs: list[Run]
    _ends: list[int] = field(default_factory=list, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def ends(self) -> list[int]:
        if len(self._ends) != len(self.runs):
            acc, self._ends = 0, []
            for r in self.runs:
                acc += r.numel
                self._ends.append(acc)
        return self._ends

    def slice(self, start: int, numel: int) -> list[Run]:
        """The runs holding this tensor's elements ``[start, start + numel)``."""
        ends = self.ends()
        out: list[Run] = []
        i = bisect.bisect_right(ends, start)
        pos, stop = start, start + numel
        while pos < stop:
            r = self.runs[i]
            begin = ends[i] - r.numel
            take = min(stop, ends[i]) - pos
            out.append(Run(r.name, r.start + pos - begin, take))
            pos += take
            i += 1
        return out


Map = dict[str, Target]


def whole(name: str, shape: tuple[int, ...]) -> Target:
    """The identity: ``name`` is all of ``name``."""
    return Target(tuple(shape), [Run(name, 0, math.prod(shape))])


def rows(name: str, shape: tuple[int, ...], first: int, count: int) -> Run:
    """Rows ``[first, first + count)`` along dim 0 of a tensor of ``shape``."""
    width = math.prod(shape[1:])
    return Run(name, first * width, count * width)


def merged(runs: list[Run]) -> list[Run]:
    """Adjacent runs of one tensor joined (fewer, larger reads)."""
    out: list[Run] = []
    for r in runs:
        if r.numel == 0:
            continue
        if out and out[-1].name == r.name and out[-1].start + out[-1].numel == r.start:
            out[-1] = Run(r.name, out[-1].start, out[-1].numel + r.numel)
        else:
            out.append(r)
    return out


def compose(outer: Map, inner: Map) -> Map:
    """``outer`` (runs over the middle space) through ``inner`` (middle -> source): runs over the source.

    Raises MismatchError when ``outer`` refers to a middle tensor ``inner`` lacks or reaches past it.
    """
    out: Map = {}
    for name, t in outer.items():
        runs: list[Run] = []
        for r in t.runs:
            mid = inner.get(r.name)
            if mid is None:
                raise MismatchError(f"{name}: needs {r.name!r}, which the naming does not provide")
            if r.start + r.numel > mid.numel:
                raise MismatchError(f"{name}: reads elements [{r.start}, {r.start + r.numel}) of {r.name!r}, "
                                    f"which has {mid.numel}")
            runs += mid.slice(r.start, r.numel)
        out[name] = Target(t.shape, merged(runs))
    return out


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, start + numel)`` of a source tensor are elements ``[at, at + numel)`` of
    the target tensor ``target``."""

    start: int
    numel: int
    target: str
    at: int


def invert(m: Map, shapes: dict[str, tuple[int, ...]], *, what: str) -> dict[str, list[Piece]]:
    """For each source tensor in ``shapes``: where its elements are among ``m``'s targets, sorted.

    Raises MismatchError naming the tensors some elements of which no target holds (or two hold).
    """
    pieces: dict[str, list[Piece]] = {n: [] for n in shapes}
    unknown: set[str] = set()
    for name, t in m.items():
        at = 0
        for r in t.runs:
            if r.name not in pieces:
                unknown.add(r.name)
            else:
                pieces[r.name].append(Piece(r.start, r.numel, name, at))
            at += r.numel
    problems: list[str] = []
    if unknown:
        problems.append(f"not in the checkpoint: {sorted(unknown)[:6]}")
    for n, ps in pieces.items():
        ps.sort(key=lambda p: p.start)
        pos = 0
        for p in ps:
            if p.start != pos:
                problems.append(f"{n}: elements [{min(pos, p.start)}, {max(pos, p.start)}) "
                                + ("missing" if p.start > pos else "given twice"))
                break
            pos += p.numel
        else:
            total = math.prod(shapes[n])
            if pos != total:
                problems.append(f"{n}: elements [{pos}, {total}) missing" if pos < total else f"{n}: too many")
    if problems:
        raise MismatchError(f"{what}: " + "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more"
                                                                      if len(problems) > 6 else ""))
    return pieces


__all__ = ["Run", "Target", "Map", "whole", "rows", "merged", "compose", "Piece", "invert"]
