"""Replays of :func:`ckpt.transfer`'s recorded runs (:class:`ckpt._transfer_net.Program`).

A run of a cached plan over the same tensors is the same copies and messages every time; replaying
the recording skips making and checking views in Python, which bound transfers of a few hundred
tensors on GPUs (docs/TRANSFER.md, "Replay").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ckpt import _transfer_exec as ex
from ckpt._transfer_exec import Failure, wait_all
from ckpt._transfer_net import Buffers, Program, Transport, same_tensors, shares_storage, signature
from ckpt._transfer_plan import Schedule
from ckpt.errors import CollectiveError
from ckpt.shards import Region


def run(sched: Schedule, sources: list[torch.Tensor], src_regions: list[Region], targets: list[torch.Tensor],
        dst_regions: list[Region], transport: Transport | None, *, rank: int, checksum: bool,
        deadline: float | None, timeout: float | None, defer: bool = False, snapshot: bool = False,
        keep: Buffers | None = None, early: Early | None = None, where: Where = None) -> Failure:
    """:func:`ckpt._transfer_exec.run_schedule`, or the replay of its recorded run in ``keep`` when
    every tensor is where it was; a run that may be replayed later is recorded. ``early``: what
    :func:`prepack` packed earlier in this call; ``where``: returns the signature of ``sources +
    targets`` where the caller keeps it (else computed here). Never raises."""
    rec = None
    if keep is not None and not snapshot and not checksum and ex.FAULT is None:
        tensors = sources + targets
        if early is not None and early.prog is keep.program and early.prog.defer == defer and same_tensors(
                tensors, early.tensors):
            return replay(early.prog, transport, rank=rank, deadline=deadline, timeout=timeout, packed=True)
        sig = signature(tensors) if where is None else where()
        if keep.program is not None and keep.program.holds(tensors, sig, defer):
            return replay(keep.program, transport, rank=rank, deadline=deadline, timeout=timeout)
        keep.program = None
        rec = Program(sig, tensors, defer)
        rec.shared = shares_storage(sources, targets)
    return ex.run_schedule(sched, sources, src_regions, targets, dst_regions, transport, rank=rank,
                           checksum=checksum, deadline=deadline, timeout=timeout, defer=defer, snapshot=snapshot,
                           keep=keep, rec=rec)


Where = Callable[[], Any] | None  # the signature of a run's tensors, where the caller keeps it


class Early(NamedTuple):
    """A recording whose first round :func:`prepack` packed, and the tensors it was found to hold for."""

    prog: Program
    tensors: list[torch.Tensor]


def prepack(keep: Buffers | None, sources: list[torch.Tensor], targets: list[torch.Tensor], defer: bool,
            where: Where = None) -> Early | None:
    """Pack the first round of the recorded run in ``keep`` when it holds for these tensors, before
    the call's plan exchange (for :func:`run`'s ``early``); None when there is nothing to pack
    ahead. Why: on GPUs the packing then runs while the host waits for the other ranks'
    fingerprints instead of before the first message (2 x H200, a MoE's layout change: ~0.4 ms of
    each). Harmless when the call then does not replay it: only this rank's own send buffers were
    written, and a run that is not this replay packs them anew. Not where a target shares storage
    with a source (the recording ran the local copies before any packing)."""
    prog = keep.program if keep is not None and ex.FAULT is None else None
    if prog is None or prog.shared or not prog.rounds:
        return None
    first = min(prog.rounds)
    r = prog.rounds[first]
    tensors = sources + targets
    if not r.outs or not prog.holds(tensors, signature(tensors) if where is None else where(), defer):
        return None
    prog.copy(("pack", first), r.outs, r.datas)
    return Early(prog, tensors)


def replay(prog: Program, transport: Transport | None, *, rank: int, deadline: float | None,
           timeout: float | None, packed: bool = False) -> Failure:
    """Run a recorded plan again (see :class:`~ckpt._transfer_net.Program`): per round one batch of
    packing copies, the round's messages and (in place) one batch of copies out of the received
    buffers. On NCCL no round waits for the host: the buffers of round k are reused by round k + 2
    after a stream wait, and the host waits (until the deadline) only once every round is posted.
    ``packed``: the first round was packed already (:func:`prepack`)."""
    fail = Failure()
    fail.program = prog
    fail.packed, fail.direct = prog.packed, prog.direct
    local = _Local(prog)
    if prog.shared or not prog.rounds:
        local.run()  # (as recorded: before any packing reads a source the copies may write)
    try:
        if prog.rounds:
            assert transport is not None
            _rounds(prog, transport, fail, local, rank=rank, deadline=deadline, timeout=timeout, packed=packed)
    finally:
        local.join()
    return fail


class _Local:
    """The local copies of an in-place replay (deferred, they are part of the commit), run once the
    first round is posted so that they overlap the transfer: on a GPU on a stream of their own,
    joined to the caller's at the end. Why: on 2 x H200 a MoE's layout change copies 1.1 GB per rank
    locally, 0.76 ms that ran before the first round was packed."""

    def __init__(self, prog: Program):
        self.prog, self.done = prog, not prog.local[0]
        self.side: Any = None

    def run(self) -> None:
        if self.done:
            return
        self.done = True
        outs, datas = self.prog.local
        dev = outs[0].device
        if dev.type != "cuda":
            self.prog.copy("local", outs, datas)
            return
        cur = torch.cuda.current_stream(dev)
        self.side = _stream(dev)
        self.side.wait_stream(cur)  # (the sources as the caller left them)
        with torch.cuda.stream(self.side):
            self.prog.copy("local", outs, datas)

    def join(self) -> None:
        self.run()
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)


_STREAMS: dict[Any, Any] = {}


def _stream(dev: torch.device) -> Any:
    if dev not in _STREAMS:
        _STREAMS[dev] = torch.cuda.Stream(dev)
    return _STREAMS[dev]


def _rounds(prog: Program, transport: Transport, fail: Failure, local: _Local, *, rank: int,
            deadline: float | None, timeout: float | None, packed: bool) -> None:
    """The rounds of :func:`replay`; the failure, if any, is recorded in ``fail``.

    This rank's own failure (a batch of copies: packing, copies out, local copies) is recorded and its
    rounds go on, as :func:`ckpt._transfer_exec.run_schedule`'s do (a bucket that could not be packed
    still goes): its peers get every message they wait for and the verdict names the failure. Why: a
    packing failure in a replay stopped the rounds, so every peer waited until the data's deadline
    (``timeout`` after the plan) and the verdict named a timeout instead of the error."""
    order = sorted(prog.rounds)
    posted: list[list[tuple[Any, int]]] = []
    waited: set[int] = set()

    def own(key: Any, outs: list[Any], datas: list[Any]) -> None:
        if fail.primary is None:  # (after a failure, nothing of value: the messages alone keep the protocol)
            try:
                prog.copy(key, outs, datas)
            except Exception as e:  # noqa: BLE001 - this rank's own: the commit exchange carries it
                fail.add(e)

    def settle(n: int, fence: bool) -> bool:
        """Round n done (``fence``: ordered after, on NCCL without the host), its copies out made."""
        if n in waited:
            return True
        if not wait_all(transport, posted[n], deadline, timeout, rank, fail, fence=fence):
            return False
        waited.add(n)
        out = prog.rounds[order[n]].unpack
        if out[0]:
            own(("unpack", order[n]), out[0], out[1])
        return True

    for n, k in enumerate(order):
        r = prog.rounds[k]
        if r.outs and not (packed and n == 0):  # (into the buffers of round n - 2: settled below, in round n - 1)
            own(("pack", k), r.outs, r.datas)
        try:
            posted.append(transport.post(r.sends, r.recvs))
        except Exception as e:  # noqa: BLE001 - posting failed: the data group is closed
            fail.add(CollectiveError(f"rank {rank}: transfer data: could not post messages ({type(e).__name__}: "
                                     f"{e}); a rank failed or exited. Nothing was committed"), primary=False)
            return
        try:
            local.run()  # (after the first round is posted)
        except Exception as e:  # noqa: BLE001 - this rank's own: the commit exchange carries it
            fail.add(e)
        # eager (gloo): each round is waited for in turn; else the last round is settled (NCCL: ordered on the
        # stream) while this one travels
        if not (settle(n, fence=False) if transport.eager else n < 1 or settle(n - 1, fence=True)):
            return
    for n in range(len(order)):
        if not transport.fence_waits and not wait_all(transport, posted[n], deadline, timeout, rank, fail):
            return  # (NCCL: the host waits for every round; settled ones too, a second wait is harmless)
        if not settle(n, fence=False):
            return


__all__ = ["run", "Early", "prepack", "replay"]
