"""``ckpt.transfer``: move weights live from one running layout to another, without disk.

The load planner's question (which held pieces overlap which wanted pieces) answered between
running processes: senders declare what they hold as ``ckpt.save`` does, receivers what they want as
``ckpt.load`` does, the coordinator plans (:mod:`ckpt._transfer_coord`, the control plane, around
:mod:`ckpt._transfer_plan`, pure), and every rank runs its part (:mod:`ckpt._transfer_exec`): local
copies, then rounds of point-to-point buckets.

One transfer is one version. Receivers keep the received buckets and write them (and their local
copies) into the destination tensors only after every rank reported that every bucket arrived (and
checked, with ``checksum``): the agreement runs over :class:`ckpt._comm.Comm` with its timeouts,
exactly as a save commits. Any failure on any rank (an exception, a CRC mismatch, a rank that never
answers) is raised on every rank as a typed error naming that rank, and no destination tensor
changed (unless ``in_place=True``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt import _transfer_exec as ex
from ckpt import _transfer_front as _front
from ckpt import _transfer_net as net
from ckpt import _transfer_replay as _replay
from ckpt import stateful
from ckpt._comm import Comm, raise_payload, side_group
from ckpt._digest import digests
from ckpt._save_plan import PieceDecl
from ckpt._state import TensorItem, flatten_state
from ckpt._transfer_coord import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WINDOW,
    NCCL_BUCKET_BYTES,
    NCCL_WINDOW,
    PLANS,
    Options,
    check_options,
    exchange,
    group_key,
    key_of,
    nccl_backend,
    nccl_data,
    pick_error,
    plan_or_reuse,
    rank_payload,
    shaping,
    sizes,
    structure_fingerprint,
)
from ckpt._transfer_plan import MIN_PART, Schedule
from ckpt.errors import CheckpointError, CollectiveError, StateError

Rename = Callable[[str], "str | None"] | dict[str, str] | None


@dataclass(slots=True)
class TransferState:
    """What a rank remembers between transfers for ``delta=True``: the last committed version, the
    plan's structure fingerprint, and a hash of each of its source and destination pieces.

    Pass the same object to every transfer of one stream of versions (one per rank)."""

    version: int = 0
    fingerprint: str | None = None
    src_hashes: list[bytes] = field(default_factory=list)
    dst_hashes: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class TransferResult:
    """The outcome of one transfer. Byte counts are over all ranks except ``rank_*``."""

    version: int
    bytes_sent: int  # over the network
    bytes_skipped: int  # not sent: unchanged since the previous version (delta)
    bytes_local: int  # copied inside a rank that held what it wanted
    buckets: int
    rounds: int
    seconds: float
    rank_sent: int = 0  # this rank's bytes sent
    rank_received: int = 0
    state: TransferState | None = None
    cached_plan: bool = False  # the plan of an earlier transfer of the same structure was reused
    rank_packed: int = 0  # this rank's bytes copied into send buffers
    rank_direct: int = 0  # this rank's bytes sent from a source, or received into a target, as they are
    replayed: bool = False  # this rank replayed its recorded run of the cached plan (see ckpt._transfer_net.Program)
    # this rank's seconds per phase: "front" (flattening src and dst into pieces), "plan" (declaring,
    # the plan exchange; a replay's first packing), "move" (local copies and the data), "agree" (the
    # commit exchange), "commit" (writing into dst)
    phases: dict[str, float] = field(default_factory=dict)
    rank_senders: list[int] = field(default_factory=list)  # the ranks this rank received bytes from


_STALE: dict[Any, bool] = {}  # per group: the data group must be made anew (a data-phase failure closed it)
# per group, host buffers of its last cached plan: (plan fingerprint, buffers); GPU memory is left to
# torch's caching allocator (held buffers would be memory the training step cannot use)
_BUFFERS: dict[Any, tuple[str, net.Buffers]] = {}


def _rename_fn(rename: Rename) -> Callable[[str], str | None]:
    if rename is None:
        return lambda k: k
    if isinstance(rename, dict):
        table = dict(rename)
        return lambda k: table.get(k, k)
    if callable(rename):
        return rename
    raise StateError(f"rename must be a dict or a callable, got {type(rename).__name__}")


def _tensors(state: Any, what: str) -> list[TensorItem]:
    if state is None:
        return []
    if not isinstance(state, dict):
        raise StateError(f"transfer {what} must be a dict of tensors (as ckpt.save / ckpt.load take) or None, got "
                         f"{type(state).__name__}")
    return [i for i in flatten_state(stateful.expand(state)) if isinstance(i, TensorItem)]


def digest(t: torch.Tensor) -> bytes:
    """A 128-bit digest of a piece's bytes (delta: a change must not go unnoticed, so no 32-bit CRC);
    on a GPU computed there (:mod:`ckpt._digest`)."""
    return digests([t])[0]


def transfer(src: dict[str, Any] | None, dst: dict[str, Any] | None, *, group: Any = None,
             bucket_bytes: int | None = None, window: int | None = None,
             timeout: float | None = DEFAULT_TIMEOUT_S, version: int | None = None, checksum: bool = False,
             delta: bool = False, state: TransferState | None = None, rename: Rename = None, cast: bool = False,
             strict: bool = True, in_place: bool = False, min_part: int = MIN_PART) -> TransferResult:
    """Copy the tensors senders hold (``src``) into the tensors receivers want (``dst``), rank to rank.

    Collective over ``group`` (default: the world; a single process works without one). ``src`` is
    this rank's state in any form ``ckpt.save`` takes (tensors: replicated; ``ckpt.Shard``;
    ``ckpt.FlatShard``, ZeRO-1 ranges; DTensors; nested dicts), or None on a rank that only
    receives. ``dst`` is any form ``ckpt.load`` takes, filled in place, or None on a rank that only
    sends. Senders and receivers may be the same ranks or disjoint. Objects (non-tensors) are ignored.

    Each wanted element comes from exactly one holder; a rank that holds what it wants copies it
    locally; replicas share the sending. Bytes travel in buckets of at most ``bucket_bytes``, in
    rounds of at most ``window * bucket_bytes`` sent and as much received per rank (memory: up to
    ``2 * window * bucket_bytes`` of send buffers, plus the bytes this rank receives, kept until the
    commit, unless ``in_place``); by default 64 MiB x 4 over gloo, 512 MiB x 1 over NCCL. A repeated
    call with the same structure on every rank reuses its plan, and over the same tensors replays its
    recorded run (on GPUs its copies as CUDA graphs).

    Args:
        rename: source name -> destination name (a dict: unlisted names stay; a callable: None drops it).
        cast: convert on receive when the destination dtype differs (else MismatchError).
        strict: a wanted key nobody sends is a MismatchError (False: left as it is).
        version: the version number of this transfer (default: the state's last + 1, else 1); every
            rank that gives one must give the same.
        checksum: CRC32 of every bucket, checked on receive (IntegrityError naming sender and tensor).
        delta: send only pieces whose bytes changed since the previous transfer with ``state`` (same
            structure); needs a ``state`` kept across calls (one is made and returned if None).
        in_place: write received bytes straight into ``dst`` (no staging copy; a failure may leave
            ``dst`` partly updated).
        min_part: a replicated piece is split over its holders only in parts of at least this many bytes.

    Raises (on every rank, the same error): StateError / MismatchError / LayoutError for bad
    layouts (naming the tensor and rank); IntegrityError for a corrupted bucket; CollectiveError naming
    the rank that failed (an exception of any other type) or did not answer within ``timeout``.
    ``dst`` is unchanged whenever it raises (unless ``in_place``).

    Example::

        # ranks 0-1 train with rows split, ranks 2-3 serve with columns split
        src = {"w": ckpt.Shard(w_rows, (1024, 1024), (rank * 512, 0))} if rank < 2 else None
        dst = {"w": ckpt.Shard(w_cols, (1024, 1024), (0, (rank - 2) * 512))} if rank >= 2 else None
        ckpt.transfer(src, dst)
    """
    comm = Comm(group, timeout=timeout)
    if delta and state is None:
        state = TransferState()
    opts = Options(bucket_bytes, window, timeout, version, checksum, delta, strict, cast, in_place, min_part)
    err: dict[str, Any] | None = None
    srcs: list[TensorItem] = []
    dsts: list[TensorItem] = []
    t0 = time.perf_counter()
    try:
        srcs, dsts = _front.declared(key_of(comm, group), src, dst, rename, declared)
    except Exception as e:  # noqa: BLE001 - reaches every rank, typed, naming this one
        err = rank_payload(e, comm.who)
    return run_items(comm, group, srcs, dsts, opts, state, err, front=time.perf_counter() - t0)


def declared(src: dict[str, Any] | None, dst: dict[str, Any] | None,
             rename: Rename) -> tuple[list[TensorItem], list[TensorItem]]:
    """This rank's source pieces (renamed; dropped where ``rename`` says None) and destination pieces."""
    name = _rename_fn(rename)
    srcs: list[TensorItem] = []
    for it in _tensors(src, "src"):
        new = name(it.key)
        if new is not None:
            it.key = new
            srcs.append(it)
    return srcs, _tensors(dst, "dst")


def run_items(comm: Comm, group: Any, srcs: list[TensorItem], dsts: list[TensorItem], opts: Options,
              state: TransferState | None, err: dict[str, Any] | None = None, front: float = 0.0,
              tag: str = "") -> TransferResult:
    """One transfer of declared pieces (the body of :func:`transfer`, also run by the streaming and
    elastic front ends): declare, plan, move, agree, commit. ``err``: this rank already failed (its
    payload goes to every rank instead of a declaration); ``front``: seconds the caller spent
    flattening the state (reported as a phase); ``tag``: which of a caller's transfers this is (a
    stream's wave), kept apart in the plan cache: a rank whose own pieces are the same in every wave
    (a sender of the whole model) kept only the last wave's plan, and every wave was planned anew."""
    t0 = time.perf_counter()
    src_h: list[bytes] = []
    dst_h: list[bytes] = []
    wire: dict[str, Any] = {}
    fp: str | None = None
    if err is None:
        try:
            check_options(opts)
            if opts.delta:
                src_h = digests([i.local for i in srcs])
                dst_h = digests([i.local for i in dsts])
            wire = _declaration(srcs, dsts, opts, state, src_h, dst_h)
            # delta plans depend on which pieces changed: planned every time
            fp = None if opts.delta else _front.fingerprint_of(
                srcs, dsts, shaping(comm.rank, comm.world, opts),
                lambda: structure_fingerprint(wire, comm.rank, comm.world, opts)) + (f"/{tag}" if tag else "")
        except Exception as e:  # noqa: BLE001 - reaches every rank, typed, naming this one
            err = rank_payload(e, comm.who)
    early = _prepack(comm, group, fp, srcs, dsts, opts) if err is None else None
    mine, sched, hit = plan_or_reuse(comm, group, err, wire, fp, opts)
    ver = int(mine["version"])
    t1 = time.perf_counter()
    deadline = None if opts.timeout is None else time.monotonic() + opts.timeout
    staged, wanted, fail = _move(comm, group, mine, sched, srcs, dsts, opts, deadline, early)
    t2 = time.perf_counter()
    untold = _agree(comm, group, fail, ver, mine, opts, deadline)
    t3 = time.perf_counter()
    _commit(comm, fail, staged, dsts)
    t4 = time.perf_counter()
    if untold is not None:
        raise CollectiveError(f"transfer version {ver}: every rank reported success and rank {comm.rank} (the "
                              f"coordinator) committed it, but could not tell every rank: {untold}; a rank not told "
                              "may hold the previous version") from untold
    if opts.delta and state is not None:
        state.fingerprint = mine["fp"]
        state.src_hashes = src_h
        now = dict(zip(wanted, digests([dsts[j].local for j in wanted]), strict=True))
        state.dst_hashes = [now.get(j, h) for j, h in enumerate(dst_h)]
    if state is not None:
        state.version = ver
    sent, received, senders = _traffic(sched)
    phases = {"front": front, "plan": t1 - t0, "move": t2 - t1, "agree": t3 - t2, "commit": t4 - t3}
    return TransferResult(ver, mine["sent"], mine["skipped"], mine["local"], mine["buckets"], mine["rounds"],
                          time.perf_counter() - t0, sent, received, state, hit, fail.packed, fail.direct,
                          fail.program is not None, phases, list(senders))


def _prepack(comm: Comm, group: Any, fp: str | None, srcs: list[TensorItem], dsts: list[TensorItem],
             opts: Options) -> _replay.Early | None:
    """Where this call will likely replay the group's recorded run (its plan is cached, its buffers
    and recording are that plan's), that run's first round packed before the plan exchange
    (:func:`ckpt._transfer_replay.prepack`)."""
    if fp is None or opts.checksum or opts.delta:
        return None
    hit = PLANS.get((key_of(comm, group), fp))
    pc, keep = _BUFFERS.get(key_of(comm, group), ("", None))
    if hit is None or keep is None or pc != hit.fp:
        return None
    try:
        sources, targets = [i.local for i in srcs], [i.local for i in dsts]
        return _replay.prepack(keep, sources, targets, defer=not opts.in_place,
                               where=_where(srcs, dsts, sources, targets))
    except Exception:  # noqa: BLE001 - an optimisation: the move packs (and fails, if it must) as always
        return None


def _where(srcs: list[TensorItem], dsts: list[TensorItem], sources: list[torch.Tensor],
           targets: list[torch.Tensor]) -> Callable[[], Any]:
    """The signature of the pieces' tensors (``sources + targets``, the pieces' own), kept with the
    pieces by the front when it keeps them (:func:`ckpt._transfer_front.signature_of`)."""
    return lambda: _front.signature_of(srcs, dsts, lambda: net.signature(sources + targets))


def _declaration(srcs: list[TensorItem], dsts: list[TensorItem], opts: Options, state: TransferState | None,
                 src_h: list[bytes], dst_h: list[bytes]) -> dict[str, Any]:
    """What this rank tells the coordinator: its pieces, version wishes and, for delta, which of its
    pieces are unchanged (sources) or clean (destinations) since the last transfer."""
    s, d, nccl = _front.wire_of(srcs, dsts, lambda items: [PieceDecl(i.key, i.dtype, i.global_shape, i.region)
                                                          .to_wire() for i in items])
    return {"s": s, "d": d, "v": opts.version, "last": state.version if state is not None else 0,
            "fp": state.fingerprint if opts.delta and state is not None else None,
            "u": [i < len(state.src_hashes) and h == state.src_hashes[i] for i, h in enumerate(src_h)]
            if state is not None else [],
            "c": [j < len(state.dst_hashes) and h == state.dst_hashes[j] for j, h in enumerate(dst_h)]
            if state is not None else [],
            "nccl": nccl, "ck": opts.checksum}


def _move(comm: Comm, group: Any, mine: dict[str, Any], sched: Schedule, srcs: list[TensorItem],
          dsts: list[TensorItem], opts: Options, deadline: float | None, early: _replay.Early | None = None
          ) -> tuple[dict[int, torch.Tensor], list[int], ex.Failure]:
    """Run this rank's schedule. Not ``in_place``: nothing is written into ``dst`` yet; the received
    buckets are kept and the local copies noted (``Failure.writes``) until the commit. ``in_place``:
    straight into the pieces (a non-contiguous one through a contiguous staging copy, returned).
    ``deadline``: when a wait for another rank's bytes gives up (monotonic seconds)."""
    fail = ex.Failure()
    staged: dict[int, torch.Tensor] = {}
    wanted: list[int] = []
    targets: list[torch.Tensor] = [i.local for i in dsts]
    try:
        wanted = _wanted(sched)
        strided = _front.strided(srcs, dsts) if opts.in_place else []
        for j in sorted(set(strided).intersection(wanted)) if strided else []:
            t = dsts[j].local
            # the staging copy starts as dst's own values when delta may skip some of its copies
            staged[j] = t.detach().clone(memory_format=torch.contiguous_format) if opts.delta else torch.empty(
                t.shape, dtype=t.dtype, device=t.device)
            targets[j] = staged[j]
        transport = _transport(comm, group, mine, opts.timeout) if mine["net"] else None
        keep = None
        if transport is not None and not opts.delta:  # (kept on GPUs too: see release_buffers)
            pc, keep = _BUFFERS.get(key_of(comm, group), ("", None))
            if pc != mine["pc"] or keep is None:
                keep = net.Buffers()
                _BUFFERS[key_of(comm, group)] = (mine["pc"], keep)
        sources = [i.local for i in srcs]
        # deferred, a local copy cannot wait for the commit when its source may be overwritten first
        snapshot = not opts.in_place and bool(sched.local) and net.shares_storage(sources, targets)
        # (a staged target is not the piece's own tensor: then the signature is taken anew)
        where = None if staged else _where(srcs, dsts, sources, targets)
        fail = _replay.run(sched, sources, [i.region for i in srcs], targets, [i.region for i in dsts], transport,
                           rank=comm.rank, checksum=opts.checksum, deadline=deadline, timeout=opts.timeout,
                           defer=not opts.in_place, snapshot=snapshot, keep=keep, early=early, where=where)
    except Exception as e:  # noqa: BLE001
        fail.add(e)
    return staged, wanted, fail


def _of(sched: Schedule, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, derived from ``sched`` alone, kept with it (a cached plan runs again and again)."""
    if what not in sched.derived:
        sched.derived[what] = fn()
    return sched.derived[what]


def _wanted(sched: Schedule) -> list[int]:
    """The destination pieces ``sched`` writes (sorted)."""
    out: list[int] = _of(sched, "wanted", lambda: sorted({c.dst for c in sched.local}
                                                         | {c.dst for b in sched.recvs for c in b.copies}))
    return out


def _traffic(sched: Schedule) -> tuple[int, int, list[int]]:
    """Bytes ``sched`` sends and receives, and the ranks it receives from."""
    out: tuple[int, int, list[int]] = _of(sched, "traffic", lambda: (
        sum(b.nbytes for b in sched.sends), sum(b.nbytes for b in sched.recvs),
        sorted({b.sender for b in sched.recvs})))
    return out


def release_buffers(group: Any = None) -> None:
    """Free the buffers (and kept views, recorded runs and declared pieces) that :func:`transfer`
    keeps between calls of the same plan on ``group`` (default: the default group), e.g. before the
    memory is wanted for something else (an inference engine's cache after a refit). The next call
    allocates them again. Not collective."""
    import torch.distributed as dist

    # (a group is keyed by itself: the world size only names the default group, and an unregistered
    # group of ckpt's own has none torch.distributed would tell)
    world = dist.get_world_size() if group is None and dist.is_available() and dist.is_initialized() else 1
    _BUFFERS.pop(group_key(group, world), None)
    _front.forget(group_key(group, world))


def _commit(comm: Comm, fail: ex.Failure, staged: dict[int, torch.Tensor], dsts: list[TensorItem]) -> None:
    """Write this version into ``dst``: every bucket of it arrived and was checked, on every rank."""
    try:
        ex.commit(fail, [i.local for i in dsts], [i.region for i in dsts])
        for j, t in staged.items():
            dsts[j].local.copy_(t)
    except Exception as e:  # an agreed version that cannot be written here: say so, it is this rank's
        err = CollectiveError(f"rank {comm.rank}: transfer commit: writing the received tensors failed after every "
                              f"rank agreed ({type(e).__name__}: {e}); this rank's dst may be partly updated, "
                              "run the transfer again")
        err.agreed = True  # type: ignore[attr-defined]  # (this rank alone: the others committed, see after_agreement)
        raise err from e


def after_agreement(e: BaseException) -> bool:
    """Whether ``e`` is this rank's own failure after every rank agreed on the version (writing it into
    ``dst``): the other ranks committed and returned, so a front that has another exchange to come (a
    handoff's values) must carry it there, not raise it alone."""
    return bool(getattr(e, "agreed", False))


def _agree(comm: Comm, group: Any, fail: ex.Failure, ver: int, mine: dict[str, Any], opts: Options,
           deadline: float | None) -> CheckpointError | None:
    """The commit verdict: every rank reports, every rank gets the same answer; raises the chosen
    error on every rank unless all went well. Returns the error of telling the others on a coordinator
    that decided "all ok" but could not reach every rank (it commits all the same, then raises it).

    A rank waits for the others' reports until ``timeout`` after the move's ``deadline``, not only
    after its own report. Why: a rank whose data failed early (its messages could not be posted)
    reports at once, while the ranks waiting for its bytes give up only at their deadline; with
    ``timeout`` from its own report it would give up on them at the same moment, a race that closed
    the metadata group on a healthy rank and blamed it."""
    report: dict[str, Any] = {"ok": True} if fail.first is None else rank_payload(
        fail.first, comm.who, primary=fail.primary is not None, timed_out=fail.timed_out, waited=fail.waited)
    decided: list[dict[str, Any]] = []  # the verdict, on the coordinator once it decided

    def agree(got: list[dict[str, Any]]) -> list[Any]:
        decided.append(pick_error(got) or {"ok": True})
        return [decided[0]] * comm.world

    wait = opts.timeout if deadline is None or opts.timeout is None else max(
        opts.timeout, deadline + opts.timeout - time.monotonic())
    try:
        verdict = exchange(comm, report, agree, timeout=wait, what=f"transfer commit (version {ver})")
    except CheckpointError as e:
        if not decided or "err" in decided[0]:
            raise
        # The coordinator decided that every rank succeeded, then could not tell some rank (it died or
        # stopped listening after its report): the ranks it did tell commit, so the decision stands here
        # too. Why: it raised with dst unchanged while another rank returned holding the new version.
        return e
    if "err" in verdict:
        # A wait may have failed somewhere and closed the data group: every rank got this same
        # verdict, so every rank makes a new one next time (its members must agree on that).
        if mine["net"]:
            _STALE[key_of(comm, group)] = True
        _BUFFERS.pop(key_of(comm, group), None)  # a timed-out receive may still land in them
        verdict = dict(verdict, err=f"transfer version {ver}: {verdict['err']}"
                       + ("" if opts.in_place else "; no destination tensor was changed"))
        raise_payload(verdict, fail.first)
    return None


def _transport(comm: Comm, group: Any, mine: dict[str, Any], timeout: float | None) -> net.Transport:
    """The data path every rank agreed on: NCCL P2P on the caller's group when it is an NCCL group and
    some tensor is on a GPU, else ckpt's gloo side group of the same ranks (created on first use)."""
    import torch.distributed as dist

    g = comm.group
    key = key_of(comm, group)
    if isinstance(g, dist.ProcessGroupGloo) and comm.side:
        # one of ckpt's own groups (the memory tier's): not registered, so its ranks are unknown here;
        # the data goes over it (its owner makes a new one after a failure that closed it)
        _STALE.pop(key, None)
        return net.GlooTransport(g)
    if nccl_data(comm, mine["nccl"]):
        return net.NcclTransport(g)
    ranks = dist.get_process_group_ranks(g)
    pg = side_group(ranks, "transfer-data", timeout=timeout, fresh=_STALE.pop(key, False))
    return net.GlooTransport(pg)


__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_WINDOW", "NCCL_BUCKET_BYTES", "NCCL_WINDOW", "DEFAULT_TIMEOUT_S", "Rename",
           "after_agreement",
           "TransferState", "TransferResult", "digest", "rank_payload", "pick_error", "transfer", "release_buffers",
           "Options", "check_options", "declared", "run_items", "structure_fingerprint", "sizes", "nccl_backend"]
