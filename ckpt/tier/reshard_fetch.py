"""The resharding restore's fetch across hosts when the wanted pieces are known: only the stored
shards a host's ranks need cross hosts, through :func:`ckpt.transfer`'s planner and data path.

:mod:`ckpt.tier.reshard` restores from a view made of every old rank's copy. A copy no rank of a host
reaches is fetched for the host by its lowest rank (the *fetcher*). Knowing each rank's wanted pieces
(its target state), the fetcher does not take the whole copy:

1. the copy's manifest comes from the rank the plan named as its sender (one exchange);
2. every rank lists the stored shards its wanted pieces overlap that the view will not take from a
   copy its host reaches (a replica held here is read here), and each fetcher gets the union of its
   host's lists (one exchange);
3. the fetcher makes the copy's data files at their recorded sizes, sparse (a hole costs no memory)
   but for the listed shards' ranges, allocated first (a full shared memory is an ENOSPC error, not
   a SIGBUS in the middle of the transfer), and the listed shards arrive at their offsets through
   :func:`ckpt.transfer.run_items` (gloo; each shard from one of the ranks that reach it, replicas
   sharing the sending); the manifest is committed last, as every ckpt writer does.

The view then links these files like any copy. The load reads only the shards the rank's pieces
overlap, which are the ones that arrived, every checksum checked against the manifest of the rank
that wrote it: a byte damaged at the source or on the way fails the restore on every rank, which then
falls back to storage. Bytes moved: the needed shards, whole (a rank wanting part of a shard receives
all of it), once per host. Every rank takes part in every exchange and in the transfer whatever
failed locally (a failure travels in them), so no rank waits for one that gave up.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ckpt import stateful
from ckpt._comm import describe
from ckpt._dtypes import dtype_from_name, itemsize
from ckpt._regions import flat_segments, intersect_boxes
from ckpt._state import TensorItem, flatten_state
from ckpt._transaction import commit_manifest
from ckpt.errors import CheckpointError, ManifestError, StorageError
from ckpt.formats.msgpack_codec import decode_manifest
from ckpt.manifest import MANIFEST_NAME, Manifest
from ckpt.shards import Box, Flat, Region
from ckpt.storage.local import LocalStorage
from ckpt.tier import safefs
from ckpt.tier.store import META_KEY
from ckpt.tier.transfer import _map, package
from ckpt.transfer import Options, rank_payload, release_buffers, run_items

if TYPE_CHECKING:
    from ckpt.tier.types import TierView

ShardId = tuple[int, str, int]  # (old rank, data file within its copy, byte offset)


@dataclass(frozen=True, slots=True)
class StoredShard:
    """One stored shard of an old rank's copy, placed in its global tensor."""

    owner: int
    file: str  # relative to the copy's directory
    offset: int
    length: int
    key: str  # the global tensor's key
    dtype: str
    shape: tuple[int, ...]  # the global tensor's shape
    region: Region  # in the global tensor

    @property
    def id(self) -> ShardId:
        return (self.owner, self.file, self.offset)


def global_region(where: list[Any], local: Region) -> Region:
    """The global region of a stored shard: ``local`` is its region within the rank's local piece,
    ``where`` the piece's place in the global tensor (as recorded in the copy's ``pieces``)."""
    if where[0] == "box":
        offsets = tuple(int(x) for x in where[1])
        if not isinstance(local, Box) or len(local.offsets) != len(offsets):
            raise ManifestError(f"a box piece stored as {local}: cannot place it in its global tensor")
        return Box(tuple(o + lo for o, lo in zip(offsets, local.offsets, strict=True)), local.lengths)
    start, box = int(where[1]), where[3]
    gbox = Box(tuple(int(x) for x in box[0]), tuple(int(x) for x in box[1])) if box else None
    if isinstance(local, Box) and len(local.offsets) == 1:
        return Flat(start + local.offsets[0], start + local.offsets[0] + local.lengths[0], gbox)
    if isinstance(local, Flat) and local.box is None:
        return Flat(start + local.start, start + local.stop, gbox)
    raise ManifestError(f"a flat piece stored as {local}: cannot place it in its global tensor")


def stored_shards(owner: int, m: Manifest, where: str) -> list[StoredShard]:
    """Every shard of old rank ``owner``'s copy (manifest ``m``, read from ``where``), placed in its
    global tensor. Raises ManifestError for a tensor without a piece description or a shard whose
    bytes are not its elements as they are (only raw shards can be received in place)."""
    pieces = ((m.user_metadata or {}).get(META_KEY) or {}).get("pieces") or {}
    out = []
    for key, entry in m.tensors.items():
        if key not in pieces:
            raise ManifestError(f"{where}: tensor {key!r} has no piece description; not resharded")
        gkey, dtype, gshape, place = pieces[key]
        for s in entry.shards:
            region = global_region(place, s.region)
            size = m.files.get(s.file)
            if s.length != region.numel * itemsize(dtype_from_name(str(dtype))) or size is None \
                    or s.offset < 0 or s.offset + s.length > size:
                raise ManifestError(f"{where}: shard of {gkey!r} at {s.file}:{s.offset} is not raw bytes inside "
                                    "its file; not fetched")
            out.append(StoredShard(owner, s.file, s.offset, s.length, str(gkey), str(dtype),
                                   tuple(int(x) for x in gshape), region))
    return out


def overlaps(a: Region, b: Region, shape: tuple[int, ...]) -> bool:
    """Whether two regions of one tensor share an element."""
    if isinstance(a, Box) and isinstance(b, Box):
        if not shape:
            return True
        box = intersect_boxes(a, b)
        return box is not None and box.numel > 0
    return bool(flat_segments(a, b, shape)[2].sum())


def needed(local: list[StoredShard], remote: list[StoredShard], want: list[TensorItem]) -> list[StoredShard]:
    """The remote shards a rank must receive: of each ``(key, region)``, the one the view takes
    (:func:`ckpt.tier.reshard.build_view` with the local owners preferred: a local copy's, else the
    lowest remote owner's), when it overlaps a wanted piece."""
    seen = {(s.key, s.region) for s in local}
    wants: dict[str, list[Region]] = {}
    for w in want:
        wants.setdefault(w.key, []).append(w.region)
    out = []
    for s in sorted(remote, key=lambda s: s.owner):
        if (s.key, s.region) in seen:
            continue
        seen.add((s.key, s.region))
        if any(overlaps(s.region, r, s.shape) for r in wants.get(s.key, ())):
            out.append(s)
    return out


def _typed(buf: torch.Tensor, s: StoredShard) -> torch.Tensor:
    t = buf[s.offset : s.offset + s.length].view(dtype_from_name(s.dtype))
    return t.view(s.region.lengths) if isinstance(s.region, Box) else t


def _item(buf: torch.Tensor, s: StoredShard) -> TensorItem:
    return TensorItem(s.key, _typed(buf, s), s.dtype, s.shape, s.region)


def _create(path: str, size: int, ranges: list[tuple[int, int]]) -> mmap.mmap | None:
    """A new file of ``size`` bytes, mapped shared (None when empty): a hole but for ``ranges``
    (``(offset, length)``: what will be received), which are allocated now. A full shared memory is
    then an OSError (ENOSPC) here, never a SIGBUS when the bytes are written through the mapping."""
    safefs.makedirs(os.path.dirname(path))
    fd = safefs.open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        os.ftruncate(fd, size)
        for offset, length in ranges:
            os.posix_fallocate(fd, offset, length)
        return mmap.mmap(fd, size) if size else None
    finally:
        os.close(fd)


def _close(maps: list[mmap.mmap]) -> None:
    for mm in maps:
        try:
            mm.close()
        except BufferError:
            pass  # a tensor still views it: unmapped when that goes


def _to_all(reply: Callable[[list[Any]], list[Any]]) -> Callable[[list[Any]], list[Any]]:
    """``reply`` run on the coordinator over the ranks' ``{"err": ..., ...}`` messages: the first
    rank's error, or a failure of ``reply`` itself (raised there, it would leave the others waiting
    for an answer until the timeout), is every rank's answer instead."""
    def run(got: list[Any]) -> list[Any]:
        bad = [g["err"] for g in got if g.get("err")]
        if bad:
            return [{"err": bad[0]}] * len(got)
        try:
            return reply(got)
        except Exception as e:  # noqa: BLE001
            return [{"err": f"rank 0 (coordinating the fetch): {describe(e)}"}] * len(got)
    return run


def _decode(data: bytes, where: str) -> Manifest:
    return decode_manifest(data, url=os.path.join(where, MANIFEST_NAME))


def fetch(tier: TierView, plan: dict[str, Any], local: dict[int, str], want: dict[str, Any],
          fetch_dir: Callable[[int], str]) -> tuple[dict[int, str], int, list[int]]:
    """Run ``plan``'s fetches as shard transfers (see the module docstring; collective over the
    tier's group). ``local``: the copies this rank reaches, by old rank; ``want``: this rank's target
    state; ``fetch_dir(fetcher)``: where that rank puts the copies it fetches for its host. Returns where
    each old rank's copy is for this rank, the bytes it received and the ranks it received from.
    Raises CheckpointError / OSError (every rank raises one when any failed), CollectiveError for a
    lost rank."""
    rank = tier.rank
    step = int(str(plan["key"]).split("|")[0])
    what = f"memory tier resharding restore of step {step}"
    at = {int(o): int(f) for o, f in plan["at"].get(str(rank), [])}
    mine = sorted({int(f[1]) for f in plan["fetch"] if int(f[0]) == rank})
    where = dict(local)
    where.update({o: os.path.join(fetch_dir(f), f"rank-{o}") for o, f in at.items()})

    # 1. the manifests of the copies this host lacks, from the ranks the plan names as their senders
    err: str | None = None
    sent: list[list[Any]] = []
    try:
        for o in sorted({int(f[1]) for f in plan["fetch"] if int(f[2]) == rank}):
            pkg = package(local[o], f"rank {rank}'s copy of rank {o}'s memory step {step}")
            if not pkg.header.get("ok"):
                raise ManifestError(str(pkg.header.get("err")))
            sent.append([o, bytes(pkg.header["manifest"])])
    except Exception as e:  # noqa: BLE001 - travels in the exchange: every rank gives up together
        err = f"rank {rank}: {describe(e)}"

    def give(got: list[Any]) -> list[Any]:
        known = {int(o): m for g in got for o, m in g["m"]}
        return [{"m": [[o, known[int(o)]] for o, _f in plan["at"].get(str(r), [])]} for r in range(len(got))]

    got = tier.comm.exchange({"m": sent, "err": err}, _to_all(give), timeout=tier.timeout, what=f"{what} (manifests)")
    if got.get("err"):
        raise ManifestError(f"a copy's manifest could not be sent: {got['err']}")

    # 2. the shards each rank needs; each host's fetcher receives the union of its ranks'
    manifests: dict[int, bytes] = {int(o): bytes(m) for o, m in got["m"]}
    tables: dict[int, list[StoredShard]] = {}
    need: list[StoredShard] = []
    try:
        for o, path in local.items():
            tables[o] = stored_shards(o, _decode(safefs.read_bytes(os.path.join(path, MANIFEST_NAME)), path), path)
        lacking = [s for o, data in manifests.items() for s in stored_shards(o, _decode(data, where[o]), where[o])]
        tables.update({o: [s for s in lacking if s.owner == o] for o in manifests})
        items = [i for i in flatten_state(stateful.expand(want)) if isinstance(i, TensorItem)]
        need = needed([s for o in local for s in tables[o]], lacking, items)
    except Exception as e:  # noqa: BLE001 - travels in the exchange: every rank gives up together
        err = f"rank {rank}: {describe(e)}"

    def share(got: list[Any]) -> list[Any]:
        host: dict[int, set[tuple[Any, ...]]] = {}
        for r, g in enumerate(got):
            fetchers = {int(f) for _o, f in plan["at"].get(str(r), [])}
            for i in g["need"]:
                host.setdefault(min(fetchers), set()).add(tuple(i))
        every = sorted(set().union(*host.values())) if host else []
        return [{"recv": sorted(host.get(r, ())), "all": every} for r in range(len(got))]

    ids = [list(s.id) for s in need]
    got = tier.comm.exchange({"need": ids, "err": err}, _to_all(share), timeout=tier.timeout,
                             what=f"{what} (shards wanted)")
    if got.get("err"):
        raise ManifestError(f"the shards to fetch could not be listed: {got['err']}")

    # 3. the shards, through the transfer's planner and data path, into sparse copies of the files
    maps: list[mmap.mmap] = []
    srcs: list[TensorItem] = []
    dsts: list[TensorItem] = []
    payload = None
    try:
        index = {s.id: s for t in tables.values() for s in t}
        recv = [index[i] for i in map(_shard_id, got["recv"])]
        for o in mine:  # this rank's copies for its host: every file at its size, the needed shards filled
            m = _decode(manifests[o], where[o])
            bufs = {}
            for rel, size in m.files.items():  # (plain paths below the copy: decode_manifest checked each)
                ranges = [(s.offset, s.length) for s in recv if s.owner == o and s.file == rel and s.length]
                mm = _create(os.path.join(where[o], rel), int(size), ranges)
                if mm is not None:
                    maps.append(mm)
                    bufs[rel] = torch.frombuffer(mm, dtype=torch.uint8)
            dsts += [_item(bufs[s.file], s) for s in recv if s.owner == o]
        held = {}
        for i in map(_shard_id, got["all"]):
            if i[0] in local:
                if (i[0], i[1]) not in held:
                    mm, held[(i[0], i[1])] = _map(os.path.join(local[i[0]], i[1]), _size(index[i], local[i[0]]))
                    maps.append(mm)
                srcs.append(_item(held[(i[0], i[1])], index[i]))
    except Exception as e:  # noqa: BLE001 - travels in the transfer (e.g. a misaligned shard's RuntimeError)
        payload = rank_payload(e if isinstance(e, CheckpointError) else StorageError(f"{what}: {describe(e)}"),
                               rank)
    try:
        res = run_items(tier.comm, tier.pg, srcs, dsts, Options(timeout=tier.timeout, in_place=True), None, payload)
    finally:
        release_buffers(tier.pg)  # the transfer keeps views of its pieces for a next call: none comes
        del srcs, dsts
        _close(maps)
    for o in mine:
        storage = LocalStorage(where[o])
        try:
            commit_manifest(storage, manifests[o], overwrite=False)  # last: the copy is whole now
        finally:
            storage.close()
    return where, res.rank_received, res.rank_senders


def _shard_id(i: Any) -> ShardId:
    return (int(i[0]), str(i[1]), int(i[2]))


def _size(s: StoredShard, path: str) -> int:
    st = safefs.regular(os.path.join(path, s.file))
    if st is None:
        raise StorageError(f"{os.path.join(path, s.file)}: missing or not a regular file of this user")
    return st.st_size


__all__ = ["StoredShard", "fetch", "global_region", "needed", "overlaps", "stored_shards"]
