"""Real FSDP2 x TP states for the framework tests: a small MLP block parallelized with
``parallelize_module`` (Colwise / Rowwise) on the ``tp`` mesh dim and ``fully_shard`` on ``dp``
(HSDP: ``dp_replicate`` x ``dp_shard``), trained one AdamW step on fixed data."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Block(torch.nn.Module):
    def __init__(self, dim: int = 12, hidden: int = 20, vocab: int = 10) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.out = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.out(h + self.down(torch.relu(self.up(h))))


def build(mesh_shape: tuple[int, ...], names: tuple[str, ...], *, train: bool = True, tie: bool = False) -> Any:
    """The model and AdamW on a mesh: ``("dp", "tp")``, ``("dp",)``, ``("tp",)``,
    ``("dp_replicate", "dp_shard", "tp")`` or ``()`` (one plain process)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Block()
    if tie:
        model.out.weight = model.emb.weight
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names) if names else None
    if mesh is not None and "tp" in names:
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
    if mesh is not None:
        dp = [n for n in names if n.startswith("dp")]
        if dp:
            fully_shard(model, mesh=mesh[tuple(dp)] if len(dp) > 1 else mesh[dp[0]])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if train:
        # TP ranks of one data-parallel group must see the same batch (rank-major mesh: tp is last)
        tp = mesh_shape[-1] if names and names[-1] == "tp" else 1
        g = torch.Generator().manual_seed(1 + (dist.get_rank() // tp if dist.is_initialized() else 0))
        idx = torch.randint(0, 10, (4, 6), generator=g)
        model(idx).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def state(model: Any, opt: Any, **options: Any) -> dict[str, Any]:
    """What torchtitan hands DCP: ``get_state_dict`` of model and optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(**options))
    return {"model": msd, "optim": osd}


def full(sd: Any) -> Any:
    """Every DTensor gathered to a full tensor (collective), plain tensors cloned, others as they are."""
    from torch.distributed.tensor import DTensor

    if isinstance(sd, dict):
        return {k: full(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [full(v) for v in sd]
    if isinstance(sd, DTensor):
        return sd.full_tensor().clone()
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    return sd


def equal(a: Any, b: Any, path: str = "") -> None:
    """Bitwise equality of two nested states (assertion naming the first difference)."""
    if isinstance(a, dict):
        assert set(a) == set(b), (path, sorted(set(a) ^ set(b)))
        for k in a:
            equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            equal(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, (path, a, b)
