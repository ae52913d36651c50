"""Source key names: how a checkpoint names the canonical parameters (:mod:`ckpt.hf.adapters`).

- ``ckpt``: ``model.<canonical name>`` (what ``ckpt import-hf`` and the trainer write);
- ``hf``: the Hugging Face names themselves (``model.layers.N.self_attn.q_proj.weight``, per-expert
  tensors, ``lm_head.weight``): a DCP checkpoint of a ``transformers`` model's ``state_dict()``;
- ``torchtitan``: ``tok_embeddings``, ``layers.N.attention.wq`` (rows permuted for Llama: torchtitan's
  complex-number RoPE pairs adjacent elements, Hugging Face's pairs the two halves of a head),
  ``feed_forward.w1/w2/w3``, ``moe.router.gate``, stacked ``moe.experts.w1/w2/w3``, ``output``; and
  torchtitan 0.3's spellings of the same tensors, ``attention.qkv_linear.wq/wk/wv`` and ``lm_head``;
- ``megatron``: ``embedding.word_embeddings``, fused ``linear_qkv`` in Megatron's per-query-group
  order (each group's query heads, then its key, then its value), fused ``linear_fc1`` (gate then up),
  Transformer Engine's fused norms (``linear_qkv.layer_norm_weight``) or the local spec's
  ``input_layernorm``, per-expert ``local_experts.E`` (SequentialMLP) or ``linear_fc1.weightE``
  (TEGroupedMLP), and ``torch_dist``'s layer-stacked tensors (``decoder.layers.<name>`` with a
  leading layer dim), resolved against what the checkpoint holds;
- a JSON file ``{"rename": [[regex, replacement], ...]}``: canonical name -> stored name, first
  match wins, elements unchanged.

:func:`naming` gives the map canonical -> logical stored names (with their shapes and alternative
spellings); :func:`resolve` binds it to the keys a manifest really has; :func:`names_of` picks the
naming of a checkpoint (``--source-names auto``): the one recorded by ``import-hf``, else the one its
keys match (:func:`detect`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ckpt.errors import ConfigError, MismatchError
from ckpt.formats import foreign_json
from ckpt.hf.adapters import Adapter, Config
from ckpt.hf.mapping import Map, Run, Target, invert, merged, rows, whole
from ckpt.interop.names import AUTO, NAMINGS, PATTERNS, key_schemes, scheme_of_keys  # noqa: F401 - API
from ckpt.interop.names import TITAN as _TITAN
from ckpt.interop.names import TITAN_03 as _TITAN_03

VOCAB = ("model.embed_tokens.weight", "lm_head.weight")  # dim 0 may carry the trainer's vocab padding


@dataclass(slots=True)
class Naming:
    """canonical -> runs over logical stored names; their shapes; other spellings to try."""

    kind: str
    map: Map
    shapes: dict[str, tuple[int, ...]]
    alternatives: dict[str, list[str]] = field(default_factory=dict)
    prefixes: tuple[str, ...] = ("",)
    padded: set[str] = field(default_factory=set)  # logical names whose dim 0 may be longer (vocab)


def naming(kind: str, adapter: Adapter, cfg: Config) -> Naming:
    """The naming ``kind`` (``ckpt``, ``hf``, ``torchtitan``, ``megatron`` or a JSON rename file path)."""
    params = adapter.params(cfg)
    if kind == AUTO:  # a caller that had no keys to detect from (names_of resolves auto first)
        raise ConfigError("names 'auto' means: detect how a checkpoint names its weights (export-hf --source-names); "
                          "to write a checkpoint, pick the names: " + ", ".join(NAMINGS) + " or a JSON names file")
    if kind == "hf":
        return _hf(adapter, cfg, params)
    if kind == "ckpt":
        n = Naming("ckpt", {p: whole("model." + p, s) for p, s in params}, {"model." + p: s for p, s in params})
        n.padded = {"model." + v for v in VOCAB}
        return n
    if kind == "torchtitan":
        return _torchtitan(adapter, cfg, params)
    if kind == "megatron":
        return _megatron(cfg, params)
    return _rename_file(kind, params)


def _rename_file(path: str, params: list[tuple[str, tuple[int, ...]]]) -> Naming:
    usage = '{"rename": [["regex", "replacement"], ...]} or one of ' + ", ".join(NAMINGS)
    try:
        spec = foreign_json.read_path(path, budget=foreign_json.NAMES)  # bounded: size, depth, items
    except ConfigError as e:
        raise ConfigError(f"{e}; expected a names file {usage}") from None
    rename = spec.get("rename") if isinstance(spec, dict) else None
    if not (isinstance(rename, list) and all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                             for p in rename)):
        raise ConfigError(f"{path}: not a names file: field 'rename' must be a list of [regex, replacement] string "
                          f"pairs; expected {usage}")
    try:
        pairs = [(re.compile(a), b) for a, b in rename]
    except re.error as e:
        raise ConfigError(f"{path}: not a names file (bad regex: {e}); expected {usage}") from None
    out: Map = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for p, s in params:
        name = p
        for rx, repl in pairs:
            if rx.search(p):
                try:
                    name = rx.sub(repl, p)
                except re.error as e:  # a bad group reference in the replacement
                    raise ConfigError(f"{path}: replacement {repl!r} of {rx.pattern!r}: {e}") from None
                break
        out[p], shapes[name] = whole(name, s), s
    return Naming(path, out, shapes, prefixes=("", "model."), padded=set(VOCAB))


def _hf(adapter: Adapter, cfg: Config, params: list[tuple[str, tuple[int, ...]]]) -> Naming:
    """Stored keys are the Hugging Face names: the inverse of the adapter's Hugging Face map (each
    canonical tensor as runs over Hugging Face tensors, e.g. a stacked experts tensor over per-expert ones)."""
    hf = adapter.hf_map(cfg)
    pieces = invert(hf, dict(params), what=f"{adapter.name}: Hugging Face names")
    out: Map = {p: Target(s, merged([Run(pc.target, pc.at, pc.numel) for pc in pieces[p]])) for p, s in params}
    # no "model." prefix: that would be ckpt's own names for a dense model, and detection must tell them apart
    return Naming("hf", out, {n: t.shape for n, t in hf.items()}, padded=set(VOCAB))


def _layer(name: str) -> tuple[int, str] | None:
    m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
    return (int(m.group(1)), m.group(2)) if m else None





def _titan_alternatives(shapes: dict[str, tuple[int, ...]]) -> dict[str, list[str]]:
    """Each old torchtitan name -> its torchtitan 0.3 spelling (resolve tries both)."""
    out: dict[str, list[str]] = {}
    for name in shapes:
        for old, new in _TITAN_03.items():
            if name == old or name.endswith("." + old):
                out[name] = [name[:len(name) - len(old)] + new]
    return out


def _torchtitan(adapter: Adapter, cfg: Config, params: list[tuple[str, tuple[int, ...]]]) -> Naming:
    table = dict(_TITAN)
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}
    out: Map = {}
    shapes: dict[str, tuple[int, ...]] = {}
    permute = adapter.name == "llama"  # torchtitan's Llama uses complex (interleaved) RoPE
    for p, s in params:
        lay = _layer(p)
        if lay is None:
            name = top[p]
        elif lay[1] in table:
            name = f"layers.{lay[0]}.{table[lay[1]]}"
        else:
            raise MismatchError(f"{p}: torchtitan has no name for this parameter of a {adapter.name} model")
        shapes[name] = s
        if permute and lay is not None and lay[1] in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = cfg["num_attention_heads"] if "q_proj" in lay[1] else cfg["num_key_value_heads"]
            out[p] = Target(s, _rope_rows(name, s, heads, cfg["head_dim"]))
        else:
            out[p] = whole(name, s)
    return Naming("torchtitan", out, shapes, _titan_alternatives(shapes), prefixes=("", "model."),
                  padded={"tok_embeddings.weight", "output.weight"})


def _rope_rows(name: str, shape: tuple[int, ...], heads: int, d: int) -> list[Run]:
    """Hugging Face row ``h*d + a*d/2 + b`` is torchtitan row ``h*d + 2*b + a`` (the inverse of
    torchtitan's ``_permute`` from its checkpoint to Hugging Face's)."""
    half = d // 2
    return [rows(name, shape, h * d + 2 * b + a, 1) for h in range(heads) for a in range(2) for b in range(half)]


_MEGATRON_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_MEGATRON_FC1 = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.shared_experts.gate_proj.weight",
                 "mlp.shared_experts.up_proj.weight", "mlp.shared_expert.gate_proj.weight",
                 "mlp.shared_expert.up_proj.weight")
_MEGATRON_EXPERTS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
_MEGATRON_TOP = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
                 "model.norm.weight": "decoder.final_layernorm.weight", "lm_head.weight": "output_layer.weight"}
# Per-layer tensors stored whole: canonical rest -> Megatron spellings, the first the one written
_MEGATRON_SIMPLE = {
    "input_layernorm.weight": ["self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"],
    "self_attn.o_proj.weight": ["self_attention.linear_proj.weight"],
    "self_attn.o_proj.bias": ["self_attention.linear_proj.bias"],
    "self_attn.q_norm.weight": ["self_attention.q_layernorm.weight"],
    "self_attn.k_norm.weight": ["self_attention.k_layernorm.weight"],
    "mlp.down_proj.weight": ["mlp.linear_fc2.weight"],
    "mlp.gate.weight": ["mlp.router.weight"],
    "mlp.gate.e_score_correction_bias": ["mlp.router.expert_bias"],
    "mlp.shared_experts.down_proj.weight": ["mlp.shared_experts.linear_fc2.weight"],
    "mlp.shared_expert.down_proj.weight": ["mlp.shared_experts.linear_fc2.weight"],
    "mlp.shared_expert_gate.weight": ["mlp.shared_experts.gate_weight"],
    # multi-latent attention (DeepSeek-V3)
    "self_attn.q_proj.weight": ["self_attention.linear_q_proj.weight"],
    "self_attn.q_a_proj.weight": ["self_attention.linear_q_down_proj.weight"],
    "self_attn.q_a_layernorm.weight": ["self_attention.linear_q_up_proj.layer_norm_weight",
                                       "self_attention.q_layernorm.weight"],
    "self_attn.q_b_proj.weight": ["self_attention.linear_q_up_proj.weight"],
    "self_attn.kv_a_proj_with_mqa.weight": ["self_attention.linear_kv_down_proj.weight"],
    "self_attn.kv_a_layernorm.weight": ["self_attention.linear_kv_up_proj.layer_norm_weight",
                                        "self_attention.kv_layernorm.weight"],
    "self_attn.kv_b_proj.weight": ["self_attention.linear_kv_up_proj.weight"],
}


def _megatron_qkv(cfg: Config, pre: str, rest: str, s: tuple[int, ...], shapes: dict[str, tuple[int, ...]]) \
        -> Target:
    """q/k/v (weight or bias) as row blocks of ``linear_qkv``: per query group, its query heads, k, v."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nh, ng = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    qpg = nh // ng
    kind = rest.split(".")[1][0]  # q, k or v
    suffix = rest.rsplit(".", 1)[1]
    name = pre + "self_attention.linear_qkv." + suffix
    full = ((nh + 2 * ng) * d, h) if suffix == "weight" else ((nh + 2 * ng) * d,)
    shapes[name] = full
    first = {"q": 0, "k": qpg * d, "v": (qpg + 1) * d}[kind]
    count = qpg * d if kind == "q" else d
    return Target(s, [rows(name, full, g * (qpg + 2) * d + first, count) for g in range(ng)])


def _megatron_fc1(pre: str, rest: str, s: tuple[int, ...], shapes: dict[str, tuple[int, ...]]) -> Target:
    """gate / up as the first / second half of ``linear_fc1``'s rows."""
    name = pre + ("mlp.shared_experts.linear_fc1.weight" if "shared" in rest else "mlp.linear_fc1.weight")
    full = (2 * s[0], s[1])
    shapes[name] = full
    return Target(s, [rows(name, full, 0 if "gate_proj" in rest else s[0], s[0])])


def _megatron_experts(pre: str, rest: str, s: tuple[int, ...], shapes: dict[str, tuple[int, ...]],
                      alt: dict[str, list[str]]) -> Target:
    """A stacked expert tensor as one block of each local expert's ``linear_fc1`` / ``linear_fc2``."""
    runs = []
    fc = "linear_fc2" if rest.endswith("down_proj") else "linear_fc1"
    for k in range(s[0]):
        name = f"{pre}mlp.experts.local_experts.{k}.{fc}.weight"
        full = (s[1], s[2]) if fc == "linear_fc2" else (2 * s[1], s[2])
        shapes[name] = full
        alt[name] = [f"{pre}mlp.experts.{fc}.weight{k}"]
        runs.append(rows(name, full, s[1] if rest.endswith("up_proj") else 0, s[1]))
    return Target(s, runs)


def _megatron(cfg: Config, params: list[tuple[str, tuple[int, ...]]]) -> Naming:
    out: Map = {}
    shapes: dict[str, tuple[int, ...]] = {}
    alt: dict[str, list[str]] = {}
    by_name = dict(params)
    for p, s in params:
        lay = _layer(p)
        if lay is None:
            name = _MEGATRON_TOP[p]
            out[p], shapes[name] = whole(name, s), s
            continue
        n, rest = lay
        pre = f"decoder.layers.{n}."
        mla = f"model.layers.{n}.self_attn.kv_b_proj.weight" in by_name
        if not mla and rest in _MEGATRON_QKV:
            out[p] = _megatron_qkv(cfg, pre, rest, s, shapes)
            continue
        if rest in _MEGATRON_FC1:
            out[p] = _megatron_fc1(pre, rest, s, shapes)
            continue
        if rest in _MEGATRON_EXPERTS:
            out[p] = _megatron_experts(pre, rest, s, shapes, alt)
            continue
        simple: list[str] | None
        if rest == "post_attention_layernorm.weight":
            moe_layer = f"model.layers.{n}.mlp.experts.gate_proj" in by_name
            simple = (["pre_mlp_layernorm.weight"] if moe_layer else
                      ["mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"])
        else:
            simple = _MEGATRON_SIMPLE.get(rest)
        if simple is None:
            raise MismatchError(f"{p}: no Megatron-Core name is known for this parameter; pass a names file")
        name = pre + simple[0]
        out[p], shapes[name] = whole(name, s), s
        if len(simple) > 1:
            alt[name] = [pre + x for x in simple[1:]]
    return Naming("megatron", out, shapes, alt, prefixes=("", "model.", "module."),
                  padded={"embedding.word_embeddings.weight", "output_layer.weight"})


def resolve(nm: Naming, stored: dict[str, tuple[int, ...]], *, where: str) -> Map:
    """Logical name -> the stored key holding it (a prefix, an alternative spelling, or a row block
    of a layer-stacked tensor), as a Map. Raises MismatchError listing what is missing or mis-shaped."""
    out: Map = {}
    missing: list[str] = []
    wrong: list[str] = []
    prefix = next((p for p in nm.prefixes if any(k.startswith(p) and k[len(p):] in nm.shapes for k in stored)),
                  nm.prefixes[0])
    for name, shape in nm.shapes.items():
        found = None
        for cand in [name, *nm.alternatives.get(name, [])]:
            key = prefix + cand
            if key in stored:
                got = stored[key]
                ok = got == shape or (name in nm.padded and len(got) == 2 and got[1] == shape[1] and got[0] >= shape[0])
                if not ok:
                    wrong.append(f"{key} is {list(got)}, the config needs {list(shape)}")
                found = Target(shape, [Run(key, 0, math.prod(shape))])
                break
            m = re.match(r"(.*\.layers)\.(\d+)\.(.*)$", cand)
            if m and (stacked := f"{prefix}{m.group(1)}.{m.group(3)}") in stored:
                got = stored[stacked]
                if tuple(got[1:]) != shape or int(m.group(2)) >= got[0]:
                    wrong.append(f"{stacked} is {list(got)}, layer {m.group(2)} needs [L, *{list(shape)}]")
                n = math.prod(shape)
                found = Target(shape, [Run(stacked, int(m.group(2)) * n, n)])
                break
        if found is None:
            missing.append(prefix + name)
        else:
            out[name] = found
    if missing or wrong:
        parts = ([f"missing: {'; '.join(missing[:6])}" + (f"; and {len(missing) - 6} more" if len(missing) > 6 else "")]
                 if missing else []) + ([f"wrong shape: {'; '.join(wrong[:6])}"] if wrong else [])
        raise MismatchError(f"{where}: the checkpoint does not hold the {nm.kind} names this model needs: "
                            + " | ".join(parts) + " (wrong --source-names, or a config for another model?)")
    return out


class AmbiguousNamesError(MismatchError):
    """The checkpoint's keys fit more than one naming scheme: ``--source-names`` must say which."""


def detect(stored: dict[str, tuple[int, ...]], adapter: Adapter | None = None, cfg: Config | None = None, *,
           where: str) -> str:
    """The naming scheme of a checkpoint holding ``stored`` (key -> shape).

    With a model (``adapter``, ``cfg``): the one scheme whose names for that model all resolve against
    the keys; when none does, the scheme most keys look like (its resolve then says what is missing).
    Without: the scheme most keys look like (``ckpt`` when none).

    Raises AmbiguousNamesError when several schemes fit, listing them and the flag to pass;
    MismatchError when the keys look like no known scheme.
    """
    seen = key_schemes(stored)
    flag = "pass --source-names " + " | ".join(NAMINGS) + " | a JSON names file"
    if adapter is None or cfg is None:
        return scheme_of_keys(stored)
    fits: list[str] = []
    for kind in NAMINGS:
        try:
            resolve(naming(kind, adapter, cfg), stored, where=where)
        except MismatchError:  # this scheme has no name for a parameter, or the keys lack some
            continue
        fits.append(kind)
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise AmbiguousNamesError(f"{where}: the keys fit more than one naming scheme ({', '.join(fits)}); "
                                  f"pass --source-names {fits[0]} (or {', '.join(fits[1:])}) to say which")
    if not seen:
        sample = sorted(stored)[:3]
        raise MismatchError(f"{where}: the tensor names (e.g. {sample}) match none of {', '.join(NAMINGS)}; {flag}")
    return max(seen, key=lambda k: seen[k])


def names_of(manifest: object, requested: str | None, found: tuple[Adapter, Config] | None, *, where: str) -> str:
    """The naming to read a checkpoint's weights with (``--source-names``; None or ``auto``: the one
    ``import-hf`` recorded, else :func:`detect`).

    Raises ManifestError when the names are not ckpt's and no model config is known (``found`` None),
    AmbiguousNamesError / MismatchError from :func:`detect`.
    """
    from ckpt.errors import ManifestError

    tensors = getattr(manifest, "tensors", {})
    stored = {k: tuple(t.shape) for k, t in tensors.items()}
    recorded = getattr(manifest, "user_metadata", {}).get("names")
    if requested not in (None, AUTO):
        kind = str(requested)
    elif isinstance(recorded, str):
        kind = recorded
    else:
        kind = detect(stored, *(found or (None, None)), where=where)
    if found is None and kind != "ckpt":
        how = "" if requested not in (None, AUTO) else f" (detected from its keys: {kind})"
        raise ManifestError(f"{where}: exporting {kind} names{how} needs the model's Hugging Face config: "
                            "pass --config CONFIG_JSON (or the HF model directory it came from)")
    return kind


__all__ = ["VOCAB", "Naming", "naming", "resolve", "AmbiguousNamesError", "detect", "names_of"]
