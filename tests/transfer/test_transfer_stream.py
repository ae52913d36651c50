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


def _names(stream: object) -> list[str]:
    return [n for n, _ in stream]  # type: ignore[attr-defined]


def test_a_delta_stream_sends_only_tensors_whose_sources_changed() -> None:
    full = _full()
    src = {k: v.clone() for k, v in full.items()}
    state = ckpt.TransferState()

    def stream(want: object = ALL, delta: bool = True) -> tuple[dict[str, torch.Tensor], object]:
        s = transfer_iter(src, want, names=_map(), stream_bytes=300, delta=delta, state=state)
        return dict(s), s.stats

    got, stats = stream()
    assert list(got) == list(_map()) and stats.bytes_skipped == 0 and stats.tensors_skipped == 0
    got, stats = stream()  # nothing changed: nothing sent, nothing yielded
    total = sum(t.numel() * 4 for t in _expected(full).values())
    assert got == {} and stats.bytes_skipped == total and stats.tensors_skipped == len(_map())
    assert stats.bytes_sent == 0 and stats.version == 2 and state.version == 2
    src["up"][1, 0, 0] += 1  # one element of one source tensor: only the fused tensor made of it travels
    got, stats = stream()
    want = _expected({k: v.clone() for k, v in src.items()})
    assert list(got) == ["gate_up"] and torch.equal(got["gate_up"], want["gate_up"])
    assert stats.bytes_skipped == total - want["gate_up"].numel() * 4
    # another catalog (a rank wants other names): everything it wants travels, then is unchanged
    assert list(stream(["emb"])[0]) == ["emb"] and stream(["emb"])[0] == {}
    # a stream that did not finish forgets: the next one sends everything
    partial = iter(transfer_iter(src, ALL, names=_map(), stream_bytes=1, delta=True, state=state))
    next(partial)  # the consumer takes one tensor and drops the stream
    partial.close()  # (what dropping a generator does)
    assert state.fingerprint is None
    assert list(stream()[0]) == list(_map())
    # a stream without delta hashes nothing: the next delta stream sends everything
    stream(delta=False)
    assert list(stream()[0]) == list(_map())


def _delta_ranks(rank: int, world: int) -> None:
    full = _full()
    e0 = rank * E // 2
    src = {"gate": ckpt.Shard(full["gate"][e0: e0 + E // 2].clone(), (E, INTER, H), (e0, 0, 0)),
           "up": ckpt.Shard(full["up"][e0: e0 + E // 2].clone(), (E, INTER, H), (e0, 0, 0)),
           "emb": full["emb"].clone()} if rank < 2 else None  # emb replicated on both senders
    want = ALL if rank == 2 else (["emb"] if rank == 0 else None)
    state = ckpt.TransferState()

    def stream(st: ckpt.TransferState, delta: bool = True) -> tuple[dict[str, torch.Tensor], object]:
        s = transfer_iter(src, want, names=_map(), stream_bytes=200, bucket_bytes=96, timeout=60, delta=delta,
                          state=st)
        return dict(s), s.stats

    got, _ = stream(state)
    assert len(got) == (len(_map()) if rank == 2 else 1 if rank == 0 else 0)
    if rank == 1:
        src["up"].local[0, 0, 0] += 1  # expert 2 of 'up', held by rank 1 only
    full["up"][2, 0, 0] += 1
    got, stats = stream(state)
    if rank == 2:
        assert list(got) == ["gate_up"] and torch.equal(got["gate_up"], _expected(full)["gate_up"])
    else:
        assert got == {}
    assert stats.bytes_skipped == sum(t.numel() * 4 for t in _expected(full).values()) - E * 2 * INTER * H * 4 + \
        H * 7 * 4  # the receivers' skipped bytes: rank 2's all but gate_up, and rank 0's emb
    # a receiver that lost its state (a restarted engine) gets everything again, and so does every rank
    got, _ = stream(ckpt.TransferState() if rank == 2 else state)
    assert len(got) == (len(_map()) if rank == 2 else 1 if rank == 0 else 0)
    # ranks that disagree on delta: the same typed error on every rank
    with pytest.raises(StateError, match=r"disagree on delta"):
        stream(state, delta=rank != 1)


@pytest.mark.multiproc
def test_ranks_delta_stream_sends_only_what_changed_on_any_sender() -> None:
    run_ranks(3, _delta_ranks)


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(st.one_of(
    st.tuples(st.just("edit"), st.sampled_from(["gate", "up", "emb"]), st.integers(0, 7)),
    st.tuples(st.just("stream"), st.sampled_from(["all", "some", "emb"]), st.integers(0, 8))), max_size=12))
def test_generated_delta_streams_leave_the_engine_bitwise_current(steps: list[tuple[str, str, int]]) -> None:
    """Sequences of source edits and delta streams (different wanted names, consumers that stop after
    a few tensors): after every stream that finished, the engine (the tensors it was ever handed,
    the last one per name) holds every wanted name bitwise as the sources now make it."""
    src = {k: v.clone() for k, v in _full().items()}
    state = ckpt.TransferState()
    engine: dict[str, torch.Tensor] = {}
    wants = {"all": ALL, "some": ["gate_up", "experts.1.gate"], "emb": ["emb"]}
    for kind, what, n in steps:
        if kind == "edit":
            flat = src[what].view(-1)
            flat[(n // 2) % flat.numel()] += 1 if n % 2 else -1  # (a later edit may undo an earlier one)
            continue
        stream = transfer_iter(src, wants[what], names=_map(), stream_bytes=150, delta=True, state=state)
        it = iter(stream)
        stop = n if n < 4 else None  # stop after n tensors, or go to the end
        for k, (name, t) in enumerate(it):
            engine[name] = t
            if stop is not None and k + 1 >= stop:
                break
        else:
            want = _expected(src)
            for name in want if what == "all" else wants[what]:
                assert torch.equal(engine[name], want[name]), name
            continue
        it.close()  # type: ignore[attr-defined]
