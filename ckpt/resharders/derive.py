"""Sharding rules derived from a checkpoint's own key names (torchtitan, DCP, Hugging Face, Megatron).

A checkpoint we did not write (a torchtitan or plain DCP directory) names its tensors in its own
scheme: ``layers.0.attention.wq.weight``, ``optimizer.state.layers.0.attention.wq.weight.exp_avg``.
A rules table of patterns cannot describe those keys (the optimizer's moments put the parameter in
the middle of the key), so without this every rank of a resharded checkpoint held every tensor whole.

:func:`derive_rules` binds a rules table to the checkpoint's keys instead (a
:class:`~ckpt.resharders.rules.KeyedRules`):

1. the naming scheme is detected from the keys (:func:`ckpt.interop.names.scheme_of_keys`: ``ckpt``, ``hf``,
   ``torchtitan`` old and 0.3, ``megatron``);
2. each parameter key maps to its canonical (Hugging Face) name (:func:`canonical_name`), whose
   placement the adapters' table knows (:data:`~ckpt.resharders.rules.HF_RULES`; names every adapter
   keeps whole, :data:`~ckpt.resharders.rules.HF_WHOLE`, are known too); one expert of a stacked expert
   tensor (``mlp.experts.3.down_proj.weight``) takes the stacked tensor's placement without its expert dim;
3. an optimizer-state key inherits its parameter's placement (:func:`optimizer_param`:
   ``optimizer.state.<fqn>.<state>`` as ``torch.distributed.checkpoint.state_dict`` writes it, or
   Megatron's ``optimizer.state.<state>.<fqn>``); a state shaped otherwise (the scalar ``step``) is
   held whole, on its parameter's pipeline stage. A parameter that only the optimizer state names
   (torchtitan 0.3's fused ``qkv_linear.wqkv``, whose model weight is saved split) is placed by its own name.

Keys it cannot place are held whole by every rank and listed (:attr:`KeyedRules.unmatched`, the
first few in the error of ``--strict-rules``). Pure functions of the keys and shapes: no I/O.
"""

from __future__ import annotations

import fnmatch
import glob
import re
from collections.abc import Mapping

from ckpt.errors import LayoutError
from ckpt.interop import names as key_names
from ckpt.manifest import Manifest
from ckpt.resharders.rules import HF_RULES, HF_WHOLE, REPLICATED, KeyedRules, Placement, RuleSet

PREFIX = "names:"  # rules names of derived tables: "names:torchtitan" (re-derived, never registered)
CKPT_OPTIM = "optim."  # ckpt's own key contract (a DCP export of a ckpt checkpoint keeps it)
OPTIM_STATE = "optimizer.state."  # torch DCP's get_optimizer_state_dict, under the "optimizer" key
WRAPPERS = ("", "model.", "module.")  # outer prefixes a framework may add to the model's own fqns
# Top-level state that is not the model's: never a parameter, never reported as unmatched.
NOT_MODEL = ("optimizer.param_groups.", "lr_scheduler.", "train_state.", "dataloader.", "rng", "extra_state")
SHOWN = 5  # unmatched names an error lists


class UnmatchedTensorsError(LayoutError):
    """``--strict-rules``: some tensors match no sharding rule and would be held whole by every rank."""


def _titan_table() -> dict[str, str]:
    """torchtitan name (old and 0.3 spellings) -> canonical, layer part only (``attention.wq.weight``)."""
    out = {titan: canon for canon, titan in key_names.TITAN}
    for old, new in key_names.TITAN_03.items():
        if old in out:
            out[new] = out[old]
    # torchtitan 0.3's fused projection: its state dict hook saves wq/wk/wv, but the optimizer state
    # stays keyed by the parameter, whose rows are whole query groups in order (q heads, k, v of group
    # 0, then group 1...), so its TP chunks are too: torchtitan itself shards it column-wise.
    out["attention.qkv_linear.wqkv.weight"] = "self_attn.qkv_proj.weight"
    return out


_TITAN = _titan_table()
_TITAN_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight", "lm_head.weight": "lm_head.weight"}
# Megatron-Core per-layer names whose tensor is one canonical tensor, or (linear_qkv) a fused one whose
# rows are whole query groups in order, so that its TP chunks are too (MiniMax's qkv_proj has that rule).
# linear_fc1 (gate and up fused, each TP-split apart) has no contiguous split: it stays whole.
_MEGATRON = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_MEGATRON_TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                 "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def canonical_names(scheme: str, key: str) -> list[str]:
    """Candidate canonical (Hugging Face) names of parameter key ``key`` in naming ``scheme``, most
    likely first (empty when the scheme has no such name). Outer wrapper prefixes (``model.``,
    ``module.``) are tried off in turn: ckpt's ``model.<canonical>`` and a DCP save of a
    ``transformers`` model under a ``"model"`` key look the same and mean the same tensor."""
    out: list[str] = []
    for wrap in WRAPPERS:
        if not key.startswith(wrap):
            continue
        name = key[len(wrap):]
        if scheme in ("ckpt", "hf") and (name.startswith("model.") or name == "lm_head.weight"):
            out.append(name)
        elif scheme == "torchtitan":
            if name in _TITAN_TOP:
                out.append(_TITAN_TOP[name])
            elif (m := re.match(r"layers\.(\d+)\.(.*)$", name)) and m.group(2) in _TITAN:
                out.append(f"model.layers.{m.group(1)}.{_TITAN[m.group(2)]}")
        elif scheme == "megatron":
            if name in _MEGATRON_TOP:
                out.append(_MEGATRON_TOP[name])
            elif (m := re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)) and m.group(2) in _MEGATRON:
                out.append(f"model.layers.{m.group(1)}.{_MEGATRON[m.group(2)]}")
    return out


def _matching(rules: RuleSet, name: str) -> Placement | None:
    for r in rules.rules:
        if fnmatch.fnmatchcase(name, r.pattern):
            return r.placement
    return None


def canonical_placement(base: RuleSet, name: str, ndim: int) -> Placement | None:
    """Placement of canonical parameter ``name`` (``ndim`` dims as stored) under ``base``, or None
    when no rule and no known-whole name covers it. One expert of a stacked expert tensor takes the
    stacked rule's placement less its expert dim (``experts.E.down_proj.weight`` of ``experts.down_proj``)."""
    p = _matching(base, name)
    if p is not None:
        return p
    m = _EXPERT.match(name)
    if m:
        stacked = _matching(base, f"{m.group(1)}.{m.group(3)}")
        if stacked is not None and stacked.ep_dim == 0 and (stacked.tp_dim or 0) >= 1:
            tp = stacked.tp_dim - 1 if stacked.tp_dim is not None else None
            return Placement(tp_dim=tp if tp is not None and tp < ndim else None)
    if any(fnmatch.fnmatchcase(name, w) for w in HF_WHOLE):
        return REPLICATED
    return None


def optimizer_param(key: str, params: Mapping[str, object]) -> str | None:
    """The parameter key among ``params`` whose optimizer state ``key`` is, or None.

    ``optimizer.state.<fqn>.<state>`` (torch DCP: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
    ``step``...) or ``optimizer.state.<state>.<fqn>`` (Megatron); the fqn is the model's own, which a
    framework may have stored under an outer prefix (``model.<fqn>`` when the model's state dict was
    saved under a ``"model"`` key)."""
    if key.startswith(OPTIM_STATE):
        rest = key[len(OPTIM_STATE):]
        candidates = [rest.rpartition(".")[0], rest.partition(".")[2]]
    elif key.startswith(CKPT_OPTIM):  # ckpt's own optim.<state>.<param>, of parameter model.<param>
        candidates = ["model." + key[len(CKPT_OPTIM):].partition(".")[2]]
    else:
        return None
    for fqn in candidates:
        for wrap in WRAPPERS:
            if fqn and wrap + fqn in params:
                return wrap + fqn
    return None


def _stage_patterns(canon: Mapping[str, str], patterns: list[str]) -> list[str]:
    """Stored keys (escaped for fnmatch) whose canonical name matches one of ``patterns``."""
    return sorted(glob.escape(k) for k, c in canon.items() if any(fnmatch.fnmatchcase(c, p) for p in patterns))


def _unsaved_params(specs: Mapping[str, tuple[str, tuple[int, ...]]], scheme: str, base: RuleSet,
                    keyed: Mapping[str, Placement]) -> dict[str, tuple[Placement, tuple[int, ...]]]:
    """Placement and shape of each parameter that only the optimizer state names (torchtitan's fused
    ``wqkv``, which the model's state dict saves split), placed by the parameter's own name; its shape
    is that of its first non-scalar state (a state shaped otherwise, the scalar ``step``, stays whole)."""
    out: dict[str, tuple[Placement, tuple[int, ...]]] = {}
    for key, (_dtype, shape) in specs.items():
        if not key.startswith(OPTIM_STATE) or not shape or optimizer_param(key, keyed) is not None:
            continue
        fqn = key[len(OPTIM_STATE):].rpartition(".")[0]
        for name in canonical_names(scheme, fqn):
            p = canonical_placement(base, name, len(shape))
            if p is not None and fqn not in specs and fqn not in out:
                out[fqn] = (p, tuple(shape))
                break
    return out


def derive_rules(specs: Mapping[str, tuple[str, tuple[int, ...]]], scheme: str, base: RuleSet = HF_RULES) \
        -> KeyedRules:
    """A rules table bound to the keys ``specs`` (key -> (dtype, shape)) of a checkpoint in naming
    ``scheme`` (see the module docstring), named ``names:<scheme>``."""
    keyed: dict[str, Placement] = {}
    canon: dict[str, str] = {}
    for key, (_dtype, shape) in specs.items():
        if key.startswith(OPTIM_STATE):
            continue
        for name in canonical_names(scheme, key):
            p = canonical_placement(base, name, len(shape))
            if p is not None:
                keyed[key], canon[key] = p, name
                break
    unsaved = _unsaved_params(specs, scheme, base, keyed)
    keyed.update({fqn: p for fqn, (p, _shape) in unsaved.items()})
    optim = {k: prm for k, (_d, shape) in specs.items() if (prm := optimizer_param(k, keyed)) is not None
             and (prm not in unsaved or unsaved[prm][1] == tuple(shape))}
    unmatched = tuple(sorted(k for k, (_d, shape) in specs.items()
                             if len(shape) > 0 and k not in keyed and k not in optim and not k.startswith(NOT_MODEL)))
    # pipeline: by layer index in the stored names; embeddings first, final norm and head last
    # (their optimizer states follow them: the stage is asked of the parameter key)
    return KeyedRules(rules=[], layer_regex=base.layer_regex, first_stage=_stage_patterns(canon, base.first_stage),
                      last_stage=_stage_patterns(canon, base.last_stage), name=PREFIX + scheme,
                      param_prefix="", optim_prefix="", keyed=keyed, optim=optim, unmatched=unmatched)


def scheme_of(manifest: Manifest) -> str:
    """The naming scheme of a checkpoint's keys: the one ``import-hf`` recorded, else the one most
    parameter keys look like (:func:`ckpt.interop.names.scheme_of_keys`)."""
    recorded = manifest.user_metadata.get("names")
    if isinstance(recorded, str) and recorded in key_names.NAMINGS:
        return recorded
    stored = {k: tuple(t.shape) for k, t in manifest.tensors.items() if not k.startswith(OPTIM_STATE)}
    return key_names.scheme_of_keys(stored)


def is_foreign(manifest: Manifest) -> bool:
    """True when the checkpoint's keys do not follow ckpt's key contract (``model.<param>``,
    ``optim.<state>.<param>``): another tool wrote it (DCP, torchtitan), or it holds DCP optimizer
    state, or its parameters are named in another scheme."""
    if manifest.source_format != "ckpt":
        return True
    if any(k.startswith(OPTIM_STATE) for k in manifest.tensors):
        return True
    return scheme_of(manifest) != "ckpt"


def unmatched_keys(manifest: Manifest, rules: RuleSet) -> list[str]:
    """Tensor keys (sorted) that no rule of ``rules`` places and that are held whole on every rank for
    want of one (scalars, non-model state and names known to stay whole are not counted)."""
    if isinstance(rules, KeyedRules):
        return list(rules.unmatched)
    from ckpt.resharders.placement import GLOBAL, classify, specs_of  # placement imports rules, not us

    specs = specs_of(manifest)
    out = []
    for key, (_dtype, shape) in specs.items():
        role = classify(key, shape, specs, rules)
        if len(shape) == 0 or role.kind == GLOBAL or role.param is None:
            continue
        if _matching(rules, role.param) is None and not any(fnmatch.fnmatchcase(role.param, w) for w in HF_WHOLE):
            out.append(key)
    return sorted(out)


def check_strict(keys: list[str], total: int) -> None:
    """``--strict-rules``: raise UnmatchedTensorsError listing the first few of ``keys`` (if any)."""
    if not keys:
        return
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    raise UnmatchedTensorsError(
        f"{len(keys)} of {total} tensors match no sharding rule and would be held whole by every rank "
        f"({', '.join(keys[:SHOWN])}{more}); pass --rules FILE with rules for them, or drop --strict-rules "
        "to reshard them whole")


__all__ = ["UnmatchedTensorsError", "derive_rules", "canonical_names", "canonical_placement", "optimizer_param",
           "scheme_of", "is_foreign", "unmatched_keys", "check_strict", "PREFIX"]
