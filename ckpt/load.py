"""Load with load-time resharding: every rank plans its own reads from the manifest."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt import stateful
from ckpt._checksum import crc32
from ckpt._codec_reads import data_storage
from ckpt._comm import Comm, error_payload, raise_payload
from ckpt._device_load import load_into_device
from ckpt._io import default_workers, read_gap, run_read_plan, verify_shards
from ckpt._load_plan import DEFAULT_MAX_READ, LoadRequest, ReadPlan, plan_load
from ckpt._regions import check_tiling
from ckpt._state import Item, ObjectItem, TensorItem, flatten_state, rebuild_state
from ckpt.errors import CheckpointError, IntegrityError, LayoutError, ManifestError, MismatchError, StateError
from ckpt.formats.msgpack_codec import decode_manifest, decode_object
from ckpt.formats.objects import decode_value
from ckpt.interop.sources import LOOKED_FOR, foreign_source
from ckpt.manifest import MANIFEST_NAME, Manifest
from ckpt.storage import Storage, get_storage


def fetch_manifest(storage: Storage | None, comm: Comm | None = None, *, manifest_read: str = "broadcast",
                   timeout: float | None = 600.0, failure: BaseException | None = None) -> Manifest:
    """The validated manifest on every rank.

    ``manifest_read="broadcast"`` (default): the coordinator reads it once and sends the bytes to
    every rank (one read of the object store / filesystem per job). ``"each"``: every rank reads it
    itself (no collective; better when the storage serves many readers well and the manifest is large).

    With ``"broadcast"`` on several ranks this is collective and agreed: every rank first reports
    that it is ready (or ``failure``, an exception it already hit, e.g. opening ``storage``, which
    may then be None), then the coordinator reads the manifest and sends every rank the same
    verdict: the bytes, or the first error. So any exception on any rank, typed or not, is raised
    on every rank as a CheckpointError (its class kept when it is one) naming the rank and the
    cause ("rank 0: NotADirectoryError: ..."). ``timeout`` (seconds; None: gloo's own) bounds each
    wait: a rank that does not arrive is named in a CollectiveError.
    """
    payload = manifest_bytes(storage, comm, manifest_read=manifest_read, timeout=timeout, failure=failure)
    return decode_payload(storage, payload)


def manifest_bytes(storage: Storage | None, comm: Comm | None = None, *, manifest_read: str = "broadcast",
                   timeout: float | None = 600.0, failure: BaseException | None = None) -> dict[str, Any]:
    """:func:`fetch_manifest` up to the decoding: the manifest's bytes and source format (``{"ok": bytes,
    "src": name}``), the same on every rank; raises like it."""
    comm = comm or Comm(None)
    if manifest_read not in ("broadcast", "each"):
        raise ValueError(f"manifest_read must be 'broadcast' or 'each', got {manifest_read!r}")
    collective = manifest_read == "broadcast" and not comm.single
    mine: list[BaseException] = [failure] if failure is not None else []  # this rank's own failure

    def read() -> dict[str, Any]:
        if mine:
            return error_payload(mine[0], comm.who if collective else None)
        try:
            assert storage is not None, "fetch_manifest: no storage and no failure"
            if storage.size(MANIFEST_NAME) is None:
                # another tool's checkpoint (DCP, DeepSpeed) is read in place through a manifest
                # describing its files; the bytes travel like ours, the format name beside them
                foreign = foreign_source(storage)  # encoded, its unrecordable values refused by name
                if foreign is not None:
                    return {"ok": foreign[0], "src": foreign[1]}
                raise ManifestError(f"{storage.url}: no committed checkpoint here (looked for {LOOKED_FOR}); if it "
                                    "is a ckpt save, it may not have finished (see `ckpt ls`)")
            return {"ok": storage.read_file(MANIFEST_NAME)}
        except Exception as e:  # noqa: BLE001 - any failure reaches every rank, typed, naming this one
            mine.append(e)
            return error_payload(e, comm.who if collective else None)

    if not collective:
        payload = read()
    else:
        ready = error_payload(mine[0], comm.rank) if mine else {"ready": True}

        def reply(got: list[Any]) -> list[Any]:
            errs = [g for g in got if "err" in g]
            return [errs[0] if errs else read()] * comm.world

        payload = comm.exchange(ready, reply, timeout=timeout, what="load manifest")
    if "err" in payload:
        raise_payload(payload, mine[0] if mine else None)  # the original chained on its own rank
    return payload


def decode_payload(storage: Storage | None, payload: dict[str, Any]) -> Manifest:
    """The manifest of :func:`manifest_bytes`'s payload, validated (on each rank: no collective)."""
    url = storage.url if storage is not None else "?"
    m = decode_manifest(payload["ok"], url=f"{url}/{MANIFEST_NAME}")
    m.source_format = str(payload.get("src", "ckpt"))
    return m


def load(state: dict[str, Any], url: str, *, group: Any = None, strict: bool = True, verify: bool = False,
         storage_options: dict[str, Any] | None = None, workers: int | None = None,
         max_read: int = DEFAULT_MAX_READ, max_gap: int | None = None, manifest_read: str = "broadcast",
         stats: dict[str, Any] | None = None, timeout: float | None = 600.0) -> dict[str, Any]:
    """Fill the tensors of ``state`` in place from the checkpoint at ``url``, resharding as needed.

    Each tensor, ``Shard``, ``FlatShard`` or DTensor in ``state`` says which region of which global
    tensor this rank wants; the stored layout does not matter. Returns a structure like ``state``
    with the loaded objects (and the filled tensors) in place.

    ``stats``, when given a dict, receives this rank's phase durations in seconds (manifest, plan,
    verify, read, copy) and byte counts. ``manifest_read`` picks how ranks get the manifest (see
    :func:`fetch_manifest`). ``workers``: this rank's reader threads (default 4; fewer from local
    files when the ranks on this host outnumber its cores: :func:`ckpt._io.default_workers`).

    With ``verify=True`` every stored shard this rank touches is read whole and its checksum
    checked before any destination tensor is written (a verification pass, then the copy pass).

    ``timeout`` (seconds; None: no limit of ours, gloo's group timeout applies) bounds each wait
    of the collective part (``manifest_read="broadcast"`` on several ranks): the manifest exchange,
    and the completion exchange after every rank has planned, read and restored on its own. A rank
    that does not arrive in time is named in a CollectiveError on every rank, and a failure on any
    rank, before, while or after the manifest is read, reaches every rank: a load returns on every
    rank or raises on every rank (a rank whose own part succeeded may then hold partly loaded state:
    load again). ``manifest_read="each"`` has no collective part: each rank's errors are its own.

    Raises (only CheckpointErrors; any other exception is raised as a CheckpointError naming its
    type, the original chained as ``__cause__``):
        MismatchError: (strict) a requested key missing from the checkpoint (stored keys that are not
            requested are fine: ranks may load different subsets); a dtype or
            global shape mismatch, naming the key.
        IntegrityError: (verify) a shard's bytes do not match its checksum, naming tensor, file, range.
        ManifestError / StorageError: no committed checkpoint, or unreadable bytes.
        CollectiveError: a rank did not arrive within ``timeout`` (named), or lost contact.

    Example::

        out = ckpt.load({"model": model.state_dict(), "step": 0}, "/ckpts/step-10")
        step = out["step"]
    """
    who: int | None = None
    storage: Storage | None = None
    try:
        try:
            comm = Comm(group, timeout=timeout)
            who = comm.who
            failure: BaseException | None = None
            try:
                storage = get_storage(url, **(storage_options or {}))
            except Exception as e:  # noqa: BLE001 - reported to every rank by the manifest exchange
                failure = e
            t0 = time.perf_counter()
            payload = manifest_bytes(storage, comm, manifest_read=manifest_read, timeout=timeout, failure=failure)
            assert storage is not None
            phases: dict[str, Any] = {}
            mine: BaseException | None = None
            try:  # this rank's own part, from decoding the manifest to restoring Stateful values
                manifest = decode_payload(storage, payload)
                phases["manifest"] = time.perf_counter() - t0
                if workers is None:
                    workers = default_workers(storage, comm.world)
                # Stateful values (DCP's protocol) are asked through state_dict() and restored in place
                request = stateful.expand(state)
                # compressed data files are read through their frames (ckpt._codec), every other file as is
                reader = data_storage(storage, manifest)
                gap = max_gap if max_gap is not None else read_gap(reader)
                out = _load(manifest, reader, request, comm.rank, strict, workers, max_read, verify, gap, phases)
                stateful.restore(state, out)
            except Exception as e:  # noqa: BLE001 - reported to every rank by the completion exchange
                mine = e
            if manifest_read == "broadcast" and not comm.single:
                _agree(comm, mine, timeout)
            if mine is not None:
                raise mine
            if stats is not None:
                stats.update(phases)
            return out
        finally:
            if storage is not None:
                storage.close()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - the public API raises only CheckpointErrors
        where = f"rank {who}: " if who is not None else ""
        raise CheckpointError(f"{where}loading {url}: {type(e).__name__}: {e}") from e


def _agree(comm: Comm, mine: BaseException | None, timeout: float | None) -> None:
    """The completion exchange of a collective load: every rank reports whether its own part (plan,
    reads, restore) succeeded, and every rank raises the first failure, naming its rank, so that no
    rank goes on training with a load that failed elsewhere (the rule of DESIGN.md's "Failure
    semantics across ranks"; DCP's load fails on every rank too). Returns when every rank succeeded."""
    report = error_payload(mine, comm.rank) if mine is not None else {"ok": True}

    def reply(got: list[Any]) -> list[Any]:
        errs = [g for g in got if "err" in g]
        return [errs[0] if errs else {"ok": True}] * comm.world

    verdict = comm.exchange(report, reply, timeout=timeout, what="load completion")
    if "err" in verdict:
        raise_payload(verdict, mine)  # the original chained on its own rank


@dataclass(slots=True)
class _Targets:
    """A load's state sorted by destination: object values, host reads, GPU reads."""

    values: dict[str, Any] = field(default_factory=dict)
    requests: list[LoadRequest] = field(default_factory=list)  # host targets, read by one plan
    targets: list[torch.Tensor] = field(default_factory=list)
    direct: list[bool] = field(default_factory=list)
    device_reqs: list[LoadRequest] = field(default_factory=list)  # GPU targets, through the pinned ring
    device_targets: list[torch.Tensor] = field(default_factory=list)
    finals: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (target, its staging)


def _load(manifest: Manifest, storage: Storage, state: dict[str, Any], rank: int, strict: bool,
          workers: int, max_read: int, verify: bool = False, max_gap: int = 4096,
          phases: dict[str, Any] | None = None) -> dict[str, Any]:
    phases = phases if phases is not None else {}
    t0 = time.perf_counter()
    items = flatten_state(state)
    subtrees = _object_subtrees(manifest, items)
    if strict:
        _check_missing(manifest, storage, items, subtrees)
    tg = _sort_targets(manifest, items, subtrees, rank, strict, verify)

    def plan_reads(reqs: list[LoadRequest], contiguous: list[bool] | None = None) -> ReadPlan:
        return plan_load(manifest, reqs, contiguous_targets=contiguous or [True] * len(reqs), max_read=max_read,
                         max_gap=max_gap, max_waste=storage.coalesce_waste,
                         merge_direct=storage.merge_direct)

    plan = plan_reads(tg.requests, tg.direct)
    t1 = time.perf_counter()
    phases["plan"] = t1 - t0
    if verify:
        phases["bytes_verified"] = _verify_requested(manifest, storage, tg.requests + tg.device_reqs, workers)
        phases["verify"] = time.perf_counter() - t1
        t1 = time.perf_counter()
    run_read_plan(storage, plan, tg.targets, [r.dtype for r in tg.requests], workers=workers, map_files=True)
    t2 = time.perf_counter()
    phases["read"] = t2 - t1  # reads and the copies into place, overlapped across reader threads
    for dst, staging in tg.finals:
        dst.copy_(staging)
    bytes_read, ops = plan.bytes_read, len(plan.ops)
    if tg.device_reqs:
        more_bytes, more_ops = _load_device(storage, tg, plan_reads, workers)
        bytes_read, ops = bytes_read + more_bytes, ops + more_ops
    phases["copy"] = time.perf_counter() - t2  # GPU (reads overlapped with copies) / non-contiguous targets
    phases["bytes_read"] = bytes_read
    phases["ops"] = ops
    return rebuild_state(state, tg.values)


def _object_subtrees(manifest: Manifest, items: list[Item]) -> dict[str, list[str]]:
    """The stored object keys each requested object leaf stands for, when it names a nested dict."""
    # An object leaf may stand for a whole nested dict of stored objects ("meta": None gets
    # back {"lr": ..., "name": ...}).
    subtrees: dict[str, list[str]] = {}
    for it in items:
        if isinstance(it, ObjectItem) and it.key not in manifest.objects and it.key not in manifest.tensors:
            sub = [k for k in manifest.objects if k.startswith(it.key + ".")]
            if sub:
                subtrees[it.key] = sub
    return subtrees


def _check_missing(manifest: Manifest, storage: Storage, items: list[Item], subtrees: dict[str, list[str]]) -> None:
    """Raise MismatchError (strict loads) naming the requested keys the checkpoint lacks."""
    keys = {i.key for i in items}
    for sub in subtrees.values():
        keys.update(sub)
    # A rank loads what it asks for (as in DCP): stored keys it does not request are fine, ranks
    # may request different key sets; a requested key the checkpoint lacks is an error.
    missing = sorted(k for k in keys if k not in manifest.tensors and k not in manifest.objects
                     and k not in subtrees)
    if missing:
        raise MismatchError(f"{storage.url}: requested but missing from the checkpoint: {_few(missing)} "
                            "(pass strict=False to skip missing keys)")


def _sort_targets(manifest: Manifest, items: list[Item], subtrees: dict[str, list[str]], rank: int, strict: bool,
                  verify: bool) -> _Targets:
    """Decode the requested objects and sort the tensor targets, in state order (errors name the first bad key)."""
    tg = _Targets()
    for it in items:
        if isinstance(it, ObjectItem):
            _add_object(manifest, it, subtrees, rank, strict, verify, tg)
            continue
        assert isinstance(it, TensorItem)
        if it.key not in manifest.tensors:
            if it.key in manifest.objects:
                _object_value(manifest, it.key, rank, strict)  # a foreign tensor ckpt refused raises its own error
                raise MismatchError(f"key {it.key!r}: the checkpoint holds an object, the target is a tensor")
            continue
        _add_tensor(it, tg)
    return tg


def _add_object(manifest: Manifest, it: ObjectItem, subtrees: dict[str, list[str]], rank: int, strict: bool,
                verify: bool, tg: _Targets) -> None:
    """Decode the stored value (or nested dict of values) for object leaf ``it`` into ``tg.values``."""
    if it.key in subtrees:
        tg.values[it.key] = _nest(it.key, {k: _object_value(manifest, k, rank, strict, verify)
                                           for k in subtrees[it.key]})
        return
    if it.key not in manifest.objects:
        if it.key in manifest.tensors:
            raise MismatchError(f"key {it.key!r}: the checkpoint holds a tensor, the target is an object")
        return
    o = manifest.objects[it.key]
    if o.per_rank is not None and rank not in o.per_rank and not strict:
        return
    tg.values[it.key] = _object_value(manifest, it.key, rank, strict, verify)


def _add_tensor(it: TensorItem, tg: _Targets) -> None:
    """Add tensor target ``it`` to the GPU reads or the host reads (staged when not contiguous on the CPU)."""
    dst = it.local
    if dst.numel() and any(st == 0 and n > 1 for st, n in zip(dst.stride(), dst.shape, strict=True)):
        raise StateError(f"tensor {it.key!r}: the target is expanded (stride 0: several elements share one "
                         "memory location) and cannot hold the loaded values; pass a real tensor (e.g. .clone())")
    req = LoadRequest(it.key, it.dtype, it.global_shape, it.region)
    if through_bounce(dst):  # GPU targets: through pinned bounce buffers, after the host targets
        tg.device_reqs.append(req)
        tg.device_targets.append(dst)
        return
    if dst.device.type != "cpu" or not dst.is_contiguous():
        staging = torch.empty(dst.shape, dtype=dst.dtype)
        tg.finals.append((dst, staging))
        dst = staging
    tg.requests.append(req)
    tg.targets.append(dst)
    tg.direct.append(True)


def _verify_requested(manifest: Manifest, storage: Storage, reqs: list[LoadRequest], workers: int) -> int:
    """Check the tiling and checksums of every stored shard ``reqs`` touch; the bytes verified."""
    for req in reqs:  # a manifest whose shards do not tile a tensor cannot be trusted either
        t = manifest.tensors[req.key]
        try:
            check_tiling(req.key, tuple(t.shape), [s.region for s in t.shards])
        except LayoutError as e:
            raise IntegrityError(f"{e}; the manifest is corrupted, nothing was loaded") from None
    # a foreign source (DCP, DeepSpeed) records no checksums: structure and sizes are all there is
    return verify_shards(storage, manifest, reqs, workers=workers) if manifest.source_format == "ckpt" else 0


def _load_device(storage: Storage, tg: _Targets, plan_reads: Callable[[list[LoadRequest]], ReadPlan],
                 workers: int) -> tuple[int, int]:
    """Fill the GPU targets through the pinned ring; the bytes read and read ops it took."""
    bytes_read, ops = 0, 0
    lock = threading.Lock()

    def run_reads(p: ReadPlan, host: list[torch.Tensor], dtypes: list[str]) -> None:
        nonlocal bytes_read, ops
        run_read_plan(storage, p, host, dtypes, workers=1, map_files=True)
        with lock:
            bytes_read, ops = bytes_read + p.bytes_read, ops + len(p.ops)

    load_into_device(tg.device_reqs, tg.device_targets, plan_reads, run_reads, threads=max(workers, 2))
    return bytes_read, ops


def through_bounce(dst: torch.Tensor) -> bool:
    """Whether target ``dst`` is filled through :mod:`ckpt._device_load`'s pinned ring (GPU tensors)."""
    return dst.device.type == "cuda"


def _few(keys: list[str], n: int = 8) -> str:
    s = ", ".join(repr(k) for k in keys[:n])
    return s + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _object_value(manifest: Manifest, key: str, rank: int, strict: bool, verify: bool = False) -> Any:
    o = manifest.objects[key]
    if verify and o.data is not None and o.checksum is not None and crc32(o.data) != o.checksum:
        raise IntegrityError(f"object {key!r}: checksum mismatch in the manifest; it is corrupted")
    if o.per_rank is not None:
        if rank not in o.per_rank:
            if strict:
                raise MismatchError(f"object {key!r}: no value was saved for rank {rank}; pass strict=False to skip")
            return None
        return decode_value(decode_object(o.per_rank[rank], key=key), key=key)
    assert o.data is not None
    # the one object mapping (ckpt.formats.objects): tagged values come back as their own type, a
    # foreign value ckpt refused raises its typed error here, for this key only
    return decode_value(decode_object(o.data, key=key), key=key)


def _nest(prefix: str, flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in flat.items():
        parts = k[len(prefix) + 1 :].split(".")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return out


__all__ = ["decode_payload", "fetch_manifest", "load", "manifest_bytes", "through_bounce"]
