"""Loading into GPU tensors through a ring of pinned bounce buffers.

Copying from a memory-mapped file straight into a GPU tensor is a *pageable* host-to-device copy
(many times slower than one from pinned memory: measured in docs/BENCHMARKS.md, section "GPU
restores and synchronous GPU saves"), and staging the whole state in host memory first doubles the
host footprint. Instead, the device targets are cut into batches of at most ``BOUNCE`` bytes (a
large tensor into runs of whole rows, or of its flat range), and ``W`` threads each take the next
batch, read it into a free pinned slab with the ordinary read plan (page cache or disk straight into
pinned memory), and queue its host-to-device copies on a side stream. A slab is reused once its
copies are done, so reads from storage overlap the copies, and host memory stays at ``2 W`` slabs
whatever the state's size.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt._dtypes import dtype_from_name
from ckpt._load_plan import LoadRequest, ReadPlan
from ckpt._regions import sub_region

BOUNCE = 32 << 20  # bytes per pinned slab (a power of two: the pinned allocator does not round it up)
ALIGN = 64


@dataclass(frozen=True)
class Part:
    """Elements ``[start, start + count)`` of request ``req``'s local data, at ``offset`` of its batch's slab."""

    req: int
    start: int
    count: int
    offset: int


def batches(requests: list[LoadRequest], itemsizes: list[int], slab: int) -> list[list[Part]]:
    """Requests cut into batches of at most ``slab`` bytes each (parts start ``ALIGN``-aligned). A box
    is cut into whole rows and a flat range anywhere; a single row larger than ``slab`` gets a batch
    of its own, larger than the slab (the caller then allocates that one separately)."""
    out: list[list[Part]] = [[]]
    used = 0
    for i, r in enumerate(requests):
        n, isz = r.region.numel, itemsizes[i]
        if n == 0:
            continue
        lengths = getattr(r.region, "lengths", None)
        unit = math.prod(lengths[1:]) if lengths else 1  # a box is cut into whole rows
        start = 0
        while start < n:
            room = max(0, slab - used) // (unit * isz) * unit
            if room <= 0 and used:
                out.append([])
                used = 0
                continue
            count = min(n - start, max(room, unit))
            out[-1].append(Part(i, start, count, used))
            used = -(-(used + count * isz) // ALIGN) * ALIGN
            start += count
    return [b for b in out if b]


def load_into_device(requests: list[LoadRequest], targets: list[torch.Tensor],
                     plan_reads: Callable[[list[LoadRequest]], ReadPlan],
                     run_reads: Callable[[ReadPlan, list[torch.Tensor], list[str]], None], *,
                     threads: int = 4, slab: int | None = None) -> None:
    """Fill the device tensors ``targets`` (shaped like their requests' regions) with ``requests``.

    ``plan_reads(reqs)`` plans the reads of some requests (``planner.plan_load`` with the load's
    options) and ``run_reads(plan, host_targets, dtypes)`` executes one into contiguous host tensors.
    """
    slab = slab or BOUNCE
    dts = [dtype_from_name(r.dtype) for r in requests]
    isz = [torch.empty((), dtype=d).element_size() for d in dts]
    todo = batches(requests, isz, slab)
    if not todo:
        return
    threads = max(1, min(threads, len(todo)))
    ring = _Ring(requests, targets, plan_reads, run_reads, dts, isz, pin=torch.cuda.is_available())
    for _ in range(min(2 * threads, len(todo))):
        ring.free.put((torch.empty(slab, dtype=torch.uint8, pin_memory=ring.pin), None))
    devices = {t.device.index for t in targets if t.device.type == "cuda"}
    ring.starts = {d: torch.cuda.current_stream(d) for d in devices}  # copies follow the caller's work so far

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-h2d") as ex:
        futures = [ex.submit(ring.fill, b) for b in todo]
        errors = [f.exception() for f in futures]
    for s in ring.streams.values():
        s.synchronize()
    for e in errors:
        if e is not None:
            raise e


@dataclass
class _Ring:
    """What the threads of one :func:`load_into_device` share: the free slabs and each device's side stream."""

    requests: list[LoadRequest]
    targets: list[torch.Tensor]
    plan_reads: Callable[[list[LoadRequest]], ReadPlan]
    run_reads: Callable[[ReadPlan, list[torch.Tensor], list[str]], None]
    dts: list[torch.dtype]
    isz: list[int]  # bytes per element of each request
    pin: bool
    # (slab, events of its last copies: the slab is free once they are done)
    free: queue.Queue[tuple[torch.Tensor, list[Any] | None]] = field(default_factory=queue.Queue)
    streams: dict[int, Any] = field(default_factory=dict)  # device index -> its side stream
    starts: dict[int, Any] = field(default_factory=dict)  # device index -> the caller's stream
    lock: threading.Lock = field(default_factory=threading.Lock)
    failed: threading.Event = field(default_factory=threading.Event)

    def stream(self, dev: torch.device) -> Any:
        """The side stream of ``dev``, created on first use after the caller's work so far."""
        with self.lock:
            s = self.streams.get(dev.index)
            if s is None:
                s = self.streams[dev.index] = torch.cuda.Stream(device=dev)
                s.wait_stream(self.starts[dev.index])
            return s

    def fill(self, batch: list[Part]) -> None:
        """Read ``batch`` into a free slab and queue its copies into the targets (one pool thread's job)."""
        if self.failed.is_set():
            return
        buf, done = self.free.get()
        work = buf
        events: dict[int, Any] = {}  # device index -> the side stream this batch's copies were queued on
        try:
            for ev in done or ():
                ev.synchronize()
            last = batch[-1]
            need = last.offset + last.count * self.isz[last.req]
            if need > buf.numel():  # one row larger than a slab: a buffer of its own
                work = torch.empty(need, dtype=torch.uint8, pin_memory=self.pin)
            reqs, views = self._views(batch, work)
            self.run_reads(self.plan_reads(reqs), views, [r.dtype for r in reqs])
            self._copy(batch, views, events)
        except BaseException:
            self.failed.set()
            raise
        finally:
            self._release(buf, work, events)

    def _views(self, batch: list[Part], work: torch.Tensor) -> tuple[list[LoadRequest], list[torch.Tensor]]:
        """The requests of ``batch``'s parts, and the views of ``work`` their reads fill."""
        reqs, views = [], []
        for p in batch:
            r = self.requests[p.req]
            region = r.region if p.count == r.region.numel else sub_region(r.region, p.start, p.count)
            reqs.append(LoadRequest(r.key, r.dtype, r.shape, region))
            shape = getattr(region, "lengths", None)
            view = work[p.offset : p.offset + p.count * self.isz[p.req]].view(self.dts[p.req])
            views.append(view.view(shape if shape is not None else (p.count,)))
        return reqs, views

    def _copy(self, batch: list[Part], views: list[torch.Tensor], events: dict[int, Any]) -> None:
        """Copy each part into its target: queued on the device's side stream (noted in ``events``) for GPU ones."""
        for p, view in zip(batch, views, strict=True):
            dst = self.targets[p.req]
            part = dst if p.count == self.requests[p.req].region.numel else _part(dst, self.requests[p.req], p)
            if dst.device.type == "cuda":
                s = self.stream(dst.device)
                with torch.cuda.stream(s):
                    part.copy_(view.view(part.shape), non_blocking=True)
                events[dst.device.index] = s
            else:
                part.copy_(view.view(part.shape))

    def _release(self, buf: torch.Tensor, work: torch.Tensor, events: dict[int, Any]) -> None:
        """Give slab ``buf`` back with events for the copies queued from it (waited here for a one-off ``work``)."""
        recorded = []
        for s in events.values():  # copies run in order on each device's side stream
            ev = torch.cuda.Event()
            ev.record(s)
            recorded.append(ev)
        if work is not buf:
            for ev in recorded:
                ev.synchronize()  # the one-off buffer may be freed only after its copies
        self.free.put((buf, recorded))


def _part(dst: torch.Tensor, req: LoadRequest, p: Part) -> torch.Tensor:
    """The part of target ``dst`` that part ``p`` fills: whole rows of a box, a range of a flat one."""
    lengths = getattr(req.region, "lengths", None)
    if lengths is None:  # a flat range: its target is 1-D
        return dst.view(-1).narrow(0, p.start, p.count)
    unit = math.prod(lengths[1:])
    return dst.narrow(0, p.start // unit, p.count // unit)


__all__ = ["ALIGN", "BOUNCE", "Part", "batches", "load_into_device"]
