"""Elastic restart through live transfer: the ranks that survive hand their state to a new layout.

When a job changes its world size (a rank lost and replaced, ranks removed or added), the surviving
ranks still hold the previous layout's pieces in memory. :func:`handoff` moves them into the new
layout's tensors over the new group, without storage: survivors pass their old state, new ranks
pass None. Tensors go through :func:`ckpt.transfer` (each wanted element from one surviving holder:
replicas over ``dp`` cover for a lost rank); plain values (step counters, schedulers' state dicts)
come from the lowest surviving rank that holds each key, after every survivor holding it agreed on
its value. Per-rank values (``ckpt.PerRank``: RNG states) are not carried: ranks no longer correspond.

When the survivors do not hold every element the new layout wants (a tensor-parallel shard whose
every replica was lost), every rank raises :class:`~ckpt.errors.LayoutError` before any byte moves,
naming the tensor: restore from the newest checkpoint instead (``ckpt.load`` reshards the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from ckpt import stateful
from ckpt._comm import Comm, raise_payload
from ckpt._state import ObjectItem, flatten_state, rebuild_state
from ckpt._transfer_coord import exchange
from ckpt.errors import CollectiveError, LayoutError, MismatchError, StateError
from ckpt.transfer import (
    DEFAULT_TIMEOUT_S,
    Options,
    TransferResult,
    after_agreement,
    declared,
    pick_error,
    rank_payload,
    run_items,
)


@dataclass(slots=True)
class Handoff:
    """The outcome of :func:`handoff`: ``state`` is ``new`` with its plain values replaced (as
    ``ckpt.load`` returns); ``objects`` the values carried, ``skipped`` the per-rank keys left alone."""

    state: dict[str, Any]
    result: TransferResult
    objects: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def handoff(old: dict[str, Any] | None, new: dict[str, Any], *, group: Any = None,
            timeout: float | None = DEFAULT_TIMEOUT_S, bucket_bytes: int | None = None,
            window: int | None = None, checksum: bool = False, strict: bool = True) -> Handoff:
    """Fill ``new`` (this rank's state under the new layout, any form ``ckpt.load`` takes) from the
    surviving ranks' ``old`` states (any form ``ckpt.save`` takes; None on a rank that has nothing).

    Collective over ``group`` (the new world). Tensors are filled in place, atomically for the whole
    group (no rank's ``new`` changes unless every rank's transfer succeeded); plain values are set in
    the returned ``Handoff.state``. ``strict=False``: a wanted key no survivor holds is left alone.

    Raises (on every rank): LayoutError when the survivors do not cover what ``new`` wants (restore
    from storage then); StateError when survivors disagree on a plain value; the errors of
    :func:`ckpt.transfer`.

    Example::

        # 4 ranks at dp=2 x tp=2; rank 3 died and was replaced: it passes None, the new layout is tp=4
        out = ckpt.transfer_elastic.handoff(old_state if survivor else None, new_state)
        step = out.state["train"]["step"]
    """
    comm = Comm(group, timeout=timeout)
    opts = Options(bucket_bytes=bucket_bytes, window=window, timeout=timeout, checksum=checksum, strict=strict)
    err: dict[str, Any] | None = None
    try:
        expanded = stateful.expand(new)
        srcs, dsts = declared(old, expanded, None)
        held = _plain(old)
        wanted = [i.key for i in flatten_state(expanded) if isinstance(i, ObjectItem) and not i.per_rank]
        skipped = [i.key for i in flatten_state(expanded) if isinstance(i, ObjectItem) and i.per_rank]
    except Exception as e:  # noqa: BLE001 - reaches every rank, typed, naming this one
        err = rank_payload(e, comm.who)
        srcs, dsts, held, wanted, skipped = [], [], {}, [], []
    try:
        result = run_items(comm, group, srcs, dsts, opts, None, err)
    except (LayoutError, MismatchError) as e:
        raise type(e)(f"elastic handoff: the surviving ranks' memory does not hold the new layout: {e}. "
                      "Restore from the newest checkpoint instead (ckpt.load reshards it)") from e
    except CollectiveError as e:
        if not after_agreement(e):
            raise
        # this rank alone failed writing the agreed tensors; the others go on to the values exchange: it
        # carries the error to them (raised alone, it left them waiting out the timeout there)
        err = rank_payload(e, comm.who)
    objects = _objects(comm, held, wanted, strict, timeout, err)
    state = rebuild_state(new, objects)
    stateful.restore(new, state)
    return Handoff(state, result, objects, skipped)


def _plain(old: dict[str, Any] | None) -> dict[str, bytes]:
    """This survivor's plain (not per-rank) values, each encoded (agreement is compared on bytes)."""
    if old is None:
        return {}
    out: dict[str, bytes] = {}
    for it in flatten_state(stateful.expand(old)):
        if isinstance(it, ObjectItem) and not it.per_rank:
            try:
                out[it.key] = msgpack.packb(it.value, use_bin_type=True)
            except (TypeError, ValueError) as e:
                raise StateError(f"value {it.key!r} cannot be carried by the handoff ({e}); it must be msgpack-able "
                                 "(numbers, strings, bytes, lists, dicts)") from e
    return out


def _objects(comm: Comm, held: dict[str, bytes], wanted: list[str], strict: bool,
             timeout: float | None, err: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plain values every rank wants, from the lowest survivor holding each, checked for agreement."""
    def reply(got: list[dict[str, Any]]) -> list[Any]:
        bad = pick_error(got)
        if bad is not None:
            return [bad] * comm.world
        try:
            return [{"v": _choose(got, rank, strict)} for rank in range(len(got))]
        except Exception as e:  # noqa: BLE001 - names the key and ranks itself
            return [rank_payload(e, None)] * comm.world

    mine = err or {"held": held, "want": wanted}
    out = exchange(comm, mine, reply, timeout=timeout, what="handoff values")
    if "err" in out:
        raise_payload(out)
    return {k: msgpack.unpackb(v, raw=False) for k, v in out["v"].items()}


def _choose(got: list[dict[str, Any]], rank: int, strict: bool) -> dict[str, bytes]:
    values: dict[str, bytes] = {}
    for key in got[rank]["want"]:
        holders = [(r, g["held"][key]) for r, g in enumerate(got) if key in g["held"]]
        if not holders:
            if strict:
                raise MismatchError(f"value {key!r}: rank {rank} wants it but no surviving rank holds it; pass "
                                    "strict=False to keep the new state's own value")
            continue
        differ = [r for r, v in holders if v != holders[0][1]]
        if differ:
            raise StateError(f"value {key!r}: surviving ranks {holders[0][0]} and {differ[0]} hold different values; "
                             "a replicated value must agree (wrap a per-rank value in ckpt.PerRank)")
        values[key] = holders[0][1]
    return values


__all__ = ["Handoff", "handoff"]
