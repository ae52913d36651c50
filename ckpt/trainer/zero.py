"""Data-parallel gradient reduction and AdamW with ZeRO-1 (optimizer state flat-sharded).

Per step, after backward:

1. q/k-norm gradients are summed over TP (each TP rank saw only its heads);
2. gradients are summed over each parameter's replica group (``dense``: ``dp x ep x sp``;
   ``expert``: ``dp x sp``) and divided by ``dp x ep`` (every data-parallel rank's loss is a mean
   over its own samples; expert gradients already hold their EP peers' tokens; the ``sp`` ranks of
   one data-parallel rank each hold their tokens' share of its mean, so their sum is that mean's
   gradient): with ZeRO-1 one bucketed
   reduce-scatter per group hands each rank just its ranges, else one all-reduce;
3. the global gradient norm counts each element once: ZeRO ranges partition a block over its replica
   group, and blocks replicated over TP count on TP rank 0 only;
4. AdamW (``torch.optim.AdamW``'s single-tensor arithmetic) updates this rank's flat range of each
   parameter's block, the range being ``optim_region`` of the rules (``zero_range``);
5. one all-gather per group puts every updated range back into every replica.

With ``zero=0`` the range is the whole block and step 5 vanishes. The state this holds is exactly
what a checkpoint stores under ``optim.exp_avg.<param>`` / ``optim.exp_avg_sq.<param>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ckpt.resharders.rules import optim_region
from ckpt.shards import Flat
from ckpt.trainer.parallel import Group, all_gather_flat, all_reduce_, reduce_scatter_flat
from ckpt.trainer.parallelize import ParallelModel, ParamSpec


@dataclass(frozen=True, slots=True)
class AdamWConfig:
    """AdamW hyperparameters (decoupled weight decay, applied to matrices only)."""

    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass(slots=True)
class _Slot:
    spec: ParamSpec
    start: int  # this rank's range of the block's flattening
    stop: int
    numel: int  # the block's numel
    chunk: int  # ceil(numel / group size): the all-gather stride
    exp_avg: Tensor
    exp_avg_sq: Tensor
    region: Any  # the rules' optim_region (Flat or Box)


class ZeroAdamW:
    """AdamW over a :class:`ParallelModel`'s blocks with ZeRO-1 when ``layout.zero == 1``.

    Example::

        opt = ZeroAdamW(pm, AdamWConfig())
        loss.backward(); norm = opt.step(lr=1e-3)
    """

    def __init__(self, pm: ParallelModel, cfg: AdamWConfig):
        self.pm, self.cfg = pm, cfg
        ctx = pm.ctx
        self.ctx = ctx
        self.step_count = 0
        self.groups: dict[str, Group] = {"dense": ctx.groups["dense"], "expert": ctx.groups["expert"]}
        self.slots: dict[str, list[_Slot]] = {"dense": [], "expert": []}
        for spec in pm.specs:
            region = optim_region(spec.name, spec.global_shape, ctx.layout, ctx.coord, pm.rules)
            kind = "expert" if spec.expert else "dense"
            n = spec.box.numel
            start, stop = (region.start, region.stop) if isinstance(region, Flat) else (0, n)
            size = self.groups[kind].size if ctx.layout.zero else 1
            zeros = torch.zeros(stop - start, dtype=torch.float32, device=ctx.device)
            self.slots[kind].append(_Slot(spec, start, stop, n, -(-n // size), zeros, zeros.clone(), region))

    # ------------------------------------------------------------------ state (for checkpoints)

    def all_slots(self) -> list[_Slot]:
        """Every parameter's optimizer slot, dense then expert."""
        return self.slots["dense"] + self.slots["expert"]

    # ------------------------------------------------------------------ the step

    def zero_grad(self) -> None:
        """Drop gradients (the next backward allocates them afresh)."""
        for spec in self.pm.specs:
            spec.param.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> float:
        """Reduce gradients, clip, update, re-replicate; returns the global gradient norm (pre-clip)."""
        self.reduce_tp_partial()
        grads = {kind: self.reduce(kind) for kind in self.slots}
        norm = self._grad_norm(grads)
        coef = min(self.cfg.grad_clip / (norm + 1e-6), 1.0) if self.cfg.grad_clip > 0 else 1.0
        self.step_count += 1
        for kind, slots in self.slots.items():
            for s, grad in zip(slots, grads[kind], strict=True):
                if self.cfg.grad_clip > 0:
                    grad = grad * coef  # as torch's clip_grad_norm_: always scaled by the clamped coef
                self._adamw(s, grad, lr)
            if self.ctx.layout.zero:
                self._gather(kind)
        self.zero_grad()
        return norm

    def reduce_tp_partial(self) -> None:
        """Sum over TP the gradients that each TP rank holds only a part of (q/k norms)."""
        partial = [s for s in self.pm.specs if s.tp_partial_grad]
        if not partial or self.ctx.tp.trivial:
            return
        flat = torch.cat([s.real_grad().reshape(-1) for s in partial])
        all_reduce_(flat, self.ctx.tp)
        offset = 0
        for s in partial:
            g = s.real_grad()
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def reduce(self, kind: str) -> list[Tensor]:
        """Each ``kind`` slot's range of the gradient, summed over the replica group and divided by
        ``dp x ep`` (not ``sp``: see the module docstring): one bucketed reduce-scatter with ZeRO-1
        (each rank receives only its ranges), else one all-reduce."""
        slots, group = self.slots[kind], self.groups[kind]
        if not slots:
            return []
        scale = 1.0 / self.ctx.data_world
        if self.ctx.layout.zero and not group.trivial:
            # Row g of the send buffer holds, for every slot, chunk g of its block's flattening (zero
            # padded to group.size x chunk): after the reduce-scatter this rank has its own chunks.
            width = sum(s.chunk for s in slots)
            send = torch.zeros(group.size, width, dtype=torch.float32, device=self.ctx.device)
            offset = 0
            for s in slots:
                padded = torch.zeros(group.size * s.chunk, dtype=torch.float32, device=self.ctx.device)
                padded[: s.numel] = s.spec.real_grad().reshape(-1)
                send[:, offset: offset + s.chunk] = padded.view(group.size, s.chunk)
                offset += s.chunk
            mine = reduce_scatter_flat(send.view(-1), group).mul_(scale)
            out, offset = [], 0
            for s in slots:
                out.append(mine[offset: offset + s.stop - s.start])
                offset += s.chunk
            return out
        flat = torch.cat([s.spec.real_grad().reshape(-1).float() for s in slots])
        all_reduce_(flat, group)
        if scale != 1.0:
            flat.mul_(scale)
        out, offset = [], 0
        for s in slots:
            out.append(flat[offset + s.start: offset + s.stop])
            offset += s.numel
        return out

    def _grad_norm(self, grads: dict[str, list[Tensor]]) -> float:
        coord, zero = self.ctx.coord, self.ctx.layout.zero
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for kind, slots in self.slots.items():
            for s, g in zip(slots, grads[kind], strict=True):
                # Count every global element once: the ZeRO ranges partition the replicas (or, with
                # zero=0, replica 0 counts), and a TP-replicated block counts on TP rank 0.
                counted = (s.spec.tp_split or coord.tp == 0) and (
                    zero == 1 or (coord.dp == 0 and coord.sp == 0 and (kind == "expert" or coord.ep == 0)))
                if counted:
                    total += g.double().pow(2).sum()
        all_reduce_(total, self.ctx.groups["world"])
        return math.sqrt(float(total))

    def _adamw(self, s: _Slot, grad: Tensor, lr: float) -> None:
        cfg = self.cfg
        param = s.spec.real().reshape(-1)[s.start: s.stop]  # a view: updates land in the parameter
        if cfg.weight_decay and not s.spec.norm:
            param.mul_(1 - lr * cfg.weight_decay)
        s.exp_avg.lerp_(grad, 1 - cfg.beta1)
        s.exp_avg_sq.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
        bias_correction1 = 1 - cfg.beta1 ** self.step_count
        bias_correction2 = 1 - cfg.beta2 ** self.step_count
        step_size = lr / bias_correction1
        denom = (s.exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(cfg.eps)
        param.addcdiv_(s.exp_avg, denom, value=-step_size)

    def _gather(self, kind: str) -> None:
        group = self.groups[kind]
        slots = self.slots[kind]
        if group.trivial or not slots:
            return
        width = sum(s.chunk for s in slots)
        send = torch.zeros(width, dtype=torch.float32, device=self.ctx.device)
        offset = 0
        for s in slots:
            send[offset: offset + s.stop - s.start] = s.spec.real().reshape(-1)[s.start: s.stop]
            offset += s.chunk
        out = all_gather_flat(send, group).view(group.size, width)
        offset = 0
        for s in slots:
            full = out[:, offset: offset + s.chunk].reshape(-1)[: s.numel]
            s.spec.real().view(-1).copy_(full)
            offset += s.chunk


@dataclass(slots=True)
class LRSchedule:
    """Linear warmup to ``base_lr`` over ``warmup`` steps, cosine decay to ``base_lr * min_ratio``
    at ``total``; its state is plain data (``train.lr_scheduler`` in a checkpoint)."""

    base_lr: float
    warmup: int
    total: int
    min_ratio: float = 0.1
    last_step: int = 0

    def lr(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based)."""
        if step < self.warmup:
            return self.base_lr * (step + 1) / self.warmup
        span = max(self.total - self.warmup, 1)
        progress = min((step - self.warmup) / span, 1.0)
        return self.base_lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def state_dict(self) -> dict[str, Any]:
        """Plain data: what ``train.lr_scheduler`` stores."""
        return {"kind": "warmup_cosine", "base_lr": self.base_lr, "warmup": self.warmup, "total": self.total,
                "min_ratio": self.min_ratio, "last_step": self.last_step}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; raises ValueError on another kind of schedule."""
        if d.get("kind") != "warmup_cosine":
            raise ValueError(f"train.lr_scheduler: unknown schedule kind {d.get('kind')!r}")
        self.base_lr, self.warmup, self.total = float(d["base_lr"]), int(d["warmup"]), int(d["total"])
        self.min_ratio, self.last_step = float(d["min_ratio"]), int(d["last_step"])


__all__ = ["AdamWConfig", "ZeroAdamW", "LRSchedule"]
