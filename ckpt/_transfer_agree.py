"""The short agreement of :func:`ckpt.transfer` on GPUs: a repeated transfer's two metadata exchanges
(the plan's fingerprint, the commit verdict) as one all-reduce of a few integers each, over NCCL.

Why: each metadata exchange is a gather and a scatter of msgpack messages over ckpt's gloo group
(:class:`ckpt._comm.Comm`), 0.2-0.6 ms each on one host; on 4 x H100 the two were ~1.1 ms of a 12 ms
transfer of an 8.6 GB MoE (docs/TRANSFER.md). An all-reduce of a dozen int64 on the caller's NCCL
group is tens of microseconds.

When: only on a call that follows a transfer on the same group whose verdict was "all ok" and whose
data went over NCCL. Every rank saw that same verdict, so every rank takes this path (a rank cannot
tell alone whether the others still hold the same cached plan: that is what the all-reduce tells).
Each rank gives [holds a cached plan, its fingerprint, failed already, its version wish, its last
version]; the maxima (and minima, as maxima of the negations) tell every rank the same: either all
hold the plan one fingerprint names and none failed, and every rank replays it under the version the
coordinator would choose, or every rank takes the metadata exchange as before (which carries error
payloads and plans anew). The verdict: one all-reduce of "this rank is ok"; all ok commits,
anything else goes to the metadata exchange, which carries the errors.

Failures: an all-reduce cannot name a rank that never arrives. A reduce waits until the transfer's
deadline; one that ran out of time falls back to the metadata exchange, whose own timeout names the
missing rank (a lost rank costs up to twice ``timeout``, as a lost data message already did). A rank
whose data wait failed (its NCCL queue is stuck behind the lost messages) goes to the metadata
exchange at once. Off with ``CKPT_TRANSFER_SHORT_AGREE=0``.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch

ON = os.environ.get("CKPT_TRANSFER_SHORT_AGREE", "1") != "0"
# Test hook: the same agreement over a gloo side group of the ranks when the data goes over gloo (CPU
# ranks exercise the state machine; production uses it only over NCCL).
GLOO = False

BIG = 1 << 62  # versions beyond +-BIG cannot be encoded: such a call takes the metadata exchange

_READY: dict[Any, str] = {}  # group key -> the channel ("nccl" / "gloo") after a call agreed "all ok"
USED = {"plan": 0, "verdict": 0}  # calls this process decided by the short agreement (for tests, benches)


def take(key: Any) -> str | None:
    """Whether this call starts with the short agreement, and over which channel; forgotten at once:
    only a call that reaches an "all ok" verdict enables the next (every rank alike)."""
    return _READY.pop(key, None)


def settle(key: Any, channel: str | None) -> None:
    """After a verdict every rank shares: the next call on the group agrees over ``channel`` (None: not)."""
    if channel is None or not ON:
        _READY.pop(key, None)
    else:
        _READY[key] = channel


def channel_for(comm: Any, nccl_data: bool) -> str | None:
    """The channel of a call whose data path is NCCL (``nccl_data``) or gloo: "nccl", or "gloo" under
    the test hook, or None (a single process, or one of ckpt's own groups)."""
    if comm.single or comm.side:
        return None
    if nccl_data:
        return "nccl"
    return "gloo" if GLOO else None


def encode_plan(pc: str | None, failed: bool, version: int | None, last: int) -> list[int]:
    """This rank's contribution to the plan's agreement (see :func:`decode_plan`)."""
    bad = (failed or (version is not None and abs(version) >= BIG) or abs(last) >= BIG or pc is None
           or len(pc) > 15 * PARTS)
    hit = 0 if bad else 1
    # the fingerprint (hex) in pieces of 15 digits: each fits an int64, and so does its negation
    parts = [int(pc[i: i + 15], 16) for i in range(0, len(pc), 15)] if hit and pc is not None else []
    parts = (parts + [0] * PARTS)[:PARTS]
    given = int(version is not None and not bad)
    v = int(version) if given and version is not None else -BIG
    nv = -int(version) if given and version is not None else -BIG
    pieces = [x for p in parts for x in (p, -p)]
    return [hit, -hit, int(bad), given, -given, v, nv, int(last) if not bad else 0, *pieces]


PARTS = 3  # a fingerprint of up to 45 hex digits (ckpt's are 32: blake2b, 16 bytes)


def decode_plan(r: list[int]) -> int | None:
    """The version every rank replays its cached plan under, from the element-wise maxima ``r`` of every
    rank's :func:`encode_plan`; None: some rank holds another plan or none, failed, or the versions
    disagree (then every rank takes the metadata exchange, which names the cause)."""
    if r[2] != 0 or -r[1] != 1 or any(r[i] != -r[i + 1] for i in range(8, 8 + 2 * PARTS, 2)):
        return None
    if r[3] == 1:  # some rank gives a version: the others that give one must give the same
        return r[5] if r[5] == -r[6] else None
    return r[7] + 1


def reduce_max(channel: str, comm: Any, vals: list[int], deadline: float | None) -> list[int] | None:
    """Element-wise maximum of ``vals`` over the group's ranks; None when it did not finish by ``deadline``."""
    import torch.distributed as dist

    t = torch.tensor(vals, dtype=torch.int64)
    if channel == "gloo":
        from ckpt._comm import side_group

        pg = side_group(dist.get_process_group_ranks(comm.group), "transfer-agree")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # (torch's stub names the enum's type)
        work = pg.allreduce([t], opts)
        try:
            if deadline is None:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception:  # noqa: BLE001 - timed out or a rank gone: the metadata exchange names it
            return None  # (the group is closed then; the hook's tests end with such a failure)
        return [int(x) for x in t.tolist()]
    from ckpt._transfer_net import poll

    dev = torch.device("cuda", torch.cuda.current_device())
    # a stream of its own: the all-reduce need not wait for the caller's queued work (a training step)
    with torch.cuda.stream(_stream(dev)):
        g = t.to(dev)
        work = dist.all_reduce(g, op=dist.ReduceOp.MAX, group=comm.group, async_op=True)
        if work is None or not poll(work, deadline):
            return None
        return [int(x) for x in g.cpu().tolist()]


_STREAMS: dict[int, Any] = {}


def _stream(dev: torch.device) -> Any:
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _STREAMS:
        _STREAMS[i] = torch.cuda.Stream(dev)
    return _STREAMS[i]


def plan(channel: str, comm: Any, pc: str | None, failed: bool, version: int | None, last: int,
         timeout: float | None) -> int | None:
    """The version to replay the cached plan ``pc`` under when every rank holds it; else None."""
    deadline = None if timeout is None else time.monotonic() + timeout
    r = reduce_max(channel, comm, encode_plan(pc, failed, version, last), deadline)
    ver = None if r is None else decode_plan(r)
    USED["plan"] += ver is not None
    return ver


def verdict(channel: str, comm: Any, ok: bool, timeout: float | None) -> bool:
    """Whether every rank ran its part without error (False: some did not, or a rank did not answer
    in time; the metadata exchange then carries the errors)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    r = reduce_max(channel, comm, [0 if ok else 1], deadline)
    USED["verdict"] += r is not None and r[0] == 0
    return r is not None and r[0] == 0


__all__ = ["ON", "GLOO", "BIG", "USED", "PARTS", "take", "settle", "channel_for", "encode_plan", "decode_plan",
           "reduce_max", "plan", "verdict"]
