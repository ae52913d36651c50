"""The memory tier's restore under another layout across hosts (issue 33 item 5): only the wanted
shards cross hosts (through ``ckpt.transfer``) vs whole copies vs a resharding load from storage.

4 forked gloo ranks in 2 simulated nodes keep one memory checkpoint each of ``--size-mb`` (8
"layers", each split by rows over the ranks as tensor parallelism splits them, 3/4 of the bytes, and
a flat ZeRO-1 range of the rest) and save the same state to ``--dir`` (the storage baseline). The
tier is then split over two simulated hosts' shared memory, each holding its own node's copies only
(what a host keeps after a restart), and 2 ranks, one per host, restore it as 2 pipeline stages:
each rank wants 4 of the layers whole (half of each lies on the other host) and half of the flat
range (on its own host). Each contender runs on a fresh split, ``--repeats`` times, every restored
tensor compared bitwise with what was saved:

- ``shards``: ``CheckpointManager.restore`` (it names the pieces it wants): the stored shards they
  overlap cross hosts through ``ckpt.transfer`` (``ckpt/tier/reshard_fetch.py``), whole shards;
- ``whole copies``: ``MemoryTier.restore_resharded_with`` without ``want=``: every copy a host lacks;
- ``storage``: ``ckpt.load(..., verify=True)`` of the same target from ``--dir`` (every checksum checked,
  as the tier checks them; page cache warm: it was just written, a best case for storage);
- limit: a raw gloo send/recv between the two ranks of the bytes ``shards`` received, both ways at once.

Times are the slowest rank's wall time of the restore call (the managers are built before it); the
JSON also has the tier's split of it (``fetch_s``: the fetch; ``load_s``: the view and the load).

    python -m bench tier-reshard [--size-mb 64] [--repeats 3] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import fmt, gbps, machine_info, median, print_table
from bench.ranks import gloo_ranks

OLD, NEW = 4, 2  # ranks that saved, ranks that restore (one per simulated host)
LAYERS = 8  # tensors split by rows over the old ranks; the new ranks take half of them each, whole
METHODS = ("shards", "whole copies", "storage")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=float, default=64.0, help="memory checkpoint per old rank, MiB (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="restores per contender (default 3)")
    p.add_argument("--dir", default=None, help="disk directory for the storage baseline (default: $TMPDIR)")
    p.add_argument("--timeout", type=float, default=600.0, help="the tier's timeout, seconds (default 600)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")


def geometry(size_mb: float) -> tuple[int, int, int]:
    """(rows per old rank of each of the :data:`LAYERS` tensors, columns, flat elements per old rank)
    of float32 tensors: 3/4 of the bytes in the layers, at least one row."""
    cols = 256
    rows = max(1, int(size_mb * 2**20 * 3 / 4) // (4 * cols * LAYERS))
    flat = max(1, int(size_mb * 2**20 / 4) // 4)
    return rows, cols, flat


def _values(rank: int, rows: int, cols: int, flat: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(rows, cols, generator=g) for _ in range(LAYERS)], torch.randn(flat, generator=g)


def _saved(rank: int, rows: int, cols: int, flat: int) -> dict[str, Any]:
    """Old rank ``rank``'s state: its row block of every layer (tensor parallel) and its range of m."""
    import ckpt

    ws, m = _values(rank, rows, cols, flat)
    return {"layers": {f"w{i}": ckpt.Shard(w, (OLD * rows, cols), (rank * rows, 0)) for i, w in enumerate(ws)},
            "m": ckpt.FlatShard(m, (OLD * flat,), rank * flat), "step": 1}


def _stage(rank: int) -> range:
    per = LAYERS // NEW
    return range(rank * per, (rank + 1) * per)


def _target(rank: int, rows: int, cols: int, flat: int) -> dict[str, Any]:
    """New rank ``rank``'s state: the layers of its pipeline stage, whole, and its half of m."""
    import ckpt

    n = OLD * flat // NEW
    return {"layers": {f"w{i}": ckpt.Shard(torch.zeros(OLD * rows, cols), (OLD * rows, cols), (0, 0))
                       for i in _stage(rank)},
            "m": ckpt.FlatShard(torch.zeros(n), (OLD * flat,), rank * n), "step": 0}


def _check(rank: int, target: dict[str, Any], rows: int, cols: int, flat: int, what: str) -> None:
    n = OLD * flat // NEW
    parts = [_values(r, rows, cols, flat) for r in range(OLD)]
    ok = torch.equal(target["m"].local, torch.cat([p[1] for p in parts])[rank * n:(rank + 1) * n])
    for i in _stage(rank):
        ok = ok and torch.equal(target["layers"][f"w{i}"].local, torch.cat([p[0][i] for p in parts]))
    if not ok:
        raise AssertionError(f"rank {rank}: {what} restored other values than were saved")


def _save_rank(rank: int, world: int, shm: str, root: str, disk: str, geo: tuple[int, int, int],
               timeout: float) -> None:
    import ckpt

    state = _saved(rank, *geo)
    ckpt.save(state, disk)  # the storage baseline: the same state, one ordinary checkpoint
    mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=shm, nodes=2, memory_timeout=timeout)
    if not mgr.save_memory(1, state).result().complete:
        raise RuntimeError(f"rank {rank}: the memory checkpoint did not complete")
    # no clean end: the copies stay in shared memory, as after the job was killed


def _restore_rank(rank: int, world: int, hosts: list[str], root: str, disk: str, geo: tuple[int, int, int],
                  method: str, timeout: float, out: str) -> None:
    import torch.distributed as dist

    import ckpt

    target = _target(rank, *geo)
    rec: dict[str, Any] = {"rank": rank}
    if method == "storage":
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.load(target, disk, verify=True)  # every CRC checked, as the tier's restore checks them
        rec["seconds"] = time.perf_counter() - t0
        rec["received"] = 0
    else:
        mgr = ckpt.CheckpointManager(root, async_save=False, memory_every=1, shm_dir=hosts[rank], nodes=2,
                                     memory_timeout=timeout)
        tier = mgr.memory
        assert tier is not None
        dist.barrier()
        t0 = time.perf_counter()
        if method == "shards":
            mgr.restore(target)
            got = mgr.last_restore
        else:
            got = tier.restore_resharded_with(lambda url: tier.load_view(target, url, verify=True))
            if got is not None:
                tier.reset(None)  # as the manager does after a resharded restore
        rec["seconds"] = time.perf_counter() - t0
        if got is None or got.tier != "memory-reshard":
            raise RuntimeError(f"rank {rank}: {method}: not restored from the memory tier ({got})")
        rec["received"] = got.fetched_bytes
        rec["peers"] = got.peer_ranks
        rec["fetch_s"], rec["load_s"] = got.rank_fetch_s, got.rank_load_s
    _check(rank, target, *geo, method)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(rec, f)


def _raw_rank(rank: int, world: int, nbytes: list[int], repeats: int, out: str) -> None:
    import torch.distributed as dist

    peer = 1 - rank
    send = torch.ones(max(nbytes[rank], 1), dtype=torch.uint8)
    recv = torch.empty(max(nbytes[peer], 1), dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        reqs = [dist.isend(send, peer), dist.irecv(recv, peer)]
        for r in reqs:
            r.wait()
        times.append(time.perf_counter() - t0)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"seconds": times}, f)


def _split(shm: str, run: str, hosts: list[str]) -> None:
    """The 2-node tier in ``shm`` as two hosts' shared memory: node i's own copies in ``hosts[i]``."""
    src = Path(shm) / run
    for i, h in enumerate(hosts):
        dst = Path(h) / run
        dst.mkdir(parents=True, mode=0o700)
        os.chmod(h, 0o700)
        for p in src.iterdir():
            if p.is_file():
                shutil.copy2(p, dst / p.name)
        shutil.copytree(src / f"node-{i}", dst / f"node-{i}", ignore=shutil.ignore_patterns("replicas", ".slots"))


def _results(out: str) -> list[dict[str, Any]]:
    return [json.loads((Path(out) / f"{r}.json").read_text()) for r in range(NEW)]


def run(size_mb: float, repeats: int, disk_dir: str | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """Save on 4 ranks, then restore on 2 ranks (one per simulated host) by each method; the figures."""
    from ckpt.tier.nodes import run_id_for

    geo = geometry(size_mb)
    base = tempfile.mkdtemp(prefix="ckpt-bench-tier-reshard-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    disk = tempfile.mkdtemp(prefix="ckpt-bench-tier-reshard-disk-", dir=disk_dir)
    try:
        shm, root, plain = os.path.join(base, "shm"), os.path.join(disk, "ckpts"), os.path.join(disk, "plain")
        os.mkdir(shm, 0o700)
        gloo_ranks(OLD, _save_rank, shm, root, plain, geo, timeout)
        run_dir = f"ckpt-{run_id_for(root)}"
        per: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in METHODS}
        for rep in range(repeats):
            for method in METHODS:
                hosts = [os.path.join(base, f"{method[:5]}-{rep}-host-{h}") for h in "ab"]
                if method != "storage":
                    _split(shm, run_dir, hosts)
                out = tempfile.mkdtemp(dir=base)
                gloo_ranks(NEW, _restore_rank, hosts, root, plain, geo, method, timeout, out)
                per[method].append(_results(out))
                for h in hosts:
                    shutil.rmtree(h, ignore_errors=True)
        received = [per["shards"][0][r]["received"] for r in range(NEW)]
        out = tempfile.mkdtemp(dir=base)
        gloo_ranks(NEW, _raw_rank, received, repeats, out)
        raw = median([max(x) for x in zip(*(_results(out)[r]["seconds"] for r in range(NEW)), strict=True)])
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    rows = {m: {"seconds": median([max(r["seconds"] for r in rep) for rep in per[m]]),
                # the tier's own split of its restore (slowest rank): fetching, then building the view and loading
                "fetch_s": median([max(r.get("fetch_s", 0.0) for r in rep) for rep in per[m]]),
                "load_s": median([max(r.get("load_s", 0.0) for r in rep) for rep in per[m]]),
                "received_per_rank": [per[m][0][r]["received"] for r in range(NEW)],
                "peers": [per[m][0][r].get("peers", []) for r in range(NEW)]} for m in METHODS}
    nbytes = OLD * (LAYERS * geo[0] * geo[1] + geo[2]) * 4
    return {"size_mb_per_old_rank": size_mb, "state_bytes": nbytes, "repeats": repeats, "methods": rows,
            "raw_gloo_seconds": raw, "raw_gloo_bytes_per_rank": received, "verified": True}


def main(args: argparse.Namespace) -> int:
    res = run(args.size_mb, args.repeats, args.dir, args.timeout)
    res["machine"] = machine_info(args.dir or tempfile.gettempdir())
    shards = res["methods"]["shards"]["seconds"]
    table = []
    for m in METHODS:
        r = res["methods"][m]
        moved = max(r["received_per_rank"])
        table.append([m, fmt(r["seconds"], 4), f"{moved:,}", fmt(gbps(moved, r["seconds"]), 2) if moved else "-",
                      fmt(r["seconds"] / shards, 2)])
    raw = res["raw_gloo_seconds"]
    table.append(["limit: raw gloo send/recv of the shards' bytes", fmt(raw, 4),
                  f"{max(res['raw_gloo_bytes_per_rank']):,}", fmt(gbps(max(res['raw_gloo_bytes_per_rank']), raw), 2),
                  fmt(raw / shards, 2)])
    print_table(f"memory tier restore on {NEW} ranks (one per host) of {OLD} ranks' copies, "
                f"{res['state_bytes'] / 2**20:.0f} MiB in all, as 2 pipeline stages; medians of {args.repeats}, "
                "every restore checked bitwise",
                ["method", "seconds (slowest rank)", "bytes received per rank (max)", "GB/s", "x shards' time"], table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0
