"""Build this rank's piece of :class:`~ckpt.trainer.model.MoEForCausalLM` (or of the hybrid family's
:class:`~ckpt.trainer.hybrid.HybridForCausalLM`) for a layout.

Every decision comes from the model's rules table (:data:`ckpt.resharders.rules.MOE_RULES`; for
the hybrid model :data:`ckpt.resharders.rules.HF_RULES`, whose names are the model's and whose expert
rules equal MOE_RULES'), :func:`rules_of`:

- pipeline stage: ``stage_bounds`` / ``RuleSet.stage_of`` pick the layers (kept in an
  ``nn.ModuleDict`` keyed by global index, so parameter names stay global) and whether the stage
  holds ``embed_tokens`` (first), ``norm`` and ``lm_head`` (last);
- the block of each parameter a rank holds: ``param_box`` (TP rows/columns, EP expert slices; the
  vocabulary split is padded to ``padded_rows`` rows per rank, padding zero-filled and never saved);
- then TP (:mod:`ckpt.trainer.tp`) and EP (:mod:`ckpt.trainer.ep`) wrap the modules that compute
  on those blocks, SP (:mod:`ckpt.trainer.sp`) gives the model global positions and LASP-2H
  attention (parameters are whole on every ``sp`` rank), and :mod:`ckpt.trainer.pp` runs the stage
  under a pipeline schedule. The hybrid model's lightning-attention layers take their TP and LASP-2
  from :mod:`ckpt.trainer.hybrid_parallel`, on the same zigzag slices as its softmax layers.

Each local block is drawn from the same per-parameter generator as
:meth:`~ckpt.trainer.model.MoEForCausalLM.init_weights` (draw the whole, keep the block), so every
layout starts from bitwise the same global weights; a rank keeps only its blocks.

Example::

    ctx = ParallelContext.create(Layout(tp=2, ep=2))
    pm = parallelize(CONFIGS["tiny"], ctx, seed=0)
    loss = pm.loss_fn(pm.module(ids), ids)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ckpt.errors import LayoutError
from ckpt.resharders.rules import HF_RULES, MOE_RULES, RuleSet, padded_rows, param_box, stage_bounds
from ckpt.shards import Box
from ckpt.trainer.ep import ParallelMoEBlock
from ckpt.trainer.hybrid import HybridConfig, HybridDecoderLayer, HybridForCausalLM, LightningAttention
from ckpt.trainer.hybrid_parallel import shard_linear_attention, use_lasp2
from ckpt.trainer.model import (
    IGNORE_INDEX,
    DecoderLayer,
    ModelConfig,
    MoEBlock,
    MoEForCausalLM,
    RMSNorm,
    causal_lm_loss,
    initial_value,
)
from ckpt.trainer.parallel import ParallelContext
from ckpt.trainer.sp import shard_sequence, sp_loss_denominator
from ckpt.trainer.tp import (
    VocabParallelEmbedding,
    VocabParallelHead,
    is_tp_partial_grad,
    parallel_causal_lm_loss,
    shard_attention,
    vocab_parallel_cross_entropy,
)

RULES = MOE_RULES  # the MoE model's table (rules_of(config) for any model)


def rules_of(config: ModelConfig | HybridConfig) -> RuleSet:
    """The sharding rules of a model: the names its checkpoints use, recorded as ``rules``."""
    return HF_RULES if isinstance(config, HybridConfig) else MOE_RULES


@dataclass(slots=True)
class ParamSpec:
    """One local parameter and where it sits in the global model.

    ``name`` is the global parameter name (the rules key; the checkpoint key is ``model.<name>``);
    ``box`` the real block this rank holds; ``pad_dim`` the dim padded past the block (vocab rows).
    """

    name: str
    param: nn.Parameter
    global_shape: tuple[int, ...]
    box: Box
    pad_dim: int | None
    expert: bool
    tp_split: bool  # split over TP (else every TP rank holds the same block)
    tp_partial_grad: bool
    norm: bool

    def real(self) -> Tensor:
        """The parameter's data without padding (a view; contiguous)."""
        return self._unpad(self.param.data)

    def real_grad(self) -> Tensor:
        """The gradient without padding (zeros when the parameter got none)."""
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        return self._unpad(self.param.grad)

    def _unpad(self, t: Tensor) -> Tensor:
        if self.pad_dim is None:
            return t
        return t.narrow(self.pad_dim, 0, self.box.lengths[self.pad_dim])


@dataclass(slots=True)
class ParallelModel:
    """A rank's module (its pipeline stage, TP/EP-split) with a spec per local parameter, and the
    rules its blocks follow."""

    module: MoEForCausalLM | HybridForCausalLM
    specs: list[ParamSpec]
    ctx: ParallelContext
    config: ModelConfig | HybridConfig
    rules: RuleSet = field(default_factory=lambda: MOE_RULES)

    def loss_fn(self, output: Tensor, labels: Tensor) -> Tensor:
        """Mean next-token loss of the last stage's output (local logits under TP).

        ``labels`` are the input ids (shifted here), except under sequence parallelism: then they
        are this rank's zigzag slice of the labels shifted on the whole sequence
        (:func:`ckpt.trainer.sp.split_batch`), and the result is this rank's share of the mean (the
        sum of its tokens' losses over the whole batch's count), which sums to the mean over ``sp``.
        """
        head = self.module.lm_head
        if self.ctx.layout.sp > 1:
            total = sp_loss_denominator(labels, self.ctx.sp)
            logits, target = output.reshape(-1, output.shape[-1]), labels.reshape(-1)
            if isinstance(head, VocabParallelHead):
                return vocab_parallel_cross_entropy(logits, target, head.start, head.real, head.group, total=total)
            return F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="sum") / total
        if isinstance(head, VocabParallelHead):
            return parallel_causal_lm_loss(output, labels, head)
        return causal_lm_loss(output, labels)


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


def parallelize(config: ModelConfig | HybridConfig, ctx: ParallelContext, seed: int = 0,
                moe_dispatch: str = "dedup", moe_sequence_shard: bool = False) -> ParallelModel:
    """This rank's stage of the model with its blocks of every parameter, initialized as
    ``init_weights(seed)`` would initialize the full model. ``moe_dispatch`` / ``moe_sequence_shard``
    choose the MoE blocks' dispatch (:class:`~ckpt.trainer.ep.ParallelMoEBlock`). A
    :class:`HybridConfig` builds the hybrid family (its layouts: :func:`check_hybrid_layout`).

    Raises LayoutError when the layout cannot split this model (see the rules' messages).
    """
    rules = rules_of(config)
    # A CPU skeleton (its values are replaced below; cheap, and its memory is transient): on the
    # meta device, nn.Embedding's init would import torch._dynamo, a slow import in every fresh
    # process (measured in docs/BENCHMARKS.md, section "Figures that code comments used to quote").
    model = HybridForCausalLM(config) if isinstance(config, HybridConfig) else MoEForCausalLM(config)
    global_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    norms = {f"{m_name}.{p_name}" for m_name, m in model.named_modules() if isinstance(m, RMSNorm)
             for p_name, _ in m.named_parameters(recurse=False)}
    stage_layers, on_stage = _keep_stage(model, config, ctx, rules)
    boxes = _shard_params(model, config, ctx, rules, seed, on_stage, global_shapes, norms)
    _wrap_modules(model, stage_layers, boxes, config, ctx, moe_dispatch, moe_sequence_shard)
    specs = _param_specs(model, boxes, global_shapes, norms, rules, ctx.layout.tp)
    return ParallelModel(model, specs, ctx, config, rules)


def _keep_stage(model: MoEForCausalLM | HybridForCausalLM, config: ModelConfig | HybridConfig,
                ctx: ParallelContext, rules: RuleSet) -> tuple[nn.ModuleDict, Callable[[str], bool]]:
    """Cut ``model`` to this rank's pipeline stage: its layers (by global index) and the first/last-stage
    modules; returns the stage's layers and whether a parameter name is on this stage by the rules."""
    layout, coord = ctx.layout, ctx.coord
    lo, hi = stage_bounds(config.num_hidden_layers, layout.pp)[coord.pp]
    full_layers = model.model.layers
    assert isinstance(full_layers, nn.ModuleList)
    stage_layers = nn.ModuleDict({str(i): full_layers[i] for i in range(lo, hi)})
    model.model.layers = stage_layers

    def on_stage(name: str) -> bool:
        return rules.stage_of(name, config.num_hidden_layers, layout.pp) == coord.pp

    if not on_stage("model.embed_tokens.weight"):
        model.model.embed_tokens = None
    if not on_stage("model.norm.weight"):
        model.model.norm = None
    if not on_stage("lm_head.weight"):
        model.lm_head = None
    return stage_layers, on_stage


def _shard_params(model: MoEForCausalLM | HybridForCausalLM, config: ModelConfig | HybridConfig,
                  ctx: ParallelContext, rules: RuleSet, seed: int, on_stage: Callable[[str], bool],
                  global_shapes: dict[str, tuple[int, ...]], norms: set[str]) -> dict[str, tuple[Box, int | None]]:
    """Replace every parameter of the stage by this rank's block of its initial value (padded rows
    zero-filled); returns each parameter's block and padded dim."""
    layout, coord = ctx.layout, ctx.coord
    boxes: dict[str, tuple[Box, int | None]] = {}
    for name, param in list(model.named_parameters()):
        if not on_stage(name):
            raise LayoutError(f"parameter {name!r} is not on stage {coord.pp} by the rules but its module is")
        shape = global_shapes[name]
        box = param_box(name, shape, layout, coord, rules)
        placement = rules.placement(name)
        local_shape = list(box.lengths)
        pad_dim = None
        if placement.pad and placement.tp_dim is not None and layout.tp > 1:
            pad_dim = placement.tp_dim
            local_shape[pad_dim] = padded_rows(shape[pad_dim], layout.tp)
        local = torch.zeros(local_shape, dtype=param.dtype, device=ctx.device)
        real = local if pad_dim is None else local.narrow(pad_dim, 0, box.lengths[pad_dim])
        if name in norms:
            real.fill_(1.0)
        else:
            full = initial_value(name, shape, config.initializer_range, seed)
            real.copy_(full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))])
        owner, attr = _owner(model, name)
        setattr(owner, attr, nn.Parameter(local))
        boxes[name] = (box, pad_dim)
    return boxes


def _wrap_modules(model: MoEForCausalLM | HybridForCausalLM, stage_layers: nn.ModuleDict,
                  boxes: dict[str, tuple[Box, int | None]], config: ModelConfig | HybridConfig,
                  ctx: ParallelContext, moe_dispatch: str, moe_sequence_shard: bool) -> None:
    """Wrap the modules that compute on the blocks: TP attention, EP MoE blocks, SP (and LASP-2 for
    the hybrid model) and the vocabulary-parallel embedding and head."""
    layout = ctx.layout
    hybrid = isinstance(config, HybridConfig)
    num_experts = config.num_local_experts if isinstance(config, HybridConfig) else config.num_experts
    for index, layer in stage_layers.items():
        assert isinstance(layer, DecoderLayer | HybridDecoderLayer) and isinstance(layer.mlp, MoEBlock)
        if isinstance(layer.self_attn, LightningAttention):
            shard_linear_attention(layer.self_attn, ctx.tp)
        else:
            shard_attention(layer.self_attn, ctx.tp)
        experts = layer.mlp.experts
        experts.expert_offset = boxes[f"model.layers.{index}.mlp.experts.gate_proj"][0].offsets[0]
        layer.mlp = ParallelMoEBlock(layer.mlp.gate, experts, num_experts, ctx.ep, ctx.tp,  # type: ignore[assignment]
                                     moe_dispatch, moe_sequence_shard)
    shard_sequence(model, ctx.sp)  # global positions and LASP-2H attention (nothing when sp == 1)
    if hybrid and not ctx.sp.trivial:
        # LASP-2 on the same zigzag chunks as sp.split_batch / LASP-2H (chunk_ids "zigzag": rank i
        # holds chunks i and 2sp-1-i), so no activation is re-arranged between the two layer kinds.
        use_lasp2(model, ctx.sp, layout="zigzag")
    if layout.tp > 1 and model.model.embed_tokens is not None:
        box, _ = boxes["model.embed_tokens.weight"]
        model.model.embed_tokens = VocabParallelEmbedding(  # type: ignore[assignment]
            model.model.embed_tokens.weight.data, box.offsets[0], box.lengths[0], ctx.tp)
    if layout.tp > 1 and model.lm_head is not None:
        box, _ = boxes["lm_head.weight"]
        model.lm_head = VocabParallelHead(  # type: ignore[assignment]
            model.lm_head.weight.data, box.offsets[0], box.lengths[0], ctx.tp)


def _param_specs(model: nn.Module, boxes: dict[str, tuple[Box, int | None]],
                 global_shapes: dict[str, tuple[int, ...]], norms: set[str], rules: RuleSet,
                 tp: int) -> list[ParamSpec]:
    """A spec per parameter of the wrapped model, each of which must have a block in ``boxes``."""
    specs = []
    for name, param in model.named_parameters():
        if name not in boxes:
            raise LayoutError(f"parallelize: parameter {name!r} has no block (internal naming error)")
        box, pad_dim = boxes[name]
        placement = rules.placement(name)
        specs.append(ParamSpec(name, param, global_shapes[name], box, pad_dim, placement.is_expert,
                               placement.tp_dim is not None and tp > 1,
                               tp > 1 and is_tp_partial_grad(name), name in norms))
    if len(specs) != len(boxes):
        raise LayoutError("parallelize: a parameter was lost while wrapping modules (internal error)")
    return specs


__all__ = ["RULES", "rules_of", "ParamSpec", "ParallelModel", "parallelize"]
