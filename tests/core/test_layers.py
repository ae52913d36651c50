"""The package is layered: its import graph, with each folder taken as one node and each module at the
package root as one, has no cycle (an import that runs back up a layer closes one), nothing inside the
package imports a deprecated 0.1 path, and every 0.1 path still imports, warning, as its new module."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt._moved import MOVED
from tests.helpers import file_imports

ROOT = Path(__file__).resolve().parents[2] / "ckpt"


def _node(module: str) -> str | None:
    """The graph node of a module of ckpt: its top folder, or itself at the package root."""
    parts = module.split(".")
    if parts[0] != "ckpt":
        return None
    return parts[1] if len(parts) > 1 else "__init__"  # the package itself: what `import ckpt` runs


def _graph() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("").parts
        mod = ".".join(rel[:-1] if path.name == "__init__.py" else rel)  # a package's face is its folder's
        for line, name in file_imports(path):
            a, b = _node(mod), _node(name)
            if a and b and a != b:
                edges[(a, b)].append(f"{mod}:{line} -> {name}")
    return edges


def _cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    succ: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(list(succ)):
        if v not in index:
            visit(v)
    return out


def test_no_import_runs_back_up_a_layer() -> None:
    edges = _graph()
    cycles = _cycles(edges)
    detail = []
    for comp in cycles:
        inside = set(comp)
        detail += [f"  {a} -> {b}: {', '.join(why[:3])}" for (a, b), why in sorted(edges.items())
                   if a in inside and b in inside]
    assert not cycles, "import cycles between layers (move the code, or invert the dependency):\n" + "\n".join(detail)


def test_the_cycle_finder_finds_cycles() -> None:
    """The check above can fail: a planted back edge is reported."""
    edges = {("a", "b"): ["x"], ("b", "c"): ["y"], ("c", "a"): ["z"], ("c", "d"): ["w"]}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({("a", "b"): ["x"]}) == []


def test_the_package_uses_no_deprecated_path() -> None:
    bad = [f"{p.relative_to(ROOT.parent)}:{line} imports {name} (now {', '.join(MOVED[name])})"
           for p in sorted(ROOT.rglob("*.py")) if p.name != "_moved.py"
           for line, name in file_imports(p) if name in MOVED]
    assert not bad, "\n".join(bad)


@settings(max_examples=len(MOVED), deadline=None)
@given(st.sampled_from(sorted(MOVED)))
def test_every_old_path_imports_as_its_new_module_with_a_warning(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old][0].replace(".", r"\.")):
        mod = importlib.import_module(old)
    parts = [importlib.import_module(n) for n in MOVED[old]]
    if len(parts) == 1:
        assert mod is parts[0]
    else:  # a split module: each public name of each part, through the old path, is the same object
        for part in parts:
            for name in getattr(part, "__all__", ()):
                assert getattr(mod, name) is getattr(part, name)
        with pytest.raises(AttributeError):
            mod.no_such_name  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(old) is mod  # imported once: no second warning


def test_the_top_level_package_reaches_every_tool() -> None:
    import ckpt

    for name in ckpt.__all__:
        assert callable(getattr(ckpt, name)) or isinstance(getattr(ckpt, name), type), name
    from ckpt.convert import export_dcp, import_checkpoint
    from ckpt.hf.convert import export_hf, import_hf
    from ckpt.resharders.diff import diff
    from ckpt.resharders.reshard import reshard

    assert (ckpt.reshard, ckpt.diff, ckpt.import_checkpoint, ckpt.export_dcp, ckpt.export_hf, ckpt.import_hf) == (
        reshard, diff, import_checkpoint, export_dcp, export_hf, import_hf)
    with pytest.raises(AttributeError, match="no_such"):
        ckpt.no_such  # noqa: B018


def _manifest_commits(tree: ast.AST) -> list[int]:
    """Lines of ``<x>.commit(MANIFEST_NAME, ...)`` / ``.commit("manifest.msgpack", ...)`` calls."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "commit"
                and node.args):
            continue
        first = node.args[0]
        if (isinstance(first, ast.Name) and first.id == "MANIFEST_NAME") or (
                isinstance(first, ast.Constant) and first.value == "manifest.msgpack"):
            out.append(node.lineno)
    return out


def test_every_manifest_commit_goes_through_the_transaction() -> None:
    """One commit (checked decode, data names durable, exclusive unless replacing, clean-up of what the
    writer created): ``_transaction.commit_manifest``. The memory tier's peer copies and reshard views too."""
    bad = [f"{p.relative_to(ROOT.parent)}:{line}" for p in sorted(ROOT.rglob("*.py")) if p.name != "_transaction.py"
           for line in _manifest_commits(ast.parse(p.read_text()))]
    assert not bad, "commit manifests with ckpt._transaction.commit_manifest:\n" + "\n".join(bad)
    assert _manifest_commits(ast.parse("s.commit(MANIFEST_NAME, b'')\nt.commit('manifest.msgpack', d)")) == [1, 2]


def _public_modules() -> list[str]:
    out = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        if any(part.startswith("_") and part != "__init__" for part in rel.parts):
            continue
        out.append(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    return out


def test_every_public_module_declares_its_names() -> None:
    """A module without a leading underscore is public: it says what it offers in ``__all__``, and
    every name there exists (a private module, ``ckpt._x``, needs none)."""
    missing, dangling = [], []
    for name in _public_modules():
        path = ROOT.parent.joinpath(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        tree = ast.parse(path.read_text())
        declared = [n for n in tree.body if (isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)) or (
            isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == "__all__")]
        defines = any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in tree.body)
        if not declared:
            if defines:
                missing.append(name)
            continue
        mod = importlib.import_module(name)
        dangling += [f"{name}.{n}" for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, "public modules without __all__ (add one, or mark the module private with _):\n" + \
        "\n".join(missing)
    assert not dangling, "names in __all__ that do not exist:\n" + "\n".join(dangling)
