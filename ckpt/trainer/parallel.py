"""Process groups of a layout and the few collectives the trainer needs, as no-ops on one rank.

Every group comes from :class:`ckpt.layout.Layout` (rank order tp, sp, ep, dp, pp), the same
object the resharders read, so "who holds what" has one definition:

- ``tp``: tensor-parallel peers (same data, split weights);
- ``sp``: sequence-parallel peers (same samples, different tokens of them; LASP-2H's K/V all-gather);
- ``ep``: expert-parallel peers (different data, experts split): the all-to-all group;
- ``pp``: the pipeline (one rank per stage);
- ``dense``: replicas of a dense parameter (``dp x ep x sp``): gradient all-reduce and ZeRO-1 group;
- ``expert``: replicas of an expert parameter (``dp x sp``);
- ``world``.

Groups are created with ``new_group`` in the same order on every rank (``new_group`` is collective
over the world even for ranks outside the group). One code path for gloo (CPU) and NCCL (CUDA):
the backend follows the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckpt.errors import LayoutError
from ckpt.layout import AXES, Coord, Layout
from ckpt.resharders.rules import DENSE_REPLICAS, EXPERT_REPLICAS

# The replica groups are the rules' (ZeRO ranges and checkpoints agree with the reductions).
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "sp": ("sp",), "ep": ("ep",), "pp": ("pp",), "dense": DENSE_REPLICAS,
    "expert": EXPERT_REPLICAS, "world": AXES,
}


@dataclass(slots=True)
class Group:
    """This rank's group along some axes: member ranks (global), its index among them, the handle."""

    ranks: list[int]
    index: int
    pg: Any  # ProcessGroup, or None when the group is this rank alone

    @property
    def size(self) -> int:
        """Number of member ranks."""
        return len(self.ranks)

    @property
    def trivial(self) -> bool:
        """True when this rank is alone in the group: collectives are no-ops."""
        return self.pg is None


def pick_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto``: CUDA (this process's local GPU) when available, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise LayoutError("--device cuda was requested but torch.cuda.is_available() is False")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device_name: str = "auto") -> torch.device:
    """Join the process group torchrun describes (``env://``); pick and return this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_name, local_rank)
    if dist.is_initialized():
        return device
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one TCPStore for all restarts of the group. The rendezvous keys of a
        # killed attempt (e.g. gloo's listening addresses) would still be there and the next attempt
        # would dial dead peers ("Connection refused"), so every attempt works under its own prefix.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
        attempt = dist.PrefixStore(f"ckpt/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend_for(device), store=attempt, rank=rank, world_size=world, **kwargs)
    else:
        dist.init_process_group(backend_for(device), init_method="env://", **kwargs)
    return device


@dataclass(slots=True)
class ParallelContext:
    """A rank's place in a layout: coordinate, device and groups."""

    layout: Layout
    rank: int
    coord: Coord
    device: torch.device
    groups: dict[str, Group]

    @property
    def tp(self) -> Group:
        """Tensor-parallel peers."""
        return self.groups["tp"]

    @property
    def sp(self) -> Group:
        """Sequence-parallel peers (each holds a zigzag slice of the same samples)."""
        return self.groups["sp"]

    @property
    def ep(self) -> Group:
        """Expert-parallel peers (the all-to-all group)."""
        return self.groups["ep"]

    @property
    def pp(self) -> Group:
        """The pipeline: one rank per stage, in stage order."""
        return self.groups["pp"]

    @property
    def data_rank(self) -> int:
        """Index among the ``dp x ep`` ranks that see different samples (the ``sp`` ranks of one data rank
        share its samples, each holding a slice of their tokens)."""
        return self.coord.dp * self.layout.ep + self.coord.ep

    @property
    def data_world(self) -> int:
        """Number of ranks that see different samples (``dp x ep``)."""
        return self.layout.dp * self.layout.ep

    @property
    def is_first_stage(self) -> bool:
        """This rank's stage takes token ids."""
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank's stage computes the loss."""
        return self.coord.pp == self.layout.pp - 1

    @classmethod
    def create(cls, layout: Layout, device: torch.device | None = None) -> ParallelContext:
        """Build the groups of ``layout`` (collective when distributed).

        Raises LayoutError when the layout's world size differs from the process group's.
        """
        device = device or torch.device("cpu")
        if not dist.is_initialized():
            if layout.world_size != 1:
                raise LayoutError(f"layout {layout} needs {layout.world_size} ranks but torch.distributed is "
                                  "not initialized; launch with `ckpt train` (torchrun)")
            groups = {name: Group([0], 0, None) for name in GROUP_AXES}
            return cls(layout, 0, layout.coord(0), device, groups)
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != layout.world_size:
            raise LayoutError(f"layout {layout} needs {layout.world_size} ranks, the process group has {world}; "
                              "the launcher's process count must equal " + "*".join(AXES))
        groups = {}
        for name, axes in GROUP_AXES.items():
            mine: Group | None = None
            for ranks in layout.all_groups(axes):
                if len(ranks) == 1:
                    pg = None
                elif len(ranks) == world:
                    pg = dist.group.WORLD
                else:
                    pg = dist.new_group(ranks=ranks)  # collective: every rank creates every group
                if rank in ranks:
                    mine = Group(ranks, ranks.index(rank), pg)
            assert mine is not None
            groups[name] = mine
        return cls(layout, rank, layout.coord(rank), device, groups)


def all_reduce_(t: torch.Tensor, group: Group, op: Any = None) -> torch.Tensor:
    """In-place all-reduce (sum by default) over ``group``; nothing to do on a trivial group."""
    if not group.trivial:
        dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=group.pg)
    return t


def all_gather_flat(local: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate the equal-sized 1-D ``local`` of every member in group order."""
    if group.trivial:
        return local
    out = torch.empty(local.numel() * group.size, dtype=local.dtype, device=local.device)
    # all_gather_single is the 2.13 name; older torch (2.11 on the GPU box) has only the old one.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group.pg)
    return out


def reduce_scatter_flat(full: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum the 1-D ``full`` (``group.size`` equal chunks) over the group; return this member's chunk."""
    if group.trivial:
        return full
    out = torch.empty(full.numel() // group.size, dtype=full.dtype, device=full.device)
    # reduce_scatter_single is the 2.13 name; older torch (2.11 on the GPU box) has only the old one.
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, full, group=group.pg)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.pg)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group.pg)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    """Autograd-aware uneven all-to-all along dim 0: ``send[r]`` rows of ``x`` go to member ``r``,
    ``recv[r]`` rows come from it; the backward sends the gradients the opposite way."""
    return _AllToAll.apply(x, send, recv, group)


__all__ = ["GROUP_AXES", "Group", "pick_device", "backend_for", "init_distributed", "ParallelContext", "all_reduce_",
           "all_gather_flat", "reduce_scatter_flat", "all_to_all"]
