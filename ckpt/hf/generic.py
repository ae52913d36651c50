"""The generic adapter: every causal-LM architecture transformers can build, without a hand-written family,
and the multimodal models built around one (``text_config``: llava, qwen2_5_vl, mistral3, gemma3, ...: the
language model split by its plan, the vision tower kept as stored tensors, replicated unless a plan names
them) and the ``*_text`` text models of such families.

For a ``model_type`` no explicit adapter serves (:data:`ckpt.hf.adapters.ADAPTERS`, registered ones win),
the tensors and their sharding are derived from transformers itself, once, at import (or at an export
given a ``config.json``):

- names and shapes: the model is built on the meta device (``AutoModelForCausalLM.from_config``) and
  its state dict put through what ``save_pretrained`` does to it (ignored keys and tied weights
  dropped, transformers' weight conversions reverted), so the names are exactly the files' names;
- per-expert file tensors (``<prefix>.experts.<e>.<rest>``, complete and equally shaped) are stored
  stacked as ``<prefix>.experts.<rest>`` of shape ``(E, ...)``, so that expert parallelism is a split
  of dim 0; fused tensors a plan packs (``packed_colwise``: gate and up halves) are stored as their
  parts (``<name>.part<k>``), each split on its own as transformers' strided shard does;
- the sharding rules: each tensor's style in the model's ``tp_plan`` / ``ep_plan`` (transformers'
  lookup: layer numbers as ``*``, the parameter's own entry, else its module's) becomes a
  :class:`~ckpt.resharders.rules.Placement` (:data:`TP_STYLES`, :data:`EP_STYLES`); a style not
  listed there refuses the family by name; a tensor no plan names is replicated.

What export needs is recorded with the config (``hf_config[LAYOUT_KEY]``: the file tensors, the packed
ones, the rules table), so that an export, a reshard and a ``--check`` of the checkpoint need no
transformers and give the same answer whatever transformers version is installed later.
"""

from __future__ import annotations

import re
from typing import Any

from ckpt.errors import ConfigError, ManifestError
from ckpt.formats.foreign_json import MAX_EXPERTS, MAX_LAYERS
from ckpt.hf.adapters import Adapter, Config
from ckpt.hf.mapping import Map, Run, Target, whole
from ckpt.resharders.rules import Placement, Rule, RuleSet, register_rules

__all__ = ["EP_STYLES", "GENERIC", "LAYOUT_KEY", "TP_STYLES", "Generic", "knows", "placement_of_style"]

LAYOUT_KEY = "ckpt_generic_layout"  # hf_config[LAYOUT_KEY]: what the import derived (never written to config.json)
NAME = "hf-generic"
MAX_TENSORS = 1 << 22  # recorded file tensors a checkpoint may declare (a real model: ~10**5)

# transformers' TP styles (transformers.distributed.tensor_parallel / ALL_PARALLEL_STYLES) -> how the
# style splits one parameter: ("col", "row", "emb_row", "emb_col", "packed_col", "packed_row") or None
# for a style that leaves the parameters whole (it acts on the module's inputs / outputs / gradients).
TP_STYLES: dict[str, str | None] = {
    "colwise": "col", "colwise_gather_output": "col", "colwise_rep": "col",
    "rowwise": "row", "rowwise_split_input": "row", "rowwise_rep": "row",
    "embedding_rowwise": "emb_row", "embedding_colwise": "emb_col",
    "packed_colwise": "packed_col", "packed_rowwise": "packed_row",
    "replicate": None, "replicated_with_grad_allreduce": None, "all_reduce": None, "sequence_parallel": None,
    "mla_kv_a_proj": None, "moe_tp_experts": None, "moe_identity_expert": None, "local_params": None,
}
# EP styles (transformers.distributed.expert_parallel): grouped_gemm shards the expert dim (0).
EP_STYLES: dict[str, bool] = {"grouped_gemm": True, "ep_dispatch_experts": False, "colwise": False,
                              "rowwise": False}
PACK = 2  # parts of a packed tensor (transformers' split_factor: gate and up)


def placement_of_style(style: str | None, ndim: int, *, what: str) -> tuple[int | None, tuple[int, int] | None]:
    """(TP dim, packing (dim, parts) or None) of a tensor of ``ndim`` dims under TP style ``style``:
    colwise splits a weight's output dim (``ndim - 2``; a bias its only dim), rowwise its input dim
    (``ndim - 1``; a bias stays whole, it is added after the reduce), embedding_rowwise the vocab (0),
    packed_colwise / packed_rowwise each part of the output / input dim.

    Raises ManifestError naming ``what`` and a style transformers uses that ckpt cannot place.
    """
    if style is None:
        return None, None
    if style not in TP_STYLES:
        raise ManifestError(f"{what}: transformers' tensor-parallel style {style!r} has no ckpt placement "
                            f"(known: {', '.join(sorted(TP_STYLES))}); write an adapter (ckpt.hf.register_adapter)")
    kind = TP_STYLES[style]
    if kind is None or ndim == 0:
        return None, None
    if kind == "col":
        return (ndim - 2 if ndim >= 2 else 0), None
    if kind == "row":
        return (ndim - 1 if ndim >= 2 else None), None
    if kind == "emb_row":
        return 0, None
    if kind == "emb_col":
        return ndim - 1, None
    if kind == "packed_col":  # transformers: a 1-D packed bias is a plain Shard(-1)
        return (ndim - 2, (ndim - 2, PACK)) if ndim >= 2 else (0, None)
    return (ndim - 1, (ndim - 1, PACK)) if ndim >= 2 else (None, None)  # packed_row


def _plan_style(name: str, plan: dict[str, str]) -> str | None:
    """transformers' lookup (``_get_parameter_plan``): layer numbers as ``*``, the parameter's entry,
    else its module's."""
    generic = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)
    if generic in plan:
        return plan[generic]
    module = generic.rsplit(".", 1)[0] if "." in generic else None
    return plan.get(module) if module is not None else None


_EXPERT = re.compile(r"(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<rest>.+)")


def knows(model_type: Any) -> bool:
    """True when the installed transformers builds ``model_type``'s model: a causal LM, a multimodal model
    around a language model (``text_config``: llava, qwen2_5_vl, mistral3, ...), or the text model of one
    (a ``*_text`` type). False without transformers."""
    if not isinstance(model_type, str):
        return False
    try:
        from transformers import CONFIG_MAPPING

        return model_type in CONFIG_MAPPING and _model_class(CONFIG_MAPPING[model_type], model_type, None) is not None
    except Exception:  # noqa: BLE001 - no (usable) transformers: no generic path
        return False


def _causal_class(model_type: str) -> Any:
    """The causal-LM class whose own config class is ``model_type``'s (a ``*_text_model`` type that the
    auto mapping lists under its multimodal parent, e.g. emu3's, mllama's), or None."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    want = CONFIG_MAPPING[model_type]
    for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is not None and getattr(cls, "config_class", None) is want:
            return cls
    return None


def _model_class(config_class: Any, model_type: str, architectures: Any) -> Any:
    """The transformers class whose ``save_pretrained`` wrote a model of ``config_class``, or None: the
    class ``architectures`` names (when it is a causal LM, a multimodal or a base model of this config),
    else the causal LM, else the image-text-to-text model (the language model under
    ``model.language_model``, the vision tower beside it), else, for a ``*_text`` type, its text model."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    tables = (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
              auto.MODEL_MAPPING_NAMES)
    named = architectures[0] if isinstance(architectures, list) and architectures else None
    if isinstance(named, str) and any(named == v or (isinstance(v, tuple) and named in v)
                                      for t in tables for v in t.values()):
        cls = getattr(transformers, named, None)
        if cls is not None and getattr(cls, "config_class", None) is config_class:
            return cls
    causal = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if isinstance(causal, tuple):
        causal = causal[0] if causal else None
    if isinstance(causal, str):
        return getattr(transformers, causal, None)
    own = _causal_class(model_type)
    if own is not None:
        return own
    multimodal = auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    if isinstance(multimodal, str):
        return getattr(transformers, multimodal, None)
    base = auto.MODEL_MAPPING_NAMES.get(model_type)
    if model_type.endswith("_text") and isinstance(base, str):
        return getattr(transformers, base, None)
    return None


def _count(cfg: Any, *names: str) -> int:
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return 0


def derive(d: Config, *, where: str) -> dict[str, Any]:
    """Build ``d``'s model on the meta device with transformers and return its recorded layout:
    ``tensors`` (file name, shape) in save order, ``packed`` (name -> [dim, parts]) and ``rules``
    (:meth:`RuleSet.to_dict`).

    Raises ManifestError (transformers missing or unable to build the model; a style ckpt cannot
    place), ConfigError (transformers rejects the config, or a count beyond ckpt's bounds).
    """
    model_type = d.get("model_type")
    model, layers = _build(d, where=where)
    try:
        files, model_names, origin = _file_tensors(model)
        tp_plan = dict(getattr(model, "tp_plan", None) or {})
        ep_plan = dict(getattr(model, "ep_plan", None) or {})
    except Exception as e:  # noqa: BLE001 - transformers cannot save this model's state
        raise ManifestError(f"{where}: transformers cannot build {model_type} from this config on the meta device "
                            f"({type(e).__name__}: {str(e)[:200]}); nothing was written") from None
    tensors = [[n, [int(x) for x in t.shape]] for n, t in files.items()]
    packed, rules = _derive_rules(tensors, model_names, origin, tp_plan, ep_plan, where=where)
    table = RuleSet(rules, name=f"{NAME}:{model_type}", first_stage=["model.embed_tokens.*"],
                    last_stage=["model.norm.*", "lm_head.*"])
    return {"tensors": tensors, "packed": packed, "rules": table.to_dict(), "layers": layers,
            "layers_given": "num_hidden_layers" in d}


def _build(d: Config, *, where: str) -> tuple[Any, int]:
    """``d``'s model built by transformers on the meta device, and its (text model's) layer count."""
    model_type = d.get("model_type")
    try:
        import torch
        from transformers import CONFIG_MAPPING
    except Exception as e:  # noqa: BLE001 - report what is missing
        raise ManifestError(f"{where}: model_type {model_type!r} has no built-in adapter and the generic one needs "
                            f"transformers ({type(e).__name__}: {e}); install transformers") from None
    body = {k: v for k, v in d.items() if k != LAYOUT_KEY}
    try:
        config = CONFIG_MAPPING[str(model_type)].from_dict(body)
    except Exception as e:  # noqa: BLE001 - transformers' own validation of the config
        raise ConfigError(f"{where}: transformers rejects this {model_type} config ({type(e).__name__}: "
                          f"{str(e)[:200]}); fix config.json") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = _count(text, "num_hidden_layers", "n_layer", "num_layers")
    experts = _count(text, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if layers > MAX_LAYERS or experts > MAX_EXPERTS:
        raise ConfigError(f"{where}: {layers} layers / {experts} experts is beyond what ckpt imports "
                          f"(at most {MAX_LAYERS} / {MAX_EXPERTS}); fix config.json")
    try:
        cls = _model_class(type(config), str(model_type), d.get("architectures"))
        if cls is None:
            raise ManifestError(f"{where}: the installed transformers has no model class for {model_type}; "
                                "nothing was written")
        with torch.device("meta"):
            return cls._from_config(config), layers
    except ManifestError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers cannot build this config
        raise ManifestError(f"{where}: transformers cannot build {model_type} from this config on the meta device "
                            f"({type(e).__name__}: {str(e)[:200]}); nothing was written") from None


def _file_tensors(model: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """What ``save_pretrained`` writes of ``model`` (file name -> meta tensor, in order), the model's own
    parameters, and for each file tensor a reverted conversion made, the parameter it came from."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    sd = model.state_dict()
    for k in getattr(model, "_keys_to_ignore_on_save", None) or ():
        sd.pop(k, None)
    sd = remove_tied_weights_from_state_dict(sd, model)
    model_names = dict(sd)
    files = revert_weight_conversion(model, sd)
    origin: dict[str, str] = {}
    if files.keys() != model_names.keys():
        for name, t in model_names.items():
            for f in revert_weight_conversion(model, {name: t}):
                origin.setdefault(f, name)
    return files, model_names, origin


def _derive_rules(tensors: list[list[Any]], model_names: dict[str, Any], origin: dict[str, str],
                  tp_plan: dict[str, str], ep_plan: dict[str, str], *,
                  where: str) -> tuple[dict[str, list[int]], list[Rule]]:
    """The packed file tensors (name -> [dim, parts]) and a rule per canonical pattern, from the plans."""
    packed: dict[str, list[int]] = {}
    rules: list[Rule] = []
    seen: set[str] = set()
    for name, shape in tensors:
        src = origin.get(name, name)
        src_ndim = len(model_names[src].shape) if src in model_names else len(shape)
        tp_dim, pack = placement_of_style(_plan_style(src, tp_plan), src_ndim, what=f"{where}: {src}")
        ep_style = _plan_style(src, ep_plan)
        if ep_style is not None and ep_style not in EP_STYLES:
            raise ManifestError(f"{where}: {src}: transformers' expert-parallel style {ep_style!r} has no ckpt "
                                f"placement (known: {', '.join(sorted(EP_STYLES))})")
        ep = bool(ep_style and EP_STYLES[ep_style])
        m = _EXPERT.fullmatch(name)
        stacked = m is not None and src != name
        if src != name:
            # a piece of a converted parameter: one part of a packed one (split on its own, as the strided
            # shard splits each part) or one expert of a stacked one (stacked again below: the same dims)
            pack = None
            if tp_dim is not None and tp_dim >= len(shape) + (1 if stacked else 0):
                tp_dim = None
        if pack is not None and shape[pack[0]] % pack[1] == 0:
            packed[name] = list(pack)
        elif pack is not None:
            tp_dim = None  # an odd packed width: kept whole (transformers could not split it either)
        canon = f"{m['prefix']}.{m['rest']}" if stacked and m is not None else name
        ep_dim = 0 if ep and (stacked or src == name) else None  # grouped_gemm: the expert dim (0)
        pattern = re.sub(r"\.\d+(\.|$)", lambda mm: ".*" + mm.group(1), canon)
        targets = [f"{pattern}.part{k}" for k in range(pack[1])] if name in packed and pack else [pattern]
        for p in targets:  # patterns over the canonical names (checkpoint key = "model." + name)
            if p in seen or (tp_dim is None and ep_dim is None):
                continue
            seen.add(p)
            rules.append(Rule(p, Placement(tp_dim=tp_dim, ep_dim=ep_dim, pad=tp_dim is not None)))
    return packed, rules


def _legacy_names(cfg: Config, unknown: set[str], missing: set[str]) -> dict[str, str]:
    """For names save_pretrained writes (``missing`` from the files): the file name in ``unknown`` that
    transformers' renamings of this model (``get_model_conversion_mapping``) load as the same parameter.
    Empty when transformers cannot tell (the import then names the tensors that do not match)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        model, _ = _build(cfg, where="")
        renamings = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]
        # both spellings meet where transformers loads them (the model's own names): the files may hold
        # an older spelling than save_pretrained's, or a newer one (save_pretrained writes llava's old one)
        loaded_as = {rename_source_key(n, renamings, [])[0]: n for n in sorted(missing)}
        out: dict[str, str] = {}
        for k in sorted(unknown):
            name = loaded_as.get(rename_source_key(k, renamings, [])[0])
            if name is not None and name not in out:
                out[name] = k
        return out
    except Exception:  # noqa: BLE001 - no usable renamings: the names stay as derived
        return {}


def _check_layout(lay: Any, *, where: str) -> dict[str, Any]:
    """A recorded layout, every field type- and range-checked (it comes from a file)."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where}: recorded field {LAYOUT_KEY}.{what} is malformed; re-import the model")

    if not isinstance(lay, dict):
        raise bad("(root)")
    tensors = lay.get("tensors")
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise bad("tensors")
    for t in tensors:
        if not (isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) and isinstance(t[1], list)
                and len(t[1]) <= 8 and all(type(x) is int and 0 <= x < 1 << 40 for x in t[1])):
            raise bad("tensors")
    packed = lay.get("packed")
    if not isinstance(packed, dict) or not all(
            isinstance(v, list) and len(v) == 2 and all(type(x) is int and x >= 0 for x in v) and v[1] >= 1
            for v in packed.values()):
        raise bad("packed")
    shapes = {n: s for n, s in tensors}
    for n, (dim, parts) in packed.items():
        if n not in shapes or dim >= len(shapes[n]) or shapes[n][dim] % parts:
            raise bad(f"packed[{n!r}]")
    if not isinstance(lay.get("rules"), dict):
        raise bad("rules")
    if type(lay.get("layers")) is not int or not 0 <= lay["layers"] <= MAX_LAYERS:
        raise bad("layers")
    if not isinstance(lay.get("layers_given"), bool):
        raise bad("layers_given")
    names = lay.get("file_names", {})
    if not (isinstance(names, dict) and len(set(names.values())) == len(names)
            and all(isinstance(k, str) and k in shapes and isinstance(v, str) and v not in shapes
                    for k, v in names.items())):
        raise bad("file_names")
    return lay


class Generic(Adapter):
    """The plan-derived adapter (module docstring): the fallback for every model type transformers
    builds as a causal LM and no explicit adapter serves."""

    name, architecture = NAME, "?"
    model_types: tuple[str, ...] = ()

    def __init__(self, rules: RuleSet | None = None) -> None:
        if rules is not None:
            self.rules = rules

    def for_config(self, cfg: Config) -> Generic:
        """This adapter with ``cfg``'s derived rules (what an import reshards with); the table is also
        registered by name, so a reshard in this process finds it without the checkpoint."""
        rules = RuleSet.from_dict(cfg[LAYOUT_KEY]["rules"], source=f"{LAYOUT_KEY}.rules")
        register_rules(rules)
        return Generic(rules)

    def complete(self, d: Config, *, where: str) -> Config:
        """``d`` with its derived layout (recorded: checked; else derived with transformers)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: the config is a {type(d).__name__}, not a JSON object")
        quant = d.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ManifestError(f"{where}: quantization_config {method!r}: "
                                "quantized weights are not supported; dequantize to bf16/fp32 first")
        cfg = dict(d)
        if LAYOUT_KEY in cfg:
            _check_layout(cfg[LAYOUT_KEY], where=where)
        else:
            if not knows(cfg.get("model_type")):
                raise ManifestError(f"{where}: model_type {cfg.get('model_type')!r} is not supported: no adapter, "
                                    "and the installed transformers has no causal LM for it; nothing was written")
            cfg[LAYOUT_KEY] = derive(cfg, where=where)
        # the engine's scale checks read num_hidden_layers: transformers' count where the family names it
        # otherwise (n_layer); hf_config leaves it out again
        cfg.setdefault("num_hidden_layers", cfg[LAYOUT_KEY]["layers"])
        return cfg

    def hf_config(self, cfg: Config) -> Config:
        out = {k: v for k, v in cfg.items() if k != LAYOUT_KEY}
        if not cfg[LAYOUT_KEY]["layers_given"]:
            out.pop("num_hidden_layers", None)
        return out

    def describe(self, cfg: Any) -> str:
        return f"{cfg.get('model_type')} (generic, from transformers' plans)" if isinstance(cfg, dict) else NAME

    def checkpoint_metadata(self, cfg: Any, names: str) -> dict[str, Any]:
        meta = super().checkpoint_metadata(cfg, names)
        if names == "ckpt":
            meta["rules_table"] = cfg[LAYOUT_KEY]["rules"]  # reshard finds the table without transformers
        return meta

    # ---- parameters ------------------------------------------------------------------------------
    def _layout(self, cfg: Config) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, tuple[int, int]]]:
        lay = cfg[LAYOUT_KEY]
        return [(n, tuple(s)) for n, s in lay["tensors"]], {n: (v[0], v[1]) for n, v in lay["packed"].items()}

    def _stacks(self, tensors: list[tuple[str, tuple[int, ...]]]) -> dict[str, list[str]]:
        """Stacked name -> its per-expert file tensors in expert order (complete groups of one shape)."""
        groups: dict[str, dict[int, tuple[str, tuple[int, ...]]]] = {}
        for n, s in tensors:
            if m := _EXPERT.fullmatch(n):
                groups.setdefault(f"{m['prefix']}.{m['rest']}", {})[int(m["e"])] = (n, s)
        out: dict[str, list[str]] = {}
        for canon, by_e in groups.items():
            if sorted(by_e) == list(range(len(by_e))) and len({s for _, s in by_e.values()}) == 1:
                out[canon] = [by_e[e][0] for e in range(len(by_e))]
        return out

    def hf_map(self, cfg: Config, present: set[str] | None = None) -> Map:
        """File tensor -> runs over the canonical ones. The files' own spelling of a name where it is another
        one transformers loads as the same parameter (llava's ``model.language_model.*`` for the
        ``language_model.model.*`` save_pretrained writes): found at import among ``present`` and recorded,
        written back by export."""
        tensors, packed = self._layout(cfg)
        shapes = dict(tensors)
        spelled = self._file_names(cfg, present)
        stacked = {f: (canon, e) for canon, fs in self._stacks(tensors).items() for e, f in enumerate(fs)}
        out: Map = {}
        for n, s in tensors:
            if n in stacked:
                canon, e = stacked[n]
                size = _numel(s)
                t = Target(s, [Run(canon, e * size, size)])
            elif n in packed:
                dim, parts = packed[n]
                outer, chunk = _numel(s[:dim]), s[dim] // parts * _numel(s[dim + 1:])
                t = Target(s, [Run(f"{n}.part{k}", o * chunk, chunk) for o in range(outer) for k in range(parts)])
            else:
                t = whole(n, shapes[n])
            out[spelled.get(n, n)] = t
        return out

    def _file_names(self, cfg: Config, present: set[str] | None) -> dict[str, str]:
        """Name -> the files' older spelling of it: as recorded, else (an import) found among ``present``
        through transformers' own renamings of this model (recorded in the layout, for the export)."""
        lay = cfg[LAYOUT_KEY]
        if "file_names" in lay or present is None:
            return dict(lay.get("file_names") or {})
        derived = {n for n, _ in lay["tensors"]}
        unknown, missing = present - derived, derived - present
        found = _legacy_names(cfg, unknown, missing) if unknown and missing else {}
        if found:
            lay["file_names"] = found
        return found

    def params(self, cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
        tensors, packed = self._layout(cfg)
        stacks = self._stacks(tensors)
        first = {fs[0]: canon for canon, fs in stacks.items()}
        members = {f for fs in stacks.values() for f in fs}
        out: list[tuple[str, tuple[int, ...]]] = []
        for n, s in tensors:
            if n in first:
                out.append((first[n], (len(stacks[first[n]]), *s)))
            elif n in members:
                continue
            elif n in packed:
                dim, parts = packed[n]
                part = tuple(x // parts if i == dim else x for i, x in enumerate(s))
                out += [(f"{n}.part{k}", part) for k in range(parts)]
            else:
                out.append((n, s))
        return out


def _numel(shape: Any) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


GENERIC = Generic()
