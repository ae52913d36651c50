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
from dataclasses import dataclass
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
    pin = torch.cuda.is_available()
    free: queue.Queue[tuple[torch.Tensor, list[Any] | None]] = queue.Queue()
    for _ in range(min(2 * threads, len(todo))):
        free.put((torch.empty(slab, dtype=torch.uint8, pin_memory=pin), None))
    streams: dict[int, Any] = {}
    lock = threading.Lock()
    failed = threading.Event()
    devices = {t.device.index for t in targets if t.device.type == "cuda"}
    starts = {d: torch.cuda.current_stream(d) for d in devices}  # copies follow the caller's work so far

    def stream(dev: torch.device) -> Any:
        with lock:
            s = streams.get(dev.index)
            if s is None:
                s = streams[dev.index] = torch.cuda.Stream(device=dev)
                s.wait_stream(starts[dev.index])
            return s

    def one(batch: list[Part]) -> None:
        if failed.is_set():
            return
        buf, done = free.get()
        work, events = buf, {}
        try:
            for ev in done or ():
                ev.synchronize()
            need = batch[-1].offset + batch[-1].count * isz[batch[-1].req]
            if need > buf.numel():  # one row larger than a slab: a buffer of its own
                work = torch.empty(need, dtype=torch.uint8, pin_memory=pin)
            reqs, views = [], []
            for p in batch:
                r = requests[p.req]
                region = r.region if p.count == r.region.numel else sub_region(r.region, p.start, p.count)
                reqs.append(LoadRequest(r.key, r.dtype, r.shape, region))
                shape = getattr(region, "lengths", None)
                view = work[p.offset : p.offset + p.count * isz[p.req]].view(dts[p.req])
                views.append(view.view(shape if shape is not None else (p.count,)))
            run_reads(plan_reads(reqs), views, [r.dtype for r in reqs])
            for p, view in zip(batch, views, strict=True):
                dst = targets[p.req]
                part = dst if p.count == requests[p.req].region.numel else _part(dst, requests[p.req], p)
                if dst.device.type == "cuda":
                    s = stream(dst.device)
                    with torch.cuda.stream(s):
                        part.copy_(view.view(part.shape), non_blocking=True)
                    events[dst.device.index] = s
                else:
                    part.copy_(view.view(part.shape))
        except BaseException:
            failed.set()
            raise
        finally:
            recorded = []
            for s in events.values():  # copies run in order on each device's side stream
                ev = torch.cuda.Event()
                ev.record(s)
                recorded.append(ev)
            if work is not buf:
                for ev in recorded:
                    ev.synchronize()  # the one-off buffer may be freed only after its copies
            free.put((buf, recorded))

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-h2d") as ex:
        futures = [ex.submit(one, b) for b in todo]
        errors = [f.exception() for f in futures]
    for s in streams.values():
        s.synchronize()
    for e in errors:
        if e is not None:
            raise e


def _part(dst: torch.Tensor, req: LoadRequest, p: Part) -> torch.Tensor:
    """The part of target ``dst`` that part ``p`` fills: whole rows of a box, a range of a flat one."""
    lengths = getattr(req.region, "lengths", None)
    if lengths is None:  # a flat range: its target is 1-D
        return dst.view(-1).narrow(0, p.start, p.count)
    unit = math.prod(lengths[1:])
    return dst.narrow(0, p.start // unit, p.count // unit)


__all__ = ["ALIGN", "BOUNCE", "Part", "batches", "load_into_device"]
