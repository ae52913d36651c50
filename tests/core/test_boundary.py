"""The library never imports its example trainer: every module under ``ckpt/`` outside ``ckpt/trainer/``
(except the CLI's ``train`` / ``demo`` commands, which launch it) is parsed and each of its imports,
function-local ones and ``importlib.import_module("...")`` with a literal name included, must not name
``ckpt.trainer``. The trainer's models reach the library through its public extension points
(``ckpt.hf.register_adapter``, the ``ckpt.hf_adapters`` entry point) instead."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

from tests.helpers import imports_in

ROOT = Path(__file__).resolve().parents[2] / "ckpt"
ALLOWED = {"cli/train.py"}  # `ckpt train` / `ckpt demo`: the trainer's own commands


def _trainer_imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree`` that names ckpt.trainer (absolute or relative)."""
    return [(line, n) for line, n in imports_in(tree, package) if n == "ckpt.trainer" or n.startswith("ckpt.trainer.")]


def _library_modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if p.relative_to(ROOT).parts[0] != "trainer" and p.relative_to(ROOT).as_posix() not in ALLOWED)


@pytest.mark.slow
def test_the_library_does_not_import_the_trainer() -> None:
    bad = []
    for path in _library_modules():
        rel = path.relative_to(ROOT)
        package = ".".join(("ckpt", *rel.parts[:-1]))
        for line, name in _trainer_imports(ast.parse(path.read_text(), str(path)), package):
            bad.append(f"ckpt/{rel.as_posix()}:{line} imports {name}")
    assert not bad, "the library must reach the trainer only through registration:\n" + "\n".join(bad)


@pytest.mark.parametrize("src", [
    "import ckpt.trainer.model", "from ckpt.trainer import model", "from ckpt.trainer.model import X",
    "def f():\n    from ckpt.trainer.checkpoint import load_full_model", "import ckpt.trainer",
    "importlib.import_module('ckpt.trainer.hf_adapters')", "from ..trainer import model",
])
def test_the_scan_sees_every_spelling(src: str) -> None:
    assert _trainer_imports(ast.parse(src), "ckpt.hf"), src


@pytest.mark.slow
@pytest.mark.multiproc
def test_importing_the_library_loads_no_trainer_module() -> None:
    import subprocess
    import sys

    code = ("import sys, ckpt, ckpt.hf, ckpt.hf.convert, ckpt.resharders.plan; "
            "print(sorted(m for m in sys.modules if m.startswith('ckpt.trainer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_trainer_adapter_is_declared_as_an_entry_point() -> None:
    eps = importlib.metadata.entry_points(group="ckpt.hf_adapters")
    assert "ckpt.trainer.hf_adapters:register" in {ep.value for ep in eps}
