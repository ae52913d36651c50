"""Helpers shared by test modules: seeded random states, load targets and bitwise comparison.

Import as ``from tests.helpers import ...`` (like ``tests.dist_utils``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import ckpt

Spec = tuple[int, ...] | tuple[tuple[int, ...], torch.dtype]


def random_state(seed: int, tensors: Mapping[str, Spec], /, **objects: Any) -> dict[str, Any]:
    """``{name: randn(shape)}`` from one generator seeded ``seed``, drawn in ``tensors``' order (a
    ``(shape, dtype)`` spec is drawn in fp32 and cast), then ``objects`` as given (any names, ``seed`` too).

    The one seeded-state helper of the suite: a test's ``_state(seed)`` is a one-line spec over it."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name, spec in tensors.items():
        if spec and isinstance(spec[0], tuple):
            shape, dtype = spec  # type: ignore[misc]
            out[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[name] = torch.randn(spec, generator=g)  # type: ignore[arg-type]
    out.update(objects)
    return out


def zeros_like_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A load target shaped like ``state``: tensors zeroed, nested dicts recursed, other values ``None``."""
    return {k: zeros_like_state(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor)
            else None for k, v in state.items()}


def assert_same_state(a: Any, b: Any) -> None:
    """``a`` and ``b`` are the same: same keys, tensors of one dtype and equal bits, other values equal."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (sorted(a), sorted(b) if isinstance(b, dict) else b)
        for k in a:
            assert_same_state(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert type(a) is type(b) and a == b, (a, b)


def load_like(url: str, state: Mapping[str, Any], **kw: Any) -> dict[str, Any]:
    """``ckpt.load`` of ``url`` into a fresh :func:`zeros_like_state` of ``state``."""
    return ckpt.load(zeros_like_state(state), url, **kw)
