"""ckpt.transfer_iter: destination tensors streamed as (name, tensor) pairs in waves bounded by
stream_bytes, assembled through a name map (stacked experts to per-expert tensors, two tensors to
one fused one), bitwise; in one process and on forked gloo ranks (senders and receivers disjoint)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import MismatchError, StateError
from ckpt.hf.mapping import Map, Run, Target, whole
from ckpt.transfer_stream import ALL, transfer_iter
from tests.dist_utils import run_ranks

E, INTER, H = 4, 3, 5  # experts, intermediate, hidden


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"gate": torch.randn(E, INTER, H, generator=g), "up": torch.randn(E, INTER, H, generator=g),
            "emb": torch.randn(7, H, generator=g)}


def _map() -> Map:
    """HF-like names: per-expert gate, a fused gate_up (gate and up rows of each expert interleaved),
    and the embedding as is."""
    m: Map = {f"experts.{e}.gate": Target((INTER, H), [Run("gate", e * INTER * H, INTER * H)]) for e in range(E)}
    runs = [Run(n, e * INTER * H, INTER * H) for e in range(E) for n in ("gate", "up")]
    m["gate_up"] = Target((E, 2 * INTER, H), runs)
    m["emb"] = whole("emb", (7, H))
    return m


def _expected(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {f"experts.{e}.gate": full["gate"][e] for e in range(E)}
    out["gate_up"] = torch.cat([full["gate"], full["up"]], dim=1)
    out["emb"] = full["emb"]
    return out


@settings(max_examples=20, deadline=None)
@given(stream_bytes=st.integers(1, 1200))
def test_single_process_stream_is_bitwise_and_waves_are_bounded(stream_bytes: int) -> None:
    full = _full()
    stream = transfer_iter({k: v.clone() for k, v in full.items()}, ALL, names=_map(), stream_bytes=stream_bytes,
                           bucket_bytes=128)
    got = list(stream)
    want = _expected(full)
    assert [n for n, _ in got] == list(_map())  # the map's order
    for name, t in got:
        assert torch.equal(t, want[name]), name
    biggest = max(t.numel() * 4 for t in want.values())
    assert stream.stats.peak_wave_bytes <= max(stream_bytes, biggest)
    assert stream.stats.tensors == len(want) and stream.stats.version == 1


def test_stream_errors_are_typed() -> None:
    full = _full()
    with pytest.raises(MismatchError, match=r"'nope'.*name map does not define"):
        list(transfer_iter(full, ["nope"], names=_map()))
    with pytest.raises(MismatchError, match=r"'nope': rank 0 wants it but no sender holds it"):
        list(transfer_iter(full, ["nope"]))
    with pytest.raises(StateError, match=r"list of names"):
        list(transfer_iter(full, "emb"))
    with pytest.raises(StateError, match=r"stream_bytes"):
        transfer_iter(full, ALL, stream_bytes=0)
    stream = transfer_iter(full, ["emb"], dtype=torch.bfloat16)  # cast on receive
    assert [(n, t.dtype) for n, t in stream] == [("emb", torch.bfloat16)]
    with pytest.raises(StateError, match=r"iterated once"):
        iter(stream)


def _ranks(rank: int, world: int) -> None:
    full = _full()
    # ranks 0-1 train: experts split over ep (dim 0), the embedding's columns split over tp
    if rank < 2:
        e0, c0 = rank * E // 2, rank * H // 2
        c1 = (rank + 1) * H // 2
        src = {"gate": ckpt.Shard(full["gate"][e0: e0 + E // 2].clone(), (E, INTER, H), (e0, 0, 0)),
               "up": ckpt.Shard(full["up"][e0: e0 + E // 2].clone(), (E, INTER, H), (e0, 0, 0)),
               "emb": ckpt.Shard(full["emb"][:, c0:c1].clone(), (7, H), (0, c0))}
    else:
        src = None
    want = ALL if rank == 2 else (["emb"] if rank == 0 else None)
    stream = transfer_iter(src, want, names=_map(), stream_bytes=200, bucket_bytes=96, checksum=True, timeout=60)
    got = dict(stream)
    expected = _expected(full)
    if rank == 2:
        assert list(got) == list(_map())
        assert all(torch.equal(got[k], expected[k]) for k in got)
        assert stream.stats.waves > 2 and stream.stats.rank_received > 0
    elif rank == 0:
        assert list(got) == ["emb"] and torch.equal(got["emb"], full["emb"])
    else:
        assert got == {}
    with pytest.raises(MismatchError, match=r"'missing'"):
        list(transfer_iter(src, ["missing"] if rank == 2 else None, names=_map(), timeout=60))


@pytest.mark.multiproc
def test_ranks_stream_per_expert_and_fused_names() -> None:
    run_ranks(3, _ranks)
