"""Metadata exchange between ranks: msgpack bytes over a CPU (gloo) group. Never pickle, never data.

Every exchange is point-to-point between the coordinator (group rank 0) and each rank: a rank
sends one message and receives one, so what a rank sends and receives is O(its own metadata), and
a coordinator waiting for a slow or dead rank names it after ``timeout`` seconds instead of
hanging. Only the load path broadcasts (the manifest, which every loading rank needs).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import msgpack
import torch

from ckpt import errors

_GLOO_GROUPS: dict[Any, Any] = {}


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class Comm:
    """Collective helpers for one process group, or a no-op single-process stand-in.

    ``group=None`` with an initialized default group means the whole world takes part.
    ``sent`` / ``received`` count this rank's metadata bytes (for the traffic figures).
    """

    def __init__(self, group: Any = None):
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
        self.cpu_group = self._cpu_group()

    @property
    def who(self) -> int | None:
        """This rank for error messages, or None when single-process."""
        return self.rank if self.world > 1 else None

    @property
    def single(self) -> bool:
        return not self.enabled or self.world == 1

    def _cpu_group(self) -> Any:
        dist = _dist()
        if dist.get_backend(self.group) == "gloo":
            return self.group
        # NCCL groups cannot carry CPU tensors; metadata goes over a gloo group with the same ranks,
        # created once (new_group is collective) and cached.
        key = id(self.group)
        if key not in _GLOO_GROUPS:
            ranks = dist.get_process_group_ranks(self.group)
            _GLOO_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
        return _GLOO_GROUPS[key]

    def _global(self, r: int) -> int:
        dist = _dist()
        return int(dist.get_global_rank(self.cpu_group, r)) if self.cpu_group is not dist.group.WORLD else r

    # --- point to point -------------------------------------------------------------------

    def _send(self, data: bytes, peer: int) -> None:
        dist = _dist()
        try:
            dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=self._global(peer), group=self.cpu_group)
            if data:
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=self._global(peer),
                          group=self.cpu_group)
        except RuntimeError as e:  # gloo: the peer is gone or the group was closed after a timeout
            raise errors.CollectiveError(f"rank {self.rank}: lost contact with rank {peer} ({e}); "
                                         "the checkpoint is not committed: restart the job") from None
        self.sent += len(data) + 8

    def _recv_payload(self, n: int, peer: int) -> bytes:
        buf = torch.empty(n, dtype=torch.uint8)
        if n:
            try:
                _dist().recv(buf, src=self._global(peer), group=self.cpu_group)
            except RuntimeError as e:
                raise errors.CollectiveError(f"rank {self.rank}: lost contact with rank {peer} ({e}); "
                                             "the checkpoint is not committed: restart the job") from None
        self.received += n + 8
        return buf.numpy().tobytes()

    def _wait_sizes(self, peers: list[int], timeout: float | None, what: str) -> dict[int, int]:
        """Post a size receive from every peer, then wait for all; name the missing ones on timeout."""
        dist = _dist()
        bufs = {p: torch.zeros(1, dtype=torch.int64) for p in peers}
        works = {p: dist.irecv(bufs[p], src=self._global(p), group=self.cpu_group) for p in peers}
        deadline = None if timeout is None else time.monotonic() + timeout
        missing: list[int] = []
        for p in peers:  # all receives are posted: waiting in order costs nothing extra
            try:
                if deadline is None:
                    works[p].wait()
                    continue
                left = max(deadline - time.monotonic(), 0.001) if not missing else 0.001
                works[p].wait(timeout=datetime.timedelta(seconds=left))
            except RuntimeError:  # gloo: timed out, or the peer is gone (the pair is closed afterwards)
                missing.append(p)
        if missing:
            within = f"within {timeout:g} s" if timeout is not None else "(connection lost)"
            raise errors.CollectiveError(
                f"{what}: rank(s) {missing} did not report {within} (slow, hung or dead); "
                "the checkpoint is not committed. The metadata group is unusable after this: restart the job"
            )
        return {p: int(bufs[p].item()) for p in peers}

    def gather(self, obj: Any, *, timeout: float | None = None, what: str = "gather") -> list[Any] | None:
        """Every rank sends ``obj`` (msgpack-able) to the coordinator; it returns all of them, others None.

        Raises CollectiveError on the coordinator naming ranks that did not report within ``timeout``.
        """
        if self.single:
            return [obj]
        if self.rank != 0:
            self._send(_pack(obj), 0)
            return None
        peers = list(range(1, self.world))
        sizes = self._wait_sizes(peers, timeout, what)
        out: list[Any] = [obj] + [None] * (self.world - 1)
        for p in peers:
            out[p] = _unpack(self._recv_payload(sizes[p], p))
        return out

    def send_each(self, objs: list[Any]) -> Any:
        """Coordinator only: send ``objs[r]`` to each rank r; returns its own ``objs[0]``."""
        if self.single:
            return objs[0]
        for r in range(1, self.world):
            self._send(_pack(objs[r]), r)
        return objs[0]

    def recv_one(self, *, timeout: float | None = None, what: str = "reply") -> Any:
        """Non-coordinator: receive the coordinator's message; CollectiveError after ``timeout``."""
        sizes = self._wait_sizes([0], timeout, f"{what} (waiting for the coordinator, rank 0)")
        return _unpack(self._recv_payload(sizes[0], 0))

    def exchange(self, obj: Any, reply: Any, *, timeout: float | None = None, what: str = "exchange") -> Any:
        """gather + per-rank reply: ``reply(list_of_objs) -> list_of_replies`` runs on the coordinator."""
        got = self.gather(obj, timeout=timeout, what=what)
        if self.rank == 0:
            assert got is not None
            return self.send_each(reply(got))
        return self.recv_one(timeout=timeout, what=what)

    # --- broadcast (load path) --------------------------------------------------------------

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Broadcast raw bytes from ``src`` to every rank."""
        if self.single:
            assert data is not None
            return data
        dist = _dist()
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(n, src=self._global(src), group=self.cpu_group)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src and data
               else torch.empty(int(n.item()), dtype=torch.uint8))
        if buf.numel():
            dist.broadcast(buf, src=self._global(src), group=self.cpu_group)
        if self.rank == src:
            self.sent += buf.numel() * (self.world - 1)
        else:
            self.received += buf.numel()
        return buf.numpy().tobytes()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Broadcast a msgpack-able object from ``src``."""
        data = _pack(obj) if self.rank == src else None
        return _unpack(self.broadcast_bytes(data, src))


def error_payload(e: BaseException, rank: int | None) -> dict[str, Any]:
    """Encode an exception so that other ranks can re-raise it with the same type.

    ``rank`` (None in a single process) is prefixed to the message so that every rank names the culprit.
    """
    kind = type(e).__name__ if isinstance(e, errors.CheckpointError) else "CheckpointError"
    return {"err": f"rank {rank}: {e}" if rank is not None else str(e), "type": kind, "cause": type(e).__name__}


def raise_payload(p: dict[str, Any]) -> None:
    """Re-raise an error encoded by :func:`error_payload`."""
    cls = getattr(errors, p.get("type", "CheckpointError"), errors.CheckpointError)
    if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
        cls = errors.CheckpointError
    raise cls(p["err"])
