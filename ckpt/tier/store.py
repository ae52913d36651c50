"""One rank's side of a node's shared-memory directory: write, find, load and free memory checkpoints.

A memory checkpoint is an ordinary ckpt checkpoint written by ``ckpt.save`` through a single-rank
group (no collective), holding exactly this rank's pieces as *local* tensors: the manifest's keys
are the flattened state keys, each tensor is the rank's own piece (a ``Shard``'s or
``FlatShard``'s ``local``), objects (RNG, data position, scheduler) are kept as they are. What the
pieces are pieces *of* (global shape and region of each key) is summarized in a digest in the
manifest's ``user_metadata["ckpt_tier"]``, next to the run id, the owner rank and the world size:
a copy is used only where all of them match the job that restores it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from ckpt import stateful
from ckpt._state import ObjectItem, TensorItem, flatten_state, rebuild_state
from ckpt.errors import CheckpointError, ManifestError
from ckpt.manifest import MANIFEST_NAME, Manifest
from ckpt.shards import Flat, PerRank
from ckpt.tier import fastload, safefs
from ckpt.tier.fastload import read_manifest
from ckpt.tier.nodes import RANK_DIR, STEP_DIR, node_dir, step_name

META_KEY = "ckpt_tier"  # user_metadata entry of every memory checkpoint
TIER_VERSION = 1
REPLICAS = "replicas"


def localize(state: dict[str, Any]) -> tuple[dict[str, Any], list[str], str]:
    """``(flat state of local pieces, object keys, digest)``: see :func:`localize_pieces`."""
    flat, objects, digest, _pieces = localize_pieces(state)
    return flat, objects, digest


def localize_pieces(state: dict[str, Any]) -> tuple[dict[str, Any], list[str], str, dict[str, list[Any]]]:
    """``(flat state of local pieces, object keys, digest, pieces)`` of a state as ``ckpt.save`` takes it.

    Tensors become their local pieces under their flattened keys (a DTensor with several local
    boxes gets ``key@1``, ``key@2``, ... for the extra ones); objects keep their value (``PerRank``
    kept). The digest hashes each tensor's key, dtype, global shape and region: equal digests mean
    the same pieces of the same global tensors, i.e. the same layout for this rank. ``pieces`` maps
    each flat tensor key to ``[global key, dtype, global shape, where]`` (``where``: ``["box",
    offsets, lengths]`` or ``["flat", start, stop, box or None]``): what a resharding restore needs
    to read the memory checkpoint as pieces of the global tensors (:mod:`ckpt.tier.reshard`).
    """
    items = flatten_state(stateful.expand(state))
    flat: dict[str, Any] = {}
    objects: list[str] = []
    h = hashlib.blake2b(digest_size=16)
    seen: dict[str, int] = {}
    pieces: dict[str, list[Any]] = {}
    for it in items:
        if isinstance(it, TensorItem):
            n = seen.get(it.key, 0)
            seen[it.key] = n + 1
            key = it.key if n == 0 else f"{it.key}@{n}"
            flat[key] = it.local
            region = it.region
            where = (["flat", region.start, region.stop, region.box.to_list() if region.box else None]
                     if isinstance(region, Flat) else ["box", list(region.offsets), list(region.lengths)])
            h.update(repr((key, it.dtype, list(it.global_shape), where)).encode())
            pieces[key] = [it.key, it.dtype, list(it.global_shape), where]
        else:
            assert isinstance(it, ObjectItem)
            flat[it.key] = PerRank(it.value) if it.per_rank else it.value
            objects.append(it.key)
    return flat, objects, h.hexdigest(), pieces


def pieces_digest(state: dict[str, Any]) -> str:
    """The digest :func:`localize` computes (only the tensors' keys, dtypes, shapes and regions count)."""
    return localize(state)[2]


def load_local(state: dict[str, Any], url: str, *, strict: bool = True, stats: dict[str, Any] | None = None,
               verify: bool = True, group: Any = None, mapped: dict[tuple[int, int], Any] | None = None
               ) -> dict[str, Any]:
    """Fill ``state`` (same structure as saved) from this rank's memory checkpoint at ``url``.

    Every piece's checksum is checked (``verify`` is always on: the tier exists to restore fast
    *and* right). When the copy holds exactly ``state``'s pieces, whole (the usual case), they are
    read, checked and copied in one pass on many threads (:mod:`ckpt.tier.fastload`): a corrupt
    piece is then found after some targets were written (the IntegrityError has ``partial`` set;
    the tier's restore overwrites everything from the next copy). Otherwise ``ckpt.load`` with
    ``verify=True`` (checks first, then writes). Returns the state's structure with the loaded
    objects in place, as ``ckpt.load`` does; ``group``: a single-rank group when
    torch.distributed is initialized (the load is not collective); ``mapped``: files already mapped
    (see :func:`ckpt.tier.fastload.load_pieces`).

    Raises IntegrityError (a checksum mismatch), MismatchError, ManifestError, StorageError.
    """
    import time

    from ckpt.load import load

    del verify  # always verified
    expanded = stateful.expand(state)
    flat, objects, _ = localize(expanded)
    planned = fastload.plan_pieces(flat, url)
    if planned is None:
        out = load(flat, url, group=group, strict=strict, verify=True, stats=stats)
    else:
        t0 = time.perf_counter()
        fast: dict[str, Any] = {}
        nbytes = fastload.load_pieces(planned[1], mapped=mapped, stats=fast)
        t1 = time.perf_counter()
        out = (load({k: flat[k] for k in objects}, url, group=group, strict=strict, verify=True, stats=stats)
               if objects else {})  # (nothing but tensors: no second read of the manifest)
        if stats is not None:  # one fused pass: read, checked and copied
            stats.update(read=t1 - t0, bytes_read=nbytes, bytes_verified=nbytes, ops=len(planned[1]), **fast)
    values = {k: out[k] for k in objects if k in out}
    result = rebuild_state(expanded, values)
    stateful.restore(state, result)
    return result  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Entry:
    """A step directory found on this node: ``kind`` is ``local`` (the owner's own) or ``replica``.

    ``problem`` is empty for a usable (committed, ours) copy, else why it is not used.
    """

    owner: int
    step: int
    path: str
    kind: str
    committed: bool
    bytes: int
    digest: str | None = None
    epoch: str = ""
    problem: str = ""
    world: int | None = None  # the world size of the job that wrote it (None: not a tier copy)

    @property
    def usable(self) -> bool:
        return self.committed and not self.problem


def read_entry(path: str, owner: int, step: int, kind: str, run_id: str, world: int | None,
               lineage: str | None = None) -> Entry:
    """Describe one step directory; never raises (a damaged manifest is an entry with a problem).
    ``world`` / ``lineage``: what the copy must have been written under (None: not checked)."""
    size = sum(st.st_size for f in safefs.walk_files(path) if (st := safefs.regular(f)) is not None)
    mpath = os.path.join(path, MANIFEST_NAME)
    if safefs.regular(mpath) is None:
        return Entry(owner, step, path, kind, False, size, problem="incomplete (no manifest): a write was cut short")
    try:
        m = read_manifest(mpath)
    except (OSError, CheckpointError) as e:
        return Entry(owner, step, path, kind, False, size, problem=f"unreadable manifest: {e}")
    meta = (m.user_metadata or {}).get(META_KEY)
    problem = _identity_problem(meta, m, owner, step, run_id, world, lineage)
    meta = meta if isinstance(meta, dict) else {}
    digest, epoch, wrote = meta.get("digest"), meta.get("epoch"), meta.get("world")
    return Entry(owner, step, path, kind, True, size, digest if isinstance(digest, str) else None,
                 epoch if isinstance(epoch, str) else "", problem, wrote if isinstance(wrote, int) else None)


def _identity_problem(meta: Any, m: Manifest, owner: int, step: int, run_id: str, world: int | None,
                      lineage: str | None) -> str:
    if not isinstance(meta, dict):
        return "not a memory-tier checkpoint (no ckpt_tier metadata)"
    if meta.get("run_id") != run_id:
        return f"stale: written by run {meta.get('run_id')!r}, this is run {run_id!r}"
    if lineage is not None and meta.get("lineage") != lineage:
        return (f"stale: written by an earlier run under the same root (lineage {meta.get('lineage')!r}, now "
                f"{lineage!r}: the root was emptied or replaced since)")
    if world is not None and meta.get("world") != world:
        return f"stale: written by a job of {meta.get('world')} ranks, this one has {world}"
    if meta.get("owner") != owner or m.step != step:
        return f"misplaced: holds rank {meta.get('owner')}'s step {m.step}, found as rank {owner}'s step {step}"
    return ""


def remove_step(path: str) -> None:
    """Delete one step directory: the manifest first (what is left is no longer a checkpoint), then
    the rest. Best effort: a leftover without a manifest is never used and goes at the next reset."""
    if not safefs.is_dir(path):  # a link (or a file) planted there: removed itself, nothing it points to
        safefs.rmtree(path)
        return
    with contextlib.suppress(OSError):
        safefs.unlink(os.path.join(path, MANIFEST_NAME))
    safefs.rmtree(path)


class NodeStore:
    """Paths and listings of this rank's part of its node's directory (no collectives)."""

    def __init__(self, base: str, run_id: str, node: int, rank: int, world: int, lineage: str | None = None):
        self.base, self.run_id, self.node, self.rank, self.world = base, run_id, node, rank, world
        self.lineage = lineage
        self.dir = node_dir(base, run_id, node)

    def own_root(self, rank: int | None = None) -> str:
        return os.path.join(self.dir, f"rank-{self.rank if rank is None else rank}")

    def own(self, step: int) -> str:
        """This rank's memory checkpoint of ``step``."""
        return os.path.join(self.own_root(), step_name(step))

    def replica_root(self, owner: int) -> str:
        return os.path.join(self.dir, REPLICAS, f"rank-{owner}")

    def replica(self, owner: int, step: int) -> str:
        """The copy of ``owner``'s memory checkpoint of ``step`` kept on this node."""
        return os.path.join(self.replica_root(owner), step_name(step))

    def scan_own(self) -> list[Entry]:
        """This rank's own step directories, oldest first."""
        return [read_entry(p, self.rank, s, "local", self.run_id, self.world, self.lineage)
                for s, p in _steps(self.own_root())]

    def scan_replicas(self, owners: list[int] | None = None) -> list[Entry]:
        """Copies kept on this node (of ``owners``, or of every rank), by owner then step."""
        root = os.path.join(self.dir, REPLICAS)
        out: list[Entry] = []
        for name in sorted(_listdir(root)):
            m = RANK_DIR.match(name)
            if m is None or (owners is not None and int(m.group(1)) not in owners):
                continue
            owner = int(m.group(1))
            out += [read_entry(p, owner, s, "replica", self.run_id, self.world, self.lineage)
                    for s, p in _steps(os.path.join(root, name))]
        return out

    def own_steps(self) -> list[tuple[int, str]]:
        return _steps(self.own_root())

    def replica_steps(self, owner: int) -> list[tuple[int, str]]:
        return _steps(self.replica_root(owner))

    def prune(self, ranks_here: list[int], held_owners: list[int]) -> list[str]:
        """Remove ``rank-*`` and ``replicas/rank-*`` directories of this node that no rank of the
        current job uses (another world size, another node mapping). Returns what was removed."""
        gone: list[str] = []
        for name in _listdir(self.dir):
            m = RANK_DIR.match(name)
            if m is not None and int(m.group(1)) not in ranks_here:
                safefs.rmtree(os.path.join(self.dir, name))  # (a link: itself, never its target's files)
                gone.append(os.path.join(self.dir, name))
        root = os.path.join(self.dir, REPLICAS)
        for name in _listdir(root):
            m = RANK_DIR.match(name)
            if m is not None and int(m.group(1)) not in held_owners:
                safefs.rmtree(os.path.join(root, name))
                gone.append(os.path.join(root, name))
        return gone


def _listdir(path: str) -> list[str]:
    """A tier directory's names (nothing for a link or what lies behind one: :func:`safefs.listdir`)."""
    return safefs.listdir(path)


def _steps(root: str) -> list[tuple[int, str]]:
    out = []
    for name in _listdir(root):
        m = STEP_DIR.match(name)
        full = os.path.join(root, name)
        if m is not None and safefs.is_dir(full):
            out.append((int(m.group(1)), full))
    return sorted(out)


def manifest_bytes(path: str) -> bytes:
    """The committed manifest of a step directory (ManifestError when there is none)."""
    try:
        return safefs.read_bytes(os.path.join(path, MANIFEST_NAME))
    except OSError as e:
        raise ManifestError(f"{path}: no readable manifest ({e.strerror or e}); the memory checkpoint is "
                            "incomplete") from e


def data_bytes(path: str) -> int:
    """Bytes of a committed step directory's files (data files + manifest); 0 when unreadable."""
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        return committed_bytes(path, read_manifest(mpath))
    except (OSError, CheckpointError):
        return 0


def committed_bytes(path: str, manifest: Manifest) -> int:
    """:func:`data_bytes` of step directory ``path`` whose committed manifest is ``manifest`` (the
    save's return value: the memory checkpoint's background thread then decodes nothing again)."""
    st = safefs.regular(os.path.join(path, MANIFEST_NAME))
    if st is None:
        raise OSError(f"{path}: its manifest is gone or not a regular file")
    return sum(manifest.files.values()) + st.st_size


def local_tensor_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's local pieces (what a memory checkpoint of ``state`` holds)."""
    return sum(v.numel() * v.element_size() for v in localize(state)[0].values() if isinstance(v, torch.Tensor))


__all__ = ["META_KEY", "TIER_VERSION", "REPLICAS", "localize", "localize_pieces", "pieces_digest", "load_local",
           "Entry", "read_entry", "remove_step", "NodeStore", "manifest_bytes", "data_bytes", "committed_bytes",
           "local_tensor_bytes"]
