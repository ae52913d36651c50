"""Global regions of DTensor local tensors (ckpt/_dtensor.py): pure checks against torch.chunk, and
real DTensors (Shard, _StridedShard in any nesting, Replicate, uneven sizes) on 4 gloo ranks."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt._dtensor import local_intervals
from tests.dist_utils import run_ranks


def _brute(n: int, spec: list[tuple[str, int, int, int]], coords: list[int]) -> list[int]:
    """The indices a rank holds along one dim, by applying DTensor's splitting to an arange."""
    x = torch.arange(n)
    for (kind, sf, k, _), c in zip(spec, coords, strict=True):
        if kind == "replicate":
            continue
        if kind == "shard":
            ch = list(torch.chunk(x, k)) if len(x) else []
            x = ch[c] if c < len(ch) else x[:0]
        else:
            pieces = list(torch.chunk(x, sf)) if len(x) else []
            parts = []
            for p in pieces:
                ch = list(torch.chunk(p, k)) if len(p) else []
                parts.append(ch[c] if c < len(ch) else p[:0])
            x = torch.cat(parts) if parts else x[:0]
    return x.tolist()


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 40), data=st.data())
def test_intervals_match_dtensor_splitting(n, data):
    depth = data.draw(st.integers(1, 3))
    spec = [(data.draw(st.sampled_from(["shard", "strided", "replicate"])), data.draw(st.integers(1, 4)),
             data.draw(st.integers(1, 4)), 0) for _ in range(depth)]
    coords = [data.draw(st.integers(0, k - 1)) for (_, _, k, _) in spec]
    runs = local_intervals((n,), [(kind, 0, sf, k, c) for (kind, sf, k, _), c in zip(spec, coords, strict=True)])[0]
    got = [i for a, b in runs for i in range(a, b)]
    assert got == _brute(n, spec, coords)


def _real(rank: int, world: int, seed: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckpt._dtensor import dtensor_pieces

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rng = random.Random(seed)
    strided_seen = 0
    for _ in range(16):
        shape = (rng.randint(1, 9), rng.randint(1, 7))
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        opts = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=2)]
        placements = [rng.choice(opts), rng.choice(opts[:3])]
        try:
            dt = distribute_tensor(full, mesh, placements)
        except Exception:  # noqa: BLE001 - a combination DTensor itself does not build
            continue
        strided_seen += isinstance(placements[0], _StridedShard)
        covered = torch.zeros(shape)
        for box, view in dtensor_pieces(dt, "t"):
            idx = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))
            assert torch.equal(view, full[idx]), (placements, box)
            covered[idx] += 1
        # every element is held by exactly as many ranks as replicate it: at least this rank's share
        assert covered.sum() == dt.to_local().numel()
    assert strided_seen >= 2  # the strided placements were built and checked, not skipped


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("seed", [0, 1])
def test_real_dtensor_pieces_hold_the_right_elements(seed):
    run_ranks(4, _real, seed)
