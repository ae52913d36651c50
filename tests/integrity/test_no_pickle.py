"""No pickle anywhere: not in the format, not in objects, not in any loader.

1. A static scan of the package source (AST, so comments and docstrings do not count): no import of a
   pickle-family module, no ``torch.load`` without ``weights_only=True``, no ``torch.save`` (its format
   is a pickle), no ``numpy.load(allow_pickle=True)``, no torch.distributed object collectives (they
   pickle), no ``pickle``-style hooks, no ``eval``/``exec``, no unsafe YAML.
2. At run time: save, async save, the manager, load, verify and inspect all work with pickle, torch.load
   and torch.save replaced by functions that raise.
3. The bytes on disk: a manifest that is msgpack and data files that are safetensors, nothing else.
"""

from __future__ import annotations

import ast
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

import ckpt
from ckpt.manifest import MANIFEST_NAME

PACKAGE = Path(ckpt.__file__).parent
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "pickletools", "dill", "cloudpickle", "joblib", "shelve",
                  "marshal", "jsonpickle", "copyreg", "copy_reg"}
OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"}
PICKLE_HOOKS = {"__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "find_class"}
PICKLE_CALLS = {"read_pickle", "to_pickle"}


def _sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10, f"scan found only {len(files)} files under {PACKAGE}"
    return files


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _kw(call: ast.Call, name: str) -> Any:
    for k in call.keywords:
        if k.arg == name:
            return k.value.value if isinstance(k.value, ast.Constant) else "<expr>"
    return None


def violations(path: Path) -> list[str]:
    """Pickle and unsafe-parsing uses in one source file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[str] = []

    def at(node: ast.AST, what: str) -> None:
        rel = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path
        out.append(f"{rel}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PICKLE_MODULES:
                    at(node, f"imports {a.name}")
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            if mod in PICKLE_MODULES:
                at(node, f"imports from {node.module}")
            for a in node.names:
                if a.name in OBJECT_COLLECTIVES:
                    at(node, f"imports {a.name} (pickles its arguments)")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in PICKLE_HOOKS:
            at(node, f"defines {node.name} (a pickle hook)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.rsplit(".", 1)[-1]
            if name in ("torch.load",) and _kw(node, "weights_only") is not True:
                at(node, "torch.load without weights_only=True")
            if name == "torch.save":
                at(node, "torch.save (a pickle-based format)")
            if last == "load" and name.split(".")[0] in ("np", "numpy") and _kw(node, "allow_pickle") not in (
                    None, False):
                at(node, "numpy.load(allow_pickle=...)")
            if last in OBJECT_COLLECTIVES:
                at(node, f"{name} (torch.distributed object collectives pickle)")
            if last in PICKLE_CALLS:
                at(node, name)
            if isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec", "__import__"):
                at(node, f"{node.func.id}()")
            if name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load") and _kw(node, "Loader") is None:
                at(node, f"{name} (use yaml.safe_load)")
    return out


# The two modules that deal in other tools' pickle formats (issue 15), and exactly what each may do:
# torch_pickle reads them with an allowlisting Unpickler (find_class) whose stand-in class records
# state (__setstate__); convert writes DCP's format, whose .metadata and items are pickles by
# definition. Nothing on ckpt's own format paths (test below) touches pickle.
FOREIGN_FORMATS = {
    "ckpt/formats/torch_pickle.py": {"imports pickle", "defines find_class (a pickle hook)",
                                     "defines __setstate__ (a pickle hook)"},
    "ckpt/convert.py": {"imports pickle", "torch.save (a pickle-based format)"},
}


def test_package_source_has_no_pickle():
    found = []
    for p in _sources():
        for v in violations(p):
            where, _, what = v.split(":", 2)
            if what.strip() not in FOREIGN_FORMATS.get(where, set()):
                found.append(v)
    assert not found, "pickle or unsafe parsing in the package:\n" + "\n".join(found)


def test_the_scanner_catches_what_it_looks_for(tmp_path):
    bad = tmp_path / "probe.py"
    src = ("import pickle\nfrom dill import loads\nimport torch\nimport numpy as np\n"
           "torch.load('x')\ntorch.load('x', weights_only=False)\ntorch.save({}, 'x')\n"
           "np.load('x', allow_pickle=True)\ndist.broadcast_object_list([1])\neval('1')\n"
           "class A:\n    def __reduce__(self):\n        return (A, ())\n"
           "torch.load('ok', weights_only=True)\nnp.load('ok')\nmodel.eval()\n")
    bad.write_text(src)
    found = violations(bad)
    assert len(found) == 9, "\n".join(found)


def _refuse(*_a: Any, **_k: Any) -> Any:
    raise AssertionError("pickle (or torch.load/torch.save) was used")


class _RefusingPickler:
    def __init__(self, *_a: Any, **_k: Any) -> None:
        _refuse()


def test_save_load_verify_never_call_pickle(tmp_path, monkeypatch: pytest.MonkeyPatch):
    for name in ("dump", "dumps", "load", "loads"):
        monkeypatch.setattr(pickle, name, _refuse)
    monkeypatch.setattr(pickle, "Pickler", _RefusingPickler)
    monkeypatch.setattr(pickle, "Unpickler", _RefusingPickler)
    monkeypatch.setattr(torch, "load", _refuse)
    monkeypatch.setattr(torch, "save", _refuse)
    state = {"w": torch.randn(4, 4), "flat": ckpt.FlatShard(torch.arange(6.0), (2, 3), 0),
             "step": 3, "cfg": {"betas": (0.9, 0.99), "name": "x"}, "scale": np.float32(2.0),
             "rng": ckpt.PerRank([1, 2])}
    url = str(tmp_path / "sync")
    ckpt.save(state, url, step=3, user_metadata={"model": "tiny"})
    h = ckpt.async_save(state, str(tmp_path / "async"), step=3)
    h.done()
    mgr = ckpt.CheckpointManager(str(tmp_path / "run"), keep_last=1)
    mgr.save(1, state).done()
    mgr.save(2, state).done()
    for u in (url, str(tmp_path / "async"), mgr.latest()):
        assert ckpt.verify(u, deep=True).ok
        ckpt.inspect(u)
        dst = {"w": torch.zeros(4, 4), "flat": torch.zeros(2, 3), "step": None, "cfg": None, "scale": None,
               "rng": None}
        out = ckpt.load(dst, u, verify=True)
        assert torch.equal(out["w"], state["w"]) and out["cfg"] == {"betas": (0.9, 0.99), "name": "x"}
        assert out["scale"] == np.float32(2.0) and out["rng"] == [1, 2]
    restored = {"w": torch.zeros(4, 4), "flat": torch.zeros(2, 3), "step": None, "cfg": None, "scale": None,
                "rng": None}
    assert mgr.restore(restored) == 2


def test_files_on_disk_are_msgpack_and_safetensors_only(tmp_path):
    url = str(tmp_path / "c")
    m = ckpt.save({"w": torch.randn(3), "o": {"k": (1, 2)}, "r": ckpt.PerRank("x")}, url)
    for dirpath, _dirs, files in os.walk(url):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), url)
            raw = Path(dirpath, f).read_bytes()
            assert not raw.startswith((b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")), rel
            assert b"c__builtin__" not in raw and b"ctorch" not in raw, rel
            if rel == MANIFEST_NAME:
                assert isinstance(msgpack.unpackb(raw, raw=False, strict_map_key=False), dict)
            else:
                assert rel in m.files
                (n,) = struct.unpack("<Q", raw[:8])
                assert raw[8:9] == b"{"
                from safetensors import safe_open

                with safe_open(os.path.join(url, rel), framework="pt") as sf:
                    assert len(list(sf.keys())) == 1
                assert n % 8 == 0
