"""Deprecated: the embedded MoE's Hugging Face functions moved to :mod:`ckpt.trainer.hf_adapters`
(its adapter, state dicts, parameter list) and :mod:`ckpt.trainer.model_config` (its ``config.json``).

Kept so that ``from ckpt.hf.embedded import to_hf_state_dict`` keeps working: a name is taken, with
a DeprecationWarning, from the module of the adapter registered under ``embedded-moe`` (through
:mod:`ckpt.hf.registry`, so the library never names the trainer).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from ckpt.hf.registry import adapter_named
from ckpt.resharders.rules import MOE_RULES


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    adapter = adapter_named(MOE_RULES.name)
    if adapter is None:
        raise AttributeError(f"ckpt.hf.embedded.{name}: no adapter is registered for {MOE_RULES.name!r}")
    module = importlib.import_module(type(adapter).__module__)
    if not hasattr(module, name):
        raise AttributeError(f"module 'ckpt.hf.embedded' has no attribute {name!r}")
    warnings.warn(f"ckpt.hf.embedded.{name} is deprecated: import it from {module.__name__}",
                  DeprecationWarning, stacklevel=2)
    return getattr(module, name)


__all__: list[str] = []  # a deprecated shim: every name comes from the registered adapter's module
