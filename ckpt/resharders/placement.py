"""Which region of each checkpoint tensor a rank of a layout holds: the checkpoint key contract.

Keys are classified once (:func:`classify`), then placed per rank (:func:`region_of`):

- ``<param_prefix><param>`` (``model.<param>``): a model parameter. Its block is
  :func:`~ckpt.resharders.rules.param_box`; ranks not on the parameter's pipeline stage hold nothing.
- ``<optim_prefix><name>.<param>`` (``optim.exp_avg.<param>``): optimizer state of ``<param>``,
  shaped like it. Its region is :func:`~ckpt.resharders.rules.optim_region` (with ZeRO-1 a flat
  range of the parameter's block). State shaped otherwise (a per-parameter scalar ``step``) is held
  whole by every rank of the parameter's stage.
- anything else (``optim.step``, a data-loader tensor, ...): global, every rank holds all of it.

All functions here are pure (no I/O, no process group).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckpt._dtypes import dtype_from_name
from ckpt.errors import LayoutError
from ckpt.layout import Layout
from ckpt.manifest import Manifest
from ckpt.resharders.rules import RuleSet, check_blocks, optim_region, param_box, stage_bounds
from ckpt.shards import Box, FlatShard, Region, Shard, full_box

PARAM = "param"  # a model parameter
OPTIM = "optim"  # optimizer state shaped like its parameter
STAGED = "staged"  # per-parameter state of another shape: whole, on the parameter's stage
GLOBAL = "global"  # replicated on every rank

Spec = tuple[str, tuple[int, ...]]  # (dtype name, global shape)


@dataclass(frozen=True, slots=True)
class Role:
    """How a checkpoint key is placed: ``kind`` (PARAM, OPTIM, STAGED, GLOBAL) and the parameter
    name the rules see (None for GLOBAL)."""

    kind: str
    param: str | None = None


def classify(key: str, shape: tuple[int, ...], specs: Mapping[str, Spec], rules: RuleSet) -> Role:
    """Role of checkpoint tensor ``key`` (shape ``shape``) among all tensors ``specs`` (key -> spec)."""
    bound = rules.key_role(key)  # a table bound to the checkpoint's own names knows each key
    if bound is not None:
        kind, param = bound
        if kind == OPTIM and param is not None and param in specs and tuple(specs[param][1]) != tuple(shape):
            return Role(STAGED, param)  # e.g. a scalar ``step``: whole, on its parameter's stage
        return Role(kind, param if kind != GLOBAL else None)
    if rules.optim_prefix and key.startswith(rules.optim_prefix):
        rest = key[len(rules.optim_prefix):]
        if "." in rest:
            param = rest.split(".", 1)[1]
            twin = specs.get(rules.param_prefix + param)
            if twin is not None and tuple(twin[1]) != tuple(shape):
                return Role(STAGED, param)
            return Role(OPTIM, param)
        return Role(GLOBAL)
    if key.startswith(rules.param_prefix):
        return Role(PARAM, key[len(rules.param_prefix):])
    return Role(GLOBAL)


def specs_of(manifest: Manifest) -> dict[str, Spec]:
    """``key -> (dtype, global shape)`` of every tensor of a manifest."""
    return {k: (t.dtype, tuple(t.shape)) for k, t in manifest.tensors.items()}


def num_layers_of(manifest: Manifest, rules: RuleSet) -> int:
    """Number of decoder layers: ``user_metadata["model_config"]["num_hidden_layers"]`` when present,
    else one more than the largest global layer index found in the parameter keys (0 when none)."""
    cfg = manifest.user_metadata.get("model_config")
    if isinstance(cfg, dict):
        n = cfg.get("num_hidden_layers")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return infer_num_layers(specs_of(manifest), rules)


def infer_num_layers(specs: Mapping[str, Spec], rules: RuleSet) -> int:
    """One more than the largest layer index among the parameters of ``specs`` (0 when none)."""
    top = -1
    for key, (_dtype, shape) in specs.items():
        role = classify(key, shape, specs, rules)
        if role.param is not None and (layer := rules.layer_of(role.param)) is not None:
            top = max(top, layer)
    return top + 1


def region_of(key: str, role: Role, shape: tuple[int, ...], layout: Layout, rank: int, rules: RuleSet,
              num_layers: int, stages: list[int] | None = None) -> Region | None:
    """The region of ``key`` that ``rank`` holds under ``layout``, or None when it holds nothing.

    Raises LayoutError naming the key and the rank when the layout cannot hold the tensor (experts
    not dividing over EP, a TP dim not dividing, a layer beyond the pipeline), saying what to change.
    """
    coord = layout.coord(rank)
    try:
        if role.kind == GLOBAL or role.param is None:
            return full_box(shape)
        if layout.pp > 1 and rules.stage_of(role.param, num_layers, layout.pp, stages) != coord.pp:
            return None
        if role.kind == PARAM:
            return param_box(role.param, shape, layout, coord, rules)
        if role.kind == OPTIM:
            return optim_region(role.param, shape, layout, coord, rules)
        return full_box(shape)
    except LayoutError as e:
        raise LayoutError(f"tensor {key!r}, target rank {rank} ({layout.coord_str(rank)}) of layout {layout}: {e}") \
            from None


def check_block_splits(specs: Mapping[str, Spec], layout: Layout, rules: RuleSet) -> None:
    """Refuse ``layout`` when it would cut a declared block (``rules.blocks``) of some tensor of
    ``specs``: one check per tensor, before any rank's regions are computed (pure, no I/O).

    Raises LayoutError naming the layout, the tensor, the dim and its block count.
    """
    if not rules.blocks:
        return
    for key in sorted(specs):
        shape = tuple(specs[key][1])
        role = classify(key, shape, specs, rules)
        if role.kind not in (PARAM, OPTIM) or role.param is None:
            continue
        try:
            check_blocks(role.param, shape, layout, rules)
        except LayoutError as e:
            raise LayoutError(f"target layout {layout}: tensor {key!r}: {e}") from None


def coord_str(layout: Layout, rank: int) -> str:
    """``"dp=0,tp=1,pp=0,ep=1"`` for ``rank`` of ``layout`` (``sp`` too when the layout has it)."""
    return layout.coord_str(rank)


def regions_for_ranks(specs: Mapping[str, Spec], layout: Layout, rules: RuleSet, num_layers: int,
                      stages: list[int] | None = None) -> list[dict[str, Region]]:
    """For every rank of ``layout``: ``key -> region`` it holds (keys it holds nothing of are absent).

    Also validates explicit ``stages`` against ``num_layers`` and ``layout.pp``.
    """
    if layout.pp > 1 and (stages is not None or num_layers):
        stage_bounds(num_layers, layout.pp, stages)  # raises with a clear message when impossible
    roles = {k: classify(k, s[1], specs, rules) for k, s in specs.items()}
    out: list[dict[str, Region]] = []
    for rank in range(layout.world_size):
        mine: dict[str, Region] = {}
        for key in sorted(specs):
            r = region_of(key, roles[key], specs[key][1], layout, rank, rules, num_layers, stages)
            if r is not None:
                mine[key] = r
        out.append(mine)
    return out


def stage_layers(layout: Layout, rank: int, num_layers: int, stages: list[int] | None = None) \
        -> tuple[int, int] | None:
    """``[lo, hi)`` global layers on ``rank``'s pipeline stage (None when the model has no layers)."""
    if num_layers <= 0:
        return None
    return stage_bounds(num_layers, layout.pp, stages)[layout.coord(rank).pp]


def _wrap(local: torch.Tensor, shape: tuple[int, ...], region: Region) -> Any:
    if isinstance(region, Box):
        return Shard(local, shape, region.offsets)
    box = (region.box.offsets, region.box.lengths) if region.box is not None else None
    return FlatShard(local, shape, region.start, box=box)


def local_piece(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The elements of global tensor ``full`` in ``region``, shaped like the region (a copy)."""
    if isinstance(region, Box):
        return full[tuple(slice(o, o + n) for o, n in zip(region.offsets, region.lengths, strict=True))].clone()
    src = full
    if region.box is not None:
        b = region.box
        src = full[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))]
    return src.reshape(-1)[region.start:region.stop].clone()


def shard_state(full: Mapping[str, torch.Tensor], layout: Layout, rank: int, rules: RuleSet, *,
                num_layers: int | None = None, stages: list[int] | None = None) -> dict[str, Any]:
    """What ``rank`` of ``layout`` holds of a full (global) flat state, as ``ckpt.Shard`` /
    ``ckpt.FlatShard`` pieces ready for ``ckpt.save`` (keys it holds nothing of are absent).

    ``full`` maps checkpoint keys (``model.<param>``, ``optim.exp_avg.<param>``, ...) to global
    tensors; non-tensor values are passed through unchanged. ``num_layers`` defaults to the largest
    layer index found in the keys plus one.

    Example::

        state = shard_state(full, Layout.parse("tp=2,ep=2"), rank, MOE_RULES)
        ckpt.save(state, url, layout=Layout.parse("tp=2,ep=2").to_dict())
    """
    specs = {k: (_dtype_str(v), tuple(v.shape)) for k, v in full.items() if isinstance(v, torch.Tensor)}
    n = infer_num_layers(specs, rules) if num_layers is None else num_layers
    out: dict[str, Any] = {}
    for key, v in full.items():
        if not isinstance(v, torch.Tensor):
            out[key] = v
            continue
        shape = tuple(v.shape)
        region = region_of(key, classify(key, shape, specs, rules), shape, layout, rank, rules, n, stages)
        if region is not None:
            out[key] = _wrap(local_piece(v, region), shape, region)
    return out


def rank_state(manifest: Manifest, layout: Layout, rank: int, rules: RuleSet, *,
               stages: list[int] | None = None) -> dict[str, Any]:
    """Zero-filled load targets for what ``rank`` of ``layout`` holds of ``manifest``'s tensors
    (``ckpt.Shard`` / ``ckpt.FlatShard``), for ``ckpt.load(..., strict=False)``."""
    specs = specs_of(manifest)
    n = num_layers_of(manifest, rules)
    out: dict[str, Any] = {}
    for key, (dtype, shape) in specs.items():
        region = region_of(key, classify(key, shape, specs, rules), shape, layout, rank, rules, n, stages)
        if region is None:
            continue
        lens = region.lengths if isinstance(region, Box) else (region.numel,)
        out[key] = _wrap(torch.zeros(lens, dtype=dtype_from_name(dtype, key=key)), shape, region)
    return out


def _dtype_str(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


__all__ = [
    "Role", "PARAM", "OPTIM", "STAGED", "GLOBAL", "classify", "specs_of", "num_layers_of", "infer_num_layers",
    "region_of", "regions_for_ranks", "check_block_splits", "stage_layers", "shard_state", "rank_state",
    "local_piece", "coord_str",
]
