"""Map and pin this rank's newest memory checkpoint while the job starts, before its restore.

Why: a restore that copies from a pinned mapping of the slot (DMA and CRC reading the same pages)
runs at close to pinned host-to-device speed, one that cannot (``pread`` into pinned slabs, then
DMA) at about half of it: host memory bandwidth is shared by the extra copy. Pinning the slot
(``MAP_POPULATE``, then ``cudaHostRegister``; it does not go faster on more threads) takes longer
than the copy itself (measured in docs/BENCHMARKS.md, section "Memory tier, second pass"), so it is
worth doing only where it is hidden: a restarted job knows which files its restore will most likely
read (its own newest committed step) long before the restore's agreement, and has seconds of
process-group setup and model building to overlap it with. The pinned slot then stays with the
tier's slot pool, so the snapshots that later reuse it pay nothing more.

Best effort: a failure (no CUDA, a step without a slot, a file gone) leaves the restore on its
``pread`` path. Not collective.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ckpt.manifest import MANIFEST_NAME
from ckpt.tier import safefs
from ckpt.tier.slots import SlotPool


class PinAhead:
    """One background mapping of the newest committed step's data files into ``pool``'s slots."""

    def __init__(self, pool: SlotPool, steps: list[tuple[int, str]], device: Any = None):
        import torch

        dev = torch.device(device) if device is not None else None
        self.pin = dev is not None and dev.type == "cuda" and torch.cuda.is_available()
        if self.pin and dev is not None and dev.index is None:  # "cuda": the caller's current device
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.stats: dict[str, Any] = {"step": None, "bytes": 0, "pinned": self.pin, "ms": 0.0, "wait_ms": 0.0}
        committed = [(s, p) for s, p in steps if safefs.regular(os.path.join(p, MANIFEST_NAME)) is not None]
        self._files: list[str] = []
        if committed:
            step, path = committed[-1]
            self.stats["step"] = step
            self._files = [f for f in safefs.walk_files(path) if os.path.basename(f) != MANIFEST_NAME]
        self._pool = pool
        self._thread = threading.Thread(target=self._run, daemon=True, name="ckpt-memory-tier-pin-ahead")
        self._thread.start()

    def _run(self) -> None:
        import torch

        t0 = time.perf_counter()
        try:
            if self.pin and self.device is not None:
                torch.cuda.set_device(self.device)  # the registration's context is the job's device's
            for f in self._files:
                slot = self._pool.map_linked(f, pin=self.pin)
                if slot is not None:
                    self.stats["bytes"] += slot.size
                    self.stats["pinned"] = self.stats["pinned"] and slot.registered
        except Exception as e:  # noqa: BLE001 - best effort: the restore reads through pread then
            self.stats["error"] = f"{type(e).__name__}: {e}"
        self.stats["ms"] = round((time.perf_counter() - t0) * 1e3, 3)

    def wait(self) -> dict[str, Any]:
        """Wait for the mapping to finish (the slot pool is the caller's again); its figures, with
        ``wait_ms``: how long this call waited (the part not hidden)."""
        t0 = time.perf_counter()
        self._thread.join()
        self.stats["wait_ms"] = round(self.stats["wait_ms"] + (time.perf_counter() - t0) * 1e3, 3)
        return self.stats


__all__ = ["PinAhead"]
