"""The data path of :func:`ckpt.transfer`: point-to-point transports and the buffers of a schedule.

Transports: ``gloo`` sends CPU buffers over ckpt's own gloo side group of the ranks (never the
metadata group, so a data-phase timeout cannot take the agreement down with it); ``nccl`` posts
``batch_isend_irecv`` on the caller's NCCL group with buffers on the current CUDA device.
"""

from __future__ import annotations

import datetime
import operator
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ckpt._transfer_plan import Bucket, Copy, Schedule, aligned

Post = tuple[torch.Tensor, int, int]  # (buffer, peer, tag)


class Transport:
    """Point-to-point messages between group ranks: post, then wait until a deadline.

    ``eager``: each message may be posted as soon as it is ready (gloo: a packed bucket leaves
    while the next is packed); else a round's messages are posted as one batch (NCCL)."""

    device = torch.device("cpu")
    eager = False
    fence_waits = True  # :meth:`fence` is a wait (else the host goes on)

    def post(self, sends: list[Post], recvs: list[Post]) -> list[tuple[Any, int]]:
        """Post receives, then sends; returns ``(work, peer)`` pairs to wait for."""
        raise NotImplementedError

    def wait(self, work: Any, deadline: float | None) -> None:
        raise NotImplementedError

    def fence(self, work: Any, deadline: float | None) -> None:
        """Order what the caller does next after ``work``: a wait, except where the backend orders
        it without the host (NCCL: the current stream waits)."""
        self.wait(work, deadline)


class GlooTransport(Transport):
    """Over a gloo group, through the group's own ``send`` / ``recv`` (group ranks)."""

    eager = True

    def __init__(self, pg: Any):
        self.pg = pg

    def post(self, sends: list[Post], recvs: list[Post]) -> list[tuple[Any, int]]:
        works = [(self.pg.recv([buf], peer, tag), peer) for buf, peer, tag in recvs]
        works += [(self.pg.send([buf], peer, tag), peer) for buf, peer, tag in sends]
        return works

    def wait(self, work: Any, deadline: float | None) -> None:
        if deadline is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


class NcclTransport(Transport):
    """Over the caller's NCCL group: one coalesced batch of sends and receives per round (what
    ``batch_isend_irecv`` does), buffers on the current GPU."""

    fence_waits = False

    def __init__(self, group: Any):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.direct = _coalesces(group, self.device)

    def post(self, sends: list[Post], recvs: list[Post]) -> list[tuple[Any, int]]:
        peers = [p for _, p, _ in recvs] + [p for _, p, _ in sends]
        if not peers:
            return []
        if self.direct:
            # The group's own coalescing, as batch_isend_irecv runs it for NCCL, without its per-operation
            # Python (argument checks, rank translation: ~40 us an operation; 0.23-0.38 ms to post a round
            # of 6 on 4 x H100, before the first byte moved). Group ranks, as the group's send takes them.
            g = self.group
            g._start_coalescing(self.device)
            try:
                for buf, peer, tag in recvs:
                    g.recv([buf], peer, tag)
                for buf, peer, tag in sends:
                    g.send([buf], peer, tag)
            finally:
                work = g._end_coalescing(self.device)
            return [(work, peers[0])]
        d = self.dist
        ops = [d.P2POp(d.irecv, buf, d.get_global_rank(self.group, peer), self.group, tag) for buf, peer, tag in recvs]
        ops += [d.P2POp(d.isend, buf, d.get_global_rank(self.group, peer), self.group, tag) for buf, peer, tag in sends]
        works = list(d.batch_isend_irecv(ops))
        # NCCL may hand back one work for the whole batch
        return list(zip(works, peers, strict=True)) if len(works) == len(peers) else [(w, peers[0]) for w in works]

    def wait(self, work: Any, deadline: float | None) -> None:
        if not poll(work, deadline):
            raise TimeoutError("NCCL point-to-point operation timed out")

    def fence(self, work: Any, deadline: float | None) -> None:
        work.wait()  # (a stream wait: the host goes on)


def _coalesces(group: Any, device: torch.device) -> bool:
    """Whether ``group`` is a plain ProcessGroup whose backend for ``device`` coalesces point-to-point
    operations itself (NCCL): the case in which ``batch_isend_irecv`` only wraps the group's own
    ``_start_coalescing`` / ``send`` / ``recv`` / ``_end_coalescing``, which NcclTransport then calls
    directly. False on anything else (another torch, a wrapped group): the public call is used."""
    import torch.distributed as dist

    try:
        return (type(group) is dist.ProcessGroup and all(
            hasattr(group, a) for a in ("_start_coalescing", "_end_coalescing", "send", "recv"))
                and bool(group._get_backend(device).supports_coalescing))
    except Exception:  # noqa: BLE001 - not the shape this relies on: the public call
        return False


def poll(work: Any, deadline: float | None) -> bool:
    """Wait for an NCCL ``work`` until ``deadline`` (a blocking NCCL wait has none), then order the
    current stream after it; False when the deadline passed first. The sleep is short: a round may take
    well under 1 ms."""
    while deadline is not None and not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.00005)
    work.wait()  # orders the current stream after the work: what follows reads its buffers
    return True


class Pool:
    """The buffers of one round (its packed sends and, unless they go to an :class:`Arena`, the
    receives not taken straight into a target), carved at 16-byte offsets out of one allocation of
    ``cap`` bytes (the largest round's, at most ``2 * window * bucket_bytes``), reused by every
    other round (two pools: the next round is packed while one travels)."""

    def __init__(self, cap: int, device: torch.device):
        self.cap, self.device = cap, device
        self.buf: torch.Tensor | None = None
        self.used = 0  # bytes carved in the current round

    def next(self, nbytes: int) -> torch.Tensor:
        if self.buf is None:
            self.buf = torch.empty(self.cap, dtype=torch.uint8, device=self.device)
        at = self.used
        self.used += aligned(nbytes)
        assert self.used <= self.cap, (self.used, self.cap)  # (the cap is the largest round's need)
        return self.buf[at: at + nbytes]


def round_bytes(rounds: list[tuple[list[Bucket], list[Bucket]]], recvs_pooled: bool) -> int:
    """What a :class:`Pool` must hold: the largest round's sends (and receives when they use the
    pool), each from a 16-byte boundary."""
    return max((sum(aligned(b.nbytes) for b in s + (r if recvs_pooled else [])) for s, r in rounds), default=0)


class Arena:
    """One allocation for every bucket this rank receives when writes are deferred to the commit
    (the received bytes are the staging: they stay until the verdict)."""

    def __init__(self, recvs: list[Bucket], device: torch.device):
        self.buf = torch.empty(self.size(recvs), dtype=torch.uint8, device=device)
        self.at = 0

    @staticmethod
    def size(recvs: list[Bucket]) -> int:
        return sum(aligned(b.nbytes) for b in recvs)

    def next(self, nbytes: int) -> torch.Tensor:
        out = self.buf[self.at: self.at + nbytes]
        self.at += aligned(nbytes)
        return out


_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _widens(t: torch.Tensor, isz: int, w: int) -> bool:
    """Whether ``t`` (elements of ``isz`` bytes) can be seen as ``w``-byte elements: its rows are
    contiguous, and its row length, every other stride, its offset and its address fit ``w``."""
    return (t.stride(-1) == 1 and t.shape[-1] * isz % w == 0 and t.data_ptr() % w == 0
            and all(st * isz % w == 0 for st in t.stride()[:-1]))


def wide(out: torch.Tensor, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``data``, the two sides of a bitwise copy (same dtype and shape), seen as the widest
    integer type both layouts allow (int64 where rows are multiples of 8 bytes at 8-byte offsets).
    Why: copying a strided sub-box of a 2-byte dtype moves 2 bytes per element; as int64 the same
    copy is a quarter of the elements and of the per-element work, which on GPUs is what a strided
    copy kernel is bound by. Pairs that differ in dtype (a cast) or shape are returned as they are."""
    isz = out.element_size()
    if out.dtype != data.dtype or out.shape != data.shape or out.dim() == 0 or isz >= 8 or out.numel() == 0:
        return out, data
    for w in (8, 4, 2):
        if w > isz and _widens(out, isz, w) and _widens(data, isz, w):
            return out.view(_INTS[w]), data.view(_INTS[w])
    return out, data


class Views:
    """Views a plan's copies read and write, made once per tensor and reused by later runs of the same
    (cached) plan. Why: on GPUs a transfer is bound by the host; making a sub-box view (a ``narrow``
    per dimension and a ``view``) for each of a few hundred copies was a large part of a call's time
    (docs/TRANSFER.md, "A mixture-of-experts model on 4 x H100"). A view is reused only for the very
    tensor it was made of, at the same address (a tensor whose storage was replaced since, e.g.
    ``p.data = ...``, gets a new one). Only the views the last run used are kept (:meth:`begin`): a
    caller passing new tensors each call keeps at most one call's views alive."""

    def __init__(self) -> None:
        self._memo: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._prev: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def clear(self) -> None:
        """Forget every view (the buffers they were made of are replaced)."""
        self._memo, self._prev = {}, {}

    def begin(self) -> None:
        """A new run: the views the previous one used are the candidates; the others go."""
        self._prev, self._memo = self._memo, {}

    def get(self, tag: str, c: Copy, base: torch.Tensor, make: Callable[[], torch.Tensor],
            at: int | None = None) -> torch.Tensor:
        """The view ``make()`` gives for copy ``c`` of ``base`` (``at``: the address that tells
        views of one base apart, default ``base``'s own)."""
        key = (tag, id(c), id(base), base.data_ptr() if at is None else at)
        hit = self._memo.get(key) or self._prev.pop(key, None)
        if hit is not None and hit[0] is base:
            self._memo[key] = hit
            return hit[1]
        v = make()
        self._memo[key] = (base, v)  # (holding base: its id is not reused while the entry lives)
        return v


class Round:
    """One round of a recorded run: the packing copies (outputs and inputs of one ``_foreach_copy_``)
    and the messages posted."""

    __slots__ = ("outs", "datas", "sends", "recvs", "unpack")

    def __init__(self) -> None:
        self.outs: list[torch.Tensor] = []
        self.datas: list[torch.Tensor] = []
        self.sends: list[Post] = []
        self.recvs: list[Post] = []
        self.unpack: list[list[torch.Tensor]] = [[], []]  # in place: [outs, datas] of the received copies


def shares_storage(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> bool:
    """Whether some target lives in the same storage as some source (then a copy into the target may
    overwrite a source that is still to be read)."""
    held = {t.untyped_storage().data_ptr() for t in sources}
    return any(t.untyped_storage().data_ptr() in held for t in targets)


def same_tensors(tensors: list[torch.Tensor], held: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` are the very objects of ``held``, in order (cheaper than :func:`signature`)."""
    return len(tensors) == len(held) and all(map(operator.is_, tensors, held))


def signature(tensors: list[torch.Tensor]) -> tuple[Any, ...]:
    """Where each tensor's bytes are: a recorded run holds only for tensors at the same addresses."""
    return tuple((t.data_ptr(), t.stride(), t.device) for t in tensors)


# Recorded batches of copies run as CUDA graphs on GPUs (``CKPT_TRANSFER_GRAPHS=0``: as launches).
GRAPHS = os.environ.get("CKPT_TRANSFER_GRAPHS", "1") != "0"


class Batch:
    """One recorded ``torch._foreach_copy_(outs, datas)`` of a replay: a round's packing, its copies
    out (in place), the local copies or the commit. On GPUs it is captured as a CUDA graph at its first
    replay and launched as one from then on. Why: a batch of a few hundred strided copies is a few
    hundred kernel launches of ~5-10 us of host time each, and on 4 x H100 the commit of a MoE's
    1.4 GB per rank took 2.5 ms of launches for ~1 ms of copying. The graph's copies read and write
    the recorded views, whose memory the :class:`Program` holds (a replay runs only over tensors at
    the recorded addresses). A batch whose capture fails is launched as before."""

    __slots__ = ("outs", "datas", "graph", "tried")

    def __init__(self, outs: list[torch.Tensor], datas: list[torch.Tensor]):
        self.outs, self.datas = outs, datas
        self.graph: Any = None
        self.tried = False

    def run(self) -> None:
        """The copies, in order on the current stream."""
        if not self.outs:
            return
        if self.graph is None and not self.tried:
            self.tried = True
            self.graph = _capture(self.outs, self.datas)
        if self.graph is not None:
            self.graph.replay()
        else:
            torch._foreach_copy_(self.outs, self.datas)


def _capture(outs: list[torch.Tensor], datas: list[torch.Tensor]) -> Any:
    """``_foreach_copy_(outs, datas)`` captured as a CUDA graph (not run), or None: off, not every
    tensor on the current GPU, or the capture failed (the batch is then launched as before)."""
    # (the tensors are looked at before any CUDA call: a CPU transfer must not initialise CUDA, which
    # would break the ranks a process forks afterwards)
    dev = outs[0].device
    if not GRAPHS or dev.type != "cuda" or not all(t.device == dev for t in (*outs, *datas)):
        return None
    try:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.device(dev), torch.cuda.stream(side):
            # thread_local: another thread's CUDA work (an async checkpoint's copies) is not an error
            g.capture_begin(capture_error_mode="thread_local")
            try:
                torch._foreach_copy_(outs, datas)
            finally:
                g.capture_end()
        torch.cuda.current_stream(dev).wait_stream(side)
        return g
    except Exception:  # noqa: BLE001 - capture is an optimisation: launch the copies instead
        return None


class Program:
    """A run of a cached plan, recorded so that later runs over the same tensors replay it: per round
    one batch of copies for the packing (a CUDA graph on GPUs, :class:`Batch`) and the round's
    messages, and one batch for the commit. Why: on GPUs a transfer of a few hundred tensors is
    bound by the host (making, finding and checking views per copy: docs/TRANSFER.md); a replay
    does none of that.

    Replayed only when every source and target is where it was when recorded (:func:`signature`:
    address, strides, device) and so are the recorded tensors: the recorded views hold what they
    view, so no other tensor can come to live at those addresses in between; and only by a run of
    the same mode (``defer``: writes kept for the commit, or in place: a recording in place writes
    the targets as it goes, which a deferred run must never do before the verdict). Recorded only
    when every copy is a view (boxes, single runs), without checksum, and the run met no failure."""

    def __init__(self, sig: tuple[Any, ...], held: list[torch.Tensor], defer: bool):
        self.sig, self.held, self.defer = sig, held, defer
        self.rounds: dict[int, Round] = {}
        self.local: list[list[torch.Tensor]] = [[], []]  # in place: [outs, datas] of the local copies
        self.commit_outs: list[torch.Tensor] = []
        self.commit_datas: list[torch.Tensor] = []
        self.packed = self.direct = 0
        self.ok = True  # False: a copy that is not a view was made (a gather, a snapshot): not replayable
        self.shared = False  # a target shares storage with a source: the local copies keep their place (first)
        self.batches: dict[Any, Batch] = {}

    def copy(self, key: Any, outs: list[torch.Tensor], datas: list[torch.Tensor]) -> None:
        """Replay the recorded batch ``key`` (``outs``, ``datas``): see :class:`Batch`."""
        b = self.batches.get(key)
        if b is None:
            b = self.batches[key] = Batch(outs, datas)
        b.run()

    def holds(self, tensors: list[torch.Tensor], sig: tuple[Any, ...], defer: bool) -> bool:
        """Whether a run over ``tensors`` (of signature ``sig``) in mode ``defer`` may replay this one:
        the same mode, the same places, and the recorded tensors still there (a storage freed, as
        FSDP frees unsharded parameters, with a new tensor at its address would leave the recorded
        views on freed memory)."""
        # (the signature kept with the call's pieces is the recorded one itself on repeated calls:
        # ckpt._transfer_front.signature_of; comparing ~340 entries cost ~0.1 ms)
        if (sig is not self.sig and sig != self.sig) or defer != self.defer:
            return False
        return same_tensors(tensors, self.held) or signature(self.held) == self.sig

    def at(self, k: int) -> Round:
        return self.rounds.setdefault(k, Round())


class Buffers:
    """The send pools and the receive arena of a schedule, kept by the caller for the next run of
    the same plan (fresh host memory costs a page fault per page on first touch), and the recorded
    run of the plan (:class:`Program`)."""

    def __init__(self) -> None:
        self.pools: list[Pool] = []
        self.arena: Arena | None = None
        self.views = Views()
        self.program: Program | None = None

    def get(self, sched: Schedule, cap: int, dev: torch.device, defer: bool) -> tuple[list[Pool], Arena | None]:
        if not self.pools or self.pools[0].cap != cap or self.pools[0].device != dev:
            if self.pools:
                self.views.clear()  # (views of the old buffers would never be hit again)
                self.program = None
            self.pools = [Pool(cap, dev), Pool(cap, dev)]  # two: the next round is packed while one travels
        if not defer:
            return self.pools, None
        size = Arena.size(sched.recvs)
        if self.arena is None or self.arena.buf.numel() != size or self.arena.buf.device != dev:
            if self.arena is not None:
                self.views.clear()
                self.program = None
            self.arena = Arena(sched.recvs, dev)
        self.arena.at = 0
        return self.pools, self.arena


__all__ = ["Post", "poll", "Transport", "GlooTransport", "NcclTransport", "Pool", "round_bytes", "wide", "Arena",
           "Views", "Round", "shares_storage", "same_tensors", "signature", "GRAPHS", "Batch", "Program", "Buffers"]
