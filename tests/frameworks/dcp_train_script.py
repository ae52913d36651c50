"""A small FSDP2 training script written against torch.distributed.checkpoint's API, in the shape of
PyTorch's DCP tutorial and torchtitan (an AppState Stateful over get_state_dict / set_state_dict,
a per-rank dataloader state under ``dp_rank_<r>``).

tests/frameworks/test_dcp_switch.py runs it as it is, and with only its ``import ... as dcp`` line
switched to ``import ckpt.dcp as dcp``.
"""

import pickle

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard


class ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = torch.nn.Linear(16, 32)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(32, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class AppState(Stateful):
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class Loader(Stateful):
    """torchtitan keeps each data-parallel rank's loader state under its own key."""

    def __init__(self, rank):
        self.rank = rank
        self.position = 0

    def next_batch(self):
        g = torch.Generator().manual_seed(1000 * self.rank + self.position)
        self.position += 1
        return torch.randn(8, 16, generator=g)

    def state_dict(self):
        return {f"dp_rank_{self.rank}": pickle.dumps({"position": self.position})}

    def load_state_dict(self, state_dict):
        self.position = pickle.loads(state_dict[f"dp_rank_{self.rank}"])["position"]


def run(checkpoint_dir, steps, resume):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ToyModel()
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = Loader(rank)
    state_dict = {"app": AppState(model, optimizer), "dataloader": loader}
    if resume:
        dcp.load(state_dict, checkpoint_id=checkpoint_dir)
    for _ in range(steps):
        loss = model(loader.next_batch()).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dcp.save(state_dict, checkpoint_id=checkpoint_dir)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return full, loader.position
