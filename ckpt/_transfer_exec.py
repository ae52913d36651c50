"""The executor of :func:`ckpt.transfer`: runs one rank's :class:`~ckpt._transfer_plan.Schedule`.

Bytes move as buckets: a header message ``[status, crc32]`` (int64) and a payload message. A sender
that fails while packing a bucket still sends it, with status FAILED, so that its receiver is never
left waiting; the failure itself travels in the commit exchange. Rounds run in order; in a round a
rank posts every send and receive before waiting for any (see the planner's rules), waits until the
transfer's deadline, then unpacks what it received into its targets (staging copies or, with
``in_place``, the destination tensors).

Transports: ``gloo`` sends CPU buffers over ckpt's own gloo side group of the ranks (never the
metadata group, so a data-phase timeout cannot take the agreement down with it); ``nccl`` posts
``batch_isend_irecv`` on the caller's NCCL group with buffers on the current CUDA device.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckpt._checksum import crc32
from ckpt._dtypes import dtype_from_name
from ckpt._transfer_plan import Bucket, Copy, Schedule
from ckpt.errors import CollectiveError, IntegrityError
from ckpt.shards import Box, Region

OK, FAILED = 1, 2
SMALL = 32  # up to this many segments a copy loops over slices; beyond, one index_select / index_copy_

# Test hook: ``FAULT(event, info)`` is called on the sender with event "pack" (before a bucket is
# packed: raise to simulate a failing sender) and "packed" (after its CRC is taken, ``info["buf"]``
# the bucket's bytes: change them to simulate corruption on the wire). None in production.
FAULT: Callable[[str, dict[str, Any]], None] | None = None


class Failure:
    """Errors met while running a schedule: ``primary`` (this rank's own fault) or ``secondary`` (a
    consequence of another rank's, e.g. a FAILED bucket); the commit exchange reports the primary."""

    def __init__(self) -> None:
        self.primary: BaseException | None = None
        self.secondary: BaseException | None = None
        self.timed_out = False  # this rank's own wait ran out of time (it names the rank it waited for)

    def add(self, e: BaseException, primary: bool = True) -> None:
        if primary and self.primary is None:
            self.primary = e
        elif not primary and self.secondary is None:
            self.secondary = e

    @property
    def first(self) -> BaseException | None:
        return self.primary or self.secondary


def box_view(local: torch.Tensor, region: Region, sub: Box) -> torch.Tensor:
    """The view of ``sub`` (global coordinates) inside ``local``, which holds box ``region``."""
    assert isinstance(region, Box)
    v = local
    for d, (o, n) in enumerate(zip(sub.offsets, sub.lengths, strict=True)):
        v = v.narrow(d, o - region.offsets[d], n)
    return v


def _index(off: np.ndarray, ln: np.ndarray) -> torch.Tensor:
    """Element indices of segments ``off[i] .. off[i] + ln[i]``, concatenated."""
    total = int(ln.sum())
    base = np.repeat(off - (np.cumsum(ln) - ln), ln)
    return torch.from_numpy(base + np.arange(total, dtype=np.int64))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def read_copy(c: Copy, local: torch.Tensor, region: Region) -> torch.Tensor:
    """The elements copy ``c`` takes from the sender's piece ``local``: a view (boxes) or a new 1-D
    tensor (segments)."""
    if c.geo.box is not None:
        return box_view(local, region, c.geo.box)
    so, ln = c.geo.so, c.geo.ln
    assert so is not None and ln is not None
    flat = _flat(local)
    if len(ln) == 1:
        return flat[int(so[0]): int(so[0] + ln[0])]
    if len(ln) <= SMALL:
        return torch.cat([flat[int(a): int(a + n)] for a, n in zip(so, ln, strict=True)])
    return flat.index_select(0, _index(so, ln).to(flat.device))


def write_copy(c: Copy, target: torch.Tensor, region: Region, data: torch.Tensor) -> None:
    """Put ``data`` (the copy's elements, in its order) into ``target`` (contiguous when ``c`` has
    segments), which holds the receiver's piece ``region``; casts to ``target``'s dtype."""
    if c.geo.box is not None:
        box_view(target, region, c.geo.box).copy_(data.view(c.geo.box.lengths))
        return
    do, ln = c.geo.do, c.geo.ln
    assert do is not None and ln is not None
    flat = target.view(-1)
    data = data.reshape(-1)
    if len(ln) <= SMALL:
        pos = 0
        for a, n in zip(do.tolist(), ln.tolist(), strict=True):
            flat[a: a + n].copy_(data[pos: pos + n])
            pos += n
        return
    flat.index_copy_(0, _index(do, ln).to(flat.device), data.to(device=flat.device, dtype=flat.dtype))


def local_copy(c: Copy, sources: list[torch.Tensor], src_regions: list[Region], targets: list[torch.Tensor],
               dst_regions: list[Region]) -> None:
    """A copy between two pieces of this rank (it holds what it wants)."""
    write_copy(c, targets[c.dst], dst_regions[c.dst], read_copy(c, sources[c.src], src_regions[c.src]))


def pack(b: Bucket, payload: torch.Tensor, head: torch.Tensor, sources: list[torch.Tensor],
         src_regions: list[Region], checksum: bool, direct: bool = False) -> None:
    """Fill ``payload`` (uint8, ``b.nbytes``) with bucket ``b`` (unless ``direct``: it already is the
    source's bytes) and ``head`` (int64[2]) with status OK and the payload's CRC32."""
    if FAULT is not None:
        FAULT("pack", {"bucket": b})
    if not direct:
        for c in b.copies:
            out = payload[c.offset: c.offset + c.nbytes].view(dtype_from_name(c.dtype))
            data = read_copy(c, sources[c.src], src_regions[c.src])
            out.view(data.shape).copy_(data)
    head.copy_(torch.tensor([OK, _crc(payload) if checksum else 0], dtype=torch.int64))
    if FAULT is not None:
        FAULT("packed", {"bucket": b, "buf": payload})


def _crc(payload: torch.Tensor) -> int:
    host = payload if payload.device.type == "cpu" else payload.cpu()
    return crc32(host.numpy())


def mark_failed(head: torch.Tensor) -> None:
    head.copy_(torch.tensor([FAILED, 0], dtype=torch.int64))


def unpack(b: Bucket, payload: torch.Tensor, head: torch.Tensor, targets: list[torch.Tensor],
           dst_regions: list[Region], checksum: bool, rank: int, direct: bool = False) -> None:
    """Check bucket ``b`` received in ``payload`` (with header ``head``) and copy its runs into
    ``targets`` (unless ``direct``: it was received in place).

    Raises CollectiveError when its sender marked it FAILED, IntegrityError on a CRC mismatch."""
    status, sent = head.tolist()
    keys = sorted({c.key for c in b.copies})
    if status != OK:
        raise CollectiveError(f"rank {rank}: bucket {b.tag} from rank {b.sender} ({_few(keys)}) was sent as failed; "
                              f"rank {b.sender} reports why")
    if checksum and (got := _crc(payload)) != int(sent) & 0xFFFFFFFF:
        raise IntegrityError(f"rank {rank}: bucket {b.tag} from rank {b.sender} (tensor {_few(keys)}) arrived with "
                             f"CRC32 {got:08x}, sent as {int(sent) & 0xFFFFFFFF:08x}: corrupted in transit; nothing "
                             "was committed, run the transfer again")
    if direct:
        return
    for c in b.copies:
        data = payload[c.offset: c.offset + c.nbytes].view(dtype_from_name(c.dtype))
        write_copy(c, targets[c.dst], dst_regions[c.dst], data)


def run_start(region: Region, geo: Any, src: bool) -> int | None:
    """Where a copy's elements start in a piece's local row-major data when they are one contiguous
    run of it, in the copy's order (the bytes can then travel without packing); else None."""
    if geo.box is None:
        offs = geo.so if src else geo.do
        return int(offs[0]) if len(offs) == 1 else None
    assert isinstance(region, Box)
    sub, n = geo.box, len(geo.box.lengths)
    k = 0
    while k < n and sub.lengths[k] == 1:
        k += 1
    if any(sub.lengths[d] != region.lengths[d] for d in range(k + 1, n)):
        return None
    start, stride = 0, 1
    for d in range(n - 1, -1, -1):
        start += (sub.offsets[d] - region.offsets[d]) * stride
        stride *= region.lengths[d]
    return start


def direct_view(t: torch.Tensor, region: Region, c: Copy, src: bool, device: torch.device) -> torch.Tensor | None:
    """The bytes of copy ``c`` inside piece ``t`` as a uint8 view, when a bucket holding only ``c`` can
    be sent from (``src``) or received into ``t`` itself; else None."""
    if t.device != device or not t.is_contiguous() or (not src and t.dtype != dtype_from_name(c.dtype)):
        return None
    at = run_start(region, c.geo, src)
    if at is None:
        return None
    return t.reshape(-1)[at: at + c.geo.numel].view(torch.uint8)


def _few(keys: list[str], n: int = 4) -> str:
    s = ", ".join(repr(k) for k in keys[:n])
    return s + (f" and {len(keys) - n} more" if len(keys) > n else "")


class Transport:
    """Point-to-point messages between group ranks: post, then wait until a deadline."""

    device = torch.device("cpu")

    def post(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]) -> list[Any]:
        raise NotImplementedError

    def wait(self, work: Any, deadline: float | None) -> None:
        raise NotImplementedError


class GlooTransport(Transport):
    """Over a gloo group, through the group's own ``send`` / ``recv`` (group ranks)."""

    def __init__(self, pg: Any):
        self.pg = pg

    def post(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]) -> list[Any]:
        works = [self.pg.recv([buf], peer, tag) for buf, peer, tag in recvs]
        works += [self.pg.send([buf], peer, tag) for buf, peer, tag in sends]
        return works

    def wait(self, work: Any, deadline: float | None) -> None:
        if deadline is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


class NcclTransport(Transport):
    """Over the caller's NCCL group: ``batch_isend_irecv`` per round, buffers on the current GPU."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.device = torch.device("cuda", torch.cuda.current_device())

    def post(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]) -> list[Any]:
        d = self.dist
        ops = [d.P2POp(d.irecv, buf, d.get_global_rank(self.group, peer), self.group, tag) for buf, peer, tag in recvs]
        ops += [d.P2POp(d.isend, buf, d.get_global_rank(self.group, peer), self.group, tag) for buf, peer, tag in sends]
        return list(d.batch_isend_irecv(ops)) if ops else []

    def wait(self, work: Any, deadline: float | None) -> None:
        while deadline is not None and not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("NCCL point-to-point operation timed out")
            time.sleep(0.0005)
        work.wait()
        torch.cuda.current_stream().synchronize()


Post = tuple[torch.Tensor, int, int]  # (buffer, peer, tag)


class _Pool:
    """Payload buffers of one schedule, reused across rounds: at most ``2 * window`` of them."""

    def __init__(self, cap: int, device: torch.device):
        self.cap, self.device = cap, device
        self.bufs: list[torch.Tensor] = []
        self.used = 0

    def next(self, nbytes: int) -> torch.Tensor:
        while len(self.bufs) <= self.used:
            self.bufs.append(torch.empty(self.cap, dtype=torch.uint8, device=self.device))
        self.used += 1
        return self.bufs[self.used - 1][:nbytes]


def run_schedule(sched: Schedule, sources: list[torch.Tensor], src_regions: list[Region],
                 targets: list[torch.Tensor], dst_regions: list[Region], transport: Transport | None, *,
                 rank: int, checksum: bool, deadline: float | None, timeout: float | None) -> Failure:
    """Run this rank's schedule; never raises (the errors are returned, for the commit exchange).

    Local copies first, then each round: pack and post every send, post every receive, wait, unpack.
    A bucket travels as two messages, its header (status, CRC32) and its payload; a bucket of one
    copy that is a contiguous run of both pieces goes from the source's memory into the target's
    (no packing). A wait that fails (deadline passed, peer gone) stops the rounds: the data group is
    closed then."""
    fail = Failure()
    for c in sched.local:
        try:
            local_copy(c, sources, src_regions, targets, dst_regions)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the commit exchange
            fail.add(e)
    if not sched.sends and not sched.recvs:
        return fail
    assert transport is not None
    dev = transport.device
    by_round: dict[int, tuple[list[Bucket], list[Bucket]]] = {}
    for b in sched.sends:
        by_round.setdefault(b.round, ([], []))[0].append(b)
    for b in sched.recvs:
        by_round.setdefault(b.round, ([], []))[1].append(b)
    pool = _Pool(max(b.nbytes for b in sched.sends + sched.recvs), dev)
    for k in sorted(by_round):
        sends, recvs = by_round[k]
        pool.used = 0
        heads = torch.zeros(len(sends) + len(recvs), 2, dtype=torch.int64, device=dev)
        posts_s = _pack_sends(sends, heads, pool, sources, src_regions, checksum, fail, dev)
        posts_r, rviews = _post_recvs(recvs, heads, len(sends), pool, targets, dst_regions, dev)
        if not _exchange(transport, posts_s, posts_r, deadline, timeout, rank, fail):
            return fail
        for i, (b, (view, direct)) in enumerate(zip(recvs, rviews, strict=True), start=len(sends)):
            try:
                unpack(b, view, heads[i], targets, dst_regions, checksum, rank, direct)
            except CollectiveError as e:
                fail.add(e, primary=False)
            except Exception as e:  # noqa: BLE001 - an IntegrityError (CRC) or a copy failure: this rank's own
                fail.add(e)
    return fail


def _pack_sends(sends: list[Bucket], heads: torch.Tensor, pool: _Pool, sources: list[torch.Tensor],
                src_regions: list[Region], checksum: bool, fail: Failure, dev: torch.device) -> list[Post]:
    """Pack a round's outgoing buckets (a one-copy bucket that is a contiguous run of its source goes
    from the source itself); a bucket that cannot be packed still goes, marked FAILED."""
    posts: list[Post] = []
    for i, b in enumerate(sends):
        view = None
        if len(b.copies) == 1:
            c = b.copies[0]
            view = direct_view(sources[c.src], src_regions[c.src], c, True, dev)
        direct = view is not None
        if view is None:
            view = pool.next(b.nbytes)
        try:
            if fail.primary is not None:
                raise RuntimeError("this rank failed earlier")  # keep the protocol; send nothing of value
            pack(b, view, heads[i], sources, src_regions, checksum, direct=direct)
        except Exception as e:  # noqa: BLE001 - the bucket still goes, marked failed: no receiver waits
            if fail.primary is None:
                fail.add(e)
            mark_failed(heads[i])
        posts += [(heads[i], b.receiver, 2 * b.tag), (view, b.receiver, 2 * b.tag + 1)]
    return posts


def _post_recvs(recvs: list[Bucket], heads: torch.Tensor, first: int, pool: _Pool, targets: list[torch.Tensor],
                dst_regions: list[Region], dev: torch.device) -> tuple[list[Post], list[tuple[torch.Tensor, bool]]]:
    """Where a round's incoming buckets land: the target itself for a one-copy bucket that is a
    contiguous run of it, else a pool buffer; the posts and ``(view, direct)`` per bucket."""
    posts: list[Post] = []
    rviews: list[tuple[torch.Tensor, bool]] = []
    for i, b in enumerate(recvs, start=first):
        view = None
        if len(b.copies) == 1:
            c = b.copies[0]
            view = direct_view(targets[c.dst], dst_regions[c.dst], c, False, dev)
        rviews.append((view if view is not None else pool.next(b.nbytes), view is not None))
        posts += [(heads[i], b.sender, 2 * b.tag), (rviews[-1][0], b.sender, 2 * b.tag + 1)]
    return posts, rviews


def _exchange(transport: Transport, posts_s: list[Post], posts_r: list[Post], deadline: float | None,
              timeout: float | None, rank: int, fail: Failure) -> bool:
    """Post a round's messages and wait for all of them; False (the failure recorded) when a wait
    failed or posting did: the data group is closed then and the rounds stop."""
    try:
        works = transport.post(posts_s, posts_r)
        peers = [p for _, p, _ in posts_r] + [p for _, p, _ in posts_s]
        # NCCL may hand back one work for the whole batch
        pairs = list(zip(works, peers, strict=True)) if len(works) == len(peers) else [(w, peers[0]) for w in works]
        for w, peer in pairs:
            try:
                transport.wait(w, deadline)
            except Exception as e:  # noqa: BLE001 - gloo: timed out or the peer is gone
                fail.timed_out = "timed out" in str(e).lower()
                how = (f"within {timeout:g} s" if timeout is not None and fail.timed_out
                       else f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
                raise CollectiveError(f"rank {rank}: transfer data: no message to or from rank {peer} {how}; "
                                      f"rank {peer} is slow, hung or dead. Nothing was committed") from e
    except CollectiveError as e:
        fail.add(e, primary=False)
        return False
    except Exception as e:  # noqa: BLE001 - posting failed: the data group is closed
        fail.add(CollectiveError(f"rank {rank}: transfer data: could not post messages ({type(e).__name__}: "
                                 f"{e}); a rank failed or exited. Nothing was committed"), primary=False)
        return False
    return True
