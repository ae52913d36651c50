"""Synchronous save: local plan, global plan, write, commit (DCP's order, without pickle).

Exchange protocol (docs/FORMAT.md, "Metadata traffic"): each rank sends its declaration (metadata
of its pieces) to the coordinator and receives only its own write assignment; after writing, it
sends its file name, size, checksums and per-rank objects, and receives a status word. When a
rank's structure (keys, shapes, dtypes, regions) is unchanged since its previous save, the
planning exchange is skipped: the cached assignment is reused and the only message is the commit
report, in which the coordinator checks that every rank's structure fingerprint matches the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import msgpack
import torch

from ckpt import _aliases as tied
from ckpt import _lease as lease
from ckpt import _transaction as transaction
from ckpt import _zarr_layout as zarr_layout
from ckpt import stateful
from ckpt._checksum import crc32
from ckpt._codec import Codec, FileCodec
from ckpt._codec import resolve as resolve_codec
from ckpt._comm import Comm, decided_nothing, error_payload, raise_payload
from ckpt._io import entry_source, write_assignment, write_compressed
from ckpt._regions import sub_region
from ckpt._save_plan import PieceDecl, RankDecl, SavePlan, WriteAssignment, plan_save
from ckpt._staging import Stager, StagingPool
from ckpt._state import ObjectItem, TensorItem, flatten_state
from ckpt.errors import CheckpointError, CollectiveError, StateError
from ckpt.formats.msgpack_codec import decode_manifest, decode_object, encode_manifest, encode_object
from ckpt.manifest import MANIFEST_NAME, Manifest, ObjectEntry, ShardEntry, TensorEntry
from ckpt.storage import Storage, get_storage

DEFAULT_TIMEOUT_S = 600.0


def build_decl(state: dict[str, Any], rank: int) -> tuple[RankDecl, list[TensorItem]]:
    """Flatten a state into this rank's declaration (metadata + encoded objects) and its tensors."""
    items = flatten_state(state)
    tensors = [i for i in items if isinstance(i, TensorItem)]
    decl = RankDecl(pieces=[PieceDecl(t.key, t.dtype, t.global_shape, t.region) for t in tensors],
                    aliases=tied.find_aliases(tensors))
    for it in items:
        if isinstance(it, ObjectItem):
            data = encode_object(it.value, key=it.key)
            decode_object(data, key=it.key)  # what we store must read back (rule 1 of the transaction)
            # Every rank declares its global objects: the commit saves the union of all ranks' keys
            # and refuses a key two ranks give different values (nothing is dropped silently).
            (decl.per_rank_objects if it.per_rank else decl.objects)[it.key] = data
    return decl, tensors


def fingerprint(decl: RankDecl) -> str:
    """Hash of a declaration's structure (pieces and object keys, not values): equal -> same plan."""
    wire = [[p.to_wire() for p in decl.pieces], sorted(decl.objects), sorted(decl.per_rank_objects),
            sorted(decl.aliases.items())]
    return hashlib.blake2b(msgpack.packb(wire, use_bin_type=True), digest_size=16).hexdigest()


def read_manifest(storage: Storage) -> Manifest | None:
    """The committed manifest at ``storage``'s root, or None when there is none."""
    if storage.size(MANIFEST_NAME) is None:
        return None
    return decode_manifest(storage.read_file(MANIFEST_NAME), url=f"{storage.url}/{MANIFEST_NAME}")


@dataclass(slots=True)
class PlanCache:
    """The last plan of one process group: reused while every rank's structure is unchanged."""

    fingerprint: str | None = None
    assignment: WriteAssignment | None = None
    plan: SavePlan | None = None  # coordinator only
    fingerprints: list[str] = field(default_factory=list)  # coordinator only: every rank's
    aliases: dict[str, str] = field(default_factory=dict)  # the plan's accepted tied keys
    hits: int = 0

    def clear(self) -> None:
        self.fingerprint, self.assignment, self.plan, self.fingerprints = None, None, None, []
        self.aliases = {}


_SYNC_CACHES: dict[Any, PlanCache] = {}
# A cache holds one save's plan from its planning to its commit, which checks every rank against
# the cached fingerprints. Two saves using one cache at once (threads of one process, each saving
# to its own URL) would clear or refill it under each other: the commit then compares with another
# save's fingerprints (a spurious CollectiveError) or an emptied list. So a save takes its group's
# cache only while no other save holds it; a save that finds it held plans on a private cache.
_SYNC_LOCK = threading.Lock()
_SYNC_BUSY: set[int] = set()  # id() of the caches that a save holds now


def _take_cache(group: Any) -> PlanCache:
    """The plan cache of ``group`` for one save, held until :func:`_give_back`; a private, empty one
    while another save (another thread) holds it. Concurrent saves over one group of several ranks
    are not supported anyway (their collectives would interleave); in one process they are."""
    with _SYNC_LOCK:
        cache = _SYNC_CACHES.setdefault(id(group), PlanCache())
        if id(cache) in _SYNC_BUSY:
            return PlanCache()
        _SYNC_BUSY.add(id(cache))
        return cache


def _give_back(cache: PlanCache) -> None:
    with _SYNC_LOCK:
        _SYNC_BUSY.discard(id(cache))


def save(state: dict[str, Any], url: str, *, group: Any = None, step: int | None = None,
         user_metadata: dict[str, Any] | None = None, overwrite: bool = False,
         layout: dict[str, Any] | None = None, storage_options: dict[str, Any] | None = None,
         timeout: float | None = DEFAULT_TIMEOUT_S, data_format: str = "safetensors",
         stats: dict[str, float] | None = None, compression: str | Codec | None = None) -> Manifest:
    """Save ``state`` to ``url`` as one committed checkpoint; collective over ``group`` when distributed.

    ``state`` is a nested dict of tensors (replicated: written once), ``ckpt.Shard``,
    ``ckpt.FlatShard``, DTensors, ``ckpt.PerRank`` values, msgpack-able objects and Stateful values
    (saved through their ``state_dict()``). Global objects are the union of every rank's keys; a
    key two ranks give different values is refused (use ``ckpt.PerRank`` for per-rank values). The coordinator
    (group rank 0) gets the full committed manifest back; other ranks get a partial one holding the
    pieces they wrote (``manifest.partial``), so no rank receives O(world) metadata.

    ``data_format="zarr"`` writes each tensor as a zarr v3 array (one chunk per shard; needs a
    uniform shard grid) instead of one safetensors file per rank; see :mod:`ckpt._zarr_layout`.

    ``compression="zstd"`` (or a :class:`ckpt._codec.Codec`) stores each data file as zstd frames,
    byte planes split first (docs/FORMAT.md "Compressed data files"; needs ``pip install
    'ckpt[zstd]'``, else ImportError); loading needs nothing more. Default: uncompressed safetensors.

    ``stats``, when given, receives this rank's figures: durations in seconds (``plan``, ``stage``,
    ``persist``, ``commit``), ``bytes`` (data written) and ``sent``/``received`` (metadata bytes).
    The coordinator's manifest holds them aggregated over ranks (``manifest.stats``).

    Raises:
        CheckpointExistsError: ``url`` already holds a committed checkpoint and ``overwrite`` is False.
        StateError / LayoutError: malformed state, ranks disagreeing, overlapping or missing pieces.
        StorageError: an I/O failure; no manifest is written and any previous checkpoint is intact.
        CollectiveError: a rank did not report within ``timeout`` seconds (it is named).

    Example::

        ckpt.save({"model": model.state_dict(), "step": 10}, "/ckpts/step-10")
    """
    codec = resolve_compression(compression, data_format)
    comm = Comm(group, timeout=timeout)
    state, storage, failed = open_state(comm, state, url, storage_options)
    cache = _take_cache(group)
    held: lease.Lease | None = None
    ok = False
    try:
        t0 = time.perf_counter()
        prep = prepare(comm, storage, state, step=step, user_metadata=user_metadata, overwrite=overwrite,
                       layout=layout, cache=cache, timeout=timeout, data_format=data_format, compression=codec,
                       failed=failed)
        assert storage is not None  # (prepare raised the failure to open it)
        prep.stats["plan"] = time.perf_counter() - t0
        held = take_lease(url, prep, comm, storage_options)
        prep.stats["stage"] = 0.0  # synchronous: written straight from the caller's tensors
        t1 = time.perf_counter()
        if data_format == "safetensors" and any(
                prep.sources[e.piece].device.type == "cuda" for e in prep.assignment.entries):
            result = _persist_from_gpu(storage, prep, comm.who)
        else:
            result = persist(storage, prep, prep.sources, comm.who)
        prep.stats["persist"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        m = commit(comm, storage, prep, result, timeout=timeout, cache=cache)
        if stats is not None:
            stats.update(prep.stats, commit=time.perf_counter() - t2)
        ok = True
        return m
    finally:
        _give_back(cache)
        if storage is not None:
            storage.close()
        if held is not None:
            held.release(tidy=not ok)  # this rank's own lease only; a failed save into a new directory leaves none


def open_state(comm: Comm, state: dict[str, Any], url: str, storage_options: dict[str, Any] | None
               ) -> tuple[dict[str, Any], Storage | None, dict[str, Any] | None]:
    """The state with its Stateful values expanded and the storage opened, or the error payload of the
    first that failed (a ``state_dict()`` that raises, a storage that cannot be opened): the failure
    travels in the planning exchange (:func:`prepare`'s ``failed``), so that every rank raises it at
    once instead of this rank alone while the others wait out the timeout."""
    storage: Storage | None = None
    try:
        state = stateful.expand(state)
        storage = get_storage(url, **(storage_options or {}))
    except Exception as e:  # noqa: BLE001 - delivered to every rank by the first exchange
        return state, storage, error_payload(e, comm.who)
    return state, storage, None


def take_lease(url: str, prep: Prepared, comm: Comm, storage_options: dict[str, Any] | None) -> lease.Lease | None:
    """This rank's lease on ``url`` (:func:`ckpt._lease.acquire`), taken after the checks of the
    planning phase and before this rank's first byte: a directory being written is leased before any
    rank writes into it, so that gc (:mod:`ckpt._retention`) never deletes the files of a save in
    progress. Every writer of a checkpoint takes one (saves here, ``reshard``, imports); the caller
    releases it when the save is over. None when the save is refused already (nothing is written).
    A lease that cannot be taken is this rank's error: kept in ``prep.refused``, the commit exchange
    delivers it to every rank (no rank writes past it, none waits for it)."""
    if prep.refused is not None:
        return None
    try:
        return lease.acquire(url, comm.rank, storage_options)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the commit exchange
        prep.refused = error_payload(e, comm.who)
        return None


@dataclass(slots=True)
class Prepared:
    """The outcome of the planning phase on one rank."""

    assignment: WriteAssignment
    sources: list[torch.Tensor]  # this rank's pieces, indexed like its declaration
    decl: RankDecl
    fingerprint: str
    plan: SavePlan | None  # the global plan (coordinator only)
    previous: Manifest | None  # the checkpoint being overwritten (coordinator only)
    step: int | None = None
    user_metadata: dict[str, Any] | None = None
    layout: dict[str, Any] | None = None
    overwrite: bool = False
    data_format: str = "safetensors"
    zarr_root: str = ""  # this save's own zarr tree (``zarr-<random>``, chosen by the coordinator)
    aliases: dict[str, str] = field(default_factory=dict)  # tied keys stored as their target's shards
    cached: bool = False
    stats: dict[str, float] = field(default_factory=dict)
    compression: Codec | None = None  # this rank's data file codec (ckpt._codec); None: safetensors
    # coordinator on the cached path: an error found before any write (the checkpoint exists, the
    # old manifest is damaged); it writes nothing and delivers it in the commit exchange, the one
    # exchange the other ranks (also cached) take, so every rank raises it at once
    refused: dict[str, Any] | None = None


def resolve_compression(compression: Any, data_format: str) -> Codec | None:
    """``save``'s ``compression`` argument as a Codec (None: uncompressed); StateError for zarr
    (its chunks are read by zarr itself), ImportError when zstandard is missing."""
    codec = resolve_codec(compression)
    if codec is not None and data_format != "safetensors":
        raise StateError(f"compression={compression!r} applies to data_format='safetensors' only, not {data_format!r}")
    return codec


def prepare(comm: Comm, storage: Storage | None, state: dict[str, Any], *, step: int | None = None,
            user_metadata: dict[str, Any] | None = None, overwrite: bool = False,
            layout: dict[str, Any] | None = None, cache: PlanCache | None = None,
            timeout: float | None = DEFAULT_TIMEOUT_S, data_format: str = "safetensors",
            compression: Codec | None = None, failed: dict[str, Any] | None = None) -> Prepared:
    """Phases 1-2: local declaration; global plan on the coordinator (skipped when cached).

    Raises the same error on every rank when any rank's state is bad or the plan is invalid.
    ``failed``: this rank's error before planning (:func:`open_state`; ``storage`` is None then),
    raised on every rank likewise.

    A rank with an error always takes the planning exchange: the others, on a cached plan, are in the
    commit exchange, which meets it (both are a gather and a reply over the same group), so the
    coordinator sees the error there and every rank raises it.
    """
    loc = _declare(comm, state, step, user_metadata, layout, data_format) if failed is None \
        else _Declared(step, user_metadata, err=failed)
    step, user_metadata, decl, fp, err = loc.step, loc.user_metadata, loc.decl, loc.fp, loc.err
    previous: Manifest | None = None
    refused: dict[str, Any] | None = None
    if comm.rank == 0 and err is None:
        assert storage is not None
        try:
            previous = transaction.begin(storage, overwrite=overwrite)
        except Exception as e:  # noqa: BLE001
            err = refused = error_payload(e, None)
    common = dict(decl=decl, fingerprint=fp, previous=previous, step=step, user_metadata=user_metadata,
                  layout=layout, overwrite=overwrite, data_format=data_format, compression=compression)
    # zarr chunk names are fixed by zarr; each save gets a fresh tree chosen by the coordinator, so
    # zarr saves always plan (no cached plan to skip the exchange).
    if ((err is None or err is refused) and cache is not None and cache.fingerprint == fp
            and cache.assignment is not None and data_format != "zarr"):
        # Steady state: same structure as last time on this rank; no exchange. The commit report
        # carries the fingerprint so the coordinator can refuse a mismatch. A refusal found by the
        # coordinator alone takes this path too: the other ranks cannot know of it before the commit.
        cache.hits += 1
        common["decl"], keep = tied.without(decl, cache.aliases)
        return Prepared(cache.assignment, [loc.sources[i] for i in keep], plan=cache.plan, cached=True,
                        aliases=cache.aliases, refused=refused, **common)  # type: ignore[arg-type]
    if cache is not None:
        cache.clear()
    payload = err or {"phase": "plan", "decl": decl.to_wire(), "fp": fp}
    # every zarr save writes its own tree, whatever is there: no other writer can produce its chunk names
    zroot = zarr_layout.fresh_root(storage) if data_format == "zarr" and comm.rank == 0 and err is None else ""
    mine, plan, fps = _plan_exchange(comm, payload, zroot, step=step, user_metadata=user_metadata, layout=layout,
                                     data_format=data_format, timeout=timeout, storage=storage)
    assignment = WriteAssignment.from_wire(mine["ok"])
    agreed = dict(mine.get("aliases") or {})
    common["decl"], keep = tied.without(decl, agreed)
    if cache is not None:
        cache.fingerprint, cache.assignment, cache.plan, cache.fingerprints = fp, assignment, plan, fps
        cache.aliases = agreed
    return Prepared(assignment, [loc.sources[i] for i in keep], plan=plan,
                    zarr_root=mine.get("zroot") or "", aliases=agreed,
                    **common)  # type: ignore[arg-type]


@dataclass(slots=True)
class _Declared:
    """One rank's planning input (its checked header, declaration, sources), or the error it hit."""

    step: int | None
    user_metadata: dict[str, Any] | None
    decl: RankDecl = field(default_factory=RankDecl)
    sources: list[torch.Tensor] = field(default_factory=list)
    fp: str = ""
    err: dict[str, Any] | None = None  # an error payload naming this rank


def _declare(comm: Comm, state: dict[str, Any], step: int | None, user_metadata: dict[str, Any] | None,
             layout: dict[str, Any] | None, data_format: str) -> _Declared:
    """Phase 1 (local): check the header and declare the state; a failure is kept as a payload, not raised."""
    out = _Declared(step, user_metadata)
    try:
        if data_format not in ("safetensors", "zarr"):
            raise StateError(f"data_format must be 'safetensors' or 'zarr', got {data_format!r}")
        out.step, out.user_metadata = transaction.check_header(step, user_metadata, layout)
        out.decl, items = build_decl(state, comm.rank)
        out.sources = [t.local for t in items]
        out.fp = fingerprint(out.decl) + data_format
    except Exception as e:  # noqa: BLE001 - any failure reaches every rank as a typed error naming this one
        out.err = error_payload(e, comm.who)
    return out


def _plan_exchange(comm: Comm, payload: dict[str, Any], zroot: str, *, step: int | None,
                   user_metadata: dict[str, Any] | None, layout: dict[str, Any] | None, data_format: str,
                   timeout: float | None, storage: Storage | None = None
                   ) -> tuple[dict[str, Any], SavePlan | None, list[str]]:
    """Phase 2 (collective): every rank's ``payload`` to the coordinator, which plans and sends each rank
    its assignment. Returns this rank's reply, the plan and every rank's fingerprint (coordinator only);
    raises on every rank the first error any rank sent or the plan hit. Ranks that sent a commit report
    instead (they saved on a cached plan: see :func:`prepare`) get the error too, their files removed."""
    plan_box: list[SavePlan] = []
    fps: list[str] = []

    def reply(got: list[Any]) -> list[Any]:
        if storage is not None:  # (None: the coordinator could not open it; those files are gc's)
            transaction.remove_files(storage, _written(got))
        errs = [g for g in got if "err" in g]
        if errs:
            return [errs[0]] * comm.world
        stray = [r for r, g in enumerate(got) if g.get("phase") != "plan"]
        if stray:
            return [_structure_error(stray)] * comm.world
        try:
            plan, agreed = _global_plan([RankDecl.from_wire(g["decl"]) for g in got], step=step,
                                        user_metadata=user_metadata, layout=layout, data_format=data_format)
        except Exception as e:  # noqa: BLE001 - a global-plan error names its tensor/ranks itself
            # (any other exception is the coordinator's own fault: named with its rank)
            return [error_payload(e, None if isinstance(e, CheckpointError) else comm.who)] * comm.world
        plan_box.append(plan)
        fps.extend(g["fp"] for g in got)
        return [{"ok": a.to_wire(), "zroot": zroot, "aliases": agreed} for a in plan.assignments]

    try:
        mine = comm.exchange(payload, reply, timeout=timeout, what="save planning")
    except CollectiveError as e:
        if comm.rank == 0 and not decided_nothing(e):  # the reply ran, then reached only some ranks
            _drain(comm, storage, e, timeout)
        raise
    if "err" in mine:
        raise_payload(mine)
    return mine, (plan_box[0] if plan_box else None), fps


def _global_plan(decls: list[RankDecl], *, step: int | None, user_metadata: dict[str, Any] | None,
                 layout: dict[str, Any] | None, data_format: str) -> tuple[SavePlan, dict[str, str]]:
    """The coordinator's plan of every rank's declaration, and the tied keys it stores once."""
    # tied keys are written once (zarr keeps one array per key, so it stores them apart)
    agreed = tied.agree(decls) if data_format == "safetensors" else {}
    decls = [tied.without(d, agreed)[0] for d in decls]
    # Safetensors writers can write part of a replicated piece (balance); zarr needs one
    # chunk per declared piece on a uniform grid, so it keeps pieces whole.
    plan = plan_save(decls, save_id="pending", step=step, user_metadata=user_metadata, layout=layout,
                     split_replicas=data_format == "safetensors")
    if data_format == "zarr":
        for key, t in plan.manifest.tensors.items():
            zarr_layout.check_key(key)
            zarr_layout.chunk_shape(key, t.shape, [s.region for s in t.shards])
    return plan, agreed


def _drain(comm: Comm, storage: Storage | None, e: CollectiveError, timeout: float | None) -> None:
    """The coordinator's planning reply failed part-way (``e``): the ranks that got their assignment write
    their files and come to the commit exchange, which nobody would answer. It answers it with ``e``: their
    files are removed and each rank raises at once (or, when a rank of it is gone too, is told that no
    reply will come: :func:`ckpt._comm.decided_nothing`, and removes its file itself). Best effort."""
    err = error_payload(e, None)

    def reply(got: list[Any]) -> list[Any]:
        if storage is not None:
            transaction.remove_files(storage, _written(got))
        return [err] * comm.world

    try:
        comm.exchange(err, reply, timeout=timeout, what="save commit (after a failed planning reply)")
    except CollectiveError:
        pass


def _structure_error(ranks: list[int]) -> dict[str, Any]:
    return error_payload(CollectiveError(
        f"rank(s) {ranks} changed the structure of their state (keys, shapes, dtypes or shards) while others "
        "did not: every rank must change together. Nothing was committed; the next save re-plans"), None)


def persist(storage: Storage, prep: Prepared, sources: list[torch.Tensor], who: int | None,
            wait_piece: Callable[[int], None] | None = None,
            segments: Callable[[int], Iterator[memoryview]] | None = None) -> dict[str, Any]:
    """Phase 3 (local): write this rank's data file from ``sources``; returns a result payload, never raises.

    The file gets a fresh name chosen here (``data/<rank>-<random>.safetensors``), so a save never
    writes into a file that a committed checkpoint may reference (overwrite stays crash-safe).
    """
    if prep.refused is not None:
        return prep.refused  # nothing written: the commit exchange delivers it to every rank
    a = prep.assignment
    base = persisted(prep, None)["ok"]
    try:
        if a.file is None:
            prep.stats["bytes"] = 0  # nothing of this rank's is stored (replicas written by others)
            return {"ok": {**base, "file": None}}
        if prep.data_format == "zarr":
            todo = [e for e in a.entries if e.length]
            pieces = [(e.key, prep.decl.pieces[e.piece].region, sources[e.piece]) for e in todo]
            chunks = zarr_layout.write_chunks(storage, pieces, wait_piece, [e.piece for e in todo],  # type: ignore[arg-type]
                                              root=prep.zarr_root)
            prep.stats["bytes"] = sum(c[1] for c in chunks)
            by_shard = {(e.key, e.shard): c for e, c in zip(todo, chunks, strict=True)}
            return {"ok": {**base, "file": None,
                           "chunks": [list(by_shard.get((e.key, e.shard), ("", 0, 0))) for e in a.entries]}}
        name = fresh_file_name(a)
        if prep.compression is not None:  # the frames of ckpt._codec: no safetensors header, a name saying so
            name = name.removesuffix(".safetensors") + ".zst"
            size, sums, fc = write_compressed(storage, WriteAssignment(name, a.header, a.entries), sources,
                                              prep.compression, wait_piece=wait_piece, segments=segments)
            out = persisted(prep, name, size, sums)
            out["ok"]["codec"] = fc.to_wire()
            return out
        size, sums = write_assignment(storage, WriteAssignment(name, a.header, a.entries), sources,
                                      wait_piece=wait_piece, segments=segments)
        return persisted(prep, name, size, sums)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the commit exchange
        return error_payload(e, who)


def fresh_file_name(a: WriteAssignment) -> str:
    """A new name for this rank's data file (``data/<rank>-<random>.safetensors``,
    :func:`ckpt._transaction.fresh_data_file`): no other writer can produce it, so a save never writes
    into a file that a committed checkpoint or another writer uses."""
    assert a.file is not None
    rank = transaction.data_file_rank(a.file)
    if rank is None:  # the plan's placeholder (``data/<rank>-pending...``): the rank is its first field
        rank = int(a.file.split("/", 1)[1].split("-", 1)[0])
    return transaction.fresh_data_file(rank)


def persisted(prep: Prepared, name: str | None, size: int = 0, sums: list[int] | None = None) -> dict[str, Any]:
    """Phase 3's result payload for the commit: this rank wrote data file ``name`` (None: none) of
    ``size`` bytes with checksums ``sums`` in entry order."""
    base = {"phase": "commit", "fp": prep.fingerprint, "objects": prep.decl.per_rank_objects,
            "globals": prep.decl.objects, "stats": prep.stats}
    if name is None:
        return {"ok": base}
    prep.stats["bytes"] = size  # this rank's data bytes (file size, header included)
    return {"ok": {**base, "file": name, "size": size, "sums": list(sums or [])}}


SYNC_RING = 256 << 20  # pinned bytes a synchronous save of GPU tensors stages through (4 slabs)


def staged_views(prep: Prepared) -> list[torch.Tensor]:
    """``prep.sources``, each piece this rank writes narrowed to what it writes of it: the whole
    piece, or its part of a split replica (``entry_source``, a view). Only that is staged."""
    views = list(prep.sources)
    for e in prep.assignment.entries:
        views[e.piece] = entry_source(prep.sources[e.piece], e.start, e.count)
    return views


def persist_staged(storage: Storage, prep: Prepared, stager: Stager, who: int | None) -> dict[str, Any]:
    """:func:`persist` from ``stager``'s host copies of :func:`staged_views` (segment by segment, or
    whole pieces for zarr) as they become ready; stops the stager when the write fails."""
    written = prep
    a = prep.assignment
    if any(e.count is not None for e in a.entries):
        # The staged copies of parts of split replicas hold just the part: write them whole.
        # (The commit keeps ``prep``, whose entries say which part each shard is.)
        written = dataclasses.replace(prep, assignment=WriteAssignment(
            a.file, a.header, [dataclasses.replace(e, start=0, count=None) for e in a.entries]))
    if stager.plan.split:
        result = persist(storage, written, prep.sources, who, segments=stager.segments)
    else:  # zarr writes whole pieces: each one's staged copy, once it is ready
        sources: list[Any] = list(prep.sources)
        for e in a.entries:
            sources[e.piece] = functools.partial(stager.piece_tensor, e.piece)
        result = persist(storage, written, sources, who)
    if "ok" not in result:
        stager.abort()
    return result


def _persist_from_gpu(storage: Storage, prep: Prepared, who: int | None) -> dict[str, Any]:
    """A synchronous save of GPU tensors: device-to-host copies into a small pinned ring
    (``SYNC_RING`` bytes) on a staging thread, overlapped with writing what is already on the host."""
    if prep.refused is not None:
        return prep.refused
    views = staged_views(prep)
    stager = Stager(StagingPool(), views, [e.piece for e in prep.assignment.entries], cap=SYNC_RING)
    thread = threading.Thread(target=stager.run, args=({},), name="ckpt-stage", daemon=True)
    thread.start()
    try:
        return persist_staged(storage, prep, stager, who)
    finally:
        stager.abort()
        thread.join()


def commit(comm: Comm, storage: Storage, prep: Prepared, result: dict[str, Any], *,
           timeout: float | None = DEFAULT_TIMEOUT_S, cache: PlanCache | None = None) -> Manifest:
    """Phase 4: the coordinator writes the manifest only when every rank persisted its file.

    Raises the first rank's error on every rank otherwise; the files this save wrote are removed
    (its written set: the files the ranks report, under names no other writer can produce).
    """
    prep.stats.update(sent=comm.sent, received=comm.received)  # metadata bytes so far
    if "ok" in result:
        result["ok"]["stats"] = dict(prep.stats)
    box: list[Manifest] = []  # the committed manifest, decoded from the bytes written

    def reply(results: list[Any]) -> list[Any]:
        t0 = time.perf_counter()
        written = _written(results)
        errs = [r for r in results if "err" in r]
        if errs:
            transaction.remove_files(storage, written)
            return [errs[0]] * comm.world
        stray = [i for i, r in enumerate(results) if r.get("ok", {}).get("phase") != "commit"]
        plan = prep.plan
        expected = cache.fingerprints if cache is not None and prep.cached else None
        if not stray and expected is not None:
            stray = [i for i, r in enumerate(results) if r["ok"]["fp"] != expected[i]]
        if stray or plan is None:
            transaction.remove_files(storage, written)
            if cache is not None:
                cache.clear()
            return [_structure_error(stray or [0])] * comm.world
        try:
            manifest = _fill_manifest(plan, prep, results)
            manifest.stats = _aggregate([r["ok"]["stats"] for r in results])
            if prep.data_format == "zarr":
                _write_zarr_metadata(storage, manifest, prep.zarr_root, written)
            data = encode_manifest(manifest)
        except Exception as e:  # noqa: BLE001 - every rank gets it, typed; this save's files are gone
            transaction.remove_files(storage, written)
            return [error_payload(e, comm.who)] * comm.world
        try:
            # removes this save's files itself when nothing was committed (keeps them when it was)
            committed = transaction.commit_manifest(storage, data, overwrite=prep.overwrite, written=written)
        except Exception as e:  # noqa: BLE001
            return [error_payload(e, comm.who)] * comm.world
        committed.stats = manifest.stats
        committed.stats["commit_s"] = time.perf_counter() - t0
        box.append(committed)
        return [{"ok": {"step": manifest.step, "created": manifest.created, "world_size": manifest.world_size}}
                ] * comm.world

    try:
        status = comm.exchange(result, reply, timeout=timeout, what="save commit")
    except CollectiveError as e:
        _after_lost_commit(storage, result, e)
        raise
    if "err" in status:
        if cache is not None:  # whatever failed, every rank re-plans next time (consistently)
            cache.clear()
        raise_payload(status)
    if box:
        return box[0]  # a fresh object (decoded): the cached plan's skeleton is refilled by the next save
    return _partial_manifest(prep, result, status["ok"])


def _after_lost_commit(storage: Storage, result: dict[str, Any], e: CollectiveError) -> None:
    """This rank's commit exchange failed (``e``): it removes its own files when nothing can commit them,
    i.e. when the exchange failed before the coordinator's reply ran (:func:`decided_nothing`: a rank
    lost a child, this rank's message did not go through, or it was told so). After any other failure
    (its wait for the reply failed: the coordinator may have committed, or may still commit, even when
    its connection was lost) they stay, for gc: a file of a failed save is in no manifest."""
    mine = _written([result])
    if mine and decided_nothing(e):
        transaction.remove_files(storage, mine)


def _written(results: list[Any]) -> transaction.WrittenSet:
    """The files the commit reports ``results`` name (data files, zarr chunks): this save's written set."""
    ok = [r["ok"] for r in results if isinstance(r, dict) and r.get("ok", {}).get("phase") == "commit"]
    written = transaction.WrittenSet(o["file"] for o in ok if o.get("file"))
    written.extend(c[0] for o in ok for c in o.get("chunks", []) if c[0])
    return written


def _fill_manifest(plan: SavePlan, prep: Prepared, results: list[Any]) -> Manifest:
    """The committed manifest: the plan's skeleton with each rank's file names, sizes and checksums."""
    sk = plan.manifest
    tensors = {k: TensorEntry(t.dtype, t.shape, [ShardEntry(s.region, s.file, s.offset, s.length)
                                                  for s in t.shards]) for k, t in sk.tensors.items()}
    files: dict[str, int] = {}
    codecs: dict[str, FileCodec] = {}
    for r, a in zip(results, plan.assignments, strict=True):
        ok = r["ok"]
        if a.file is None:
            continue
        if "chunks" in ok:  # zarr: one chunk file per shard, the shard at its offset 0
            for ent, (path, size, crc) in zip(a.entries, ok["chunks"], strict=True):
                s = tensors[ent.key].shards[ent.shard]
                if not path:  # an empty tensor: no chunk
                    s.file, s.offset, s.checksum = "", 0, 0
                    continue
                s.file, s.offset, s.checksum = path, 0, crc
                files[path] = size
            continue
        files[ok["file"]] = ok["size"]
        if "codec" in ok:  # validated like any manifest's: the coordinator never commits a table it could not read
            codecs[ok["file"]] = FileCodec.from_wire(ok["codec"], ok["file"], ok["size"])
        for ent, crc in zip(a.entries, ok["sums"], strict=True):
            s = tensors[ent.key].shards[ent.shard]
            s.file, s.checksum = ok["file"], crc
    for alias, target in sorted(prep.aliases.items()):  # tied keys: the same bytes, listed under both names
        t = tensors[target]
        tensors[alias] = TensorEntry(t.dtype, t.shape, [ShardEntry(s.region, s.file, s.offset, s.length, s.checksum)
                                                        for s in t.shards])
    objects: dict[str, ObjectEntry] = {}
    for key, data in merge_globals([r["ok"]["globals"] for r in results]).items():
        objects[key] = ObjectEntry(data=data, checksum=crc32(data))
    per_rank: dict[str, dict[int, bytes]] = {}
    for rank, r in enumerate(results):
        for key, data in r["ok"]["objects"].items():
            if key in objects:
                raise StateError(f"object {key!r}: rank {rank} saves it per rank (ckpt.PerRank) while other ranks "
                                 "save it as one global value; wrap it in ckpt.PerRank on every rank")
            per_rank.setdefault(key, {})[rank] = data
    for key in sorted(per_rank):
        objects[key] = ObjectEntry(per_rank=per_rank[key])
    return Manifest(tensors=tensors, objects=objects, files=files, step=prep.step, world_size=len(results),
                    layout=prep.layout, user_metadata=dict(prep.user_metadata or {}), data_format=prep.data_format,
                    codecs=codecs)


def merge_globals(per_rank: list[dict[str, bytes]]) -> dict[str, bytes]:
    """The union of every rank's global objects; StateError naming the key and the ranks when two
    ranks give one key different values (never keep one silently)."""
    out: dict[str, bytes] = {}
    first: dict[str, int] = {}
    for rank, objs in enumerate(per_rank):
        for key, data in objs.items():
            if key not in out:
                out[key], first[key] = data, rank
            elif out[key] != data:
                raise StateError(f"object {key!r}: ranks {first[key]} and {rank} give different values for this global "
                                 "key; wrap rank-specific values in ckpt.PerRank(...) or give each rank its own key")
    return out


def _write_zarr_metadata(storage: Storage, manifest: Manifest, root: str, written: transaction.WrittenSet) -> None:
    """The coordinator writes each array's ``zarr.json`` (and the group's) under this save's zarr
    tree; they are listed in the manifest's files and recorded in the save's ``written`` set."""
    from ckpt._dtypes import dtype_from_name, itemsize

    docs = {f"{root}/zarr.json": zarr_layout.group_metadata()}
    for key, t in manifest.tensors.items():
        chunks = zarr_layout.chunk_shape(key, t.shape, [s.region for s in t.shards])
        docs[f"{root}/{key}/zarr.json"] = zarr_layout.array_metadata(
            t.dtype, itemsize(dtype_from_name(t.dtype)), t.shape, chunks)
        # An empty tensor has no chunk: point its (empty) shard at its metadata, which exists.
        for s in t.shards:
            if not s.file:
                s.file = f"{root}/{key}/zarr.json"
    for path, data in docs.items():
        written.append(path)
        w = storage.open_writer(path)
        try:
            w.write(data)
            manifest.files[path] = w.close()
        except BaseException:
            w.abort()
            raise  # the caller removes the whole written set


def _partial_manifest(prep: Prepared, result: dict[str, Any], status: dict[str, Any]) -> Manifest:
    """What a non-coordinator rank gets back: its own pieces, checksums and file, no global view."""
    ok = result["ok"]
    tensors: dict[str, TensorEntry] = {}
    a = prep.assignment
    files: dict[str, int] = {ok["file"]: ok["size"]} if ok.get("file") else {}
    where = ([(c[0], 0, c[2]) for c in ok["chunks"]] if "chunks" in ok
             else [(ok["file"], e.offset, crc) for e, crc in zip(a.entries, ok.get("sums", []), strict=True)])
    for ent, (path, offset, crc) in zip(a.entries, where, strict=True):
        p = prep.decl.pieces[ent.piece]
        t = tensors.setdefault(p.key, TensorEntry(p.dtype, p.shape, []))
        region = p.region if ent.count is None else sub_region(p.region, ent.start, ent.count)
        t.shards.append(ShardEntry(region, path, offset, ent.length, crc))
    for c in ok.get("chunks", []):
        if c[0]:
            files[c[0]] = c[1]
    codecs = {ok["file"]: FileCodec.from_wire(ok["codec"], ok["file"], ok["size"])} if "codec" in ok else {}
    m = Manifest(tensors=tensors, files=files, codecs=codecs,
                 step=status["step"], created=status["created"], world_size=status["world_size"],
                 layout=prep.layout, user_metadata=dict(prep.user_metadata or {}))
    m.partial = True
    m.stats = dict(ok.get("stats", {}))
    return m


def _aggregate(stats: list[dict[str, float]]) -> dict[str, Any]:
    """min / median / max over ranks of each per-rank figure, and the slowest rank's id."""
    out: dict[str, Any] = {"ranks": len(stats)}
    keys = sorted({k for s in stats for k in s})
    for k in keys:
        vals = [float(s.get(k, 0.0)) for s in stats]
        out[k] = {"min": min(vals), "median": median(vals), "max": max(vals), "slowest_rank": vals.index(max(vals))}
    return out


__all__ = ["DEFAULT_TIMEOUT_S", "build_decl", "fingerprint", "read_manifest", "PlanCache", "save", "Prepared",
           "resolve_compression", "open_state", "prepare", "take_lease", "persist", "fresh_file_name", "persisted",
           "SYNC_RING", "staged_views", "persist_staged", "commit", "merge_globals"]
