"""Restore from the memory tier under another layout (another world size, TP/EP/PP/DP split) through
the ordinary resharding load.

Each memory checkpoint holds one rank's local pieces, and its tier metadata says what each piece is
a piece *of* (``pieces``: global key, dtype, global shape, region; see
:func:`ckpt.tier.store.localize_pieces`). When every old rank's copy of one step is reachable from
a new rank's file system (its own node's shared memory; on one host, every simulated node's),
that rank assembles a *view*: an ordinary checkpoint directory whose data files are hard links to
the copies' files (no bytes copied) and whose manifest lists every piece as a shard of its global
tensor, with the copies' own byte offsets and CRCs. ``ckpt.load`` then reads exactly the byte
ranges the new layout needs, every checksum checked, as from any persistent checkpoint. The ranks
agree on the step (the newest one whose every old rank's copy some new rank can reach, of one
attempt of the old job); any failure on any rank falls back to storage on every rank.

Across hosts (each host's shared memory holds only the copies of its own nodes), a rank fetches
the copies it cannot reach from a rank that can, whole, over the tier's gloo group (the same
packages as the peer copies; :func:`ckpt.tier.transfer.exchange`), once per host: the lowest rank
of the host lacking a copy fetches it into a directory of its own below the run directory
(``view-<rank>-<token>-fetched``), the host's other ranks link their views to the same files, and
the fetcher removes it once every rank agreed. So a job restarted on another world size after
losing a node restores from its peers' memory without storage, on any number of hosts. When the
ranks name the pieces they want (``want``: the manager always does), only the stored shards those
pieces overlap are fetched, through ``ckpt.transfer`` (:mod:`ckpt.tier.reshard_fetch`); without it,
whole copies.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from ckpt._comm import describe
from ckpt._transaction import commit_manifest
from ckpt.errors import CheckpointError, CollectiveError, ManifestError
from ckpt.formats.msgpack_codec import decode_manifest, encode_manifest
from ckpt.manifest import MANIFEST_NAME, Manifest, ObjectEntry, ShardEntry, TensorEntry
from ckpt.shards import Region
from ckpt.storage.local import LocalStorage
from ckpt.tier import reshard_fetch, safefs
from ckpt.tier.nodes import NODE_DIR, RANK_DIR, STEP_DIR, tier_dir
from ckpt.tier.reshard_fetch import global_region
from ckpt.tier.restore import TierRestore
from ckpt.tier.store import META_KEY, REPLICAS, _listdir
from ckpt.tier.transfer import after_copy, exchange, failed, package

if TYPE_CHECKING:
    from ckpt.tier.types import TierView

_region = global_region  # (its old name here)

VIEW_PREFIX = "view-"  # <tier>/view-<rank>-<random>/: a rank's resharding view (hard links), removed after use


def _copies(tier: TierView) -> dict[tuple[int, str, int], dict[int, str]]:
    """Every usable copy reachable from here, by ``(step, epoch, old world)`` then owner: committed,
    of this run and lineage, describing its pieces, found where its owner's copy belongs."""
    run = tier_dir(tier.base, tier.run_id)
    out: dict[tuple[int, str, int], dict[int, str]] = {}
    for node in sorted(_listdir(run)):
        if NODE_DIR.match(node) is None:
            continue
        ndir = os.path.join(run, node)
        places = [(m, os.path.join(ndir, d)) for d in _listdir(ndir) if (m := RANK_DIR.match(d))]
        places += [(m, os.path.join(ndir, REPLICAS, d)) for d in _listdir(os.path.join(ndir, REPLICAS))
                   if (m := RANK_DIR.match(d))]
        for m, where in places:
            owner = int(m.group(1))
            for name in sorted(_listdir(where)):
                sm = STEP_DIR.match(name)
                if sm is None:
                    continue
                meta = _meta(os.path.join(where, name))
                if (meta is None or meta.get("run_id") != tier.run_id or meta.get("owner") != owner
                        or (tier.config.lineage is not None and meta.get("lineage") != tier.config.lineage)
                        or not isinstance(meta.get("pieces"), dict) or not isinstance(meta.get("world"), int)):
                    continue
                key = (int(sm.group(1)), str(meta.get("epoch", "")), int(meta["world"]))
                out.setdefault(key, {}).setdefault(owner, os.path.join(where, name))
    return out


def _meta(path: str) -> dict[str, Any] | None:
    try:
        m = decode_manifest(safefs.read_bytes(os.path.join(path, MANIFEST_NAME)), url=path)
    except (OSError, CheckpointError):
        return None
    meta = (m.user_metadata or {}).get(META_KEY)
    return meta if isinstance(meta, dict) and m.step is not None else None


def build_view(copies: dict[int, str], dest: str, prefer: Collection[int] = ()) -> Manifest:
    """Write at ``dest`` an ordinary checkpoint made of the copies (``owner -> step directory``):
    hard links to their data files and a manifest of every piece as a shard of its global tensor.
    Per-rank objects keep their owner's rank; global objects come from the lowest owner. A piece
    several copies hold (a replica) is read from the lowest owner in ``prefer`` (the copies this
    host reaches), else the lowest owner (:func:`ckpt.tier.reshard_fetch.needed` makes the same choice).

    Raises ManifestError (a copy without piece descriptions, disagreeing global shapes) and
    OSError (no hard links here: another file system)."""
    safefs.rmtree(dest)
    safefs.makedirs(os.path.join(dest, "data"))
    merged = Manifest()
    seen: set[tuple[str, Region]] = set()
    shards: dict[str, list[ShardEntry]] = {}
    first: dict[str, int] = {}  # global object -> the owner whose value the view holds
    for owner in sorted(copies, key=lambda o: (o not in prefer, o)):
        path = copies[owner]
        m = decode_manifest(safefs.read_bytes(os.path.join(path, MANIFEST_NAME)), url=path)
        pieces = m.user_metadata[META_KEY]["pieces"]
        names = {}
        for rel, size in m.files.items():  # (plain paths below the copy: decode_manifest checked each)
            names[rel] = f"data/o{owner}-{os.path.basename(rel)}"
            safefs.link(os.path.join(path, rel), os.path.join(dest, names[rel]))  # a regular file of ours only
            merged.files[names[rel]] = size
        for key, entry in m.tensors.items():
            if key not in pieces:
                raise ManifestError(f"{path}: tensor {key!r} has no piece description; not resharded")
            gkey, dtype, gshape, where = pieces[key]
            t = merged.tensors.setdefault(gkey, TensorEntry(dtype, tuple(int(x) for x in gshape), []))
            if t.dtype != dtype or list(t.shape) != [int(x) for x in gshape]:
                raise ManifestError(f"{path}: tensor {gkey!r} is {dtype} {gshape} here but {t.dtype} "
                                    f"{list(t.shape)} in another rank's copy")
            for s in entry.shards:
                region = global_region(where, s.region)
                if (gkey, region) in seen:
                    continue  # a replica (DP, EP over dense weights): the lowest owner's copy serves
                seen.add((gkey, region))
                shards.setdefault(gkey, []).append(ShardEntry(region, names[s.file], s.offset, s.length, s.checksum))
        for key, obj in m.objects.items():
            if obj.per_rank is not None:
                values = list(obj.per_rank.values())  # saved through a group of one: rank 0's value
                mine = merged.objects.setdefault(key, ObjectEntry(per_rank={}))
                if len(values) != 1 or mine.per_rank is None:
                    raise ManifestError(f"{path}: object {key!r} is per-rank here but not in another copy")
                mine.per_rank[owner] = values[0]
            elif key not in merged.objects or owner < first.get(key, owner):
                merged.objects[key] = obj
                first[key] = owner
        if owner == min(copies):
            meta = dict(m.user_metadata)
            meta.pop(META_KEY, None)
            merged.user_metadata, merged.layout, merged.step = meta, m.layout, m.step
            merged.hash_algorithm = m.hash_algorithm
    for gkey, found in shards.items():
        merged.tensors[gkey].shards = found
    merged.world_size = len(copies)
    storage = LocalStorage(dest)
    try:
        commit_manifest(storage, encode_manifest(merged), overwrite=False)  # dest is fresh: nothing to replace
    finally:
        storage.close()
    return merged


def plan_fetches(reach: list[dict[str, list[int]]], hosts: list[Any], token: str) -> dict[str, Any] | None:
    """The step to restore and who fetches what (pure; run on the coordinator of the planning exchange).

    ``reach[r]``: for each ``"step|epoch|world"`` key, the old ranks whose copy rank r reaches;
    ``hosts[r]``: rank r's host (ranks with equal hosts share shared memory). The step is the newest
    key whose every old rank some rank reaches. For each host and each old rank none of the host's
    ranks reaches, the host's lowest rank fetches it from a rank that reaches it (the one with the
    fewest sends so far). Returns None (no such step) or ``{"key", "token", "fetch": [[fetcher, owner,
    sender], ...], "at": {"rank": [[owner, fetcher], ...]}}`` (``at``: where each rank finds the copies
    fetched for its host)."""
    keys = sorted(set().union(*reach), key=_order, reverse=True)
    n = len(reach)
    for key in keys:
        world = int(key.split("|")[2])
        holders = {o: [r for r in range(n) if o in reach[r].get(key, [])] for o in range(world)}
        if not all(holders.values()):
            continue
        sends = [0] * n
        fetch: list[list[int]] = []
        at: dict[int, list[list[int]]] = {}
        for host in dict.fromkeys(map(_host_id, hosts)):  # in order of first rank
            ranks = [r for r in range(n) if _host_id(hosts[r]) == host]
            here = set().union(*(reach[r].get(key, []) for r in ranks))
            for o in range(world):
                if o in here:
                    continue
                sender = min(holders[o], key=lambda h: (sends[h], h))
                sends[sender] += 1
                fetch.append([ranks[0], o, sender])
                for r in ranks:
                    at.setdefault(r, []).append([o, ranks[0]])
        return {"key": key, "token": token, "fetch": fetch, "at": {str(r): v for r, v in at.items()}}
    return None


def _order(key: str) -> tuple[int, str, int]:
    step, epoch, world = key.split("|")
    return int(step), epoch, int(world)


def _host_id(host: Any) -> str:
    return repr(host)  # (host keys are lists or tuples once they crossed the wire)


def _rounds(fetch: list[list[int]]) -> list[list[list[int]]]:
    """``fetch`` in rounds where each sender sends each fetcher at most one copy (one package per
    pair per :func:`ckpt.tier.transfer.exchange`)."""
    rounds: list[list[list[int]]] = []
    used: list[set[tuple[int, int]]] = []
    for f in fetch:
        pair = (f[2], f[0])
        k = next((i for i, u in enumerate(used) if pair not in u), len(rounds))
        if k == len(rounds):
            rounds.append([])
            used.append(set())
        rounds[k].append(f)
        used[k].add(pair)
    return rounds


def _fetch_dir(tier: TierView, fetcher: int, token: str) -> str:
    return os.path.join(tier_dir(tier.base, tier.run_id), f"{VIEW_PREFIX}{fetcher}-{token}-fetched")


def _fetch(tier: TierView, plan: dict[str, Any], local: dict[int, str]) -> tuple[dict[int, str], int, list[int]]:
    """Run ``plan``'s fetches this rank takes part in; returns where each old rank's copy is for this
    rank (its own reach, or its host's fetcher's directory), the bytes it received and the ranks it
    received from. Raises CheckpointError / OSError for a copy that did not arrive whole (CRCs are
    checked by the load), CollectiveError for a peer lost."""
    rank, token = tier.rank, str(plan["token"])
    step = int(plan["key"].split("|")[0])
    where = dict(local)
    for o, fetcher in plan["at"].get(str(rank), []):
        where[int(o)] = os.path.join(_fetch_dir(tier, int(fetcher), token), f"rank-{int(o)}")
    got_bytes, senders = 0, []
    mine = [f for f in plan["fetch"] if rank in (f[0], f[2])]
    if any(f[0] == rank for f in mine):
        safefs.makedirs(_fetch_dir(tier, rank, token))
    for rnd in _rounds(mine):
        sends = {f[0]: package(local[f[1]], f"rank {rank}'s copy of rank {f[1]}'s memory step {step}")
                 for f in rnd if f[2] == rank}
        for dst, pkg in sends.items():
            if not pkg.header.get("ok"):
                sends[dst] = failed(str(pkg.header.get("err")))
        recvs = {f[2]: where[f[1]] for f in rnd if f[0] == rank}
        arrived = exchange(tier.pg, sends, recvs, rank=rank, timeout=tier.timeout,
                           what=f"memory tier resharding restore of step {step} (fetching copies)", **tier.copy_options)
        for src, r in arrived.items():
            if not r.ok:
                raise ManifestError(f"rank {src}'s copy did not arrive: {r.err}")
            got_bytes += r.bytes
            senders.append(src)
    return where, got_bytes, senders


def run(tier: TierView, fn: Callable[[str], Any], *, min_step: int | None = None,
        on_failure: Callable[[dict[str, Any]], None] | None = None,
        want: dict[str, Any] | None = None) -> TierRestore | None:
    """Restore the newest memory step whose every old rank's copy some rank reaches, under this job's
    layout, through ``fn(view_url)`` (collective over the tier's group; ``fn`` a resharding load of
    this rank's state, not collective), fetching what this rank's host lacks first; None when
    there is none or it failed on any rank (``restore_failed`` records, tier ``memory-reshard``).
    ``want``: this rank's target state (the pieces ``fn`` loads): only the stored shards they
    overlap are fetched, through ``ckpt.transfer`` (:mod:`ckpt.tier.reshard_fetch`), when every rank
    passed one; else whole copies. Raises CollectiveError when a rank is lost."""
    tier.drain()
    found = _copies(tier)
    reach = {f"{s}|{e}|{w}": sorted(owners) for (s, e, w), owners in found.items()
             if min_step is None or s >= min_step}
    token = uuid.uuid4().hex[:8]
    hosts = getattr(tier, "hosts", None) or list(range(tier.world))  # (unknown: every rank fetches for itself)

    def planned(got: list[Any]) -> list[Any]:
        plan = plan_fetches([g[0] for g in got], hosts, token)
        if plan is not None:  # shards only when every rank named its pieces (the same path on every rank)
            plan["ranged"] = all(g[1] for g in got)
        return [plan] * len(got)

    plan = tier.comm.exchange([reach, want is not None], planned, timeout=tier.timeout,
                              what="memory tier resharding restore planning")
    if plan is None:
        return None
    step, epoch, world = plan["key"].split("|")
    step_i, world_i = int(step), int(world)
    local = found.get((step_i, epoch, world_i), {})
    view = os.path.join(tier_dir(tier.base, tier.run_id), f"{VIEW_PREFIX}{tier.rank}-{uuid.uuid4().hex[:8]}")
    t0 = time.perf_counter()
    err: str | None = None
    value: Any = None
    nbytes = fetched = 0
    senders: list[int] = []
    where = local
    if plan["fetch"]:
        try:
            if plan["ranged"] and want is not None:
                where, fetched, senders = reshard_fetch.fetch(tier, plan, local, want,
                                                              lambda f: _fetch_dir(tier, f, str(plan["token"])))
            else:
                where, fetched, senders = _fetch(tier, plan, local)
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - reported in the agreement: every rank falls back to storage
            err = f"rank {tier.rank} (fetching copies): {describe(e)}"
        # the host's other ranks read what its fetcher received: nobody reads before every fetch is over
        if tier.comm.exchange(err is not None, lambda got: [any(got)] * len(got), timeout=after_copy(tier.timeout),
                              what=f"memory tier resharding restore of step {step_i} (fetch results)") and err is None:
            err = f"rank {tier.rank}: another rank's fetch failed"
    t_fetch = time.perf_counter() - t0
    if err is None:
        try:
            manifest = build_view(where, view, prefer=local)
            nbytes = sum(manifest.files.values())
            value = fn(view)
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure: every rank falls back to storage
            err = f"rank {tier.rank}: {describe(e)}"
        finally:
            safefs.rmtree(view)  # links only: the copies stay
    t1 = time.perf_counter()

    def agree(got: list[Any]) -> list[Any]:
        return [[g for g in got if g is not None]] * len(got)

    errors = tier.comm.exchange(err, agree, timeout=tier.timeout, what="memory tier resharding restore (agreement)")
    if any(f[0] == tier.rank for f in plan["fetch"]):
        safefs.rmtree(_fetch_dir(tier, tier.rank, str(plan["token"])))  # every rank's view is gone: ours to remove
    if errors:
        if on_failure is not None:
            on_failure({"event": "restore_failed", "tier": "memory-reshard", "step": step_i, "error": errors[0],
                        "errors": errors[:8]})
        return None
    return TierRestore(step=step_i, value=value, url=f"{tier_dir(tier.base, tier.run_id)} (step {step_i} of "
                       f"{world_i} ranks, resharded)", source="reshard", holder=-1, tier="memory-reshard",
                       peer_ranks=sorted(set(senders)), bytes=nbytes, fetched_bytes=fetched, rank_fetch_s=t_fetch,
                       rank_load_s=t1 - t0 - t_fetch)


def clear_views(tier: TierView) -> None:
    """Remove views a killed restore of this rank left behind (hard links only)."""
    run = tier_dir(tier.base, tier.run_id)
    for name in _listdir(run):
        if name.startswith(f"{VIEW_PREFIX}{tier.rank}-"):
            safefs.rmtree(os.path.join(run, name))


__all__ = ["VIEW_PREFIX", "build_view", "plan_fetches", "run", "clear_views"]
