"""Which adapter serves a model: the built-in families (:data:`ckpt.hf.adapters.ADAPTERS`) and those
registered with :func:`register_adapter`, the one extension point for a model of one's own.

A package declares its adapters as Python entry points of the group ``ckpt.hf_adapters`` (an object
that is called with no arguments and calls :func:`register_adapter`)::

    [project.entry-points."ckpt.hf_adapters"]
    my-model = "my_package.hf:register"

so that any process (``ckpt export-hf`` of a checkpoint the model's trainer wrote) finds them without
ckpt importing that package by name. The entry points are loaded once, the first time the registry
is consulted (not at ``import ckpt``), before anything is looked up: which adapter serves a config
then never depends on what was looked up before in the process.

Lookups:

- :func:`adapter_for` a ``model_type`` (a ``config.json`` given explicitly);
- :func:`importer_for` a ``config.json`` being imported: an adapter registered to import that model
  type (:attr:`~ckpt.hf.adapters.Adapter.imports`) when it accepts the config, else the family's;
- :func:`adapter_of_checkpoint` the ``user_metadata`` of a checkpoint: the adapter it names
  (``hf_adapter``), else the one registered under its rules' name (the library's default table,
  ``embedded-moe``, when it names none).
"""

from __future__ import annotations

import threading
import warnings
from importlib import metadata
from typing import Any

from ckpt.errors import ManifestError
from ckpt.hf.adapters import ADAPTER_KEY, ADAPTERS, Adapter, Config
from ckpt.hf.fp8 import QUANT_KEY, with_quant
from ckpt.hf.generic import GENERIC, Generic, knows
from ckpt.resharders.rules import MOE_RULES

__all__ = ["ENTRY_POINT_GROUP", "adapter_for", "adapter_named", "adapter_of_checkpoint", "importer_for",
           "register_adapter", "registered"]

ENTRY_POINT_GROUP = "ckpt.hf_adapters"

_REGISTERED: dict[str, Adapter] = {}  # by name, in registration order
_lock = threading.RLock()
_loaded = False


def register_adapter(adapter: Adapter) -> None:
    """Make ``adapter`` (an instance of a :class:`~ckpt.hf.adapters.Adapter` subclass) known by its
    ``name``, for its ``model_types`` and the model types it :attr:`~ckpt.hf.adapters.Adapter.imports`.
    A registered adapter serves a model type before a built-in family; registering a name again
    replaces the earlier adapter.

    Raises ManifestError for something that is not an Adapter or has no name.
    """
    if not isinstance(adapter, Adapter):
        raise ManifestError(f"register_adapter: {adapter!r} is not a ckpt.hf.adapters.Adapter (subclass it)")
    if not isinstance(adapter.name, str) or adapter.name in ("", "?"):
        raise ManifestError(f"register_adapter: {type(adapter).__name__} has no name; set the class attribute "
                            "`name` (recorded in the checkpoints it imports)")
    with _lock:
        _REGISTERED.pop(adapter.name, None)
        _REGISTERED[adapter.name] = adapter


def _load_entry_points() -> None:
    """Call every ``ckpt.hf_adapters`` entry point once (a broken one is skipped with a warning that
    names it: the built-in families keep working)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True  # first: a plugin's own lookups while it registers do not load again
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()()
            except Exception as e:  # noqa: BLE001 - a third party's plugin must not break the built-ins
                warnings.warn(f"ckpt: Hugging Face adapter entry point {ep.name!r} ({ep.value}) failed to load "
                              f"and is skipped: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)


def registered() -> dict[str, Adapter]:
    """Every adapter by name: the registered ones (entry points loaded), then the built-in families."""
    _load_entry_points()
    with _lock:
        out = {**_REGISTERED, **{n: a for n, a in ADAPTERS.items() if n not in _REGISTERED}}
    out.setdefault(GENERIC.name, GENERIC)  # the fallback: every causal LM transformers builds (ckpt.hf.generic)
    return out


def adapter_named(name: str) -> Adapter | None:
    """The adapter called ``name`` (registered first, then built in), or None."""
    return registered().get(name)


def _known() -> str:
    return ", ".join(sorted(n for n in registered() if n != GENERIC.name)) + \
        " and, through transformers, every causal LM it builds (multimodal ones around a language model too)"


def adapter_for(model_type: Any, *, where: str) -> Adapter:
    """The adapter for a ``model_type`` (the latest registered that lists it, else the built-in
    family); ManifestError listing the supported ones otherwise."""
    if isinstance(model_type, str):
        _load_entry_points()
        with _lock:
            for a in reversed(_REGISTERED.values()):
                if model_type in a.model_types:
                    return a
        if model_type in ADAPTERS:
            return ADAPTERS[model_type]
        if knows(model_type):  # explicit adapters win; then the one derived from transformers' own model
            return GENERIC
    raise ManifestError(f"{where}: model_type {model_type!r} is not supported; ckpt converts {_known()}; "
                        "nothing was written")


def importer_for(d: Config, names: str, *, where: str) -> tuple[Adapter, Any]:
    """The adapter that imports the ``config.json`` body ``d`` under naming ``names``, and the config
    it imports it as. The family's adapter checks every field it reads first (ConfigError naming
    it); then a registered adapter that :attr:`~ckpt.hf.adapters.Adapter.imports` the model type
    takes the config when it :meth:`~ckpt.hf.adapters.Adapter.accept` s it (latest registered first).

    Raises ManifestError (an unknown model type, an option the family cannot represent), ConfigError.
    """
    model_type = d.get("model_type")
    family = adapter_for(model_type, where=where)
    # an fp8 block-scaled model: the family checks the model's fields, the fp8 spec is kept (ckpt.hf.fp8); a
    # registered importer (the embedded MoE's bf16/fp32 parameters) does not take it
    full = with_quant(lambda c: family.complete(c, where=where), d, where=where)
    quantized = isinstance(full, dict) and bool(full.get(QUANT_KEY))
    with _lock:
        takers = [] if quantized else [a for a in reversed(_REGISTERED.values()) if model_type in a.imports]
    for a in takers:
        cfg = a.accept(d, names, where=where)
        if cfg is not None:
            return a, cfg
    if isinstance(family, Generic):  # the rules this config's plans derive, for the import's reshard
        return family.for_config(full), full
    return family, full


def adapter_of_checkpoint(meta: dict[str, Any], *, url: str) -> Adapter:
    """The adapter of a checkpoint from its ``user_metadata``: the one it names (``hf_adapter``), else
    the one registered under its rules' name (``rules``; the embedded MoE's, ``embedded-moe``, when it
    records none).

    Raises ManifestError naming what the checkpoint records and the adapters there are.
    """
    name = meta.get(ADAPTER_KEY)
    if name is not None:
        a = adapter_named(name) if isinstance(name, str) else None
        if a is None:
            raise ManifestError(f"{url}: user_metadata names adapter {name!r}, which is not registered "
                                f"(known: {_known()}); install the package that provides it")
        return a
    rules = meta.get("rules")
    if rules is None:
        rules = MOE_RULES.name
    a = adapter_named(rules) if isinstance(rules, str) else None
    if a is None:
        raise ManifestError(f"{url}: saved for the architecture/rules {rules!r} and names no Hugging Face adapter "
                            f"(user_metadata[{ADAPTER_KEY!r}]); Hugging Face export knows {_known()}: pass the "
                            "model's config.json with --config")
    return a
