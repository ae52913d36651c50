"""Metadata exchange between ranks: msgpack bytes over a CPU (gloo) group. Never pickle, never data.

Each rank sends O(its own metadata): gather and scatter go point-to-point to/from the coordinator
(group rank 0); only the manifest is broadcast.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from ckpt import errors

_GLOO_GROUPS: dict[Any, Any] = {}


def _dist() -> Any:
    import torch.distributed as dist

    return dist


class Comm:
    """Collective helpers for one process group, or a no-op single-process stand-in.

    ``group=None`` with an initialized default group means the whole world takes part.
    """

    def __init__(self, group: Any = None):
        dist = _dist()
        self.enabled = dist.is_available() and dist.is_initialized()
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
        return int(_dist().get_global_rank(self.cpu_group, r)) if self.cpu_group is not _dist().group.WORLD else r

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Send ``obj`` (msgpack-able) to ``dst``; ``dst`` returns every rank's object, others None."""
        data = msgpack.packb(obj, use_bin_type=True)
        if not self.enabled or self.world == 1:
            return [obj]
        dist = _dist()
        if self.rank == dst:
            out: list[Any] = [None] * self.world
            out[dst] = obj
            for r in range(self.world):
                if r == dst:
                    continue
                n = torch.zeros(1, dtype=torch.int64)
                dist.recv(n, src=self._global(r), group=self.cpu_group)
                buf = torch.empty(int(n.item()), dtype=torch.uint8)
                if buf.numel():
                    dist.recv(buf, src=self._global(r), group=self.cpu_group)
                out[r] = msgpack.unpackb(buf.numpy().tobytes(), raw=False, strict_map_key=False)
            return out
        dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=self._global(dst), group=self.cpu_group)
        if data:
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=self._global(dst), group=self.cpu_group)
        return None

    def scatter(self, objs: list[Any] | None, src: int = 0) -> Any:
        """``src`` sends ``objs[r]`` to each rank r; every rank returns its own object."""
        if not self.enabled or self.world == 1:
            assert objs is not None
            return objs[0]
        dist = _dist()
        if self.rank == src:
            assert objs is not None and len(objs) == self.world
            for r in range(self.world):
                if r == src:
                    continue
                data = msgpack.packb(objs[r], use_bin_type=True)
                dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=self._global(r), group=self.cpu_group)
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=self._global(r),
                          group=self.cpu_group)
            return objs[src]
        n = torch.zeros(1, dtype=torch.int64)
        dist.recv(n, src=self._global(src), group=self.cpu_group)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.recv(buf, src=self._global(src), group=self.cpu_group)
        return msgpack.unpackb(buf.numpy().tobytes(), raw=False, strict_map_key=False)

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Broadcast raw bytes from ``src`` to every rank."""
        if not self.enabled or self.world == 1:
            assert data is not None
            return data
        dist = _dist()
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(n, src=self._global(src), group=self.cpu_group)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src and data
               else torch.empty(int(n.item()), dtype=torch.uint8))
        if buf.numel():
            dist.broadcast(buf, src=self._global(src), group=self.cpu_group)
        return buf.numpy().tobytes()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Broadcast a msgpack-able object from ``src``."""
        data = msgpack.packb(obj, use_bin_type=True) if self.rank == src else None
        return msgpack.unpackb(self.broadcast_bytes(data, src), raw=False, strict_map_key=False)


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
