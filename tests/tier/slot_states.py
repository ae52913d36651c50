"""States and file helpers shared by the slot and pin-ahead tests of the memory tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ckpt


def state_of(step: int) -> dict[str, Any]:
    """The state saved at ``step``: a 6 MiB piece (several restore chunks), a bf16 one, int64, an empty
    one, and objects."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"big": torch.randn(3 << 19, generator=g),
                      "h": torch.randn(64, 33, generator=g).to(torch.bfloat16),
                      "ids": torch.randint(0, 1 << 40, (17,), generator=g),
                      "empty": torch.zeros(0)},
            "train": {"step": step, "name": f"s{step}"}}


def zeros() -> dict[str, Any]:
    """A restore target shaped like :func:`state_of`."""
    s = state_of(1)
    return {"model": {k: torch.zeros_like(v) for k, v in s["model"].items()}, "train": {"step": 0, "name": ""}}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ``a``'s tensors equal ``b``'s, bitwise."""
    return all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])


def data_file(url: str) -> Path:
    """The one data file of a one-rank checkpoint."""
    files = list(Path(url, "data").iterdir())
    assert len(files) == 1
    return files[0]


def flip(url: str, key: str, at: int, mask: int = 0x5A) -> None:
    """Flip the byte ``at`` bytes into ``key``'s stored piece (negative: from its end)."""
    s = ckpt.inspect(url).tensors[key].shards[0]
    pos = s.offset + (at if at >= 0 else s.length + at)
    with open(data_file(url), "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))
