"""The control plane of :func:`ckpt.transfer`: what the ranks agree on before any byte moves.

The knobs (:class:`Options`, checked on the rank that passed them), errors as payloads every rank
raises alike, the coordinator's plan (:func:`plan_reply`, over the ranks' declarations from one
exchange), and each rank's cache of the plans it ran (:func:`plan_or_reuse`: a repeated call sends
only a fingerprint). The data plane (buffers, transports, the executor, replays) is in
:mod:`ckpt.transfer` and the ``_transfer_*`` modules it drives.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ckpt._comm import Comm, describe, raise_payload
from ckpt._save_plan import PieceDecl
from ckpt._transfer_plan import MIN_PART, Schedule, plan_transfer
from ckpt.errors import CheckpointError, CollectiveError, StateError

# Bucket size and window when the caller names none, by data path. Over NCCL, larger: on 4 x H100 a
# MoE's layout change in place took 10.5-11.3 ms with 256 MiB x 2-4 against 12.4-12.8 ms with 64 MiB x 4
# (fewer messages to post, fewer rounds; docs/BENCHMARKS.md), for 512 MiB per round of GPU memory. The
# same 512 MiB per round as one bucket: pieces sent unpacked go as fewer, larger messages (4 x H100,
# 8 GB to a disjoint group: 15.5-16.1 ms against 16.5-17.3 ms, 0.82-0.86x of NCCL against 0.77-0.80x;
# the layout change in place unchanged).
DEFAULT_BUCKET_BYTES = 64 << 20  # gloo
DEFAULT_WINDOW = 4
NCCL_BUCKET_BYTES = 512 << 20
NCCL_WINDOW = 1
DEFAULT_TIMEOUT_S = 600.0
JOIN_ON_GLOO = False  # test hook: join buckets into messages over gloo too (as over NCCL; see plan_transfer)


def rank_payload(e: BaseException, rank: int | None, primary: bool = True, timed_out: bool = False,
                 waited: int | None = None) -> dict[str, Any]:
    """An exception for the other ranks: a CheckpointError keeps its class, anything else becomes a
    CollectiveError; the message names the rank. ``waited``: the rank a wait that ran out was for."""
    kind = type(e).__name__ if isinstance(e, CheckpointError) else "CollectiveError"
    msg = describe(e)
    if rank is not None and not msg.startswith(f"rank {rank}:"):
        msg = f"rank {rank}: {msg}"
    out = {"err": msg, "type": kind, "primary": primary, "timed_out": timed_out}
    if timed_out and waited is not None:
        out["waited"] = int(waited)
    return out


def pick_error(got: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The error every rank raises (``got``: every rank's report, by rank): a rank's own failure first,
    then a wait that ran out of time (it names the slow rank), then any consequence seen elsewhere (a
    closed connection). From a wait that ran out, the waits are followed: when the rank waited for ran
    out waiting for another in turn, its report is taken, and so on; the chain ends at the last wait,
    which names the rank at its end (one that reports success after all, or a consequence such as a
    closed connection; a rank's own failure anywhere is chosen before any wait).

    Why: with 4 ranks, rank 3 failing to post its messages left rank 2 waiting for them, so rank 2
    posted none of its later rounds, and rank 0, waiting for rank 2, gave up on it at the same
    deadline; the lowest rank's timeout won and every rank blamed rank 2 (the generated transfer audit
    with 4 ranks). A wait chain of any length ends at the rank that was not waiting for anyone."""
    errs = [g for g in got if isinstance(g, dict) and "err" in g]
    if not errs:
        return None
    best = min(errs, key=lambda g: (not g.get("primary", True), not g.get("timed_out", False)))
    seen = {id(best)}
    while (best.get("timed_out") and not best.get("primary", True) and isinstance(best.get("waited"), int)
           and 0 <= best["waited"] < len(got)):
        nxt = got[best["waited"]]
        if not isinstance(nxt, dict) or "err" not in nxt or id(nxt) in seen:
            break  # (the rank waited for reported success, or the waits run in a circle: the wait stands)
        if not nxt.get("timed_out"):
            # a consequence there (any rank's own failure was chosen first, above), e.g. its messages could not
            # be posted once the waiting rank gave up and closed the connection: the wait names it better
            break
        seen.add(id(nxt))
        best = nxt
    return best


def exchange(comm: Comm, mine: dict[str, Any], reply: Callable[[list[dict[str, Any]]], list[Any]], *,
             timeout: float | None, what: str) -> dict[str, Any]:
    """One metadata exchange of the transfer fronts (planning, the commit verdict, a stream's catalog, a
    handoff's values): ``comm.exchange``, or ``reply`` alone in a single process. Raises only
    CheckpointErrors: anything else the exchange itself raises on this rank (it is this rank's own
    failure: its message may not have left) becomes a CollectiveError naming this rank. Why: every
    other failure of a transfer reaches the caller typed; this one escaped as it was (a RuntimeError
    out of ``ckpt.transfer``) while the other ranks named this rank in a CollectiveError."""
    if comm.single:
        return reply([mine])[0]
    try:
        return comm.exchange(mine, reply, timeout=timeout, what=what)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - the public API raises only CheckpointErrors
        raise CollectiveError(f"rank {comm.rank}: {what}: {type(e).__name__}: {e}; the other ranks fail waiting for "
                              "this rank. The metadata group may be unusable after this: restart the job") from e


@dataclass(frozen=True, slots=True)
class Options:
    """The knobs of one transfer (see :func:`transfer`), the same on every rank."""

    bucket_bytes: int | None = None  # None: by data path (see sizes)
    window: int | None = None
    timeout: float | None = DEFAULT_TIMEOUT_S
    version: int | None = None
    checksum: bool = False
    delta: bool = False
    strict: bool = True
    cast: bool = False
    in_place: bool = False
    min_part: int = MIN_PART


def check_options(opts: Options) -> None:
    """StateError for knobs no plan can use (on the rank that passed them; its payload reaches every
    rank). ``timeout`` is checked where the group is opened (:class:`ckpt._comm.Comm`)."""
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if opts.bucket_bytes is not None and not (whole(opts.bucket_bytes) and opts.bucket_bytes >= 64):
        raise StateError(f"bucket_bytes must be an int of at least 64, got {opts.bucket_bytes!r}")
    if opts.window is not None and not (whole(opts.window) and opts.window >= 1):
        raise StateError(f"window must be at least 1 bucket in flight, got {opts.window!r}")
    if opts.version is not None and not (whole(opts.version) and opts.version >= 0):
        raise StateError(f"version must be a non-negative int or None, got {opts.version!r}")
    if not whole(opts.min_part):
        raise StateError(f"min_part must be an int (bytes), got {opts.min_part!r}")


# The plans kept per process, least recently used dropped first: at most PLAN_CACHE plans holding at most
# PLAN_CACHE_PIECES copies (local, and in buckets) in all. Why a weight and not only a count: a stream's
# waves are one plan each, and a refit in more waves than plans kept evicted every wave's plan before its
# next use (16 kept: a 8.6 GB MoE streamed in 17 waves of 512 MiB planned every wave anew, every refit);
# a wave's plan is small, a whole model's may be large. ~200k copies are some tens of MB of Python objects.
PLAN_CACHE = 1024
PLAN_CACHE_PIECES = 200_000


@dataclass(slots=True)
class _Cached:
    """A plan this rank ran before: its global fingerprint, the coordinator's reply and the schedule."""

    fp: str
    mine: dict[str, Any]
    sched: Schedule
    weight: int = 1  # copies held (see PLAN_CACHE_PIECES)


PLANS: OrderedDict[tuple[Any, str], _Cached] = OrderedDict()  # (group key, structure fingerprint) -> plan


def _weight(sched: Schedule) -> int:
    return 1 + len(sched.local) + sum(len(b.copies) for b in (*sched.sends, *sched.recvs))


def _keep(key: tuple[Any, str], plan: _Cached) -> None:
    """Cache ``plan`` under ``key``, dropping the least recently used plans beyond the bounds (a plan
    heavier than the whole budget is not kept)."""
    PLANS.pop(key, None)
    if plan.weight > PLAN_CACHE_PIECES:
        return
    PLANS[key] = plan
    held = sum(c.weight for c in PLANS.values())
    while len(PLANS) > PLAN_CACHE or held > PLAN_CACHE_PIECES:
        held -= PLANS.popitem(last=False)[1].weight


def structure_fingerprint(wire: dict[str, Any], rank: int, world: int, opts: Options) -> str:
    """What makes this rank's part of a plan: its declared pieces (keys, dtypes, global shapes,
    regions), its place in the group, whether it joins over NCCL, and the planning options. Equal
    fingerprints on every rank, as at an earlier transfer, mean that transfer's plan holds again."""
    what = [wire["s"], wire["d"], wire["nccl"], *shaping(rank, world, opts)]
    return hashlib.blake2b(msgpack.packb(what, use_bin_type=True), digest_size=16).hexdigest()


def shaping(rank: int, world: int, opts: Options) -> tuple[Any, ...]:
    """What besides the pieces shapes this rank's plan: its place in the group and the planning
    options (in the structure fingerprint, and the key a kept front caches fingerprints under)."""
    return (rank, world, opts.bucket_bytes, opts.window, opts.strict, opts.cast, opts.min_part, opts.checksum)


def plan_or_reuse(comm: Comm, group: Any, err: dict[str, Any] | None, wire: dict[str, Any], fp: str | None,
                  opts: Options) -> tuple[dict[str, Any], Schedule, bool]:
    """This rank's part of the plan: the cached one when every rank still has the same structure as
    at a transfer they planned together (one small exchange of fingerprints), else planned anew.

    A rank with a cached plan sends only the plan's fingerprint; if some other rank's differs, the
    coordinator asks everyone for their declarations (a second exchange) and plans."""
    key = (key_of(comm, group), fp or "")
    hit = PLANS.get(key) if fp is not None else None
    msg = err or ({"v": opts.version, "last": wire["last"], "pc": hit.fp} if hit is not None else wire)
    out = planned(comm, group, msg, opts)
    if out.get("declare"):
        out = planned(comm, group, wire, opts)
    if out.get("cached") and hit is not None:
        PLANS.move_to_end(key)
        return dict(hit.mine, version=out["version"]), hit.sched, True
    sched = Schedule.from_wire(out["sched"])
    if fp is not None:
        _keep(key, _Cached(out["pc"], out, sched, _weight(sched)))
    return out, sched, False


def planned(comm: Comm, group: Any, mine: dict[str, Any], opts: Options) -> dict[str, Any]:
    """Every rank's declaration to the coordinator, this rank's schedule back (or the error every
    rank raises)."""
    def reply(got: list[dict[str, Any]]) -> list[Any]:
        bad = pick_error(got)
        if bad is not None:
            return [bad] * comm.world
        try:
            return plan_reply(got, comm, bucket_bytes=opts.bucket_bytes, window=opts.window, strict=opts.strict,
                              cast=opts.cast, delta=opts.delta, min_part=opts.min_part, group=group)
        except Exception as e:  # noqa: BLE001 - a plan error names its tensor and ranks itself
            return [rank_payload(e, None)] * comm.world

    out = exchange(comm, mine, reply, timeout=opts.timeout, what="transfer planning")
    if "err" in out:
        raise_payload(out)
    return out


def key_of(comm: Comm, group: Any) -> Any:
    """:func:`group_key` of ``comm``'s group as the caller named it."""
    return group_key(group, comm.world)


def group_key(group: Any, world: int) -> Any:
    """What plans and buffers are kept under: the group object, or the default group of ``world`` ranks."""
    return id(group) if group is not None else ("world", world)


def sizes(bucket_bytes: int | None, window: int | None, nccl: bool) -> tuple[int, int]:
    """The bucket size and window a plan uses: the caller's, else the data path's defaults."""
    return (bucket_bytes if bucket_bytes is not None else NCCL_BUCKET_BYTES if nccl else DEFAULT_BUCKET_BYTES,
            window if window is not None else NCCL_WINDOW if nccl else DEFAULT_WINDOW)


def plan_reply(got: list[dict[str, Any]], comm: Comm, *, bucket_bytes: int | None, window: int | None,
               strict: bool, cast: bool, delta: bool, min_part: int, group: Any) -> list[dict[str, Any]]:
    """The coordinator's part: agree on the version, plan, and hand each rank its schedule."""
    versions = {(r, g["v"]) for r, g in enumerate(got) if g["v"] is not None}
    if len({v for _, v in versions}) > 1:
        raise StateError(f"ranks give different transfer versions: {sorted(versions)}; pass the same version "
                         "on every rank (or none)")
    ver = next(iter(versions))[1] if versions else max(int(g["last"]) for g in got) + 1
    checks = {bool(g.get("ck")) for g in got if "s" in g}
    if len(checks) > 1:  # (a bucket carries a header only with checksum: the ranks must agree on it)
        raise StateError(f"ranks disagree on checksum: {[r for r, g in enumerate(got) if g.get('ck')]} pass "
                         "checksum=True, the others not; pass the same on every rank")
    pcs = {g.get("pc") for g in got}
    if len(pcs) == 1 and None not in pcs:  # every rank holds the plan these fingerprints name
        return [{"version": ver, "cached": True}] * comm.world
    if any("s" not in g for g in got):  # some rank's structure changed: everyone declares
        return [{"version": ver, "declare": True}] * comm.world
    srcs = [[PieceDecl.from_wire(p) for p in g["s"]] for g in got]
    dsts = [[PieceDecl.from_wire(p) for p in g["d"]] for g in got]
    fp = hashlib.blake2b(msgpack.packb([[g["s"], g["d"]] for g in got] + [min_part, cast],
                                       use_bin_type=True), digest_size=16).hexdigest()
    same = delta and all(g["fp"] == fp for g in got)
    nccl = any(g["nccl"] for g in got)
    on_nccl = nccl_data(comm, nccl)
    bucket_bytes, window = sizes(bucket_bytes, window, on_nccl)
    # NCCL: a pair's packed buckets of a round in one message (gloo posts each as soon as it is packed)
    join = (on_nccl or JOIN_ON_GLOO) and checks != {True}
    plan = plan_transfer(srcs, dsts, bucket_bytes=bucket_bytes, window=window, strict=strict, cast=cast, join=join,
                         min_part=min_part, unchanged=[g["u"] for g in got] if same else None,
                         clean=[g["c"] for g in got] if same else None)
    pc = hashlib.blake2b(msgpack.packb([fp, nccl, bucket_bytes, window, strict, checks == {True}], use_bin_type=True),
                         digest_size=16).hexdigest()
    common = {"version": ver, "fp": fp, "pc": pc, "net": plan.buckets > 0, "nccl": nccl, "sent": plan.bytes_sent,
              "skipped": plan.bytes_skipped, "local": plan.bytes_local, "buckets": plan.buckets, "rounds": plan.rounds}
    return [dict(common, sched=s.to_wire()) for s in plan.schedules]


def nccl_data(comm: Comm, gpu: bool) -> bool:
    """Whether the data goes over NCCL: some tensor is on a GPU (``gpu``, any rank's) and the group
    carries CUDA tensors over NCCL (not one of ckpt's own gloo groups). The coordinator's plan and
    every rank's transport ask the same question."""
    import torch.distributed as dist

    if not gpu or comm.side or not (dist.is_available() and dist.is_initialized()):
        return False
    return nccl_backend(str(dist.get_backend(comm.group)))


def nccl_backend(name: str) -> bool:
    """Whether a group of backend ``name`` sends CUDA tensors over NCCL: ``"nccl"``, or a backend per
    device such as ``"cpu:gloo,cuda:nccl"`` (what ``init_process_group()`` makes on a GPU machine when
    no backend is named, and what torchtitan asks for)."""
    parts = [p.strip().lower() for p in name.split(",")]
    return parts == ["nccl"] or "cuda:nccl" in parts


__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_WINDOW", "NCCL_BUCKET_BYTES", "NCCL_WINDOW", "DEFAULT_TIMEOUT_S",
           "JOIN_ON_GLOO", "PLAN_CACHE", "PLANS", "Options", "check_options", "rank_payload", "pick_error", "exchange",
           "structure_fingerprint", "shaping", "plan_or_reuse", "planned", "plan_reply", "key_of", "group_key",
           "sizes", "nccl_data", "nccl_backend"]
