"""Host staging for async saves: bounded, exact-size buffers filled in the background.

An async save copies what this rank writes out of the caller's tensors into host memory, so that
training can change them while the data goes to storage. Three rules shape this module:

1. **The caller never waits for memory.** Buffers are allocated (and, for GPU sources, pinned) by
   the staging thread, slab by slab, and each slab is filled as soon as it exists: the first save
   blocks no longer than the later ones; only ``staged()`` takes longer the first time (the
   handle's ``stats["alloc"]`` says how long allocation took).
2. **Pinned bytes ~= staged bytes.** PyTorch's pinned allocator rounds every block up to a power
   of two (1.4x the state for a typical model). Data is staged as byte *segments* into slabs whose
   sizes are powers of two (``SLAB`` each, the remainder decomposed into smaller powers of two down
   to ``GRAIN``), so a piece may span two slabs and no slab is rounded up.
3. **A cap makes a ring.** With ``max_staging_bytes`` below the staged size, slabs are reused in
   order: slot ``k`` waits until the writer has written slot ``k - N``; ``staged()`` returns when
   the last slot has been copied (later than without a cap: staging then runs at write speed).

zarr writes whole pieces (one chunk file per piece), so it stages each piece whole (``split=False``)
and accepts no cap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt._io import byte_view
from ckpt.errors import CheckpointError, StateError

SLAB = 64 << 20  # bytes per slab (a power of two: never rounded up by the pinned allocator)
GRAIN = 64 << 10  # smallest slab of the remainder
MIN_CAP = 2 << 20  # a ring needs two slots of at least 1 MiB


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, start + length)`` of piece ``piece``, staged at ``offset`` of slot ``slot``."""

    piece: int
    start: int
    length: int
    slot: int
    offset: int


@dataclass
class Plan:
    """Where each piece's bytes are staged. ``slot_sizes[k]``: bytes slot ``k`` can hold; slot ``k``
    lives in slab ``k % slabs`` (``slabs == len(slot_sizes)`` unless capped)."""

    by_piece: dict[int, list[Segment]]
    slots: list[list[Segment]]
    slot_sizes: list[int]
    slabs: int
    split: bool
    staged: int  # bytes copied out of the caller's tensors

    @property
    def capped(self) -> bool:
        return self.slabs < len(self.slot_sizes)

    @property
    def slab_bytes(self) -> int:
        """Host bytes the slabs take (what is pinned for GPU sources)."""
        return sum(self.slot_sizes[: self.slabs])


def _pow2_parts(n: int) -> list[int]:
    """``n`` rounded up to ``GRAIN``, as powers of two, largest first."""
    n = -(-n // GRAIN) * GRAIN
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def check_cap(cap: int | None, data_format: str = "safetensors") -> None:
    """Refuse a ``max_staging_bytes`` that cannot work (before any rank plans or writes anything).

    Raises:
        StateError: not an int, below ``MIN_CAP``, or given with ``data_format="zarr"`` (which
            stages whole pieces, one chunk file each).
    """
    if cap is None:
        return
    if not isinstance(cap, int) or isinstance(cap, bool):
        raise StateError(f"max_staging_bytes must be a number of bytes (int), got {cap!r}")
    if cap < MIN_CAP:
        raise StateError(f"max_staging_bytes={cap} is too small: give at least {MIN_CAP} bytes, or None")
    if data_format == "zarr":
        raise StateError("max_staging_bytes is not supported with data_format='zarr' (it stages whole pieces): "
                         "use data_format='safetensors' or leave the cap out")


def plan(pieces: list[tuple[int, int]], *, cap: int | None = None, split: bool = True) -> Plan:
    """Place ``pieces`` (``(piece index, nbytes)`` in write order) into slots.

    ``split``: pieces are cut into segments across slabs of ``SLAB`` bytes (else one slot per piece,
    of its exact size). ``cap``: at most that many staging bytes; slots then form a ring.

    Raises:
        StateError: see :func:`check_cap`.
    """
    total = sum(n for _, n in pieces)
    check_cap(cap, "safetensors" if split else "zarr")
    if not split:
        whole = [[Segment(p, 0, n, k, 0)] for k, (p, n) in enumerate(pieces)]
        return Plan({p: whole[k] for k, (p, _) in enumerate(pieces)}, whole, [n for _, n in pieces], len(pieces),
                    False, total)
    sizes = [SLAB] * (total // SLAB) + _pow2_parts(total % SLAB) if total % SLAB else [SLAB] * (total // SLAB)
    if cap is None or cap >= sum(sizes):  # (the slabs, not the bytes: the tail's parts round up to GRAIN)
        nslabs = len(sizes)
    else:
        size = min(SLAB, 1 << ((cap // 4).bit_length() - 1))  # four slots or more: the ring uses >= 3/4 of the cap
        nslabs = cap // size
        sizes = [size] * -(-total // size)
    by_piece: dict[int, list[Segment]] = {}
    slots: list[list[Segment]] = [[] for _ in sizes]
    k, used = 0, 0
    for p, n in pieces:
        segs = by_piece.setdefault(p, [])
        start = 0
        while start < n:
            if used == sizes[k]:
                k, used = k + 1, 0
            take = min(n - start, sizes[k] - used)
            seg = Segment(p, start, take, k, used)
            segs.append(seg)
            slots[k].append(seg)
            start, used = start + take, used + take
    return Plan(by_piece, slots, sizes, nslabs, True, total)


def _alloc(nbytes: int, pin: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data as a flat uint8 tensor on its device (a copy only when ``t`` is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


@dataclass
class StagingPool:
    """Slabs of one saver, kept across saves while the plan stays the same."""

    key: tuple[Any, ...] | None = None
    slabs: list[torch.Tensor | None] = field(default_factory=list)
    allocations: int = 0  # how many times the slabs were (re)planned: tests check steady state

    def reserve(self, key: tuple[Any, ...], nslabs: int) -> list[torch.Tensor | None]:
        """The slab list for ``key``: the old one when the plan is the same, else an empty one (the
        old slabs are dropped first). Slabs are allocated later, by the stager."""
        if key != self.key:
            self.slabs = [None] * nslabs  # the old slabs go now, before the stager allocates new ones
            self.key = key
            self.allocations += 1
        return self.slabs

    @property
    def nbytes(self) -> int:
        """Host bytes held now."""
        return sum(s.numel() for s in self.slabs if s is not None)


class Stager:
    """Copies ``views`` (this rank's pieces, any device) into the pool's slabs on its own thread,
    slot by slot, and hands the writer each segment's bytes once it is on the host."""

    def __init__(self, pool: StagingPool, views: list[torch.Tensor], pieces: list[int], *,
                 cap: int | None = None, split: bool = True):
        sizes = [(i, views[i].numel() * views[i].element_size()) for i in pieces]
        self.views = views
        self.plan = plan(sizes, cap=cap, split=split)
        self.pin = any(views[i].device.type == "cuda" for i in pieces)
        key = (tuple(sizes), self.pin, self.plan.capped, tuple(self.plan.slot_sizes[: self.plan.slabs]))
        self.slabs = pool.reserve(key, self.plan.slabs)
        self.cond = threading.Condition()
        self.ready = [False] * len(self.plan.slots)
        self.events: list[list[Any]] = [[] for _ in self.plan.slots]
        self.left = [len(s) for s in self.plan.slots]  # segments of a slot not yet written
        self.freed = [False] * len(self.plan.slots)
        self.error: BaseException | None = None
        self.aborted = False
        self.alloc_s = 0.0
        self.start_events: dict[int, Any] = {}
        self.streams: dict[int, Any] = {}
        if self.pin:  # the side streams start after the caller's work so far (recorded on its thread)
            for i in pieces:
                dev = views[i].device
                if dev.type == "cuda" and dev.index not in self.start_events:
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(dev))
                    self.start_events[dev.index] = ev

    # ---- the staging thread
    def run(self, streams: dict[int, Any]) -> None:
        """Stage every slot in order (call on the staging thread); errors are kept for the writer."""
        flats: dict[int, torch.Tensor] = {}
        last: dict[int, Any] = {}
        try:
            for k, segs in enumerate(self.plan.slots):
                m = k % self.plan.slabs
                with self.cond:
                    while k >= self.plan.slabs and not self.freed[k - self.plan.slabs] and not self.aborted:
                        self.cond.wait()
                    if self.aborted:
                        return
                buf = self.slabs[m]
                if buf is None:
                    t0 = time.perf_counter()
                    buf = self.slabs[m] = _alloc(self.plan.slot_sizes[m], self.pin)
                    self.alloc_s += time.perf_counter() - t0
                events: dict[int, Any] = {}  # device -> the event after this slot's copies
                for seg in segs:
                    src = self.views[seg.piece]
                    if seg.piece not in flats:
                        flats.clear()  # keep one piece's flat view (a copy when not contiguous)
                        flats[seg.piece] = self._flat(src, streams)
                    flat = flats[seg.piece]
                    dst = buf[seg.offset : seg.offset + seg.length]
                    if src.device.type == "cuda":
                        stream = self._stream(src.device, streams)
                        with torch.cuda.stream(stream):
                            dst.copy_(flat[seg.start : seg.start + seg.length], non_blocking=True)
                        events[src.device.index] = stream
                    else:
                        dst.copy_(flat[seg.start : seg.start + seg.length])
                recorded = []
                for dev, stream in events.items():
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    recorded.append(ev)
                    last[dev] = ev
                with self.cond:
                    self.events[k] = recorded
                    self.ready[k] = True
                    self.cond.notify_all()
            for ev in last.values():  # each device's copies run in order on its side stream
                ev.synchronize()
        except BaseException as e:  # noqa: BLE001 - the writer raises it as a CheckpointError
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _stream(self, dev: torch.device, streams: dict[int, Any]) -> Any:
        s = streams.get(dev.index)
        if s is None:
            s = streams[dev.index] = torch.cuda.Stream(device=dev)
        if dev.index not in self.streams:
            self.streams[dev.index] = s
            s.wait_event(self.start_events[dev.index])
        return s

    def _flat(self, src: torch.Tensor, streams: dict[int, Any]) -> torch.Tensor:
        if src.device.type != "cuda":
            return _flat_bytes(src)
        with torch.cuda.stream(self._stream(src.device, streams)):
            return _flat_bytes(src)  # a non-contiguous piece is made contiguous on the side stream

    def abort(self) -> None:
        """Stop staging (the writer failed): a thread waiting for a free slot returns."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    # ---- the writer's side
    def _wait(self, slot: int) -> None:
        with self.cond:
            while not self.ready[slot] and self.error is None:
                self.cond.wait()
            if self.error is not None and not self.ready[slot]:
                raise CheckpointError(f"staging failed: {self.error}") from self.error
            events = self.events[slot]
        for ev in events:
            ev.synchronize()

    def segments(self, piece: int) -> Iterator[memoryview]:
        """The bytes of ``piece``, segment by segment, each once it is staged. A segment's slot may
        be reused once the consumer asks for the next one: consume a segment before advancing."""
        for seg in self.plan.by_piece.get(piece, []):
            self._wait(seg.slot)
            buf = self.slabs[seg.slot % self.plan.slabs]
            assert buf is not None
            yield byte_view(buf[seg.offset : seg.offset + seg.length])
            with self.cond:
                self.left[seg.slot] -= 1
                if not self.left[seg.slot]:
                    self.freed[seg.slot] = True
                    self.cond.notify_all()

    def piece_tensor(self, piece: int) -> torch.Tensor:
        """A whole-piece plan's staged copy of ``piece``, shaped like it (waits until staged)."""
        assert not self.plan.split
        seg = self.plan.by_piece[piece][0]
        self._wait(seg.slot)
        buf = self.slabs[seg.slot]
        assert buf is not None
        src = self.views[piece]
        return buf.view(src.dtype).view(src.shape) if src.numel() else torch.empty(src.shape, dtype=src.dtype)


__all__ = ["GRAIN", "MIN_CAP", "SLAB", "Plan", "Segment", "Stager", "StagingPool", "check_cap", "plan"]
