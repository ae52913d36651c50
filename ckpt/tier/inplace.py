"""Commit a memory checkpoint whose data file is already written: the slot the snapshot landed in.

``ckpt.save`` plans, writes the rank's data file under a fresh name, then commits (manifest last).
Here the snapshot's copies already put every byte of that file in a slot (:mod:`ckpt.tier.slots`),
at the offsets ckpt's planner gives the state, so the write becomes: check that the plan and the
slot agree byte for byte (header and every piece's address), checksum the pieces from the slot on
several threads, hard-link the slot into the checkpoint directory under the fresh name (exclusive:
``os.link`` never replaces a file), and commit as ``ckpt.save`` does. Any failure before the manifest
leaves no checkpoint, and the commit removes the link (a file this save created), never the slot.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ckpt._checksum import crc32_parallel
from ckpt._comm import Comm, error_payload
from ckpt._io import byte_view
from ckpt.manifest import Manifest
from ckpt.save import PlanCache, Prepared, commit, fresh_file_name, persisted, prepare
from ckpt.storage import get_storage
from ckpt.tier.fastload import workers_for_restore
from ckpt.tier.slots import Slot

CRC_NICE = 10  # the checksum threads' niceness (as the busy="skip" background thread's)


def matches(prep: Prepared, slot: Slot) -> bool:
    """Whether ``prep``'s data file is exactly the slot: same header, and every entry's source is the
    slot's bytes at the entry's offset (a view of the mapping there, contiguous, whole)."""
    a = prep.assignment
    if a.file is None or slot.layout is None or slot.base is None or a.header != slot.layout.header:
        return False
    base = slot.base_ptr
    for e in a.entries:
        if e.count is not None or e.offset + e.length > slot.size:
            return False
        if not e.length:
            continue
        src = prep.sources[e.piece]
        if (src.device.type != "cpu" or not src.is_contiguous() or src.data_ptr() - base != e.offset
                or src.numel() * src.element_size() != e.length):
            return False
    return True


def save_linked(flat: dict[str, Any], url: str, slot: Slot, *, group: Any, step: int,
                user_metadata: dict[str, Any], layout: dict[str, Any] | None, timeout: float,
                cache: PlanCache, wait_piece: Callable[[str], None] | None = None) -> Manifest | None:
    """Commit ``flat`` (this rank's snapshot: tensors are views of ``slot``) as the one-rank
    checkpoint at the local path ``url``, its data file being the slot itself (hard-linked).
    ``wait_piece(key)``: blocks until ``key``'s bytes are in the slot (its device-to-host copy
    landed); pieces are checksummed in ``flat``'s order, the order they were copied in.

    Returns None, having written nothing, when the plan does not match the slot (the caller then
    saves the ordinary way). Raises what ``ckpt.save`` raises (the directory then holds no
    manifest, and no link)."""
    comm = Comm(group, timeout=timeout)
    storage = get_storage(url)
    try:
        prep = prepare(comm, storage, flat, step=step, user_metadata=user_metadata, layout=layout, cache=cache,
                       timeout=timeout)
        if not matches(prep, slot):
            return None
        a = prep.assignment
        try:
            # (the header is in the slot since it was shaped: matches() compared it with the plan's)
            rank_of = {k: i for i, k in enumerate(flat)}
            order = sorted(range(len(a.entries)), key=lambda j: rank_of.get(a.entries[j].key, len(rank_of)))
            views = [byte_view(prep.sources[a.entries[j].piece]) for j in order]
            keys = [a.entries[j].key for j in order]
            # half this rank's cores, niced: training keeps cores to launch kernels from. Threads on
            # half the cores kept up with the copies, on a quarter they did not (measured in
            # docs/BENCHMARKS.md, section "Memory tier on one H200")
            got = crc32_parallel(views, max(1, workers_for_restore() // 2), nice=CRC_NICE,
                                 before=(lambda i: wait_piece(keys[i])) if wait_piece is not None else None)
            sums = [0] * len(order)
            for j, crc in zip(order, got, strict=True):
                sums[j] = crc
            name = fresh_file_name(a)
            slot.link_as(os.path.join(url, name))
            result = persisted(prep, name, slot.size, sums)
        except Exception as e:  # noqa: BLE001 - through the commit: typed, and the files it lists go
            result = error_payload(e, comm.who)
        return commit(comm, storage, prep, result, timeout=timeout, cache=cache)
    finally:
        storage.close()


__all__ = ["CRC_NICE", "matches", "save_linked"]
