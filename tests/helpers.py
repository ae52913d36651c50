"""Helpers shared by test modules: seeded random states, load targets and bitwise comparison,
injected write failures.

Import as ``from tests.helpers import ...`` (like ``tests.dist_utils``)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import ckpt

Spec = tuple[int, ...] | tuple[tuple[int, ...], torch.dtype]
SOURCE_ROOT = Path(__file__).resolve().parents[1]  # the folder holding the ckpt package


def imports_in(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree`` (a module of ``package``), function-local ones
    included: relative imports resolved against ``package``; ``from a import b`` gives ``a.b`` when
    that is a module of this tree, else ``a``; ``importlib.import_module("x")`` / ``__import__("x")``
    with a literal name give ``x``. The one import scan of the layering and boundary tests."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if _is_module(sub) else base))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")):
            out.append((node.lineno, node.args[0].value))
    return out


def file_imports(path: Path) -> list[tuple[int, str]]:
    """:func:`imports_in` of a source file of this tree (its package taken from its path)."""
    rel = path.resolve().relative_to(SOURCE_ROOT).with_suffix("")
    return imports_in(ast.parse(path.read_text(), str(path)), ".".join(rel.parts[:-1]))


def _is_module(name: str) -> bool:
    p = SOURCE_ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


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


def fail_local_writes(mp: Any, over: int = -1) -> None:
    """Make ckpt's local file writes raise an injected StorageError ("injected I/O error") once the
    file being written holds more than ``over`` bytes (-1: every write). ``mp``: a pytest
    ``MonkeyPatch`` (or its ``context()``), which puts the real write back."""
    from ckpt.storage import local

    real = local.LocalWriter.write

    def write(w: Any, data: Any) -> None:
        if w.size > over:
            raise ckpt.StorageError(f"{w.full}: injected I/O error")
        real(w, data)

    mp.setattr(local.LocalWriter, "write", write)
