"""The plumbing under :mod:`ckpt._comm`'s exchanges: ckpt's own gloo groups (:func:`side_group`), the
exchange tree's shape, msgpack framing, waits bounded by a deadline, and how a failure is worded and
carried to the other ranks (:func:`error_payload` / :func:`raise_payload`). No protocol: what a rank
sends when, and who is named for what, is :class:`ckpt._comm.Comm`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import time
import weakref
from typing import Any

import msgpack

from ckpt import errors

_GLOO_GROUPS: dict[Any, Any] = {}
# ckpt's own gloo groups (not registered with torch.distributed) -> their global ranks; weak: a replaced group goes
_GROUP_RANKS: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def no_reply(msg: str | errors.CollectiveError) -> errors.CollectiveError:
    """``msg`` as the CollectiveError of an exchange that failed before the coordinator's reply ran (a
    rank lost a child, or was told so by its parent): nothing the exchange carried was acted on."""
    e = msg if isinstance(msg, errors.CollectiveError) else errors.CollectiveError(msg)
    e.no_reply = True  # type: ignore[attr-defined]
    return e


def decided_nothing(e: BaseException) -> bool:
    """Whether ``e`` is :func:`no_reply`'s: the exchange it ended decided nothing (see the module's text)."""
    return bool(getattr(e, "no_reply", False))


def side_group(ranks: list[int], purpose: str, *, timeout: float | None = None, fresh: bool = False) -> Any:
    """ckpt's own gloo group over ``ranks`` (global ranks) for ``purpose``, created once and cached
    (``fresh``: created anew, e.g. for an object that owns its group; every member must ask alike).

    The one place ckpt creates process groups. ``new_group`` cannot be used lazily: by default it is
    collective over the whole world (a save on a subgroup would wait for ranks that never call it),
    and it names groups from per-process counters (``group_count``, or ``len(pg_names)`` with
    ``use_local_synchronization``) that differ between ranks as soon as they belong to different
    subgroups, so members would wait under different names and hang. Here the members alone build a
    gloo group on the default store under a name made of ``purpose`` and ``ranks`` (plus a generation
    counted in the store, so a re-created group never meets a stale one). It is not registered with
    torch.distributed: :class:`Comm` talks to it through the group's own ``send`` / ``recv``.
    Creation waits at most ``timeout`` (else 30 min, gloo's default); a member that never arrives
    gives a CollectiveError naming the ranks.
    """
    dist = _dist()
    from torch.distributed.distributed_c10d import _get_default_store

    check_timeout(timeout)
    ranks = [int(r) for r in ranks]
    key = (purpose, tuple(ranks), id(dist.group.WORLD))
    if fresh:
        _GLOO_GROUPS.pop(key, None)
    if key not in _GLOO_GROUPS:
        me = dist.get_rank()
        td = datetime.timedelta(seconds=timeout if timeout is not None else 1800.0)
        name = f"ckpt/{purpose}/{'_'.join(map(str, ranks)) if len(ranks) <= 16 else _digest(ranks)}"
        try:
            store = _get_default_store()
            # every member adds 1 once per creation: the n-th creation of this group sees n*len(ranks)
            generation = (int(store.add(f"{name}/generation", 1)) - 1) // len(ranks)
            store.set(f"{name}/{generation}/arrived/{me}", "1")  # (to name the members that never came)
            prefixed = dist.PrefixStore(f"{name}/{generation}/", store)
            _GLOO_GROUPS[key] = dist.ProcessGroupGloo(prefixed, ranks.index(me), len(ranks), td)
            _GROUP_RANKS[_GLOO_GROUPS[key]] = ranks
        except Exception as e:  # noqa: BLE001 - a rank that never arrives: typed, named
            who = "a rank"
            with contextlib.suppress(Exception):
                missing = [r for r in ranks if not store.check([f"{name}/{generation}/arrived/{r}"])]
                who = (f"rank {missing[0]} never came" if len(missing) == 1 else
                       f"ranks {_few_ranks(missing)} never came" if missing else "a rank")
            raise errors.CollectiveError(
                f"rank {dist.get_rank()}: could not create ckpt's {purpose} (gloo) group of ranks {_few_ranks(ranks)} "
                f"({type(e).__name__}: {e}); {who}: slow, hung or dead? Restart the job") from e
    return _GLOO_GROUPS[key]


def _digest(ranks: list[int]) -> str:
    import hashlib

    return hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]


def tree_children(v: int, world: int, fanin: int) -> list[int]:
    """Children of virtual rank ``v`` (0 is the root) in the exchange tree of ``world`` ranks.

    ``fanin`` <= 0, or a world the root can reach directly (``world - 1 <= fanin``): the flat star.
    Pure; the same on every rank.
    """
    if fanin <= 0 or world - 1 <= fanin:
        return list(range(1, world)) if v == 0 else []
    return list(range(fanin * v + 1, min(fanin * v + fanin, world - 1) + 1))


def tree_parent(v: int, world: int, fanin: int) -> int:
    """Parent of virtual rank ``v`` > 0 in the exchange tree (see :func:`tree_children`)."""
    if fanin <= 0 or world - 1 <= fanin:
        return 0
    return (v - 1) // fanin


def tree_below(v: int, world: int, fanin: int) -> list[int]:
    """Every virtual rank strictly below ``v`` in the exchange tree, in ascending order."""
    out: list[int] = []
    todo = tree_children(v, world, fanin)
    while todo:
        out += todo
        todo = [c for p in todo for c in tree_children(p, world, fanin)]
    return sorted(out)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` if it is None or a positive number of seconds, else a StateError. Why: zero, a
    negative or NaN made every wait give up at once, and a gloo wait that gives up closes the
    group: one bad argument cost the job its metadata group."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise errors.StateError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return timeout


def _deadline(timeout: float | None) -> float | None:
    t = check_timeout(timeout)
    return None if t is None else time.monotonic() + t


def _wait(work: Any, deadline: float | None, floor: float = 0.001) -> None:
    """Wait for one posted operation until ``deadline`` (monotonic seconds; None: gloo's own timeout)."""
    if deadline is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), floor)))


def _wait_posted(works: dict[int, Any], deadline: float | None, missing: list[int],
                 first: BaseException | None) -> tuple[list[int], BaseException | None]:
    """Wait for every peer's posted receive or sends (all posted: waiting in order costs nothing extra), adding
    the peers that failed to ``missing``. After an early failure (a lost peer) the rest get no more
    time: one not done then is late, not known to be at fault. Returns the late peers and the first
    exception (``first`` if already set)."""
    late: list[int] = []
    for p, w in works.items():
        early = bool(missing) and (deadline is None or time.monotonic() < deadline)
        try:
            for one in w if isinstance(w, list) else [w]:  # (a send's head, then its payload)
                _wait(one, deadline if not missing else time.monotonic())
        except Exception as e:  # noqa: BLE001 - gloo: timed out, or the peer is gone (the pair is closed afterwards)
            (late if early and _timed_out(e) else missing).append(p)
            first = first or e
    return late, first


def _consequence(what: str) -> str:
    if what.startswith("load completion"):  # after the reads: what this rank read is in place already
        return "the load failed: this rank's state may be partly loaded (load again)"
    if what.startswith("load"):
        return "nothing was loaded"
    if what.startswith("save commit reply"):  # the coordinator decides before it replies
        return "the checkpoint may be committed all the same: check with `ckpt ls` before relying on it"
    if what.startswith("save"):
        return "the checkpoint is not committed"
    return f"the {what} did not complete on every rank"


def _timed_out(e: BaseException | None) -> bool:
    """Whether gloo's exception ``e`` says a wait passed its deadline (else the connection was lost)."""
    return e is None or "timed out" in str(e).lower()


def _reason(e: BaseException, timeout: float | None) -> str:
    """Why a gloo wait failed: our deadline passed, or the group was closed (a peer died, or another
    rank's wait timed out: gloo then closes every connection of the group)."""
    text = str(e)
    if _timed_out(e):
        return f"within {timeout:g} s (slow, hung or dead)" if timeout is not None else "(timed out)"
    first = text.splitlines()[0][:200] if text else type(e).__name__
    return f"(connection lost: {first}; a rank failed, exited or timed out)"


def _few_ranks(ranks: list[int], n: int = 8) -> str:
    if len(ranks) <= n:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:n - 2]))}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def describe(e: BaseException) -> str:
    """An exception as a message: a CheckpointError's own, others prefixed with their type."""
    return str(e) if isinstance(e, errors.CheckpointError) else f"{type(e).__name__}: {e}"


def error_payload(e: BaseException, rank: int | None) -> dict[str, Any]:
    """Encode an exception so that other ranks can re-raise it with the same type.

    ``rank`` (None in a single process) is prefixed to the message so that every rank names the
    culprit; an exception that is not a CheckpointError travels as one, its message starting with
    its own type name ("rank 1: NotADirectoryError: ...").
    """
    kind = type(e).__name__ if isinstance(e, errors.CheckpointError) else "CheckpointError"
    msg = describe(e)
    return {"err": f"rank {rank}: {msg}" if rank is not None else msg, "type": kind, "cause": type(e).__name__}


def raise_payload(p: dict[str, Any], cause: BaseException | None = None) -> None:
    """Re-raise an error encoded by :func:`error_payload` (chained to ``cause``: the original, on its rank)."""
    cls = getattr(errors, p.get("type", "CheckpointError"), errors.CheckpointError)
    if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
        cls = errors.CheckpointError
    raise cls(p["err"]) from cause


__all__ = ["no_reply", "decided_nothing", "side_group", "tree_children", "tree_parent", "tree_below", "check_timeout",
           "describe", "error_payload", "raise_payload"]
