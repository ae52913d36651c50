"""Pipeline parallelism through ``torch.distributed.pipelining``, and the forward/backward of one
step for any layout.

Each rank's module is its stage (layers split by global index, see :mod:`ckpt.trainer.parallelize`);
``PipelineStage`` wraps it on the ``pp`` group and ``ScheduleGPipe`` / ``Schedule1F1B`` run the
microbatches. Schedules scale gradients by ``1 / n_microbatches``, so the gradients are those of the
mean of the microbatch losses, which equals the mean over the rank's samples (equal-sized
microbatches of equal-length samples): the same objective as a single forward without pipelining.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ckpt.trainer.parallelize import ParallelModel


class ForwardBackward:
    """Runs forward and backward of one step on a rank's batch; returns the rank's mean loss on the
    last pipeline stage (None on other stages). Gradients are left in ``param.grad``."""

    def __init__(self, pm: ParallelModel, microbatches: int = 1, schedule: str = "1f1b"):
        self.pm = pm
        ctx = pm.ctx
        self.schedule: Any = None
        if ctx.layout.pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            stage = PipelineStage(pm.module, ctx.coord.pp, ctx.layout.pp, ctx.device, group=ctx.pp.pg)
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            # Every stage gets the loss function: schedules run backward only when they have one.
            self.schedule = cls(stage, microbatches, loss_fn=pm.loss_fn)

    def __call__(self, ids: Tensor, target: Tensor | None = None) -> Tensor | None:
        """Forward + backward on ``ids`` (local batch, seq); ``target``: what the loss function takes
        (:meth:`ParallelModel.loss_fn`; None: the ids, shifted inside)."""
        ctx = self.pm.ctx
        target = ids if target is None else target
        if self.schedule is None:
            loss = self.pm.loss_fn(self.pm.module(ids), target)
            loss.backward()
            return loss.detach()
        losses: list[Tensor] = []
        if ctx.is_first_stage:
            self.schedule.step(ids, return_outputs=False)
        elif ctx.is_last_stage:
            self.schedule.step(target=target, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        if not ctx.is_last_stage:
            return None
        return torch.stack([x.detach() for x in losses]).mean()


__all__ = ["ForwardBackward"]
