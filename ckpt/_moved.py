"""Old module paths of the 0.1 layout, still importable with a DeprecationWarning.

The package was reorganised (own codecs in :mod:`ckpt.formats`, other tools' checkpoints in
:mod:`ckpt.interop`, all Hugging Face code in :mod:`ckpt.hf`, the streaming copy engine and the other
internals in underscore modules). Code written against the old paths keeps working: importing one
returns the module at its new path (the same object) and warns once with the path to use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

#: old module -> new module(s); a module that was split maps to every part (its names are looked up in order)
MOVED: dict[str, tuple[str, ...]] = {
    "ckpt.formats.sources": ("ckpt.interop.sources",),
    "ckpt.formats.dcp_source": ("ckpt.interop.dcp_source",),
    "ckpt.formats.deepspeed": ("ckpt.interop.deepspeed",),
    "ckpt.formats.convert": ("ckpt.convert",),
    "ckpt.formats.hf": ("ckpt.hf.convert",),
    "ckpt.formats.hf_check": ("ckpt.hf.check",),
    "ckpt.formats.hf_files": ("ckpt.hf.files",),
    "ckpt.formats.zarr_layout": ("ckpt._zarr_layout",),
    "ckpt.resharders.stream": ("ckpt._stream",),
    "ckpt.resharders.chunks": ("ckpt._chunks",),
    "ckpt.resharders.layout": ("ckpt.layout",),
    "ckpt.planner": ("ckpt._save_plan", "ckpt._load_plan"),
    **{f"ckpt.{name}": (f"ckpt._{name}",) for name in (
        "aliases", "checksum", "codec", "codec_reads", "columns", "comm", "dcp_compat", "device_load", "dtensor",
        "dtypes", "io", "lease", "regions", "retention", "sharded_tensor", "source_checks", "staging", "state",
        "transaction", "transfer_plan", "transfer_exec")},
}


class _Joined(types.ModuleType):
    """A split module's old name: each attribute is looked up in its parts, in order."""

    def __init__(self, name: str, parts: list[types.ModuleType]) -> None:
        super().__init__(name)
        self._parts = parts

    def __getattr__(self, attr: str) -> Any:
        for part in self._parts:
            if hasattr(part, attr):
                return getattr(part, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path to its new module (see :data:`MOVED`)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} has moved to {' and '.join(new)}: import it from there "
                      "(the old path is deprecated and will be removed)", DeprecationWarning, stacklevel=2)
        parts = [importlib.import_module(n) for n in new]
        return parts[0] if len(parts) == 1 else _Joined(spec.name, parts)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is the new one, already imported."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import ckpt`` does this)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
