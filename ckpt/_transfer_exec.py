"""The executor of :func:`ckpt.transfer`: runs one rank's :class:`~ckpt._transfer_plan.Schedule`.

Bytes move as buckets: a payload message, with ``checksum`` preceded by a header message
``[status, crc32]`` (int64). A sender that fails while packing a bucket still sends it (with status
FAILED where it has a header), so that its receiver is never left waiting; the failure itself
travels in the commit exchange. Rounds run in order; in a round a rank posts every send and receive
before waiting for any (see the planner's rules), waits until the transfer's deadline, then unpacks
what it received into its targets (staging copies or, with ``in_place``, the destination tensors).
A run of a cached plan is recorded and later replayed (:mod:`ckpt._transfer_replay`).

The transports, the buffers and the recorded runs live in :mod:`ckpt._transfer_net`; the copies
inside one rank (views of boxes and segment runs, the commit's deferred writes) in
:mod:`ckpt._transfer_copy`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ckpt._checksum import crc32
from ckpt._dtypes import dtype_from_name
from ckpt._transfer_copy import commit_writes, direct_view, local_copy, payload_view, read_kept, write_rec
from ckpt._transfer_net import Arena, Buffers, Pool, Post, Program, Round, Transport, Views, round_bytes, wide
from ckpt._transfer_plan import Bucket, Copy, Schedule
from ckpt.errors import CollectiveError, IntegrityError
from ckpt.shards import Region

OK, FAILED = 1, 2

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
        self.waited: int | None = None  # that rank (the verdict follows such waits: pick_error)
        # deferred writes (not in place): (copy, its elements), applied by :func:`commit_writes` only
        # after every rank agreed; the elements are views of received buckets or of sources
        self.writes: list[tuple[Copy, torch.Tensor]] = []
        self.views: Views | None = None  # the kept views of this plan's copies (for the commit)
        self.rec: Program | None = None  # this run, being recorded for replays
        self.program: Program | None = None  # the recorded run this one replayed (its commit is recorded too)
        self.keep: Buffers | None = None  # where a recorded run is kept once committed
        self.packed = 0  # bytes this rank copied into send buffers
        self.direct = 0  # bytes this rank sent from, or received into, a tensor itself (no packing)

    def add(self, e: BaseException, primary: bool = True) -> None:
        if primary and self.primary is None:
            self.primary = e
        elif not primary and self.secondary is None:
            self.secondary = e

    @property
    def first(self) -> BaseException | None:
        return self.primary or self.secondary


def pack(b: Bucket, payload: torch.Tensor, head: torch.Tensor | None, sources: list[torch.Tensor],
         src_regions: list[Region], checksum: bool, direct: bool = False, views: Views | None = None,
         rec: Round | None = None) -> None:
    """Fill ``payload`` (uint8, ``b.nbytes``) with bucket ``b`` (unless ``direct``: it already is the
    source's bytes) and ``head`` (int64[2], only with ``checksum``) with status OK and the payload's
    CRC32. ``rec``: the copies made are recorded for a replay of the plan."""
    if FAULT is not None:
        FAULT("pack", {"bucket": b})
    if not direct:
        outs, datas = [], []
        for c in b.copies:
            data = read_kept(c, sources[c.src], src_regions[c.src], views)
            out, data = wide(payload_view(c, payload, data.shape, views), data)
            outs.append(out)
            datas.append(data)
        torch._foreach_copy_(outs, datas)  # one call for the bucket's copies
        if rec is not None:
            rec.outs += outs
            rec.datas += datas
    if head is not None:
        head.copy_(torch.tensor([OK, _crc(payload) if checksum else 0], dtype=torch.int64))
    if FAULT is not None:
        FAULT("packed", {"bucket": b, "buf": payload})


def _crc(payload: torch.Tensor) -> int:
    host = payload if payload.device.type == "cpu" else payload.cpu()
    return crc32(host.numpy())


def mark_failed(head: torch.Tensor) -> None:
    head.copy_(torch.tensor([FAILED, 0], dtype=torch.int64))


def unpack(b: Bucket, payload: torch.Tensor, head: torch.Tensor | None, targets: list[torch.Tensor],
           dst_regions: list[Region], checksum: bool, rank: int, direct: bool = False,
           writes: list[tuple[Copy, torch.Tensor]] | None = None, views: Views | None = None,
           rec: Program | None = None, into: list[list[torch.Tensor]] | None = None) -> None:
    """Check bucket ``b`` received in ``payload`` (with header ``head``, only with ``checksum``) and
    copy its runs into ``targets`` (unless ``direct``: it was received in place; or ``writes`` is
    given: the runs are appended to it as ``(copy, view of payload)``, to be written at commit).

    Raises CollectiveError when its sender marked it FAILED, IntegrityError on a CRC mismatch."""
    status, sent = head.tolist() if head is not None else (OK, 0)
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
        box = c.geo.box
        if writes is not None and box is not None:  # (the same view each run of a cached plan: see Views)
            writes.append((c, payload_view(c, payload, box.lengths, views)))
            continue
        data = payload[c.offset: c.offset + c.nbytes].view(dtype_from_name(c.dtype))
        if writes is not None:
            writes.append((c, data))
        else:
            write_rec(c, targets[c.dst], dst_regions[c.dst], data, rec, into)


def commit(fail: Failure, targets: list[torch.Tensor], dst_regions: list[Region]) -> None:
    """Write a run's deferred writes into the destination pieces, once every rank agreed: a replayed
    run's recorded batch, else :func:`commit_writes`; a recorded run without failure is kept then
    for the next run of its plan."""
    if fail.program is not None:
        if fail.program.commit_outs:
            fail.program.copy("commit", fail.program.commit_outs, fail.program.commit_datas)
        return
    commit_writes(fail.writes, targets, dst_regions, fail.views, fail.rec)
    rec = fail.rec
    if rec is not None and rec.ok and fail.first is None and fail.keep is not None:
        rec.packed, rec.direct = fail.packed, fail.direct
        fail.keep.program = rec


def _few(keys: list[str], n: int = 4) -> str:
    s = ", ".join(repr(k) for k in keys[:n])
    return s + (f" and {len(keys) - n} more" if len(keys) > n else "")




def run_schedule(sched: Schedule, sources: list[torch.Tensor], src_regions: list[Region],
                 targets: list[torch.Tensor], dst_regions: list[Region], transport: Transport | None, *,
                 rank: int, checksum: bool, deadline: float | None, timeout: float | None, defer: bool = False,
                 snapshot: bool = False, keep: Buffers | None = None, rec: Program | None = None) -> Failure:
    """Run this rank's schedule; never raises (the errors are returned, for the commit exchange).

    Local copies first, then each round: post every receive, pack and post every send, wait,
    unpack. A bucket travels as its payload, preceded with ``checksum`` by a header message
    (status, CRC32; a bucket whose packing failed is sent marked FAILED; without checksum it goes
    as it is, and the commit exchange carries the failure). A bucket of one copy that is a
    contiguous run of its source goes from the source's memory (no packing); one that is a
    contiguous run of its target is received into it (only when not ``defer``). With ``defer``
    nothing is written into ``targets``: local copies (their source views, or copies of them with
    ``snapshot``, when a destination may share memory with a source) and received runs (views of
    the received buckets) go to ``Failure.writes`` for :func:`commit_writes`. On NCCL the next
    round is packed while this one travels. A wait that fails (deadline passed, peer gone) stops
    the rounds: the data group is closed then. ``keep``: buffers of an earlier run to reuse;
    ``rec``: record this run into it, kept in ``keep`` at the commit (see :mod:`ckpt._transfer_replay`)."""
    fail = Failure()
    if rec is not None:
        fail.rec, fail.keep = rec, keep
    fail.views = keep.views if keep is not None else None
    if fail.views is not None:
        fail.views.begin()
    for c in sched.local:
        try:
            if defer:
                data = read_kept(c, sources[c.src], src_regions[c.src], None if snapshot else fail.views)
                fail.writes.append((c, data.clone() if snapshot else data))
                _note_view(fail.rec, c)
            else:
                local_copy(c, sources, src_regions, targets, dst_regions, fail.rec,
                           fail.rec.local if fail.rec is not None else None)
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
    cap = round_bytes(list(by_round.values()), recvs_pooled=not defer)
    pools, arena = (keep or Buffers()).get(sched, cap, dev, defer)
    rounds = sorted(by_round)
    ahead: dict[int, list[Post]] = {}
    ctx = _Ctx(sources, src_regions, targets, dst_regions, checksum, fail, dev)
    for n, k in enumerate(rounds):
        sends, recvs = by_round[k]
        pool = pools[n % 2]
        works: list[tuple[Any, int]] = []
        try:
            if transport.eager or k not in ahead:  # (receives take buffers after this round's sends)
                pool.used = 0
            if not transport.eager and k not in ahead:
                ahead[k] = _pack_sends(sends, pool, ctx, None, k)
            posts_r, rviews = _post_recvs(recvs, arena if arena is not None else pool, ctx)
            if fail.rec is not None:
                fail.rec.at(k).recvs = posts_r
            if transport.eager:
                works += transport.post([], posts_r)
                _pack_sends(sends, pool, ctx, functools.partial(_post_now, transport, works), k)
            else:
                works = transport.post(ahead.pop(k), posts_r)
                if n + 1 < len(rounds):  # pack round k+1 now: on GPUs it overlaps round k's transfer
                    nxt = pools[(n + 1) % 2]
                    nxt.used = 0
                    ahead[rounds[n + 1]] = _pack_sends(by_round[rounds[n + 1]][0], nxt, ctx, None, rounds[n + 1])
        except Exception as e:  # noqa: BLE001 - posting failed: the data group is closed
            fail.add(CollectiveError(f"rank {rank}: transfer data: could not post messages ({type(e).__name__}: "
                                     f"{e}); a rank failed or exited. Nothing was committed"), primary=False)
            return fail
        if not wait_all(transport, works, deadline, timeout, rank, fail):
            return fail
        _unpack_round(recvs, rviews, ctx, rank, defer)
    return fail


def _note_view(rec: Program | None, c: Copy) -> None:
    """A copy read as a gather (several segments) is a new tensor, not a view: no replay then."""
    if rec is not None and c.geo.box is None and c.geo.ln is not None and len(c.geo.ln) > 1:
        rec.ok = False


def _post_now(transport: Transport, works: list[tuple[Any, int]], posts: list[Post]) -> None:
    works.extend(transport.post(posts, []))


class _Ctx:
    """What packing and unpacking a round need, in one place."""

    def __init__(self, sources: list[torch.Tensor], src_regions: list[Region], targets: list[torch.Tensor],
                 dst_regions: list[Region], checksum: bool, fail: Failure, dev: torch.device):
        self.sources, self.src_regions, self.targets, self.dst_regions = sources, src_regions, targets, dst_regions
        self.checksum, self.fail, self.dev = checksum, fail, dev
        self.views = fail.views


def _pack_sends(sends: list[Bucket], pool: Pool, ctx: _Ctx,
                emit: Callable[[list[Post]], None] | None, k: int) -> list[Post]:
    """Pack round ``k``'s outgoing buckets (a one-copy bucket that is a contiguous run of its source
    goes from the source itself, unless it travels joined with others); a bucket that cannot be
    packed still goes (marked FAILED when it has a header). Buckets joined to the one before
    (``Bucket.join``) go in its message. ``emit`` posts each message as soon as it is packed.
    Returns the posts."""
    posts: list[Post] = []
    fail = ctx.fail
    rec = fail.rec.at(k) if fail.rec is not None else None
    heads = rows = None
    if ctx.checksum:
        heads = torch.zeros(len(sends), 2, dtype=torch.int64, device=ctx.dev)
        # on a GPU the headers are filled on the host and copied over once per round (not once per
        # bucket: each small host-to-device copy from pageable memory waits for the host)
        batched = emit is None and ctx.dev.type != "cpu"
        rows = torch.zeros(len(sends), 2, dtype=torch.int64) if batched else heads
    for i, b in enumerate(sends):
        joined = b.join or _joins_next(sends, i)
        assert not (joined and heads is not None), "joined buckets travel without headers"
        view = None
        if len(b.copies) == 1 and not joined:
            c = b.copies[0]
            view = direct_view(ctx.sources[c.src], ctx.src_regions[c.src], c, True, ctx.dev)
        direct = view is not None
        if view is None:
            view = pool.next(b.nbytes)
        try:
            if fail.primary is not None:
                raise RuntimeError("this rank failed earlier")  # keep the protocol; send nothing of value
            if fail.rec is not None and not direct:
                for c in b.copies:
                    _note_view(fail.rec, c)
            pack(b, view, rows[i] if rows is not None else None, ctx.sources, ctx.src_regions, ctx.checksum,
                 direct=direct, views=ctx.views, rec=rec)
            if direct:
                fail.direct += b.nbytes
            else:
                fail.packed += b.nbytes
        except Exception as e:  # noqa: BLE001 - the bucket still goes, marked failed: no receiver waits
            if fail.primary is None:
                fail.add(e)
            if rows is not None:
                mark_failed(rows[i])
        if b.join:  # (the previous post is this pair's message: it grows over this bucket)
            first, peer, tag = posts[-1]
            posts[-1] = (span(pool.buf, first, view), peer, tag)
        else:
            posts.append((view, b.receiver, 2 * b.tag + 1))
            if heads is not None:
                posts.insert(len(posts) - 1, (heads[i], b.receiver, 2 * b.tag))
        if emit is not None and not _joins_next(sends, i):
            emit(posts[-2:] if heads is not None else posts[-1:])
    if heads is not None and rows is not None and rows is not heads and sends:
        heads.copy_(rows)  # (the stream orders it before the sends posted after it)
    if rec is not None:
        rec.sends = posts
    return posts


def _joins_next(buckets: list[Bucket], i: int) -> bool:
    """Whether the bucket after ``buckets[i]`` travels in its message (``Bucket.join``)."""
    return i + 1 < len(buckets) and buckets[i + 1].join


def span(base: torch.Tensor | None, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The bytes of ``base`` (uint8) from view ``first`` to the end of view ``last`` (both carved out of it)."""
    assert base is not None
    at = first.data_ptr() - base.data_ptr()
    return base[at: last.data_ptr() - base.data_ptr() + last.numel()]


def _post_recvs(recvs: list[Bucket], bufs: Pool | Arena, ctx: _Ctx
                ) -> tuple[list[Post], list[tuple[torch.Tensor, torch.Tensor | None, bool]]]:
    """Where a round's incoming buckets land: the target itself for a one-copy bucket that is a
    contiguous run of it (unless writes are deferred: then ``bufs`` is an arena; or it travels joined
    with others), else a buffer; the posts (one per message: joined buckets in one) and
    ``(payload, header or None, direct)`` per bucket."""
    posts: list[Post] = []
    rviews: list[tuple[torch.Tensor, torch.Tensor | None, bool]] = []
    heads = torch.zeros(len(recvs), 2, dtype=torch.int64, device=ctx.dev) if ctx.checksum else None
    for i, b in enumerate(recvs):
        joined = b.join or _joins_next(recvs, i)
        view = None
        if len(b.copies) == 1 and isinstance(bufs, Pool) and not joined:
            c = b.copies[0]
            view = direct_view(ctx.targets[c.dst], ctx.dst_regions[c.dst], c, False, ctx.dev)
        payload = view if view is not None else bufs.next(b.nbytes)
        rviews.append((payload, heads[i] if heads is not None else None, view is not None))
        if b.join:
            first, peer, tag = posts[-1]
            posts[-1] = (span(bufs.buf, first, payload), peer, tag)
            continue
        if heads is not None:
            posts.append((heads[i], b.sender, 2 * b.tag))
        posts.append((payload, b.sender, 2 * b.tag + 1))
    return posts, rviews


def _unpack_round(recvs: list[Bucket], rviews: list[tuple[torch.Tensor, torch.Tensor | None, bool]], ctx: _Ctx,
                  rank: int, defer: bool) -> None:
    """Check and unpack a round's received buckets (their headers, if any, read back in one copy)."""
    fail = ctx.fail
    heads = None
    if ctx.checksum and rviews and ctx.dev.type != "cpu":
        heads = torch.stack([h for _, h, _ in rviews if h is not None]).cpu()
    for i, (b, (view, head, direct)) in enumerate(zip(recvs, rviews, strict=True)):
        try:
            unpack(b, view, head if heads is None else heads[i], ctx.targets, ctx.dst_regions, ctx.checksum, rank,
                   direct, writes=fail.writes if defer else None, views=ctx.views, rec=fail.rec,
                   into=fail.rec.at(b.round).unpack if fail.rec is not None else None)
            if direct:
                fail.direct += b.nbytes
        except CollectiveError as e:
            fail.add(e, primary=False)
        except Exception as e:  # noqa: BLE001 - an IntegrityError (CRC) or a copy failure: this rank's own
            fail.add(e)


def wait_all(transport: Transport, works: list[tuple[Any, int]], deadline: float | None, timeout: float | None,
              rank: int, fail: Failure, fence: bool = False) -> bool:
    """Wait for a round's messages (``fence``: order what follows after them, see
    :meth:`Transport.fence`); False (the failure recorded) when a wait failed: the data group is
    closed then and the rounds stop."""
    for w, peer in works:
        try:
            if fence:
                transport.fence(w, deadline)
            else:
                transport.wait(w, deadline)
        except Exception as e:  # noqa: BLE001 - gloo: timed out or the peer is gone
            fail.timed_out = "timed out" in str(e).lower()
            fail.waited = peer
            how = (f"within {timeout:g} s" if timeout is not None and fail.timed_out
                   else f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
            fail.add(CollectiveError(f"rank {rank}: transfer data: no message to or from rank {peer} {how}; "
                                     f"rank {peer} is slow, hung or dead. Nothing was committed"), primary=False)
            return False
    return True
