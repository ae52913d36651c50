"""The one reader of JSON that ckpt did not write, and the one typed accessor of its fields.

Every JSON document from outside (a Hugging Face ``config.json``, ``model.safetensors.index.json``,
a safetensors header of a foreign file, a names file, an export's config re-read by ``--check``)
is decoded by :func:`loads` under a :class:`Budget`:

- **bytes**: the document's size is checked before it is read (:func:`read_storage`,
  :func:`read_path`) and again before it is decoded;
- **nesting depth and item count**, measured *before* decoding by a linear scan that uses only C
  loops (bytes.replace / split / count / translate and one numpy cumulative sum over the bracket
  characters): the decoder recurses per nesting level and allocates per item, so a document of
  ``[[[[...`` or ``[[],[],...]`` is refused without ever being decoded, never with a raw
  ``RecursionError`` or a memory blow-up (an empty list costs ~56 bytes of Python objects per 3
  bytes of JSON);
- **NaN / Infinity** (not JSON, but accepted by Python's decoder), and numbers like ``1e999`` that
  decode to them, refused unless the budget allows them;
- integers of more than 4300 digits (Python's limit) and invalid UTF-8 refused with the file named.

The result is plain data (dict, list, str, int, float, bool, None). Fields are then read through
:class:`ConfigFields`, which checks each one's type and range (bool is not an int, a string is not
an int, null is not a number) and raises :class:`~ckpt.errors.ConfigError` naming the field, the
file and the fix, so that an adapter never meets a value it would turn into a raw
``ZeroDivisionError`` / ``TypeError`` / ``AttributeError`` or a table of 10**9 layers.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from ckpt.errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # a leaf module: safetensors_header (imported by the storage layer's users) reads through it
    from ckpt.storage import Storage

# Sanity caps on the counts a config may declare (checked before any per-layer or per-expert table is
# built; the counts are then also checked against what the files hold, see ckpt.hf.engine). The
# largest released models have ~100 layers and 384 routed experts; these leave three orders of
# magnitude of room and still keep a table of names in the hundreds of MB at most.
MAX_LAYERS = 100_000
MAX_EXPERTS = 1_000_000
MAX_HEADS = 1 << 20
MAX_DIM = 1 << 32  # any width or vocabulary size


@dataclass(frozen=True, slots=True)
class Budget:
    """Limits for one kind of document: bytes, nesting depth, items (values plus containers, counted
    as commas + opening brackets + 1, an upper bound), and whether NaN / Infinity are accepted."""

    max_bytes: int
    max_depth: int
    max_items: int
    allow_nan: bool = False


# config.json: a few KiB in practice (the largest hold a per-layer list); values are passed through to an
# export's config.json as they are, so NaN / Infinity in a field ckpt does not read are left alone
CONFIG = Budget(16 << 20, 32, 1_000_000, allow_nan=True)
# model.safetensors.index.json: ~10 MB for a 100k-tensor model
INDEX = Budget(256 << 20, 8, 8_000_000)
# a names file ({"rename": [[regex, replacement], ...]})
NAMES = Budget(4 << 20, 8, 200_000)
# a safetensors header: {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}; its byte bound is
# the file's and safetensors' own 100 MiB (ckpt.formats.safetensors_header.MAX_HEADER_BYTES)
HEADER_DEPTH = 8
HEADER_ITEMS = 16_000_000

_BRACKETS_ONLY = bytes(c for c in range(256) if c not in b"[]{}")
_NONFINITE = re.compile(r"NaN|-?Infinity")


def _scan(data: bytes) -> tuple[int, int]:
    """(items, depth) of the JSON text ``data``, without decoding it.

    Escaped backslashes and escaped quotes are removed first (left to right, as a JSON string
    reads them), so every remaining ``"`` delimits a string and the even-numbered pieces of a split
    on ``"`` are the text outside strings. For a valid document this is exact; for an invalid one it
    is exact on the prefix the decoder accepts, which is all the decoder would ever nest into.
    """
    body = data.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in data else data
    outside = b"".join(body.split(b'"')[::2]) if b'"' in body else body
    items = outside.count(b",") + outside.count(b"[") + outside.count(b"{") + 1
    brackets = outside.translate(None, _BRACKETS_ONLY)
    if not brackets:
        return items, 0
    a = np.frombuffer(brackets, np.uint8)
    steps = np.where((a == ord("[")) | (a == ord("{")), 1, -1).astype(np.int32)
    return items, int(steps.cumsum().max())


def loads(data: bytes, *, where: str, budget: Budget, error: type[CheckpointError] = ConfigError) -> Any:
    """Decode the JSON document ``data`` (the file ``where``) within ``budget``.

    Raises ``error`` (ConfigError unless told otherwise; a safetensors header raises IntegrityError)
    naming ``where`` for a document over budget, invalid UTF-8 or invalid JSON.
    """
    if len(data) > budget.max_bytes:
        raise error(f"{where}: {len(data)} bytes, more than the {budget.max_bytes} this kind of JSON file may "
                    "hold; it is not the file ckpt expects (or it is damaged)")
    # worded "not valid JSON" as a decoding error is: to ckpt, such a file is not one it can read
    items, depth = _scan(data)
    if items > budget.max_items:
        raise error(f"{where}: not valid JSON for this file: about {items} values, more than the "
                    f"{budget.max_items} allowed; refused undecoded (not the file ckpt expects, or damaged)")
    if depth > budget.max_depth:
        raise error(f"{where}: not valid JSON for this file: nested {depth} levels deep, more than the "
                    f"{budget.max_depth} allowed; refused undecoded (not the file ckpt expects, or damaged)")
    import json

    def constant(name: str) -> float:
        raise ValueError(f"{name} is not a JSON number")

    def finite(literal: str) -> float:
        # 1e999 is JSON syntax, but Python decodes it to inf: the same non-finite value as Infinity
        v = float(literal)
        if not math.isfinite(v):
            raise ValueError(f"{literal[:40]} is not a finite number")
        return v

    try:
        text = data.decode("utf-8")
        if budget.allow_nan:
            return json.loads(text)
        return json.loads(text, parse_constant=constant, parse_float=finite)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, >4300 digits
        raise error(f"{where}: not valid JSON ({e})") from None


def read_storage(storage: Storage, name: str, *, budget: Budget) -> Any:
    """:func:`loads` of the file ``name`` of ``storage``, its size checked before it is read.

    Raises ConfigError (absent, too large, not valid JSON).
    """
    where = f"{storage.url}/{name}"
    size = storage.size(name)
    if size is None:
        raise ConfigError(f"{where}: missing")
    if size > budget.max_bytes:
        raise ConfigError(f"{where}: {size} bytes, more than the {budget.max_bytes} this kind of JSON file may "
                          "hold; it is not the file ckpt expects (or it is damaged)")
    return loads(storage.read_file(name), where=where, budget=budget)


def read_path(path: str, *, budget: Budget) -> Any:
    """:func:`loads` of the local file ``path``, its size checked before it is read.

    Raises ConfigError (unreadable, too large, not valid JSON).
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > budget.max_bytes:
                raise ConfigError(f"{path}: {size} bytes, more than the {budget.max_bytes} this kind of JSON "
                                  "file may hold; it is not the file ckpt expects (or it is damaged)")
            data = f.read(budget.max_bytes + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    return loads(data, where=path, budget=budget)


def read_object(storage: Storage, name: str, *, budget: Budget) -> dict[str, Any]:
    """:func:`read_storage` of a document that must be a JSON object."""
    d = read_storage(storage, name, budget=budget)
    if not isinstance(d, dict):
        raise ConfigError(f"{storage.url}/{name}: {_kind(d)}, not a JSON object")
    return d


# ---------------------------------------------------------------------------------------------
# Typed fields
# ---------------------------------------------------------------------------------------------

_MISSING: Any = object()


def _kind(v: Any) -> str:
    """``v``'s JSON type, with its article: "an integer", "a string", "null"."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), f"a {type(v).__name__}")


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


# the accessors are named after the types they return; inside the class body those names are the methods
_Int: TypeAlias = int
_Str: TypeAlias = str
_Float: TypeAlias = float
_Bool: TypeAlias = bool


class ConfigFields:
    """Typed, range-checked access to the fields of a config (``where``: the file it came from).

    Each accessor returns the value or raises :class:`~ckpt.errors.ConfigError` naming the field, its
    value, the file and what it must be. ``default`` is returned when the field is absent (a field
    set to null counts as absent only for the ``opt_`` accessors and :meth:`bool`).

    Example::

        f = ConfigFields(cfg, where="/models/x/config.json")
        layers = f.int("num_hidden_layers", min=1, max=MAX_LAYERS)
    """

    def __init__(self, config: Mapping[str, Any], where: str) -> None:
        self.config = config
        self.where = where

    def fail(self, name: _Str, must: _Str) -> ConfigError:
        """The error for field ``name``, which ``must`` be something else."""
        v = self.config.get(name, _MISSING)
        got = "missing" if v is _MISSING else f"{_show(v)} ({_kind(v)})"
        return ConfigError(f"{self.where}: config field {name!r} is {got}; it must be {must}: fix config.json "
                           "(as transformers' config class for this model reads it)")

    def _get(self, name: _Str, default: Any, must: _Str) -> Any:
        v = self.config.get(name, _MISSING)
        if v is _MISSING:
            if default is _MISSING:
                raise self.fail(name, must)
            return default
        return v

    def int(self, name: _Str, *, min: _Int = 1, max: _Int = MAX_DIM, default: Any = _MISSING) -> _Int:  # noqa: A002
        """An integer in ``[min, max]`` (not a bool, not a string, not a float)."""
        must = f"an integer in [{min}, {max}]"
        v = self._get(name, default, must)
        if type(v) is not _Int or not min <= v <= max:
            raise self.fail(name, must)
        return v

    def opt_int(self, name: _Str, *, min: _Int = 1, max: _Int = MAX_DIM) -> _Int | None:  # noqa: A002
        """An integer in ``[min, max]``, or None when absent or null."""
        if self.config.get(name) is None:
            return None
        return self.int(name, min=min, max=max)

    def float(self, name: _Str, *, min: _Float = -math.inf, max: _Float = math.inf,  # noqa: A002
              default: Any = _MISSING) -> _Float:
        """A finite number (an integer or a float, not a bool) in ``[min, max]``."""
        must = f"a finite number in [{min}, {max}]"
        v = self._get(name, default, must)
        if type(v) not in (_Int, _Float) or not math.isfinite(v) or not min <= v <= max:
            raise self.fail(name, must)
        return _Float(v)

    def bool(self, name: _Str, *, default: _Bool = False) -> _Bool:
        """true or false; absent or null: ``default`` (transformers treats a null flag as false)."""
        v = self.config.get(name)
        if v is None:
            return default
        if type(v) is not _Bool:
            raise self.fail(name, "true or false")
        return v

    def str(self, name: _Str, *, choices: tuple[_Str, ...] | None = None, default: Any = _MISSING) -> _Str:
        """A string (one of ``choices`` when given)."""
        must = f"one of {list(choices)}" if choices else "a string"
        v = self._get(name, default, must)
        if not isinstance(v, _Str) or (choices is not None and v not in choices):
            raise self.fail(name, must)
        return v

    def opt_dict(self, name: _Str) -> dict[_Str, Any] | None:
        """An object, or None when absent or null."""
        v = self.config.get(name)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self.fail(name, "an object (or null)")
        return v

    def opt_list(self, name: _Str, *, max_len: _Int) -> list[Any] | None:
        """A list of at most ``max_len`` items, or None when absent or null."""
        v = self.config.get(name)
        if v is None:
            return None
        if not isinstance(v, list) or len(v) > max_len:
            raise self.fail(name, f"a list of at most {max_len} items (or null)")
        return v


__all__ = ["MAX_LAYERS", "MAX_EXPERTS", "MAX_HEADS", "MAX_DIM", "Budget", "CONFIG", "INDEX", "NAMES", "HEADER_DEPTH",
           "HEADER_ITEMS", "loads", "read_storage", "read_path", "read_object", "ConfigFields"]
