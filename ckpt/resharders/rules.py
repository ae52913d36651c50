"""Sharding rules: parameter-name patterns -> placement. One table drives both the trainer's
parallelize code and the resharders, so what the trainer holds is exactly what a plan predicts.

A placement says, for one parameter:

- ``tp_dim``: dim split over TP (column-parallel: 0 of a Linear weight; row-parallel: 1);
- ``ep_dim``: dim split over EP (the expert dim of fused expert weights); must divide evenly;
- ``pad``: the TP split may be uneven because the trainer pads (vocab-parallel embedding / head):
  chunks of ``ceil(n / tp)``, the last one short; padding never reaches the checkpoint;
- pipeline stage: by global layer index (``layers.N.``), ``first`` patterns on stage 0, ``last``
  patterns on the last stage.

A table may also carry **block constraints** (``RuleSet.blocks``, :class:`BlockRule`): a tensor stored
in blocks (an FP8 weight with one scale per 128x128 block) names the block size of its trailing dims,
and a layout whose TP or EP split of such a dim would not fall on a multiple of the block is refused
(:func:`check_blocks`, called by :func:`param_box`): no shard ever holds part of a block.

Checkpoint keys map to parameter names through two prefixes (``RuleSet.param_prefix``, default
``"model."``, and ``RuleSet.optim_prefix``, default ``"optim."``): ``model.<param>`` is parameter
``<param>``; ``optim.<name>.<param>`` is optimizer state ``<name>`` of ``<param>`` (see
:mod:`ckpt.resharders.placement`). A TOML rules file may set them in a ``[keys]`` table.

Splits follow ``torch.chunk`` (what DTensor uses): chunk ``ceil(n / k)``, the last ones short.
Everything not matched is replicated.
"""

from __future__ import annotations

import fnmatch
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import LayoutError
from ckpt.layout import Coord, Layout
from ckpt.shards import Box, Flat


@dataclass(frozen=True, slots=True)
class Placement:
    """How one parameter is split (see module docstring)."""

    tp_dim: int | None = None
    ep_dim: int | None = None
    pad: bool = False

    @property
    def is_expert(self) -> bool:
        return self.ep_dim is not None


REPLICATED = Placement()


@dataclass(frozen=True, slots=True)
class BlockRule:
    """``pattern`` (fnmatch glob over the parameter name) -> the block sizes of the tensor's trailing
    ``len(block)`` dims: a split of one of those dims must fall on a multiple of its block (or on the
    dim's end), so that every block stays whole on one rank."""

    pattern: str
    block: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Rule:
    """``pattern`` (fnmatch glob over the parameter name) -> placement."""

    pattern: str
    placement: Placement


@dataclass(slots=True)
class RuleSet:
    """An ordered rules table (first match wins) plus pipeline-stage rules."""

    rules: list[Rule]
    layer_regex: str = r"(?:^|\.)layers\.(\d+)\."
    first_stage: list[str] = field(default_factory=list)
    last_stage: list[str] = field(default_factory=list)
    name: str = "custom"
    param_prefix: str = "model."
    optim_prefix: str = "optim."
    blocks: list[BlockRule] = field(default_factory=list)  # first match wins; none: no block constraint

    def placement(self, param: str) -> Placement:
        for r in self.rules:
            if fnmatch.fnmatchcase(param, r.pattern):
                return r.placement
        return REPLICATED

    def block_of(self, param: str) -> tuple[int, ...] | None:
        """The block sizes of ``param``'s trailing dims (:class:`BlockRule`), or None: no blocks."""
        for b in self.blocks:
            if fnmatch.fnmatchcase(param, b.pattern):
                return b.block
        return None

    def key_role(self, key: str) -> tuple[str, str | None] | None:
        """How checkpoint ``key`` is placed when this table knows it by name: ``(kind, param)`` with
        kind ``"param"``, ``"optim"`` or ``"global"`` (:mod:`ckpt.resharders.placement`'s roles), or
        None to use the key prefixes (``param_prefix`` / ``optim_prefix``). Tables bound to one
        checkpoint's own names (:class:`KeyedRules`) answer here."""
        return None

    def layer_of(self, param: str) -> int | None:
        m = re.search(self.layer_regex, param)
        return int(m.group(1)) if m else None

    def stage_of(self, param: str, num_layers: int, pp: int, stages: list[int] | None = None) -> int:
        """Pipeline stage that holds ``param``: by global layer index, else first/last patterns, else 0."""
        layer = self.layer_of(param)
        if layer is not None:
            bounds = stage_bounds(num_layers, pp, stages)
            for s, (lo, hi) in enumerate(bounds):
                if lo <= layer < hi:
                    return s
            raise LayoutError(f"parameter {param!r}: layer {layer} is beyond the {num_layers} layers")
        if any(fnmatch.fnmatchcase(param, p) for p in self.last_stage):
            return pp - 1
        return 0

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "layer_regex": self.layer_regex, "first_stage": self.first_stage,
             "last_stage": self.last_stage, "param_prefix": self.param_prefix,
             "optim_prefix": self.optim_prefix,
             "rules": [{"pattern": r.pattern, "tp_dim": r.placement.tp_dim, "ep_dim": r.placement.ep_dim,
                        "pad": r.placement.pad} for r in self.rules]}
        if self.blocks:  # only when set: tables without blocks keep their recorded form (and plan ids)
            d["blocks"] = [{"pattern": b.pattern, "block": list(b.block)} for b in self.blocks]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "rules") -> RuleSet:
        """Build from a dict (a parsed TOML file: ``[[rule]]`` tables, optional ``[pipeline]`` and ``[keys]``).

        Also accepts :meth:`to_dict`'s output (``rules``, ``first_stage``/``last_stage`` at the top level).
        """
        items = d.get("rule", d.get("rules", []))
        if not isinstance(items, list):
            raise LayoutError(f"{source}: 'rule' must be an array of tables ([[rule]])")
        rules = []
        for i, r in enumerate(items):
            if not isinstance(r, dict) or not isinstance(r.get("pattern"), str):
                raise LayoutError(f"{source}: rule {i} needs a string 'pattern'")
            unknown = set(r) - {"pattern", "tp_dim", "ep_dim", "pad"}
            if unknown:
                raise LayoutError(f"{source}: rule {i} ({r['pattern']!r}) has unknown keys {sorted(unknown)}")
            for k in ("tp_dim", "ep_dim"):
                if r.get(k) is not None and (not isinstance(r[k], int) or r[k] < 0):
                    raise LayoutError(f"{source}: rule {i} ({r['pattern']!r}): {k} must be a dim index >= 0")
            rules.append(Rule(r["pattern"], Placement(r.get("tp_dim"), r.get("ep_dim"), bool(r.get("pad", False)))))
        blocks = _block_rules(d.get("block", d.get("blocks", [])), source)
        pipe = d.get("pipeline", {}) or {}
        keys = d.get("keys", {}) or {}
        if not isinstance(pipe, dict) or not isinstance(keys, dict):
            raise LayoutError(f"{source}: [pipeline] and [keys] must be tables")
        unknown = set(keys) - {"param_prefix", "optim_prefix"}
        if unknown:
            raise LayoutError(f"{source}: [keys] has unknown entries {sorted(unknown)} (param_prefix, optim_prefix)")
        layer_regex = pipe.get("layer_regex", d.get("layer_regex", r"(?:^|\.)layers\.(\d+)\."))
        try:
            if re.compile(layer_regex).groups != 1:
                raise LayoutError(f"{source}: layer_regex {layer_regex!r} must have exactly one group (the index)")
        except (re.error, TypeError) as e:
            raise LayoutError(f"{source}: layer_regex {layer_regex!r} is not a regular expression ({e})") from None
        prefixes = {k: keys.get(k, d.get(k, dflt)) for k, dflt in (("param_prefix", "model."),
                                                                   ("optim_prefix", "optim."))}
        for k, v in prefixes.items():
            if not isinstance(v, str):
                raise LayoutError(f"{source}: [keys] {k} must be a string")
        return cls(rules, layer_regex=layer_regex,
                   first_stage=list(pipe.get("first", d.get("first_stage", []))),
                   last_stage=list(pipe.get("last", d.get("last_stage", []))),
                   name=str(d.get("name", source)), blocks=blocks, **prefixes)


def _block_rules(items: Any, source: str) -> list[BlockRule]:
    """``[[block]]`` tables (``pattern``, ``block`` = sizes of the trailing dims), checked."""
    if not isinstance(items, list):
        raise LayoutError(f"{source}: 'block' must be an array of tables ([[block]] with pattern and block)")
    out = []
    for i, b in enumerate(items):
        if not isinstance(b, dict) or not isinstance(b.get("pattern"), str) or set(b) != {"pattern", "block"}:
            raise LayoutError(f"{source}: block rule {i} needs exactly a string 'pattern' and a 'block' list")
        sizes = b["block"]
        if not (isinstance(sizes, list) and sizes and all(type(x) is int and x >= 1 for x in sizes)):
            raise LayoutError(f"{source}: block rule {i} ({b['pattern']!r}): 'block' must be a non-empty list of "
                              f"block sizes >= 1 (one per trailing dim), got {str(sizes)[:60]}")
        out.append(BlockRule(b["pattern"], tuple(sizes)))
    return out


@dataclass(slots=True)
class KeyedRules(RuleSet):
    """A rules table bound to one checkpoint's own key names (derived from them by
    :func:`ckpt.resharders.derive.derive_rules`): each stored key's role and placement is decided up
    front and looked up by key, so keys in any scheme (torchtitan, DCP's ``optimizer.state.<fqn>.exp_avg``)
    are placed without patterns. Keys it does not know are global (whole on every rank)."""

    keyed: dict[str, Placement] = field(default_factory=dict)  # stored parameter key -> its placement
    optim: dict[str, str] = field(default_factory=dict)  # optimizer-state key -> the stored parameter key
    unmatched: tuple[str, ...] = ()  # tensor keys no rule knows (held whole), sorted

    def placement(self, param: str) -> Placement:
        return self.keyed.get(param, REPLICATED)

    def key_role(self, key: str) -> tuple[str, str | None] | None:
        if key in self.optim:
            return "optim", self.optim[key]
        if key in self.keyed:
            return "param", key
        return "global", None

    def to_dict(self) -> dict[str, Any]:
        d = RuleSet.to_dict(self)
        d["keyed"] = {k: [p.tp_dim, p.ep_dim, p.pad] for k, p in sorted(self.keyed.items())}
        d["optim"] = dict(sorted(self.optim.items()))
        return d


def load_rules(path: str) -> RuleSet:
    """Read a TOML rules file (``--rules FILE``). Raises LayoutError with the file name on bad input."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser as a package
        import tomli as tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise LayoutError(f"{path}: cannot read rules file ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise LayoutError(f"{path}: not valid TOML ({e})") from None
    except UnicodeDecodeError as e:  # (tomllib decodes the bytes itself: not UTF-8 is not a TOMLDecodeError)
        raise LayoutError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start}); a rules file is TOML "
                          "text") from None
    return RuleSet.from_dict(data, source=path)


def stage_bounds(num_layers: int, pp: int, stages: list[int] | None = None) -> list[tuple[int, int]]:
    """Layer ranges ``[lo, hi)`` per stage: balanced (earlier stages take the remainder) or explicit
    ``stages`` = number of layers per stage."""
    if stages is not None:
        if len(stages) != pp or sum(stages) != num_layers or min(stages) < 1:
            raise LayoutError(f"explicit stage sizes {stages} must be {pp} positive counts summing to {num_layers}")
        sizes = stages
    else:
        if num_layers < pp:
            raise LayoutError(f"pp={pp} needs at least {pp} layers, the model has {num_layers}")
        base, extra = divmod(num_layers, pp)
        sizes = [base + (1 if s < extra else 0) for s in range(pp)]
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


# Replica groups: ranks holding the same block of a parameter. Every axis but tp (which splits
# blocks), pp (which owns layers) and, for experts, ep (which splits them) replicates.
DENSE_REPLICAS: tuple[str, ...] = ("dp", "ep", "sp")
EXPERT_REPLICAS: tuple[str, ...] = ("dp", "sp")


def _chunk(n: int, k: int, i: int) -> tuple[int, int]:
    size = -(-n // k) if n else 0
    start = min(i * size, n)
    return start, min(start + size, n) - start


def _cut_at(n: int, parts: int, block: int) -> int | None:
    """The first boundary of ``torch.chunk``'s split of ``n`` elements into ``parts`` that falls
    inside a block of ``block`` elements (None: every block whole)."""
    c = -(-n // parts)
    return next((k * c for k in range(1, parts) if k * c < n and (k * c) % block), None)


def check_blocks(param: str, shape: tuple[int, ...], layout: Layout, rules: RuleSet) -> None:
    """Refuse a ``layout`` whose TP or EP split of ``param`` (shape ``shape``) would cut one of the
    blocks its :class:`BlockRule` declares: every split boundary must fall on a multiple of the dim's
    block (or on its end). Pure; no-op for a tensor without blocks or not split.

    Raises LayoutError naming the parameter, the dim, its block count and the sizes that would work.
    """
    if not rules.blocks:
        return
    p = rules.placement(param)
    splits = [(d, k, axis) for d, k, axis in ((p.ep_dim, layout.ep, "ep"), (p.tp_dim, layout.tp, "tp"))
              if d is not None and k > 1 and d < len(shape)]
    block = rules.block_of(param) if splits else None
    if not block:
        return
    for d, k, axis in splits:
        lead = len(shape) - len(block)
        b = block[d - lead] if d >= lead else 1
        n = shape[d]
        if b <= 1 or (at := _cut_at(n, k, b)) is None:
            continue
        even = axis == "ep" or not p.pad  # ep and unpadded tp must divide the dim
        fits = [x for x in range(1, -(-n // b) + 1) if (not even or n % x == 0) and _cut_at(n, x, b) is None]
        shown = str(fits) if len(fits) <= 12 else f"{str(fits[:12])[:-1]}, ...]"
        raise LayoutError(f"parameter {param!r} {list(shape)}: its {-(-n // b)} blocks of {b} on dim {d} do not split "
                          f"evenly over {axis}={k} (a shard would start at {at}, inside a block); choose {axis} in "
                          f"{shown}")


def param_box(param: str, shape: tuple[int, ...], layout: Layout, coord: Coord, rules: RuleSet) -> Box:
    """The block of the global parameter that a rank at ``coord`` holds (ignoring pipeline stages).

    Raises LayoutError when an expert dim does not divide evenly over EP, a non-padded TP dim
    does not divide evenly over TP (the trainer cannot run such a layout), or a split would cut one
    of the tensor's declared blocks (:func:`check_blocks`).
    """
    p = rules.placement(param)
    offs, lens = [0] * len(shape), list(shape)
    if p.ep_dim is not None and layout.ep > 1:
        d = p.ep_dim
        if d >= len(shape) or shape[d] % layout.ep:
            raise LayoutError(f"parameter {param!r}: {shape[d] if d < len(shape) else '?'} experts (dim {d}) "
                              f"cannot be split evenly over ep={layout.ep}; choose ep dividing the expert count")
        n = shape[d] // layout.ep
        offs[d], lens[d] = coord.ep * n, n
    if p.tp_dim is not None and layout.tp > 1:
        d = p.tp_dim
        if d >= len(shape):
            raise LayoutError(f"parameter {param!r}: tp_dim {d} but the tensor has {len(shape)} dims")
        if not p.pad and shape[d] % layout.tp:
            raise LayoutError(f"parameter {param!r}: dim {d} of size {shape[d]} cannot be split evenly over "
                              f"tp={layout.tp}; choose tp dividing it")
        s, n = _chunk(shape[d], layout.tp, coord.tp)
        offs[d], lens[d] = s, n
    check_blocks(param, shape, layout, rules)
    return Box(tuple(offs), tuple(lens))


def padded_rows(n: int, tp: int) -> int:
    """Local size of a padded TP dim (every rank holds ``ceil(n / tp)``, the last ones padded)."""
    return -(-n // tp)


def zero_range(numel: int, layout: Layout, coord: Coord, expert: bool) -> tuple[int, int]:
    """ZeRO-1: the ``[start, stop)`` of a local block's flattening this rank's optimizer state holds.

    The replica group is :data:`DENSE_REPLICAS` (``dp x ep x sp``) for dense parameters and
    :data:`EXPERT_REPLICAS` (``dp x sp``) for expert parameters; the rank's index in it follows the
    rank order (``Layout.group_index``: index ``dp_i * ep + ep_i`` when ``sp=1``, as before ``sp``
    existed); chunks of ``ceil(numel / group)``.
    """
    axes = EXPERT_REPLICAS if expert else DENSE_REPLICAS
    s, n = _chunk(numel, layout.group_size(axes), layout.group_index(coord, axes))
    return s, s + n


def optim_region(param: str, shape: tuple[int, ...], layout: Layout, coord: Coord, rules: RuleSet) -> Box | Flat:
    """Region of an optimizer-state tensor of ``param`` a rank holds: the param's block, or with
    ``zero=1`` a flat range of that block's flattening."""
    box = param_box(param, shape, layout, coord, rules)
    if layout.zero == 0:
        return box
    s, e = zero_range(box.numel, layout, coord, rules.placement(param).is_expert)
    full = box.lengths == tuple(shape)
    return Flat(s, e) if full else Flat(s, e, box)


# The embedded MoE's table (ckpt.trainer.model names; Qwen3-MoE compatible).
MOE_RULES = RuleSet(
    name="embedded-moe",
    rules=[
        Rule("model.embed_tokens.weight", Placement(tp_dim=0, pad=True)),  # vocab-parallel
        Rule("lm_head.weight", Placement(tp_dim=0, pad=True)),
        Rule("model.layers.*.self_attn.q_proj.weight", Placement(tp_dim=0)),  # column-parallel (heads)
        Rule("model.layers.*.self_attn.k_proj.weight", Placement(tp_dim=0)),
        Rule("model.layers.*.self_attn.v_proj.weight", Placement(tp_dim=0)),
        Rule("model.layers.*.self_attn.o_proj.weight", Placement(tp_dim=1)),  # row-parallel
        Rule("model.layers.*.mlp.experts.gate_proj", Placement(ep_dim=0, tp_dim=1)),  # (E, I, H)
        Rule("model.layers.*.mlp.experts.up_proj", Placement(ep_dim=0, tp_dim=1)),
        Rule("model.layers.*.mlp.experts.down_proj", Placement(ep_dim=0, tp_dim=2)),  # (E, H, I)
    ],
    first_stage=["model.embed_tokens.*"],
    last_stage=["model.norm.*", "lm_head.*"],
)


# Hugging Face decoder families by their canonical parameter names (checkpoint key = "model." + name):
# every adapter of ckpt.hf and the trainer's hybrid model. Its expert rules are MOE_RULES'.
HF_RULES = RuleSet(
    name="hf-decoder",
    rules=[
        Rule("model.embed_tokens.weight", Placement(tp_dim=0, pad=True)),
        Rule("lm_head.weight", Placement(tp_dim=0, pad=True)),
        *[Rule(f"model.layers.*.self_attn.{p}_proj.{w}", Placement(tp_dim=0))
          for p in ("q", "k", "v") for w in ("weight", "bias")],
        Rule("model.layers.*.self_attn.o_proj.weight", Placement(tp_dim=1)),
        Rule("model.layers.*.self_attn.q_b_proj.weight", Placement(tp_dim=0)),  # MLA: per head
        Rule("model.layers.*.self_attn.kv_b_proj.weight", Placement(tp_dim=0)),
        Rule("model.layers.*.mlp.experts.gate_proj", Placement(ep_dim=0, tp_dim=1)),
        Rule("model.layers.*.mlp.experts.up_proj", Placement(ep_dim=0, tp_dim=1)),
        Rule("model.layers.*.mlp.experts.down_proj", Placement(ep_dim=0, tp_dim=2)),
        *[Rule(f"model.layers.*.mlp.{m}gate_proj.weight", Placement(tp_dim=0))
          for m in ("", "shared_expert.", "shared_experts.")],
        *[Rule(f"model.layers.*.mlp.{m}up_proj.weight", Placement(tp_dim=0))
          for m in ("", "shared_expert.", "shared_experts.")],
        *[Rule(f"model.layers.*.mlp.{m}down_proj.weight", Placement(tp_dim=1))
          for m in ("", "shared_expert.", "shared_experts.")],
        # MiniMax lightning attention: qkv_proj rows are per head (q, k, v of head 0, then head 1...),
        # so whole heads are contiguous row blocks; the output norm spans all heads (its RMS then
        # needs a sum of squares over the TP group).
        Rule("model.layers.*.self_attn.qkv_proj.weight", Placement(tp_dim=0)),
        Rule("model.layers.*.self_attn.output_gate.weight", Placement(tp_dim=0)),
        Rule("model.layers.*.self_attn.norm.weight", Placement(tp_dim=0)),
        Rule("model.layers.*.self_attn.out_proj.weight", Placement(tp_dim=1)),
    ],
    first_stage=["model.embed_tokens.*"],
    last_stage=["model.norm.*", "lm_head.*"],
)

# Canonical (Hugging Face) parameters every adapter keeps whole on purpose: norms, routers, biases of
# row-parallel layers, MLA's down projections; with HF_RULES' patterns, the names whose placement is
# known (a foreign checkpoint's tensor matching neither is reported as held whole for want of a rule).
HF_WHOLE: list[str] = [
    "model.norm.weight",
    *[f"model.layers.*.{n}" for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "self_attn.o_proj.bias", "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
        "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias", "mlp.shared_expert_gate.weight", "mlp.down_proj.bias",
        "mlp.shared_experts.down_proj.bias", "mlp.shared_expert.down_proj.bias")],
]

# The tables a checkpoint can name in user_metadata["rules"] and be resharded by without a rules file.
_NAMED: dict[str, RuleSet] = {MOE_RULES.name: MOE_RULES, HF_RULES.name: HF_RULES}


def register_rules(rules: RuleSet) -> None:
    """Make ``rules`` known by its name, so that a checkpoint recording ``user_metadata["rules"] =
    rules.name`` is resharded with it (``ckpt reshard``, ``ckpt.resharders.plan.rules_for``) without a
    ``--rules`` file. The extension point for a model's own table; registering a name again replaces it.

    Raises LayoutError for a name that is not a non-empty string.
    """
    if not isinstance(rules.name, str) or not rules.name:
        raise LayoutError(f"register_rules: a rules table needs a name (got {rules.name!r}); set RuleSet(name=...)")
    _NAMED[rules.name] = rules


def rules_named(name: str) -> RuleSet | None:
    """The registered rules table called ``name`` (built in: ``embedded-moe``, ``hf-decoder``), or None."""
    return _NAMED.get(name)


def recorded_rules(user_metadata: Mapping[str, Any]) -> RuleSet | None:
    """The rules table a checkpoint's ``user_metadata`` names (``"rules"``): the table it carries
    under ``"rules_table"`` when that one has the same name (ckpt.hf.generic's, an fp8 import's with
    its block constraints: the checkpoint's own table wins over a table registered in this process
    under the same name), else the registered table of that name; None when neither exists.

    Raises LayoutError for a carried table that is malformed.
    """
    name = user_metadata.get("rules")
    if not isinstance(name, str):
        return None
    table = user_metadata.get("rules_table")
    if isinstance(table, dict) and table.get("name") == name:
        return RuleSet.from_dict(table, source="user_metadata['rules_table']")
    return rules_named(name)


def registered_rules() -> list[str]:
    """Names of the registered rules tables, sorted."""
    return sorted(_NAMED)


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of ``shape``."""
    return math.prod(shape)


__all__ = ["Placement", "REPLICATED", "BlockRule", "Rule", "RuleSet", "check_blocks", "KeyedRules", "load_rules",
           "stage_bounds", "DENSE_REPLICAS", "EXPERT_REPLICAS", "param_box", "padded_rows", "zero_range",
           "optim_region", "MOE_RULES", "HF_RULES", "HF_WHOLE", "register_rules", "rules_named", "recorded_rules",
           "registered_rules", "numel"]
