"""ckpt.transfer on real forked gloo groups: layouts to layouts, bitwise; failures agreed on every
rank with dst untouched; CRC mismatches caught; delta sends nothing for an unchanged state."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import ckpt
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.multiproc

from ckpt import _transfer_exec as EX  # noqa: E402,N812


def _ref(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _rows(t: torch.Tensor, i: int, n: int) -> ckpt.Shard:
    cuts = [t.shape[0] * k // n for k in range(n + 1)]
    return ckpt.Shard(t[cuts[i]: cuts[i + 1]].clone(), tuple(t.shape), (cuts[i], 0))


def _cols(t: torch.Tensor, i: int, n: int, fill: float = 0.0) -> ckpt.Shard:
    cuts = [t.shape[1] * k // n for k in range(n + 1)]
    return ckpt.Shard(torch.full((t.shape[0], cuts[i + 1] - cuts[i]), fill, dtype=t.dtype), tuple(t.shape),
                      (0, cuts[i]))


def _expect_cols(t: torch.Tensor, s: ckpt.Shard) -> torch.Tensor:
    return t[:, s.offsets[1]: s.offsets[1] + s.local.shape[1]]


# --- same ranks: rows -> columns -------------------------------------------------------------


def _rows_to_cols(rank: int, world: int) -> None:
    w, b = _ref((7, 6)), _ref((5, 3), torch.bfloat16, 1)
    src = {"w": _rows(w, rank, world), "b": _rows(b, rank, world)}
    dst = {"w": _cols(w, rank, world), "b": _cols(b, rank, world)}
    r = ckpt.transfer(src, dst, bucket_bytes=64, window=2, checksum=True, timeout=60)
    assert torch.equal(dst["w"].local, _expect_cols(w, dst["w"]))
    assert torch.equal(dst["b"].local, _expect_cols(b, dst["b"]))
    assert r.version == 1 and r.bytes_sent + r.bytes_local == 7 * 6 * 4 + 5 * 3 * 2
    assert r.bytes_sent > 0 and r.buckets > 1 and r.bytes_skipped == 0


def test_same_ranks_rows_to_columns() -> None:
    run_ranks(2, _rows_to_cols)


# --- 2 senders -> 2 disjoint receivers, rename and cast -------------------------------------


def _disjoint(rank: int, world: int) -> None:
    w, e = _ref((9, 4)), _ref((4, 5), seed=2)
    if rank < 2:
        src, dst = {"layer": {"w": _rows(w, rank, 2), "e": _rows(e, rank, 2)}}, None
    else:
        src = None
        dst = {"model.w": _cols(w, rank - 2, 2, fill=-7), "model.e": ckpt.Shard(
            torch.zeros(4, 5, dtype=torch.float64), (4, 5), (0, 0))}
    r = ckpt.transfer(src, dst, rename=lambda k: k.replace("layer.", "model."), cast=True, timeout=60)
    assert r.bytes_local == 0 and r.bytes_sent == 9 * 4 * 4 + 2 * 4 * 5 * 4
    if rank >= 2:
        assert dst is not None
        assert torch.equal(dst["model.w"].local, _expect_cols(w, dst["model.w"]))
        assert torch.equal(dst["model.e"].local, e.double())
        assert r.rank_sent == 0 and r.rank_received > 0
    else:
        assert r.rank_received == 0 and r.rank_sent > 0


def test_two_senders_to_two_disjoint_receivers() -> None:
    run_ranks(4, _disjoint)


# --- replicated -> ZeRO flat ranges ---------------------------------------------------------


def _replicated_to_zero(rank: int, world: int) -> None:
    w = _ref((6, 5))
    n = w.numel()
    cuts = [0, 7, 7, 19, n]  # uneven, one empty range
    dst = {"exp_avg": ckpt.FlatShard(torch.zeros(cuts[rank + 1] - cuts[rank]), (6, 5), cuts[rank])}
    r = ckpt.transfer({"exp_avg": w.clone()}, dst, timeout=60)
    assert torch.equal(dst["exp_avg"].local, w.reshape(-1)[cuts[rank]: cuts[rank + 1]])
    assert r.bytes_sent == 0 and r.bytes_local == n * 4  # every receiver holds the replica: no network
    # replicas on ranks 0-1 only, ZeRO ranges on ranks 2-3: both holders share the sending
    src2 = {"p": w.clone()} if rank < 2 else None
    dst2 = None if rank < 2 else {"p": ckpt.FlatShard(torch.zeros(15), (6, 5), 15 * (rank - 2))}
    r2 = ckpt.transfer(src2, dst2, min_part=16, timeout=60)
    if rank < 2:
        assert r2.rank_sent > 0  # both holders send a part
    else:
        assert dst2 is not None and torch.equal(dst2["p"].local, w.reshape(-1)[15 * (rank - 2): 15 * (rank - 1)])


def test_replicated_to_zero_flat_ranges() -> None:
    run_ranks(4, _replicated_to_zero)


# --- DTensor Shard(0) -> Shard(1) on a real DeviceMesh ---------------------------------------


def _dtensor(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    w = _ref((10, 7))  # 7 columns over 2 ranks: 4, 3 (uneven, torch.chunk)

    def dt(local: torch.Tensor, dim: int) -> DTensor:
        # from_local: distribute_tensor's first call costs ~15 s of dispatch warm-up on this machine
        return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=w.shape, stride=w.stride())

    src = {"w": dt(w.chunk(world, 0)[rank].clone(), 0)}
    dst = {"w": dt(torch.zeros_like(w.chunk(world, 1)[rank]).contiguous(), 1)}
    ckpt.transfer(src, dst, bucket_bytes=128, timeout=60)
    assert torch.equal(dst["w"].to_local(), w.chunk(world, 1)[rank])


@pytest.mark.slow  # DTensor's first use costs each forked rank ~4 s (on 2 cores)
def test_dtensor_shard0_to_shard1() -> None:
    import torch.distributed.tensor  # noqa: F401 - imported once here, not in every forked rank (~1.4 s each)

    run_ranks(2, _dtensor)


# --- failures --------------------------------------------------------------------------------


def _raising_sender(rank: int, world: int) -> None:
    w = _ref((8, 4))
    src = {"w": _rows(w, rank, world)}
    before = _cols(w, rank, world, fill=3.0)
    dst = {"w": before}
    keep = before.local.clone()
    # a malformed state on one rank: every rank gets its typed error, before any byte moves
    with pytest.raises(ckpt.StateError, match=r"rank 2: transfer src must be a dict"):
        ckpt.transfer([w] if rank == 2 else src, dst, timeout=30)  # type: ignore[arg-type]
    assert torch.equal(dst["w"].local, keep)

    def fault(event: str, info: dict) -> None:
        if event == "pack" and rank == 1:
            raise RuntimeError("simulated sender failure")

    EX.FAULT = fault
    try:
        with pytest.raises(ckpt.CollectiveError, match=r"rank 1: RuntimeError: simulated sender failure") as ei:
            ckpt.transfer(src, dst, bucket_bytes=64, timeout=30)
        assert "no destination tensor was changed" in str(ei.value)
        assert torch.equal(dst["w"].local, keep)  # no partial version visible
    finally:
        EX.FAULT = None
    r = ckpt.transfer(src, dst, bucket_bytes=64, timeout=30)  # the group still works afterwards
    assert torch.equal(dst["w"].local, _expect_cols(w, dst["w"])) and r.version == 1


def test_a_raising_sender_fails_every_rank_and_leaves_dst_unchanged() -> None:
    run_ranks(3, _raising_sender)


def _corrupt(rank: int, world: int) -> None:
    w = _ref((6, 4))
    src = {"w": w.clone()} if rank == 0 else None
    dst = None if rank == 0 else {"w": torch.zeros(6, 4)}

    def fault(event: str, info: dict) -> None:
        if event == "packed":
            info["buf"][-1] ^= 0xFF  # one flipped byte on the wire, after the CRC was taken

    EX.FAULT = fault
    try:
        with pytest.raises(ckpt.IntegrityError, match=r"from rank 0 \(tensor 'w'\).*CRC32"):
            ckpt.transfer(src, dst, checksum=True, timeout=30)
        if dst is not None:
            assert torch.equal(dst["w"], torch.zeros(6, 4))
    finally:
        EX.FAULT = None


def test_crc_mismatch_is_detected_on_receive() -> None:
    run_ranks(2, _corrupt)


def _absent(rank: int, world: int) -> None:
    group = dist.new_group([0, 1, 2])
    if rank == 2:
        time.sleep(3)  # never calls transfer
        return
    w = _ref((4, 4))
    t0 = time.monotonic()
    with pytest.raises(ckpt.CollectiveError, match=r"transfer planning") as ei:
        ckpt.transfer({"w": w} if rank == 0 else None, {"w": torch.zeros(4, 4)} if rank == 1 else None,
                      group=group, timeout=1.5)
    if rank == 0:  # the coordinator names the missing rank; rank 1 sees its link to the coordinator close
        assert "rank(s) [2] did not report" in str(ei.value)
    assert time.monotonic() - t0 < 10


def test_an_absent_rank_is_named_within_the_timeout() -> None:
    run_ranks(3, _absent)


# --- delta -----------------------------------------------------------------------------------


def _delta(rank: int, world: int) -> None:
    a, b = _ref((8, 4)), _ref((4, 4), seed=3)
    src = {"a": _rows(a, rank, world), "b": _rows(b, rank, world)}
    dst = {"a": _cols(a, rank, world), "b": _cols(b, rank, world)}
    state = ckpt.TransferState()
    r1 = ckpt.transfer(src, dst, delta=True, state=state, timeout=60)
    total = (32 + 16) * 4
    assert r1.bytes_sent + r1.bytes_local == total and r1.bytes_skipped == 0 and r1.version == 1
    r2 = ckpt.transfer(src, dst, delta=True, state=state, timeout=60)
    assert r2.bytes_sent == 0 and r2.bytes_local == 0 and r2.bytes_skipped == total and r2.version == 2
    src["b"].local.add_(1)  # one piece changes on every rank: only "b" travels
    r3 = ckpt.transfer(src, dst, delta=True, state=state, timeout=60)
    assert r3.bytes_sent + r3.bytes_local == 16 * 4 and r3.bytes_skipped == 32 * 4
    assert torch.equal(dst["b"].local, _expect_cols(b + 1, dst["b"]))
    assert torch.equal(dst["a"].local, _expect_cols(a, dst["a"]))
    if rank == 1:
        dst["a"].local.zero_()  # a receiver overwrote its copy: what it needs comes again
    r4 = ckpt.transfer(src, dst, delta=True, state=state, timeout=60)
    assert r4.bytes_sent + r4.bytes_local == 8 * 2 * 4
    assert torch.equal(dst["a"].local, _expect_cols(a, dst["a"]))


def test_delta_sends_nothing_for_an_unchanged_state() -> None:
    run_ranks(2, _delta)


def _slow_sender(rank: int, world: int) -> None:
    w = _ref((4, 4))
    src = {"w": w.clone()} if rank == 0 else None
    dst = None if rank == 0 else {"w": torch.zeros(4, 4)}

    def fault(event: str, info: dict) -> None:
        if event == "pack":
            time.sleep(2.0)  # past the receiver's deadline, within the commit exchange's

    EX.FAULT = fault
    try:
        with pytest.raises(ckpt.CollectiveError, match=r"no message to or from rank 0 within 1.5 s"):
            ckpt.transfer(src, dst, timeout=1.5)
        if dst is not None:
            assert torch.equal(dst["w"], torch.zeros(4, 4))
    finally:
        EX.FAULT = None
    ckpt.transfer(src, dst, timeout=30)  # the closed data group is made anew on every rank
    if dst is not None:
        assert torch.equal(dst["w"], w)


def test_a_hung_sender_is_named_within_the_timeout_and_the_next_transfer_works() -> None:
    run_ranks(2, _slow_sender)


def _hung_sender(rank: int, world: int) -> None:
    """Rank 0 hangs while packing (longer than the data deadline and the commit exchange's wait
    after it): rank 1 names it within ``timeout`` after the data's deadline, while rank 0 still
    hangs, and its dst is unchanged. (A wait that gave up closed the metadata group: as for any
    hung rank, the job restarts.)"""
    w = _ref((4, 4))
    src = {"w": w.clone()} if rank == 0 else None
    dst = None if rank == 0 else {"w": torch.zeros(4, 4)}

    def fault(event: str, info: dict) -> None:
        if event == "pack":
            time.sleep(4.0)

    EX.FAULT = fault
    t0 = time.monotonic()
    try:
        with pytest.raises(ckpt.CollectiveError) as ei:
            ckpt.transfer(src, dst, timeout=0.5)
    finally:
        EX.FAULT = None
    took = time.monotonic() - t0
    if rank == 1:
        assert "rank(s) [0] did not report" in str(ei.value) or "rank 0 within 0.5 s" in str(ei.value), ei.value
        assert took < 3.5, took  # (deadline 0.5 s + the commit exchange's 0.5 s, with slack; rank 0 sleeps 4 s)
        assert dst is not None and torch.equal(dst["w"], torch.zeros(4, 4))


@pytest.mark.multiproc
def test_a_hung_sender_is_named_within_timeout_after_the_data_deadline() -> None:
    run_ranks(2, _hung_sender, barrier=False)  # (the metadata group, gloo's world group here, is closed after)
