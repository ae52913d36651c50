"""The training thread's part of a memory checkpoint: copy this rank's pieces into host buffers that
are allocated once and reused, so that the write to shared memory and the copy to a peer can run on a
background thread while training changes its tensors.

Why not :class:`ckpt._staging.Stager`: it stages byte *segments* into power-of-two slabs for a writer
that streams them into files, filling them on its own thread while the caller waits for
``staged()``. The tier's background writer is ``ckpt.save`` of whole tensors (one ordinary
checkpoint per rank), so the natural buffer here is one host tensor per piece, shaped like it,
kept across steps while the pieces keep their keys, dtypes and shapes (the usual case: the same
model every step). First touch of fresh memory is what makes copies slow on a CPU host (several
times slower than into touched memory: measured in docs/BENCHMARKS.md, section "Save and load,
single process (CPU)" under Caveats, and section "Figures that code comments used to quote"): reuse
is the point.

GPU pieces are copied into pinned buffers on a side stream that starts after the work queued so far
on the current stream; the current stream then waits for the copies (so later in-place updates,
e.g. ``optimizer.step()``, cannot overtake them) and the background thread synchronizes on their
event before writing. The training thread itself never blocks on the GPU copy.

With ``deferred=True`` the current stream is *not* made to wait at once: the caller promises to
call :meth:`Snapshot.staged` before anything changes the state's tensors in place (the trainer does
it right before ``optimizer.step()``), so the copies overlap the next forward and backward instead
of holding them up: an 8 GB state's copies take a large part of a training step even at pinned
speed (measured in docs/BENCHMARKS.md, section "Memory tier on one H200", "Deferred fence").

With a slot (:mod:`ckpt.tier.slots`) the buffers are the slot's views: the copies land in the
shared-memory data file itself, and nothing is written again.

With ``stage_on_device`` the GPU pieces are first copied into one device buffer per GPU, kept
across steps (a device-to-device copy: ~1.5 TB/s on an H100 against ~25-50 GB/s to the host), and
the fence owed before the optimizer's update is that copy's only. A :class:`Drain` thread then
copies the staged bytes to the host buffers in groups of :data:`LANDED_EVERY` bytes, at the pace
of the tier's :class:`ckpt.tier.pace.Pacer`, while training goes on: the update never waits for the
host, and the traffic through host memory can be spread over several steps. It costs the state's
size in device memory; when that cannot be allocated, the snapshot copies to the host directly
(with a warning) and staging is off for the rest of the run.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt.shards import PerRank
from ckpt.tier.pace import Pacer


@dataclass(slots=True)
class Snapshot:
    """One memory checkpoint's host copy: ``flat`` as :func:`ckpt.tier.store.localize` made it, with
    every tensor replaced by its host buffer and every object by a deep copy. ``landed``: the CUDA
    events to wait for before reading the buffers (empty on CPU)."""

    flat: dict[str, Any]
    nbytes: int = 0
    slot: Any = None  # the ckpt.tier.slots.Slot the buffers live in, if any
    fences: list[tuple[Any, Any]] = field(default_factory=list)  # (device, event) the current stream still owes
    landed: dict[str, Any] = field(default_factory=dict)  # key -> the event after its copy (GPU pieces)
    _waiter: Landing | None = None  # started by the first wait on ``landed`` (a Drain at once if staged)

    def ready(self) -> None:
        """Block until every device-to-host copy has landed (call on the background thread). Raises
        what the CUDA wait raised."""
        if self.landed:
            landing = self._landing()
            landing.wait(len(landing.events) - 1)  # waited in order: the last one landed, all did

    def first_landed(self) -> None:
        """Block until the first GPU copies have landed (nothing on CPU); the background thread calls
        it before its Python work. Why: it starts while the training thread is still in
        ``save_async``, and a thread running Python keeps the GIL for up to the switch interval
        (``sys.getswitchinterval()``): the training thread then waited to return and to launch the
        next step's first kernels, with the GPU idle after the step's sync. The first landed copy
        (``LANDED_EVERY`` bytes: a short wait) lets it launch a queue of work first."""
        if self.landed:
            self._landing().wait(0)

    def wait_piece(self, key: str) -> None:
        """Block until ``key``'s device-to-host copy has landed (the checksums of the pieces copied
        first start while the later ones are still copying). Raises what the CUDA wait raised."""
        ev = self.landed.get(key)
        if ev is not None:
            landing = self._landing()
            landing.wait(landing.index[id(ev)])

    def _landing(self) -> Landing:
        with _LANDING_LOCK:  # checksum threads may ask first, at once: one waiter thread all the same
            if self._waiter is None:
                self._waiter = Landing(list(self.landed.values()))
            return self._waiter

    def staged(self) -> None:
        """Make the current stream wait for the device-to-host copies (deferred snapshots: call on the
        training thread before changing the state in place). Idempotent; cheap (no host wait)."""
        fences, self.fences = self.fences, []
        for dev, ev in fences:
            torch.cuda.current_stream(dev).wait_event(ev)


_LANDING_LOCK = threading.Lock()
LANDED_EVERY = 64 << 20  # GPU bytes copied between two "landed" events (see Snapshot.wait_piece)


def landed_event() -> Any:
    """An event a background thread waits for in ``synchronize()``: a blocking one, whose waiter
    sleeps until it completes. Why: with CUDA's default schedule the waiter spins a core for as
    long as the copies take (seconds per memory checkpoint, or for the whole drain when paced),
    beside a training thread that needs its cores and its host memory bandwidth to launch."""
    return torch.cuda.Event(blocking=True)


class Landing:
    """One thread that waits for a snapshot's "landed" events in order, in ``Event.synchronize()``,
    which holds no GIL, and wakes the waiters of each as it lands.

    Why: the checksum threads used to poll the events themselves every 0.5 ms. A poll needs the GIL;
    while the training thread runs Python without pause (a launch-bound step) each poll waited out
    the switch interval and then forced the training thread to hand the GIL over: a launch-bound
    step slowed clearly more when each checksum thread polled for its piece than when they all
    started after the copies (measured in docs/BENCHMARKS.md, section "Memory tier, third pass").
    Here the GIL is taken once per event (an event every ``LANDED_EVERY`` bytes) by this thread and
    once per piece by its checksum thread. The events are blocking (:func:`landed_event`): the
    waiter sleeps, no core spins."""

    def __init__(self, events: list[Any]):
        self.events = list({id(ev): ev for ev in events}.values())  # distinct, in order
        self.index = {id(ev): i for i, ev in enumerate(self.events)}
        self._flags = [threading.Event() for _ in self.events]
        self._error: BaseException | None = None
        self._failed_at = len(self.events)  # the first event whose wait raised
        threading.Thread(target=self._run, daemon=True, name="ckpt-memory-tier-landing").start()

    def _run(self) -> None:
        current = None
        for i, (ev, flag) in enumerate(zip(self.events, self._flags, strict=True)):
            try:
                dev = getattr(ev, "device", None)
                if isinstance(dev, torch.device) and dev.type == "cuda" and dev != current:
                    # a new thread's current device is 0: without this, a rank on another GPU
                    # would make a CUDA context on GPU 0 for the wait
                    torch.cuda.set_device(dev)
                    current = dev
                ev.synchronize()
            except BaseException as e:  # noqa: BLE001 - a CUDA error: the waiters of it and of later ones raise it
                self._fail(i, e)
                return
            flag.set()

    def _fail(self, i: int, e: BaseException) -> None:
        """Event ``i`` and every later one failed with ``e``: wake their waiters, who raise it."""
        self._error, self._failed_at = e, i
        for f in self._flags[i:]:
            f.set()

    def settle(self) -> None:
        """Block until every event has landed or failed; never raises (the snapshot's own waiters
        reported any failure)."""
        if self._flags:
            self._flags[-1].wait()

    def wait(self, i: int) -> None:
        """Block until event ``i`` (in landing order) has landed; raise the CUDA wait's error if that
        event's wait, or an earlier one's, failed."""
        self._flags[i].wait()
        if i >= self._failed_at:
            assert self._error is not None
            raise self._error


class Drain(Landing):
    """The device-to-host half of a staged snapshot (see the module docstring): one thread queues
    each group's copies from the device staging buffer to the host buffers on the copy stream,
    records the group's event and, two groups behind, waits for it in ``Event.synchronize()`` (no
    GIL) and wakes its waiters; ``pace`` is paid before each group is queued. The copy stream
    already waits for the staging copies (queued before on the same stream)."""

    DEPTH = 2  # groups queued ahead of the one waited for: the copy engine never idles on the host

    def __init__(self, events: list[Any], groups: list[list[tuple[torch.Tensor, torch.Tensor]]], stream: Any,
                 pace: Pacer):
        self._groups = groups
        self._stream = stream
        self._pace = pace
        super().__init__(events)

    def _run(self) -> None:
        try:
            self._drain()
        finally:
            self._groups = []  # the device views: not kept past the drain

    def _drain(self) -> None:
        pending: deque[int] = deque()
        try:
            torch.cuda.set_device(self._stream.device)
        except BaseException as e:  # noqa: BLE001 - a CUDA error: every waiter raises it
            self._fail(0, e)
            return
        for i, (ev, copies) in enumerate(zip(self.events, self._groups, strict=True)):
            try:
                self._pace.take(sum(d.numel() * d.element_size() for d, _s in copies))
                with torch.cuda.stream(self._stream):
                    for dst, src in copies:
                        dst.copy_(src, non_blocking=True)
                    ev.record(self._stream)
            except BaseException as e:  # noqa: BLE001 - queueing group i failed: the groups before may land
                while pending:
                    if not self._land_next(pending):
                        return
                self._fail(i, e)
                return
            pending.append(i)
            while len(pending) > self.DEPTH:
                if not self._land_next(pending):
                    return
        while pending:
            if not self._land_next(pending):
                return

    def _land_next(self, pending: deque[int]) -> bool:
        """Wait for the oldest pending group and wake its waiters; False when its wait failed (its
        waiters and every later one's raise the error)."""
        j = pending.popleft()
        try:
            self.events[j].synchronize()
        except BaseException as e:  # noqa: BLE001 - a CUDA error
            self._fail(j, e)
            return False
        self._flags[j].set()
        return True


class DeviceStage:
    """One device buffer per GPU holding a staged copy of that GPU's pieces (see the module
    docstring), reallocated only when the pieces' keys, dtypes or shapes change."""

    def __init__(self) -> None:
        self._key: dict[int, tuple[Any, ...]] = {}
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._sizes: dict[int, int] = {}
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Device bytes held now."""
        return sum(self._sizes.values())

    def views(self, dev: int, pieces: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``dev``'s staging views, one per ``(key, source)``, contiguous and shaped like it.

        Raises torch.OutOfMemoryError when the device cannot hold them (nothing is kept then)."""
        key = tuple((k, v.dtype, tuple(v.shape)) for k, v in pieces)
        if self._key.get(dev) != key:
            self._views.pop(dev, None)  # the old buffer goes before the new one is allocated
            self._key.pop(dev, None)
            self._sizes.pop(dev, None)
            places, size = stage_layout([(v.dtype, tuple(v.shape)) for _k, v in pieces])
            flat = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", dev))
            self._sizes[dev] = size
            self._views[dev] = {k: flat[o:o + n].view(v.dtype).view(v.shape)
                                for (k, v), (o, n) in zip(pieces, places, strict=True)}
            self._key[dev] = key
            self.allocations += 1
        return self._views[dev]

    def release(self) -> None:
        """Give the device memory back (to the caching allocator)."""
        self._views, self._key, self._sizes = {}, {}, {}


STAGE_ALIGN = 256  # bytes: every staged piece starts at a multiple (any dtype's view, full-width copies)


def stage_layout(pieces: list[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[tuple[int, int]], int]:
    """``(offset, nbytes)`` of each ``(dtype, shape)`` in one staging buffer, offsets aligned to
    :data:`STAGE_ALIGN`, and the buffer's size. Pure."""
    places: list[tuple[int, int]] = []
    at = 0
    for dtype, shape in pieces:
        n = dtype.itemsize
        for d in shape:
            n *= d
        places.append((at, n))
        at += -(-n // STAGE_ALIGN) * STAGE_ALIGN
    return places, at


class HostSnapshots:
    """Reused host buffers of one rank's memory checkpoints (one per piece; pinned for GPU pieces)."""

    def __init__(self, *, stage_on_device: bool = False, pace: Pacer | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self._key: tuple[Any, ...] | None = None
        self._bufs: dict[str, torch.Tensor] = {}
        self._streams: dict[int, Any] = {}
        self.allocations = 0  # how many times buffers were (re)allocated: tests check the steady state
        self.stage_on_device = stage_on_device
        self.stage = DeviceStage()
        self._pace = pace or Pacer(None)
        self._warn = warn
        self._drain: Drain | None = None  # the last staged snapshot's

    @property
    def nbytes(self) -> int:
        """Host bytes held now."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def take(self, flat: dict[str, Any], *, slot: Any = None, deferred: bool = False) -> Snapshot:
        """Copy ``flat``'s tensors into the host buffers (reallocated only when the keys, dtypes or
        shapes changed), or into ``slot``'s views, and deep-copy its objects. The buffers are reused
        by the next ``take``: the caller must be done with the previous snapshot (the tier keeps one
        in flight). ``deferred``: see the module docstring."""
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        if self._drain is not None:  # its host buffers (or slot) and staged bytes are reused below
            self._drain.settle()
            self._drain = None
        if slot is not None:
            bufs: dict[str, torch.Tensor] = slot.views
            self._bufs, self._key = {}, None  # the slot replaces them: no second copy of the state kept
        else:
            key = tuple((k, v.dtype, tuple(v.shape), v.device.type == "cuda") for k, v in tensors.items())
            if key != self._key:
                self._bufs = {}  # the old buffers go before the new ones are allocated
                self._bufs = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=v.device.type == "cuda")
                              for k, v in tensors.items()}
                self._key = key
                self.allocations += 1
            bufs = self._bufs
        out: dict[str, Any] = {}
        starts: dict[int, Any] = {}
        landed: dict[str, Any] = {}
        on_gpu: dict[int, list[str]] = {}  # per device, in order: the pieces to copy from there
        on_cpu: list[str] = []
        for k, v in flat.items():
            if isinstance(v, torch.Tensor):
                out[k] = bufs[k]
                if v.device.type == "cuda":
                    dev = v.device.index if v.device.index is not None else torch.cuda.current_device()
                    on_gpu.setdefault(dev, []).append(k)
                else:
                    on_cpu.append(k)
            elif isinstance(v, PerRank):
                out[k] = PerRank(copy.deepcopy(v.value))  # training may change its objects in place too
            else:
                out[k] = copy.deepcopy(v)
        drain: tuple[int, list[Any], list[Any]] | None = None
        for dev, keys in on_gpu.items():  # queued first: they run while the host copies below do
            pieces = [(k, bufs[k], flat[k].detach()) for k in keys]
            staged = self._stage_cuda(dev, pieces, starts, landed) if len(on_gpu) == 1 else None
            if staged is None:
                self._copy_cuda(dev, pieces, starts, landed)
            else:
                drain = (dev, *staged)
        for k in on_cpu:
            bufs[k].copy_(flat[k].detach())
        fences = []
        for dev in starts:  # (a staged device's: after its staging copy, before the drain's)
            ev = torch.cuda.Event()
            ev.record(self._streams[dev])
            fences.append((dev, ev))
        nbytes = sum(out[k].numel() * out[k].element_size() for k in tensors)
        snap = Snapshot(out, nbytes, slot=slot, fences=fences, landed=landed)
        if drain is not None:
            dev, events, groups = drain
            snap._waiter = self._drain = Drain(events, groups, self._streams[dev], self._pace)
        if not deferred:
            snap.staged()  # later in-place updates wait for the copies
        return snap

    def _copy_cuda(self, dev: int, copies: list[tuple[str, torch.Tensor, torch.Tensor]], starts: dict[int, Any],
                   landed: dict[str, Any]) -> None:
        """Queue device ``dev``'s copies ``(key, host buffer, source)`` on its copy stream, after
        everything queued so far on the current stream, with an event in ``landed`` every
        ``LANDED_EVERY`` bytes. One stream context for them all: entered per copy, it was a sizeable
        part of the training thread's time per memory checkpoint (measured in docs/BENCHMARKS.md,
        section "Memory tier, second pass")."""
        stream, starts[dev] = self._stream(dev)
        keys: list[str] = []
        size = 0
        with torch.cuda.stream(stream):
            for k, buf, src in copies:
                buf.copy_(src, non_blocking=True)
                src.record_stream(stream)  # the caller may free src meanwhile: keep its memory until copied
                keys.append(k)
                size += buf.numel() * buf.element_size()
                if size >= LANDED_EVERY:
                    self._mark(stream, keys, landed)
                    size = 0
            if keys:
                self._mark(stream, keys, landed)

    def _stream(self, dev: int) -> tuple[Any, Any]:
        """Device ``dev``'s copy stream, made to wait for everything queued so far on the current
        stream (the event of that is returned)."""
        stream = self._streams.get(dev)
        if stream is None:
            stream = self._streams[dev] = torch.cuda.Stream(device=dev)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        stream.wait_event(ev)
        return stream, ev

    def _stage_cuda(self, dev: int, copies: list[tuple[str, torch.Tensor, torch.Tensor]], starts: dict[int, Any],
                    landed: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
        """With ``stage_on_device``: queue device ``dev``'s copies ``(key, host buffer, source)`` into
        its staging buffer on its copy stream and return the drain's work (an unrecorded event per
        group of at most ``LANDED_EVERY`` bytes, ``landed`` filled with them, and each group's
        ``(host buffer, staged view)`` copies). None: not staged (off, or the device cannot hold
        the buffer: then off from now on, with a warning)."""
        if not self.stage_on_device:
            return None
        try:
            views = self.stage.views(dev, [(k, src) for k, _buf, src in copies])
        except torch.OutOfMemoryError as e:
            self.stage_on_device = False
            self.stage.release()
            if self._warn is not None:
                need = sum(src.numel() * src.element_size() for _k, _b, src in copies)
                self._warn(f"memory tier: cannot stage {need / 1e9:.2f} GB on cuda:{dev} ({str(e).splitlines()[0]}); "
                           "snapshots copy to the host directly from now on (the optimizer step waits for them)")
            return None
        stream, starts[dev] = self._stream(dev)
        with torch.cuda.stream(stream):
            torch._foreach_copy_([views[k] for k, _b, _s in copies], [src for _k, _b, src in copies])
            for _k, _buf, src in copies:
                src.record_stream(stream)  # the caller may free src meanwhile: keep its memory until copied
        events: list[Any] = []
        groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        size = LANDED_EVERY
        for k, buf, _src in copies:
            if size >= LANDED_EVERY:
                events.append(landed_event())
                groups.append([])
                size = 0
            groups[-1].append((buf, views[k]))
            landed[k] = events[-1]
            size += buf.numel() * buf.element_size()
        return events, groups

    @staticmethod
    def _mark(stream: Any, keys: list[str], landed: dict[str, Any]) -> None:
        """One event on ``stream`` after the copies of ``keys`` (and clear ``keys``)."""
        ev = landed_event()
        ev.record(stream)
        for k in keys:
            landed[k] = ev
        keys.clear()


__all__ = ["Snapshot", "LANDED_EVERY", "Landing", "Drain", "HostSnapshots", "STAGE_ALIGN"]
