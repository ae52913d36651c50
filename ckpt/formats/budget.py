"""Budgets for decoding bytes other tools wrote, and the one bounded walker over what they decode to.

A pickle is a program for a stack machine: 1.7 KB of it can build ``a = [a, a]`` sixty times over, a
graph of 120 objects that every recursive walker (``repr``, msgpack encoding, "find every tensor")
expands into a tree of 2**60 nodes; a list can contain itself; nesting can exceed Python's stack.
Unpickling itself is linear in the input, so the rule is enforced once, on the result:
:func:`check` walks the object graph iteratively, each object once (by ``id``), and computes for
every object the size of its tree expansion (nodes, and characters of the strings and bytes in it)
and its height. A cycle, more unique objects, deeper nesting, or a larger expansion than the
:class:`Budget` allows is a :class:`~ckpt.errors.ForeignFormatError` naming the file, found in time
and memory proportional to the number of *unique* objects (itself bounded by the input's size).
What passes is a tree of bounded size and depth, so every later walker over it (``repr``,
``encode_object``, :func:`walk`) finishes in bounded time without hitting the recursion limit.

Defaults are generous for real checkpoints (a real pickle shares few objects: a tree expansion
at most a few times its size) and overridable per call (``budget=``) or per process through the
environment: ``CKPT_FOREIGN_MAX_BYTES``, ``CKPT_FOREIGN_MAX_OBJECTS``, ``CKPT_FOREIGN_MAX_DEPTH``,
``CKPT_FOREIGN_EXPANSION`` (see :class:`Budget`).
"""

from __future__ import annotations

import enum
import os
import reprlib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckpt.errors import CheckpointError, ForeignFormatError

_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray, type, types.ModuleType,
               types.FunctionType, types.BuiltinFunctionType, types.MethodType, enum.Enum)


def _env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(float(raw))
    except ValueError:
        raise ForeignFormatError(f"environment variable {name}={raw!r} is not a number") from None
    if value < 1:
        raise ForeignFormatError(f"environment variable {name}={raw!r} must be at least 1")
    return value


@dataclass(frozen=True)
class Budget:
    """Limits for decoding one foreign file (a pickle stream, a zip directory, a metadata record).

    - ``max_bytes``: the most bytes of one pickle stream or zip directory read into memory (1 GiB,
      ``CKPT_FOREIGN_MAX_BYTES``);
    - ``max_objects``: the most distinct containers and instances the decoded value may hold (50M,
      ``CKPT_FOREIGN_MAX_OBJECTS``);
    - ``max_depth``: the deepest nesting of containers (100: real checkpoints nest under 20, and
      Python's own walkers need several frames per level, ``CKPT_FOREIGN_MAX_DEPTH``);
    - ``expansion`` and ``expansion_floor``: the value's tree expansion (each reference walked as if
      it were a copy) may hold at most ``expansion_floor + expansion * input bytes`` nodes, and as many
      characters of strings and bytes (4 per input byte plus 16M: ``CKPT_FOREIGN_EXPANSION`` sets the
      factor). Without shared references the expansion is smaller than the input.
    - ``max_int_bits``: integers longer than this (8192 bits) are refused; Python cannot even print
      one above ~14000 bits, and no checkpoint field needs one.
    """

    max_bytes: int = 1 << 30
    max_objects: int = 50_000_000
    max_depth: int = 100
    expansion: int = 4
    expansion_floor: int = 16_000_000
    max_int_bits: int = 8192

    @classmethod
    def default(cls) -> Budget:
        """The default budget, with the ``CKPT_FOREIGN_*`` environment overrides applied."""
        return cls(max_bytes=_env("CKPT_FOREIGN_MAX_BYTES", cls.max_bytes),
                   max_objects=_env("CKPT_FOREIGN_MAX_OBJECTS", cls.max_objects),
                   max_depth=_env("CKPT_FOREIGN_MAX_DEPTH", cls.max_depth),
                   expansion=_env("CKPT_FOREIGN_EXPANSION", cls.expansion))

    def expanded_limit(self, input_bytes: int) -> int:
        """The most nodes (and string characters) a value decoded from ``input_bytes`` may expand to."""
        return self.expansion_floor + self.expansion * max(0, input_bytes)

    def check_bytes(self, n: int, what: str, field: str) -> None:
        """Refuse reading ``n`` bytes of ``field`` of ``what`` into memory when over ``max_bytes``."""
        if n > self.max_bytes:
            raise ForeignFormatError(f"{what}: {field} claims {n} bytes, over ckpt's budget of {self.max_bytes} "
                                     "for decoding foreign metadata (the file is hostile or damaged; raise "
                                     "CKPT_FOREIGN_MAX_BYTES if it is genuine)")


def resolve(budget: Budget | None) -> Budget:
    """``budget``, or the default one (environment overrides applied)."""
    return budget if budget is not None else Budget.default()


INT64_MAX = (1 << 63) - 1  # every size, offset and length a checkpoint records fits an int64 (torch, numpy, msgpack)
MAX_DIMS = 64  # dimensions of a tensor shape (torch's own limit is 64 too)


def integer(value: Any, what: str, field: str, low: int = 0, high: int = INT64_MAX,
            error: type[CheckpointError] = ForeignFormatError) -> int:
    """``value`` (a field of a foreign record) as an int in ``[low, high]``: not a bool, a float (even
    2.0), a string or None. Every count, offset, length or dimension a foreign file claims goes
    through here before it sizes a loop, an allocation or a read, so an infinite float or a
    2**70 never reaches ``int()``, numpy or msgpack as a raw OverflowError. Raises ``error``
    (ForeignFormatError unless told otherwise) naming ``what`` and ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise error(f"{what}: {field} is {_show(value)}, expected an integer in [{low}, {high}]; the file is "
                    "damaged or not one this reader knows")
    return int(value)  # an int subclass (torch.Size's elements are plain ints) as a plain int


def dims(value: Any, what: str, field: str, error: type[CheckpointError] = ForeignFormatError) -> tuple[int, ...]:
    """``value`` as a tensor shape (or the offsets of a chunk): a list or tuple (``torch.Size``) of at
    most :data:`MAX_DIMS` integers in ``[0, 2**63 - 1]`` whose non-zero ones multiply to at most
    ``2**63 - 1`` elements, torch's own rule (``torch.load`` refuses a record that breaks it, even one
    with an empty dimension). Raises ``error`` naming ``what`` and ``field``."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_DIMS:
        raise error(f"{what}: {field} is {_show(value)}, not a sequence of at most {MAX_DIMS} integers")
    out = tuple(integer(v, what, field, error=error) for v in value)
    n = 1
    for d in out:
        n *= d or 1
    if n > INT64_MAX:
        raise error(f"{what}: {field} {list(out)} has more than 2**63 - 1 elements; no tensor does")
    return out


def _show(value: Any) -> str:
    """A short repr of ``value`` with its type: reprlib's (bounded for a hostile container or string of
    megabytes), and an integer over 256 bits by its size (``repr`` refuses one of over 4300 digits)."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    try:
        r = reprlib.repr(value)
    except Exception:  # noqa: BLE001 - a stand-in's repr of hostile state: the type says enough
        r = "?"
    return f"{r} ({type(value).__name__})"


def _children(v: Any) -> list[Any] | None:
    """The values a walker (``repr``, msgpack, ckpt's own) descends into from ``v``; None for a leaf."""
    t = type(v)
    if t is dict:  # the common cases first
        return [*v.keys(), *v.values()]
    if t is list or t is tuple:
        return v  # type: ignore[no-any-return]
    if isinstance(v, _LEAF_TYPES) or getattr(v, "__ckpt_leaf__", False):
        return None
    if isinstance(v, dict):
        return [*v.keys(), *v.values()]
    if isinstance(v, (list, tuple, set, frozenset)):
        return list(v)
    if isinstance(v, slice):
        return [v.start, v.stop, v.step]
    d = getattr(v, "__dict__", None)  # instances of allowed classes and stand-ins: their fields
    if isinstance(d, dict):
        return [*d.keys(), *d.values()]
    return None


def check(obj: Any, what: str, input_bytes: int, budget: Budget | None = None) -> None:
    """Refuse ``obj`` (decoded from ``input_bytes`` bytes of ``what``) unless it is a finite tree
    within ``budget``: no cycle, at most ``max_objects`` distinct containers, nesting at most
    ``max_depth``, and a tree expansion within :meth:`Budget.expanded_limit` nodes and characters.

    Iterative; each object visited once (shared references are looked up by ``id``), so a
    2**60-node expansion of 120 objects is refused after 120 steps. Raises ForeignFormatError.
    """
    b = resolve(budget)
    limit = b.expanded_limit(input_bytes)
    big = 1 << b.max_int_bits
    memo: dict[int, tuple[int, int]] = {}  # id -> (nodes, characters) of its expansion
    on_path: set[int] = set()
    stack: list[list[Any]] = []  # frames: [object, iterator over its non-trivial children, nodes, characters]

    def over(nodes: int, chars: int) -> None:
        if nodes > limit or chars > limit:
            raise ForeignFormatError(
                f"{what}: the pickled value expands to more than {limit} {'nodes' if nodes > limit else 'characters'} "
                f"when walked as a tree (shared references repeated, from {input_bytes} bytes of input); refusing it "
                "as a decompression bomb (raise CKPT_FOREIGN_EXPANSION if the file is genuine)")

    def leaf(v: Any) -> int:
        if isinstance(v, int) and not -big < v < big:
            raise ForeignFormatError(f"{what}: an integer of {v.bit_length()} bits, over ckpt's budget of "
                                     f"{b.max_int_bits}; no checkpoint field holds one (hostile or damaged file)")
        return len(v) if isinstance(v, (str, bytes, bytearray)) else 0

    def push(v: Any, kids: list[Any]) -> None:
        if id(v) in on_path:
            raise ForeignFormatError(f"{what}: the pickled value contains itself ({type(v).__name__} in a reference "
                                     "cycle); no checkpoint needs one, so ckpt refuses to walk it")
        if len(memo) + len(stack) >= b.max_objects:
            raise ForeignFormatError(f"{what}: more than {b.max_objects} objects in the pickled value, over ckpt's "
                                     "budget (raise CKPT_FOREIGN_MAX_OBJECTS if the file is genuine)")
        if len(stack) >= b.max_depth:
            raise ForeignFormatError(f"{what}: the pickled value nests deeper than {b.max_depth} levels, over ckpt's "
                                     "budget (raise CKPT_FOREIGN_MAX_DEPTH if the file is genuine)")
        # the leaves are summed here, in one pass (the common case, kept cheap); containers are walked
        nodes, chars, inner = 1, 0, []
        for c in kids:
            t = type(c)
            if t is str or t is bytes:
                nodes += 1
                chars += len(c)
            elif t is float or t is bool or c is None or (t is int and -big < c < big):
                nodes += 1
            else:
                inner.append(c)  # a container, or a rarer leaf: decided when reached
        on_path.add(id(v))
        stack.append([v, iter(inner), nodes, chars])

    root = _children(obj)
    if root is None:
        leaf(obj)
        return
    push(obj, root)
    while stack:
        frame = stack[-1]
        for c in frame[1]:  # resumes where the last pass broke off
            known = memo.get(id(c))  # seen before (a shared reference): its expansion, not a second walk
            if known is None:
                sub = _children(c)
                if sub is not None:
                    push(c, sub)
                    break
                known = (1, leaf(c))
            frame[2] += known[0]
            frame[3] += known[1]
            over(frame[2], frame[3])
        else:
            stack.pop()
            v, nodes, chars = frame[0], frame[2], frame[3]
            over(nodes, chars)
            on_path.discard(id(v))
            memo[id(v)] = (nodes, chars)
            if stack:
                stack[-1][2] += nodes
                stack[-1][3] += chars


def walk(obj: Any, what: str, budget: Budget | None = None,
         kind: type | tuple[type, ...] = object) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every value of type ``kind`` under ``obj`` reached through dicts, lists and tuples, with its path
    (dict keys and sequence indices), depth first in order, ``obj`` itself first (path ``()``).

    Iterative and bounded: more than ``max_depth`` levels or more nodes than the budget allows for
    its largest input raise ForeignFormatError (a value that passed :func:`check` never does).
    """
    b = resolve(budget)
    left = b.expanded_limit(b.max_bytes)
    # entries: (parent link, key, value, depth); a path is built only for a value that is yielded
    stack: list[tuple[Any, Any, Any, int]] = [(None, None, obj, 0)]
    keep = (dict, list, tuple, *(kind if isinstance(kind, tuple) else (kind,)))  # what is pushed at all
    while stack:
        entry = stack.pop()
        link, _, v, depth = entry
        left -= 1
        if left < 0 or depth > b.max_depth:
            raise ForeignFormatError(f"{what}: the value is larger or deeper than ckpt's budget for walking it")
        if isinstance(v, kind):
            path: list[Any] = []
            at: Any = entry
            while at[0] is not None:
                path.append(at[1])
                at = at[0]
            yield tuple(reversed(path)), v
        if isinstance(v, dict):
            stack.extend((entry, k, x, depth + 1) for k, x in reversed(list(v.items()))
                         if isinstance(x, keep))
        elif isinstance(v, (list, tuple)):
            stack.extend((entry, i, x, depth + 1) for i, x in reversed(list(enumerate(v)))
                         if isinstance(x, keep))


__all__ = ["Budget", "resolve", "INT64_MAX", "MAX_DIMS", "integer", "dims", "check", "walk"]
