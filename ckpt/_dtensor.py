"""Global regions of a DTensor's local tensor, for every placement DCP checkpoints.

``Shard(d)`` chunks the current local extent of dim ``d`` with ``torch.chunk`` semantics (chunks of
``ceil(n / k)``, trailing ones possibly empty). ``_StridedShard(d, split_factor=sf)`` (FSDP2 over a
TP-sharded dim) first splits that extent into ``sf`` pieces, chunks each piece ``k`` ways and keeps
the concatenation of this rank's chunk of every piece. ``Replicate`` keeps everything; ``Partial``
is refused (the values are not reduced yet). Placements apply left to right over the mesh dims, so
one tensor dim may be sharded over several mesh dims in any nesting.

Per tensor dim the local index set is a list of global intervals; the local tensor is their
Cartesian product. When every dim is one interval the local tensor is one box; otherwise it is
described by several boxes, each with a view (``narrow``) of the local tensor: no copy.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ckpt.errors import StateError
from ckpt.shards import Box

Intervals = list[tuple[int, int]]  # global [start, stop) runs, in local order


def _take(runs: Intervals, start: int, stop: int) -> Intervals:
    """The runs covering local positions ``[start, stop)`` of the concatenation of ``runs``."""
    out: Intervals = []
    pos = 0
    for a, b in runs:
        n = b - a
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += n
        if pos >= stop:
            break
    return out


def _length(runs: Intervals) -> int:
    return sum(b - a for a, b in runs)


def _chunk(runs: Intervals, k: int, c: int) -> Intervals:
    """``torch.chunk(x, k)[c]`` of the positions in ``runs`` (empty when there is no such chunk)."""
    m = _length(runs)
    size = -(-m // k) if m else 0
    return _take(runs, min(c * size, m), min((c + 1) * size, m))


def _strided(runs: Intervals, sf: int, k: int, c: int) -> Intervals:
    out: Intervals = []
    for j in range(sf):
        out += _chunk(_chunk(runs, sf, j), k, c)
    return _merge(out)


def _merge(runs: Intervals) -> Intervals:
    out: Intervals = []
    for a, b in runs:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def local_intervals(shape: tuple[int, ...], placements: list[tuple[str, int, int, int, int]]) -> list[Intervals]:
    """Pure: per tensor dim, the global runs this rank holds. ``placements`` are
    ``(kind, dim, split_factor, mesh_size, coordinate)`` with kind ``shard`` / ``strided`` / ``replicate``."""
    runs: list[Intervals] = [[(0, n)] if n else [] for n in shape]
    for kind, d, sf, k, c in placements:
        if kind == "replicate":
            continue
        runs[d] = _chunk(runs[d], k, c) if kind == "shard" else _strided(runs[d], sf, k, c)
    return runs


def dtensor_pieces(dt: Any, key: str) -> list[tuple[Box, torch.Tensor]]:
    """``(global box, local view)`` pieces of this rank's part of DTensor ``dt``; one piece when the
    local tensor is one box. A rank outside the mesh holds one empty piece. StateError for
    ``Partial`` or an unknown placement, naming the tensor."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    local = dt.to_local()
    shape = tuple(dt.shape)
    coord = dt.device_mesh.get_coordinate()
    if coord is None:  # this rank is not part of the mesh: it holds nothing
        return [(Box((0,) * len(shape), (0,) * len(shape)), local)]
    spec: list[tuple[str, int, int, int, int]] = []
    for mesh_dim, p in enumerate(dt.placements):
        if isinstance(p, Replicate):
            spec.append(("replicate", 0, 1, 1, 0))
            continue
        strided = type(p).__name__ == "_StridedShard"
        if not (isinstance(p, DShard) or strided):
            what = "Partial (unreduced values)" if type(p).__name__ == "Partial" else f"placement {p}"
            raise StateError(f"tensor {key!r}: DTensor with {what} cannot be checkpointed; reduce it first "
                             "(e.g. dt.redistribute(placements=[Replicate()]) or full_tensor())")
        d = p.dim if p.dim >= 0 else p.dim + len(shape)
        sf = int(p.split_factor) if strided else 1
        kind = "strided" if strided else "shard"
        spec.append((kind, d, sf, dt.device_mesh.size(mesh_dim), coord[mesh_dim]))
    runs = local_intervals(shape, spec)
    want = tuple(_length(r) for r in runs)
    if tuple(local.shape) != want:
        raise StateError(f"tensor {key!r}: DTensor local shape {tuple(local.shape)} does not match its placements "
                         f"{list(dt.placements)} (expected {want}); uneven custom layouts need ckpt.Shard")
    if any(not r for r in runs):  # nothing of this tensor here (an empty chunk)
        return [(Box(tuple(r[0][0] if len(r) == 1 else 0 for r in runs), want), local)]
    if all(len(r) == 1 for r in runs):
        return [(Box(tuple(r[0][0] for r in runs), want), local)]
    pieces = []
    # local offset of each run along its dim
    starts = [list(itertools.accumulate([0] + [b - a for a, b in r[:-1]])) for r in runs]
    for combo in itertools.product(*[range(len(r)) for r in runs]):
        view = local
        offs, lens = [], []
        for d, i in enumerate(combo):
            a, b = runs[d][i]
            view = view.narrow(d, starts[d][i], b - a)
            offs.append(a)
            lens.append(b - a)
        pieces.append((Box(tuple(offs), tuple(lens)), view))
    return pieces


__all__ = ["dtensor_pieces", "local_intervals"]
