"""Synchronous save: local plan, global plan, write, commit (DCP's order, without pickle)."""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.comm import Comm, error_payload, raise_payload
from ckpt.errors import CheckpointError, CheckpointExistsError
from ckpt.formats.msgpack_codec import decode_manifest, encode_manifest, encode_object
from ckpt.io import write_assignment
from ckpt.manifest import DATA_DIR, MANIFEST_NAME, Manifest
from ckpt.planner import PieceDecl, RankDecl, SavePlan, WriteAssignment, plan_save
from ckpt.state import ObjectItem, TensorItem, flatten_state
from ckpt.storage import Storage, get_storage


def build_decl(state: dict[str, Any], rank: int) -> tuple[RankDecl, list[TensorItem]]:
    """Flatten a state into this rank's declaration (metadata + encoded objects) and its tensors."""
    items = flatten_state(state)
    tensors = [i for i in items if isinstance(i, TensorItem)]
    decl = RankDecl(pieces=[PieceDecl(t.key, t.dtype, t.global_shape, t.region) for t in tensors])
    for it in items:
        if isinstance(it, ObjectItem):
            data = encode_object(it.value, key=it.key)
            if it.per_rank:
                decl.per_rank_objects[it.key] = data
            elif rank == 0:
                decl.objects[it.key] = data
    return decl, tensors


def read_manifest(storage: Storage) -> Manifest | None:
    """The committed manifest at ``storage``'s root, or None when there is none."""
    if storage.size(MANIFEST_NAME) is None:
        return None
    return decode_manifest(storage.read_file(MANIFEST_NAME), url=f"{storage.url}/{MANIFEST_NAME}")


def save(state: dict[str, Any], url: str, *, group: Any = None, step: int | None = None,
         user_metadata: dict[str, Any] | None = None, overwrite: bool = False,
         layout: dict[str, Any] | None = None, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Save ``state`` to ``url`` as one committed checkpoint; collective over ``group`` when distributed.

    ``state`` is a nested dict of tensors (replicated: written once), ``ckpt.Shard``,
    ``ckpt.FlatShard``, DTensors, ``ckpt.PerRank`` values and msgpack-able objects.

    Raises:
        CheckpointExistsError: ``url`` already holds a committed checkpoint and ``overwrite`` is False.
        StateError / LayoutError: malformed state, ranks disagreeing, overlapping or missing pieces.
        StorageError: an I/O failure; no manifest is written and any previous checkpoint is intact.

    Example::

        ckpt.save({"model": model.state_dict(), "step": 10}, "/ckpts/step-10")
    """
    comm = Comm(group)
    storage = get_storage(url, **(storage_options or {}))
    try:
        prep = prepare(comm, storage, state, step=step, user_metadata=user_metadata, overwrite=overwrite,
                       layout=layout)
        result = persist(storage, prep, prep.sources, comm.who)
        return commit(comm, storage, prep, result)
    finally:
        storage.close()


@dataclass(slots=True)
class Prepared:
    """The outcome of the collective planning phase on one rank."""

    assignment: WriteAssignment
    sources: list[torch.Tensor]  # this rank's pieces, indexed like its declaration
    plan: SavePlan | None  # the global plan (coordinator only)
    previous: Manifest | None  # the checkpoint being overwritten (coordinator only)


def prepare(comm: Comm, storage: Storage, state: dict[str, Any], *, step: int | None = None,
            user_metadata: dict[str, Any] | None = None, overwrite: bool = False,
            layout: dict[str, Any] | None = None) -> Prepared:
    """Phases 1-2 (collective): local declarations, global plan on the coordinator, assignments out.

    Raises the same error on every rank when any rank's state is bad or the plan is invalid.
    """
    sources: list[torch.Tensor] = []
    try:
        decl, items = build_decl(state, comm.rank)
        sources = [t.local for t in items]
        payload: dict[str, Any] = {"ok": decl.to_wire()}
    except CheckpointError as e:
        payload = error_payload(e, comm.who)
    gathered = comm.gather(payload)
    previous: Manifest | None = None
    plan: SavePlan | None = None
    replies: list[Any] = []
    if comm.rank == 0:
        assert gathered is not None
        errs = [g for g in gathered if "err" in g]
        if errs:
            replies = [errs[0]] * comm.world
        else:
            try:
                previous = read_manifest(storage)
                if previous is not None and not overwrite:
                    raise CheckpointExistsError(
                        f"{storage.url}: already holds a committed checkpoint (step {previous.step}); "
                        "pass overwrite=True to replace it, or save to a new path"
                    )
                decls = [RankDecl.from_wire(g["ok"]) for g in gathered]
                plan = plan_save(decls, save_id=uuid.uuid4().hex[:12], step=step,
                                 user_metadata=user_metadata, layout=layout)
                replies = [{"ok": a.to_wire()} for a in plan.assignments]
            except CheckpointError as e:  # a global-plan error names its tensor/ranks itself
                replies = [error_payload(e, None)] * comm.world
    mine = comm.scatter(replies if comm.rank == 0 else None)
    if "err" in mine:
        raise_payload(mine)
    return Prepared(WriteAssignment.from_wire(mine["ok"]), sources, plan, previous)


def persist(storage: Storage, prep: Prepared, sources: list[torch.Tensor], who: int | None,
            wait_piece: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Phase 3 (local): write this rank's data file from ``sources``; returns a result payload, never raises."""
    a = prep.assignment
    try:
        if a.file is None:
            return {"ok": {"file": None}}
        size, sums = write_assignment(storage, a, sources, wait_piece=wait_piece)
        return {"ok": {"file": a.file, "size": size, "sums": sums}}
    except (CheckpointError, OSError) as e:
        return error_payload(e, who)


def commit(comm: Comm, storage: Storage, prep: Prepared, result: dict[str, Any]) -> Manifest:
    """Phase 4 (collective): the coordinator writes the manifest only when every rank persisted its file.

    Raises the first rank's error on every rank otherwise; the files this save wrote are removed.
    """
    results = comm.gather(result)
    status: dict[str, Any] = {}
    manifest_bytes = b""
    if comm.rank == 0:
        assert results is not None and prep.plan is not None
        written = [r["ok"]["file"] for r in results if "ok" in r and r["ok"]["file"]]
        errs = [r for r in results if "err" in r]
        if errs:
            status = errs[0]
            _cleanup_files(storage, written)
        else:
            try:
                manifest = prep.plan.manifest
                for r, a in zip(results, prep.plan.assignments, strict=True):
                    if a.file is None:
                        continue
                    manifest.files[a.file] = r["ok"]["size"]
                    for ent, crc in zip(a.entries, r["ok"]["sums"], strict=True):
                        manifest.tensors[ent.key].shards[ent.shard].checksum = crc
                for obj in manifest.objects.values():
                    if obj.data is not None:
                        obj.checksum = zlib.crc32(obj.data)
                manifest_bytes = encode_manifest(manifest)
                if hasattr(storage, "sync_dir"):
                    storage.sync_dir(DATA_DIR)  # data file names durable before the commit
                storage.commit(MANIFEST_NAME, manifest_bytes)
                status = {"ok": True}
                if prep.previous is not None:  # overwrite: drop files only the old checkpoint used
                    _cleanup_files(storage, [f for f in prep.previous.files if f not in manifest.files])
            except CheckpointError as e:
                status = error_payload(e, comm.who)
                _cleanup_files(storage, written)
    status = comm.broadcast(status)
    if "err" in status:
        raise_payload(status)
    data = comm.broadcast_bytes(manifest_bytes if comm.rank == 0 else None)
    return decode_manifest(data, url=f"{storage.url}/{MANIFEST_NAME}")


def _cleanup_files(storage: Storage, files: list[str]) -> None:
    for f in files:
        try:
            storage.delete(f)
        except CheckpointError:
            pass  # best effort: gc removes leftovers; never mask the original error
