"""Restore from the memory tier: find the newest step whose every piece is reachable, fetch what a
rank lacks from the peers that hold copies, load with every checksum checked, and fall back source
by source, then step by step, agreed by every rank.

:func:`plan_restore` is pure (what each rank reported -> candidates, newest first); :func:`run`
executes the plan over the tier's group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt._comm import describe
from ckpt.errors import CollectiveError, IntegrityError
from ckpt.tier.store import data_bytes, remove_step
from ckpt.tier.transfer import after_copy, exchange, failed, package

if TYPE_CHECKING:
    from ckpt.tier.types import TierView


@dataclass(frozen=True, slots=True)
class Candidate:
    """A step every rank can restore: ``sources[o]`` are the ranks holding a copy of rank ``o``'s
    pieces (``o`` itself first when it has its own copy, then the peers keeping replicas)."""

    step: int
    epoch: str
    sources: list[list[int]]

    def to_wire(self) -> list[Any]:
        return [self.step, self.epoch, self.sources]

    @classmethod
    def from_wire(cls, w: list[Any]) -> Candidate:
        return cls(int(w[0]), str(w[1]), [[int(s) for s in src] for src in w[2]])


def plan_restore(reports: list[dict[str, Any]], min_step: int | None = None) -> tuple[list[Candidate], list[str]]:
    """Candidates (newest first) and notes on what was left out, from every rank's report.

    ``reports[r]``: ``{"digest": the pieces rank r wants, "own": [[step, epoch, digest], ...],
    "held": [[owner, step, epoch, digest], ...]}`` (each copy on a node reported by one rank of it).
    A copy counts only when its digest equals its owner's (same pieces: same layout); copies of one
    step count together only when written in the same epoch (one attempt of the job: no mixing of a
    step redone after a fallback). Steps below ``min_step`` (the newest persistent checkpoint) are
    left out: storage is as new. Pure.
    """
    world = len(reports)
    notes: list[str] = []
    avail: dict[tuple[int, str], list[list[int]]] = {}
    held: list[tuple[int, int, int, str]] = []
    for rank, rep in enumerate(reports):
        for step, epoch, digest in rep.get("own", []):
            if digest != rep.get("digest"):
                notes.append(f"rank {rank}: its memory checkpoint of step {step} holds other pieces (another layout "
                             "or model): not used")
                continue
            avail.setdefault((step, epoch), [[] for _ in range(world)])[rank].append(rank)
        for owner, step, epoch, digest in rep.get("held", []):
            if not 0 <= owner < world or digest != reports[owner].get("digest"):
                notes.append(f"rank {rank}: its copy of rank {owner}'s step {step} holds other pieces: not used")
                continue
            held.append((rank, owner, step, epoch))
    for rank, owner, step, epoch in held:  # after every own copy: the owner's own comes first
        have = avail.setdefault((step, epoch), [[] for _ in range(world)])[owner]
        if rank not in have:
            have.append(rank)
    out = []
    for (step, epoch), srcs in sorted(avail.items(), key=lambda kv: -kv[0][0]):
        if min_step is not None and step < min_step:
            continue
        missing = [o for o in range(world) if not srcs[o]]
        if missing:
            notes.append(f"memory step {step}: no copy of rank(s) {missing[:8]} survives: not complete")
            continue
        out.append(Candidate(step, epoch, srcs))
    return out, notes


@dataclass(slots=True)
class TierRestore:
    """What a restore from the memory tier did. ``source`` is this rank's (``local``: its own copy,
    ``peer``: fetched from ``holder``); the other figures are over all ranks unless named ``rank_``."""

    step: int
    value: Any = field(repr=False)  # the state: printing a TierRestore must not print it
    url: str
    source: str
    holder: int
    tier: str  # "memory" (every rank had its own copy) or "memory-peer" (some fetched from peers)
    peer_ranks: list[int]
    bytes: int  # every rank's restored copy
    fetched_bytes: int  # moved between ranks
    rank_fetch_s: float
    rank_load_s: float
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def clobbered_message(root: str) -> str:
    """The error when every memory copy failed after loading began and storage has no checkpoint."""
    return (f"{root}: every memory-tier copy of the newest step failed (see the restore_failed records) after "
            "loading had begun, and there is no persistent checkpoint to restore instead: the state now holds "
            "parts of that step, not a fresh start. Restart the job: the failed copies are gone, so it starts "
            "fresh (or from storage)")


def report(tier: TierView, digest: str) -> dict[str, Any]:
    """This rank's view: its own usable copies and the copies its node keeps for others."""
    own = tier.store.scan_own()
    # Every rank of a node sees the node's copies: each is reported once, by the rank the peer
    # mapping made its holder (or, for a copy no rank of the node holds now, the node's first rank).
    here = [r for r, n in enumerate(tier.nodes) if n == tier.node]
    mapped = {o for h in here for o in tier.senders[h]}
    held = [e for e in tier.store.scan_replicas()
            if (e.owner in tier.senders[tier.rank]) or (e.owner not in mapped and tier.rank == here[0])]
    stale = [f"rank {tier.rank}: {e.path}: {e.problem}" for e in own + held if e.committed and e.problem]
    return {"digest": digest,
            "own": [[e.step, e.epoch, e.digest] for e in own if e.usable],
            "held": [[e.owner, e.step, e.epoch, e.digest] for e in held if e.usable],
            "stale": stale}


def run(tier: TierView, fn: Callable[[str], Any], *, digest: str, min_step: int | None = None,
        on_failure: Callable[[dict[str, Any]], None] | None = None) -> TierRestore | None:
    """Restore the newest complete memory step (collective over the tier's group); None when none.

    ``fn(url)`` loads this rank's copy at ``url`` and returns what the caller wants back; an
    exception from it (a checksum, a mismatch; anything but a CollectiveError) counts as that
    source failing. Each failure is
    passed to ``on_failure`` as a ``restore_failed`` record (the same on every rank) and the next
    source, then the next older step, is tried; copies left out (stale, incomplete) are passed once as
    a ``memory_tier_ignored`` record. Raises CollectiveError when a rank is lost.

    When every attempt failed (None after at least one failure) ``tier.restore_clobbered`` is set
    on every rank: the ranks whose part loaded, and a rank whose copy failed its checksums after
    part of it was copied (:mod:`ckpt.tier.fastload`), hold pieces of an abandoned step, so the
    state is no longer the caller's: it must be restored from storage or the job restarted.
    """
    tier.restore_clobbered = False
    mine = report(tier, digest)

    def decide(got: list[Any]) -> list[Any]:
        cands, notes = plan_restore(got, min_step)
        notes = [s for g in got for s in g.get("stale", [])] + notes
        verdict = {"cands": [c.to_wire() for c in cands], "notes": notes}
        return [verdict] * len(got)

    verdict = tier.comm.exchange(mine, decide, timeout=tier.timeout, what="memory tier restore planning")
    notes = [str(n) for n in verdict["notes"]]
    if notes and on_failure is not None:  # stale or incomplete copies: not failures, but worth a record
        on_failure({"event": "memory_tier_ignored", "tier": "memory", "notes": notes[:16]})
    failures: list[str] = []
    for cand in (Candidate.from_wire(w) for w in verdict["cands"]):
        bad: set[tuple[int, int]] = set()
        while True:
            choice = [next((s for s in cand.sources[o] if (o, s) not in bad), None) for o in range(tier.world)]
            if any(c is None for c in choice):
                break
            got = _attempt(tier, fn, cand, [int(c) for c in choice if c is not None])
            if got["ok"]:
                result = got["result"]
                result.failures, result.notes = failures, notes
                return result  # type: ignore[no-any-return]
            for o, src, err in got["failed"]:
                bad.add((o, src))
                what = "its own copy" if o == src else f"the copy rank {src} keeps"
                failures.append(f"memory step {cand.step}, rank {o} from {what}: {err}")
                if on_failure is not None:
                    on_failure({"event": "restore_failed", "tier": "memory", "step": cand.step, "rank": o,
                                "source": "local" if o == src else "peer", "holder": src, "error": err})
    tier.restore_clobbered = bool(failures)
    return None


def _attempt(tier: TierView, fn: Callable[[str], Any], cand: Candidate, choice: list[int]) -> dict[str, Any]:
    rank, step = tier.rank, cand.step
    url = tier.store.own(step)
    t0 = time.perf_counter()
    sends = {o: package(tier.store.replica(o, step), f"rank {rank}'s copy of rank {o}'s memory step {step}")
             for o in range(tier.world) if choice[o] == rank and o != rank}
    recvs = {choice[rank]: url} if choice[rank] != rank else {}
    for o, pkg in sends.items():
        if not pkg.header.get("ok"):
            sends[o] = failed(str(pkg.header.get("err")))
    arrived = exchange(tier.pg, sends, recvs, rank=rank, timeout=tier.timeout,
                       what=f"memory tier restore of step {step} (fetching from peers)", **tier.copy_options)
    t1 = time.perf_counter()
    err: str | None = next((r.err for r in arrived.values() if not r.ok), None)
    value: Any = None
    # fn may be collective (the trainer's reads the manifest with ckpt.inspect): when a fetch failed
    # (a copy from the same host fails its checksums there), no rank calls it, and the attempt fails
    fetch_failed = any(c != o for o, c in enumerate(choice)) and tier.comm.exchange(
        err is not None, lambda got: [any(got)] * len(got), timeout=after_copy(tier.timeout),
        what=f"memory tier restore of step {step} (fetch results)")
    if err is None and not fetch_failed:
        try:
            value = fn(url)
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of a source: the next one is tried, every rank agreeing
            err = describe(e)
            if isinstance(e, IntegrityError) or choice[rank] != rank:
                remove_step(url)  # a damaged copy (or a fetched one that failed): never tried again
    t2 = time.perf_counter()
    nbytes = data_bytes(url) if err is None else 0
    fetched = sum(r.bytes for r in arrived.values())

    def agree(got: list[Any]) -> list[Any]:
        failed_ = [[r, int(g["src"]), str(g["err"])] for r, g in enumerate(got) if g["err"] is not None]
        summary = {"failed": failed_, "bytes": sum(int(g["bytes"]) for g in got),
                   "fetched": sum(int(g["fetched"]) for g in got),
                   "peers": [r for r, g in enumerate(got) if int(g["src"]) != r]}
        return [summary] * len(got)

    summary = tier.comm.exchange({"err": err, "src": choice[rank], "bytes": nbytes, "fetched": fetched}, agree,
                                 timeout=tier.timeout, what=f"memory tier restore of step {step} (agreement)")
    if summary["failed"]:
        return {"ok": False, "failed": summary["failed"]}
    peers = [int(p) for p in summary["peers"]]
    return {"ok": True, "result": TierRestore(
        step=step, value=value, url=url, source="local" if choice[rank] == rank else "peer", holder=choice[rank],
        tier="memory-peer" if peers else "memory", peer_ranks=peers, bytes=int(summary["bytes"]),
        fetched_bytes=int(summary["fetched"]), rank_fetch_s=t1 - t0, rank_load_s=t2 - t1)}


__all__ = ["Candidate", "plan_restore", "TierRestore", "clobbered_message", "report", "run"]
