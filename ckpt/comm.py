"""Metadata exchange between ranks: msgpack bytes over a CPU (gloo) group. Never pickle, never data.

Every exchange is point-to-point between the coordinator (group rank 0) and each rank: a rank
sends one message and receives one, so what a rank sends and receives is O(its own metadata), and
a coordinator waiting for a slow or dead rank names it after ``timeout`` seconds instead of
hanging. Only the load path broadcasts (the manifest, which every loading rank needs).

Every send, receive and broadcast is bounded: it is posted without blocking and waited for until a
deadline ``timeout`` seconds after the operation started (``None``: no deadline of ours, gloo's own
group timeout applies). A rank that misses it raises :class:`~ckpt.errors.CollectiveError` naming
itself, the peer and the operation. gloo closes every connection of the group when a wait times
out, so the other ranks of the collective get a CollectiveError at once instead of waiting in turn;
the metadata group is unusable afterwards (restart the job).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import msgpack
import torch

from ckpt import errors

DEFAULT_TIMEOUT_S = 600.0
_GLOO_GROUPS: dict[Any, Any] = {}


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _wait(work: Any, deadline: float | None, floor: float = 0.001) -> None:
    """Wait for one posted operation until ``deadline`` (monotonic seconds; None: gloo's own timeout)."""
    if deadline is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), floor)))


def _consequence(what: str) -> str:
    if what.startswith("load"):
        return "nothing was loaded"
    if what.startswith("save commit reply"):  # the coordinator decides before it replies
        return "the checkpoint may be committed all the same: check with `ckpt ls` before relying on it"
    if what.startswith("save"):
        return "the checkpoint is not committed"
    return f"the {what} did not complete on every rank"


def _reason(e: BaseException, timeout: float | None) -> str:
    """Why a gloo wait failed: our deadline passed, or the group was closed (a peer died, or another
    rank's wait timed out: gloo then closes every connection of the group)."""
    text = str(e)
    if "timed out" in text.lower():
        return f"within {timeout:g} s (slow, hung or dead)" if timeout is not None else "(timed out)"
    first = text.splitlines()[0][:200] if text else type(e).__name__
    return f"(connection lost: {first}; a rank failed, exited or timed out)"


class Comm:
    """Collective helpers for one process group, or a no-op single-process stand-in.

    ``group=None`` with an initialized default group means the whole world takes part.
    ``sent`` / ``received`` count this rank's metadata bytes (for the traffic figures).
    ``timeout`` bounds the creation of the gloo side group of a non-gloo (NCCL) group, which is
    itself collective (None: the default group timeout).
    """

    def __init__(self, group: Any = None, *, timeout: float | None = None):
        dist = _dist()
        self.enabled = dist.is_available() and dist.is_initialized()
        self.sent = 0
        self.received = 0
        if not self.enabled:
            if group is not None:
                raise errors.StateError("a process group was passed but torch.distributed is not initialized")
            self.rank, self.world, self.group = 0, 1, None
            self.cpu_group = None
            return
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.cpu_group = self._cpu_group(timeout)

    @property
    def who(self) -> int | None:
        """This rank for error messages, or None when single-process."""
        return self.rank if self.world > 1 else None

    @property
    def single(self) -> bool:
        return not self.enabled or self.world == 1

    def _cpu_group(self, timeout: float | None = None) -> Any:
        dist = _dist()
        if dist.get_backend(self.group) == "gloo":
            return self.group
        # NCCL groups cannot carry CPU tensors; metadata goes over a gloo group with the same ranks,
        # created once (new_group is collective) and cached.
        key = id(self.group)
        if key not in _GLOO_GROUPS:
            ranks = dist.get_process_group_ranks(self.group)
            extra = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
            try:
                _GLOO_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo", **extra)
            except Exception as e:  # noqa: BLE001 - a rank that never arrives: typed, named
                raise errors.CollectiveError(
                    f"rank {self.rank}: could not create the metadata (gloo) group of ranks {ranks} "
                    f"({type(e).__name__}: {e}); a rank is slow, hung or dead: restart the job") from e
        return _GLOO_GROUPS[key]

    def _global(self, r: int) -> int:
        dist = _dist()
        return int(dist.get_global_rank(self.cpu_group, r)) if self.cpu_group is not dist.group.WORLD else r

    # --- point to point -------------------------------------------------------------------

    def _lost(self, what: str, verb: str, peers: list[int], e: BaseException | None,
              timeout: float | None) -> errors.CollectiveError:
        reason = _reason(e, timeout) if e is not None else "(connection lost)"
        who = f"rank {peers[0]}" if len(peers) == 1 else f"rank(s) {peers}"
        return errors.CollectiveError(
            f"{what}: rank {self.rank} could not {verb} {who} {reason}; {_consequence(what)}. "
            "The metadata group is unusable after this: restart the job")

    def _post_sends(self, data: bytes, peer: int) -> list[Any]:
        """Post the size, then the payload, to ``peer`` without blocking; returns the works to wait for."""
        dist = _dist()
        dst = self._global(peer)
        works = [dist.isend(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=self.cpu_group)]
        if data:
            works.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst,
                                    group=self.cpu_group))
        return works

    def _send_many(self, datas: dict[int, bytes], timeout: float | None, what: str) -> None:
        """Send ``datas[peer]`` to every peer at once; CollectiveError naming the peers not reached by the deadline."""
        deadline = _deadline(timeout)
        posted: dict[int, list[Any]] = {}
        missing: list[int] = []
        first: BaseException | None = None
        for p, data in datas.items():
            try:
                posted[p] = self._post_sends(data, p)
            except Exception as e:  # noqa: BLE001 - gloo: the group was closed after a failure elsewhere
                missing.append(p)
                first = first or e
        for p, works in posted.items():  # all sends are posted: waiting in order costs nothing extra
            try:
                for w in works:
                    _wait(w, deadline)
            except Exception as e:  # noqa: BLE001 - gloo: timed out, or the peer is gone
                missing.append(p)
                first = first or e
                deadline = time.monotonic() if deadline is not None else None  # the group is closed now
        if missing:
            raise self._lost(what, "send to", sorted(missing), first, timeout) from first
        for data in datas.values():
            self.sent += len(data) + 8

    def _send(self, data: bytes, peer: int, *, timeout: float | None = DEFAULT_TIMEOUT_S,
              what: str = "send") -> None:
        self._send_many({peer: data}, timeout, what)

    def _recv_payloads(self, sizes: dict[int, int], deadline: float | None, timeout: float | None,
                       what: str) -> dict[int, bytes]:
        dist = _dist()
        bufs = {p: torch.empty(n, dtype=torch.uint8) for p, n in sizes.items()}
        missing: list[int] = []
        first: BaseException | None = None
        works: dict[int, Any] = {}
        for p, n in sizes.items():
            if n:
                try:
                    works[p] = dist.irecv(bufs[p], src=self._global(p), group=self.cpu_group)
                except Exception as e:  # noqa: BLE001
                    missing.append(p)
                    first = first or e
        for p, w in works.items():
            try:
                _wait(w, deadline if not missing else time.monotonic())
            except Exception as e:  # noqa: BLE001 - gloo: timed out, or the peer is gone
                missing.append(p)
                first = first or e
        if missing:
            raise self._lost(what, "receive from", sorted(missing), first, timeout) from first
        for n in sizes.values():
            self.received += n + 8
        return {p: bufs[p].numpy().tobytes() for p in sizes}

    def _recv_payload(self, n: int, peer: int, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                      what: str = "receive") -> bytes:
        return self._recv_payloads({peer: n}, _deadline(timeout), timeout, what)[peer]

    def _wait_sizes(self, peers: list[int], timeout: float | None, what: str,
                    deadline: float | None = None) -> dict[int, int]:
        """Post a size receive from every peer, then wait for all; name the missing ones on timeout.

        ``deadline`` (monotonic seconds) defaults to ``timeout`` seconds from now.
        """
        dist = _dist()
        if deadline is None:
            deadline = _deadline(timeout)
        bufs = {p: torch.zeros(1, dtype=torch.int64) for p in peers}
        missing: list[int] = []
        lost: BaseException | None = None
        works: dict[int, Any] = {}
        for p in peers:
            try:
                works[p] = dist.irecv(bufs[p], src=self._global(p), group=self.cpu_group)
            except Exception as e:  # noqa: BLE001 - gloo: the group was closed after a failure elsewhere
                missing.append(p)
                lost = lost or e
        for p, w in works.items():  # all receives are posted: waiting in order costs nothing extra
            try:
                _wait(w, deadline if not missing else time.monotonic())
            except Exception as e:  # noqa: BLE001 - gloo: timed out, or the peer is gone (the pair is closed afterwards)
                missing.append(p)
                lost = lost or e
        if missing:
            missing.sort()
            how = _reason(lost, timeout) if lost is not None else f"within {timeout:g} s (slow, hung or dead)"
            raise errors.CollectiveError(
                f"{what}: rank(s) {missing} did not report {how}, seen from rank {self.rank}; "
                f"{_consequence(what)}. The metadata group is unusable after this: restart the job"
            ) from lost
        return {p: int(bufs[p].item()) for p in peers}

    def gather(self, obj: Any, *, timeout: float | None = DEFAULT_TIMEOUT_S, what: str = "gather") -> list[Any] | None:
        """Every rank sends ``obj`` (msgpack-able) to the coordinator; it returns all of them, others None.

        Raises CollectiveError naming the ranks that did not report (coordinator) or the coordinator
        when it did not take the message (others) within ``timeout`` seconds.
        """
        if self.single:
            return [obj]
        if self.rank != 0:
            self._send(_pack(obj), 0, timeout=timeout, what=f"{what} (sending to the coordinator, rank 0)")
            return None
        peers = list(range(1, self.world))
        deadline = _deadline(timeout)
        sizes = self._wait_sizes(peers, timeout, what, deadline)
        data = self._recv_payloads(sizes, deadline, timeout, what)
        out: list[Any] = [obj] + [None] * (self.world - 1)
        for p in peers:
            out[p] = _unpack(data[p])
        return out

    def send_each(self, objs: list[Any], *, timeout: float | None = DEFAULT_TIMEOUT_S, what: str = "reply") -> Any:
        """Coordinator only: send ``objs[r]`` to each rank r (all at once); returns its own ``objs[0]``.

        Raises CollectiveError naming the ranks that did not take their message within ``timeout``.
        """
        if self.single:
            return objs[0]
        packed: dict[int, bytes] = {}
        datas: dict[int, bytes] = {}
        for r in range(1, self.world):  # one encoding per distinct object (a verdict sent to all)
            key = id(objs[r])
            if key not in packed:
                packed[key] = _pack(objs[r])
            datas[r] = packed[key]
        self._send_many(datas, timeout, what)
        return objs[0]

    def recv_one(self, *, timeout: float | None = DEFAULT_TIMEOUT_S, what: str = "reply") -> Any:
        """Non-coordinator: receive the coordinator's message; CollectiveError after ``timeout``."""
        what = f"{what} (waiting for the coordinator, rank 0)"
        deadline = _deadline(timeout)
        sizes = self._wait_sizes([0], timeout, what, deadline)
        return _unpack(self._recv_payloads(sizes, deadline, timeout, what)[0])

    def exchange(self, obj: Any, reply: Any, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 what: str = "exchange") -> Any:
        """gather + per-rank reply: ``reply(list_of_objs) -> list_of_replies`` runs on the coordinator.

        Each half is bounded by ``timeout`` (the reply wait starts once this rank's message is taken).
        """
        got = self.gather(obj, timeout=timeout, what=what)
        if self.rank == 0:
            assert got is not None
            return self.send_each(reply(got), timeout=timeout, what=f"{what} reply")
        return self.recv_one(timeout=timeout, what=f"{what} reply")

    # --- broadcast --------------------------------------------------------------------------

    def broadcast_bytes(self, data: bytes | None, src: int = 0, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                        what: str = "broadcast") -> bytes:
        """Broadcast raw bytes from ``src`` to every rank (``src`` sends to each: gloo's own algorithm).

        Raises CollectiveError after ``timeout`` seconds naming the ranks not reached (on ``src``) or
        ``src`` (on the others).
        """
        if self.single:
            assert data is not None
            return data
        if self.rank == src:
            assert data is not None
            self._send_many({r: data for r in range(self.world) if r != src}, timeout, what)
            return data
        what = f"{what} (waiting for rank {src})"
        deadline = _deadline(timeout)
        sizes = self._wait_sizes([src], timeout, what, deadline)
        return self._recv_payloads(sizes, deadline, timeout, what)[src]

    def broadcast(self, obj: Any, src: int = 0, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                  what: str = "broadcast") -> Any:
        """Broadcast a msgpack-able object from ``src``; bounded by ``timeout`` like :meth:`broadcast_bytes`."""
        data = _pack(obj) if self.rank == src else None
        return _unpack(self.broadcast_bytes(data, src, timeout=timeout, what=what))


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
