"""The memory tier (issue 18): restore speed, recovery after a kill, peer fetch, training slowdown.

Four measurements, each with its peer or physical limit measured in the same run:

1. **peer copy** (``--peer-ranks`` forked gloo ranks in 2 simulated nodes, CPU; each rank sends its
   memory checkpoint of ``--size-gb`` to a rank of the other node and keeps one, all at once) by the
   tier's transfer (``ckpt.tier.transfer.exchange``): the same-host path (the peer reads the files
   on several threads straight into its reused slot, every piece's CRC checked: ckpt.tier.localcopy)
   vs the streamed gloo path (mapped files, 64 MiB messages into the reused slot), both linked and
   committed manifest last; limits in the same run: a raw gloo send/recv and a memcpy of the same
   bytes on as many threads as the same-host copy.
2. **recovery** (``ckpt train`` through the launcher, 2 ranks in 2 simulated nodes, CPU unless
   ``--device cuda`` finds 2 GPUs): node 1 is lost (its ranks SIGKILLed, its shared memory deleted)
   at ``--fail-at``; the same run with and without the memory tier, side by side, from the
   ``recovery`` records (detect, restart, restore, first step) plus the steps lost, redone at the
   median step time. Steps before the failure give the **step slowdown** with the tier on
   (``--memory-every 1``) vs off, and the training thread's stall per memory checkpoint.
3. **restore** (one process, ``--device``): the newest memory checkpoint (own copy in shared memory,
   every checksum checked) vs ``ckpt.load`` of the same state from disk, warm and cold, into the
   same preallocated tensors; the limit is host-to-device bandwidth (pinned and pageable) on a GPU,
   a memcpy into touched memory on CPU. The tier's restore is measured as a restarted process does
   it (a new tier object: nothing mapped), with and without ``pin_ahead`` first (its time reported
   apart: the trainer hides it behind the model build), and in the process that saved.
4. **snapshot** (one process, ``--device``): a synthetic training step (matmuls for about
   ``--step-ms``, then an in-place update of the whole state, then a sync of the training stream as
   ``loss.item()`` does) with ``save_async(..., deferred=True)`` of the ``--size-gb`` state every
   step vs without (``handle.staged()`` before the update, as the trainer does); the training
   thread's stall (waiting for the previous one + the snapshot) and the background time per memory
   checkpoint. The first two memory checkpoints (they allocate and pin the slots) are not timed.

    python -m bench memory-tier [--size-gb 0.25] [--device cpu|cuda] [--dtype mixed|bf16] [--repeats 3] [--json FILE]
        [--only peer,recovery,restore,snapshot] [--peer-ranks 2] [--peer-threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

import torch

from bench.common import GB, fmt, gbps, machine_info, median, print_table

PARTS = ("peer", "recovery", "restore", "snapshot")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=0.25, help="state size in GiB (default 0.25; 8 on an H100)")
    p.add_argument("--tensors", type=int, default=64, help="tensors in the state (default 64)")
    p.add_argument("--dtype", choices=("mixed", "bf16"), default="mixed",
                   help="the state's tensors for 'restore' and 'snapshot': fp32 and bf16 alternating (default), or "
                        "all bf16 (the same shapes in bytes)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    p.add_argument("--repeats", type=int, default=3, help="repeats per contender (default 3)")
    p.add_argument("--steps", type=int, default=24, help="training steps of each recovery run (default 24)")
    p.add_argument("--fail-at", type=int, default=17, help="step at which node 1 is lost (default 17)")
    p.add_argument("--save-every", type=int, default=10, help="persistent save interval (default 10)")
    p.add_argument("--step-ms", type=float, default=300.0, help="synthetic step length for 'snapshot' (ms)")
    p.add_argument("--matmul", type=int, default=512, help="matrix size of the synthetic step's matmuls (default 512: "
                   "many small kernels, launch-bound on a GPU; 4096: a few large ones, GPU-bound as LLM steps are)")
    p.add_argument("--peer-ranks", type=int, default=2, help="ranks of 'peer' (2 simulated nodes; 4 on a 4-GPU host)")
    p.add_argument("--peer-threads", type=int, default=None,
                   help="copy threads per rank for 'peer' (default: the tier's, the CPUs shared by the ranks, <= 16)")
    p.add_argument("--dir", default=None, help="disk directory for persistent checkpoints (default: $TMPDIR)")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no GPU here; measuring on CPU")
        name = "cpu"
    return torch.device(name)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _state(size_gb: float, n_tensors: int, dtype: str, dev: torch.device) -> dict[str, torch.Tensor]:
    """``bench.save_load.make_state`` on ``dev``; with ``dtype="bf16"`` its fp32 tensors become bf16
    ones of the same bytes (twice the columns), so both kinds of state have the same sizes."""
    from bench.save_load import make_state

    state = make_state(int(size_gb * (1 << 30)), n_tensors)
    if dtype == "bf16":
        g = torch.Generator().manual_seed(1)
        state = {k: (v if v.dtype == torch.bfloat16 else
                     torch.randn(*v.shape[:-1], 2 * v.shape[-1], generator=g, dtype=torch.bfloat16))
                 for k, v in state.items()}
    return {k: v.to(dev) for k, v in state.items()}


def _shm_base() -> str:
    return tempfile.mkdtemp(prefix="ckpt-bench-tier-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


# --- 1. peer fetch -------------------------------------------------------------------------------

def _memcpy(dst: torch.Tensor, src: torch.Tensor, threads: int) -> None:
    """``dst.copy_(src)`` cut in ``threads`` contiguous parts copied at once (each copy releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    n = src.numel()
    step = -(-n // max(1, threads))
    parts = [(o, min(n, o + step)) for o in range(0, n, step)]
    with ThreadPoolExecutor(max_workers=len(parts)) as pool:
        list(pool.map(lambda p: dst[p[0]:p[1]].copy_(src[p[0]:p[1]]), parts))


def _peer_rank(rank: int, world: int, shm: str, nbytes: int, n_tensors: int, repeats: int, out: str,
               threads: int) -> None:
    import torch.distributed as dist

    import ckpt
    from bench.save_load import make_state
    from ckpt._comm import side_group
    from ckpt.tier import safefs
    from ckpt.tier.slots import SlotPool, raw_layout
    from ckpt.tier.store import remove_step
    from ckpt.tier.transfer import exchange, package

    torch.set_num_threads(1)
    run = safefs.trust_root(os.path.join(shm, "ckpt-bench"), create=True)  # (the tier's run directory: 0700, ours)
    half = world // 2  # two simulated nodes, as the tier maps them: rank r keeps the copy of rank r - half
    to, frm, node = (rank + half) % world, (rank - half) % world, rank // half
    src = os.path.join(run, f"node-{node}", f"rank-{rank}", "step-1")
    safefs.makedirs(os.path.dirname(src))
    ckpt.save(make_state(nbytes, n_tensors, seed=rank), src, group=side_group([rank], "bench-self"))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    a = torch.ones(max(nbytes, 1), dtype=torch.uint8)  # touched: the limits are the transport and memory,
    b = torch.zeros(max(nbytes, 1), dtype=torch.uint8)  # not page faults
    # the receiver keeps the copy as the tier does: into a reused slot, then linked
    pool = SlotPool(os.path.join(run, f"node-{node}", "replicas", f"rank-{frm}"), 2)
    paths = {"local": {"local": {to}, "run_dir": run, "threads": threads}, "gloo": {}}
    times: dict[str, list[float]] = {k: [] for k in ("local", "gloo", "raw", "memcpy")}

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def copy(opts: dict[str, Any], dest: str) -> float:
        got: dict[int, Any] = {}
        t = timed(lambda: got.update(exchange(
            dist.group.WORLD, {to: package(src, "bench")}, {frm: dest}, rank=rank, timeout=600, what="bench peer copy",
            slots=lambda _owner, n: pool.acquire(raw_layout(n), pin=False), **opts)))
        assert got[frm].ok, got[frm].err
        return t

    for r in range(repeats + 1):  # round 0 allocates the slots and touches every page: not timed
        for name, opts in paths.items():
            dest = os.path.join(run, f"node-{node}", "replicas", f"rank-{frm}", f"step-{name}-{r}")
            t = copy(opts, dest)
            if r == 0:
                assert ckpt.verify(dest, deep=True).ok, f"the {name} copy does not verify"
            else:
                times[name].append(t)
            remove_step(dest)

        def raw() -> None:
            works = [dist.isend(a, dst=to), dist.irecv(b, src=frm)]
            for w in works:
                w.wait()

        t_raw, t_mem = timed(raw), timed(lambda: _memcpy(b, a, threads))
        if r:
            times["raw"].append(t_raw)
            times["memcpy"].append(t_mem)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bytes": size, "raw_bytes": nbytes, "ranks": world, "threads": threads,
                       **{f"{k}_s": v for k, v in times.items()}}, f)
    dist.destroy_process_group()


def run_peer(size_gb: float, n_tensors: int, repeats: int, ranks: int = 2, threads: int | None = None
             ) -> dict[str, Any]:
    """Replication of one rank's memory checkpoint to a rank of the other simulated node, on ``ranks``
    forked ranks at once (each sends one copy and keeps one): the same-host path (the peer reads the
    files, CRCs checked) vs the streamed gloo path, with a raw gloo send/recv and a memcpy of the same
    bytes (``threads`` threads, as the same-host copy uses) in the same run as limits."""
    from bench.ranks import gloo_ranks
    from ckpt.tier.localcopy import threads_for

    if ranks < 2 or ranks % 2:
        raise SystemExit(f"--peer-ranks {ranks}: use an even number >= 2 (two simulated nodes)")
    threads = threads or threads_for(ranks)
    base = _shm_base()
    try:
        out = os.path.join(base, "peer.json")
        gloo_ranks(ranks, _peer_rank, base, int(size_gb * (1 << 30)), n_tensors, repeats, out, threads)
        with open(out) as f:
            res: dict[str, Any] = json.load(f)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for k in ("local", "gloo"):
        res[f"{k}_gbps"] = gbps(res["bytes"], median(res[f"{k}_s"]))
    for k in ("raw", "memcpy"):
        res[f"{k}_gbps"] = gbps(res["raw_bytes"], median(res[f"{k}_s"]))
    for k in ("local", "gloo", "raw"):
        res[f"{k}_vs_memcpy"] = res[f"{k}_gbps"] / res["memcpy_gbps"]
    res["local_vs_gloo"] = res["local_gbps"] / res["gloo_gbps"]
    rows = [[label, fmt(median(res[f"{k}_s"]), 3), fmt(res[f"{k}_gbps"]), fmt(res[f"{k}_gbps"] / res["memcpy_gbps"])
             + "x"] for k, label in (
        ("local", f"same host: the peer reads the files ({threads} threads, CRCs checked) (new)"),
        ("gloo", "gloo stream: mapped files -> peer's reused slot (old)"),
        ("raw", "raw gloo send/recv of the same bytes"),
        ("memcpy", f"memcpy of the same bytes ({threads} threads; the limit)"))]
    print_table(f"peer copy of {res['bytes'] / GB:.2f} GB per rank, {ranks} ranks at once (median of {repeats}); "
                f"new path {res['local_vs_gloo']:.1f}x the old", ["path", "s", "GB/s per rank", "vs memcpy"], rows)
    return res


# --- 2. recovery and step slowdown ---------------------------------------------------------------

def _train_run(base: str, name: str, args: argparse.Namespace, device: str, busy: str | None) -> dict[str, Any]:
    from ckpt.layout import Layout
    from ckpt.trainer.config import TrainConfig
    from ckpt.trainer.launch import launch
    from ckpt.trainer.metrics import read_metrics

    cfg = TrainConfig(steps=args.steps, save_every=args.save_every, ckpt_dir=os.path.join(base, name),
                      fail_at_step=args.fail_at, fail_node=1, nodes=2, memory_every=1 if busy else None,
                      memory_busy=busy or "wait",
                      shm_dir=os.path.join(base, "shm"), run_id=f"bench-{name}", device=device)
    t0 = time.perf_counter()
    restarts = launch(cfg, Layout(dp=2), max_restarts=1, log=os.path.join(base, f"{name}.log"))
    wall = time.perf_counter() - t0
    recs = read_metrics(cfg.metrics_file or "")
    rec = next(r for r in recs if r.get("event") == "recovery")
    # steps of the first attempt before the failure, without a persistent save and past warm-up
    first: list[dict[str, Any]] = []
    for r in recs:
        if r.get("event") == "attempt_end":
            break
        if "loss" in r and "event" not in r and r["step"] > 2 and r["step"] % args.save_every:
            first.append(r)
    step_ms = median([r["step_ms"] for r in first])
    mem = [r for r in recs if r.get("event") == "memory_checkpoint"]
    before = [r for r in mem if r["step"] < args.fail_at]
    return {"memory_checkpoints_before_failure": len(before), "restarts": restarts, "wall_s": wall,
            "recovery": rec, "step_ms": step_ms,
            "steps": [r["step_ms"] for r in first], "stall_ms": median([r["ckpt_stall_ms"] for r in first]),
            "memory": {k: median([r[k] for r in mem]) for k in ("wait_ms", "snapshot_ms", "write_ms",
                                                                "replicate_ms", "agree_ms")} if mem else {},
            "redo_ms": rec.get("steps_lost", 0) * step_ms}


def run_recovery(args: argparse.Namespace) -> dict[str, Any]:
    dev = "cuda" if args.device == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
    base = tempfile.mkdtemp(prefix="ckpt-bench-recovery-", dir=args.dir)
    try:
        runs = {"storage only": _train_run(base, "off", args, dev, None),
                "memory tier, busy=wait": _train_run(base, "wait", args, dev, "wait"),
                "memory tier, busy=skip": _train_run(base, "skip", args, dev, "skip")}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    for name, r in runs.items():
        rec = r["recovery"]
        back = rec.get("total_ms", 0) + r["redo_ms"]
        r["back_to_failure_ms"] = back
        rows.append([name, rec["tier"], str(rec["step"]), str(rec.get("steps_lost", "-")),
                     fmt(rec.get("detect_ms", 0), 0), fmt(rec.get("restart_ms", 0), 0), fmt(rec["restore_ms"], 1),
                     fmt(rec["first_step_ms"], 1),
                     fmt(rec.get("total_ms", 0), 0), fmt(r["redo_ms"], 0), fmt(back, 0)])
    print_table(f"recovery after losing node 1 at step {args.fail_at} (2 ranks, 2 simulated nodes, {dev}; ms)",
                ["run", "restored from", "step", "lost", "detect", "restart", "restore", "1st step", "total",
                 "redo lost", "back at failure"], rows)
    off = runs["storage only"]
    slow: dict[str, Any] = {"step_ms_off": off["step_ms"]}
    rows = [["no memory tier", fmt(off["step_ms"], 1), fmt(off["stall_ms"], 2), "1.00x", "-", "-", "-"]]
    for name in ("memory tier, busy=wait", "memory tier, busy=skip"):
        on = runs[name]
        m = on["memory"]
        slow[name] = {"step_ms": on["step_ms"], "ratio": on["step_ms"] / off["step_ms"], "stall_ms": on["stall_ms"],
                      "memory_checkpoints": on["memory_checkpoints_before_failure"], "background": m}
        bg = m.get("write_ms", 0) + m.get("replicate_ms", 0) + m.get("agree_ms", 0)
        rows.append([name.replace("memory tier, ", "memory-every 1, "), fmt(on["step_ms"], 1), fmt(on["stall_ms"], 2),
                     fmt(on["step_ms"] / off["step_ms"], 3) + "x", str(on["memory_checkpoints_before_failure"]),
                     fmt(m.get("snapshot_ms", 0), 2), fmt(bg, 1)])
    print_table(f"training step, memory checkpoint due every step vs no tier (steps 3-{args.fail_at - 1} of the "
                "first attempt, persistent-save steps left out; medians)",
                ["run", "step ms", "stall ms", "vs off", f"memory ckpts of {args.fail_at - 1} steps", "snapshot ms",
                 "background ms"], rows)
    return {"device": dev, "runs": runs, "slowdown": slow}


# --- 3. restore ----------------------------------------------------------------------------------

def _limit(nbytes: int, dev: torch.device) -> dict[str, float]:
    if dev.type == "cuda":
        from bench.gpu_io import h2d_gbps

        return {"h2d_pinned_gbps": h2d_gbps(nbytes, True), "h2d_pageable_gbps": h2d_gbps(nbytes, False)}
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return {"memcpy_gbps": gbps(nbytes, median(times))}


def run_restore(size_gb: float, n_tensors: int, repeats: int, dev: torch.device, disk: str | None,
                dtype: str = "mixed") -> dict[str, Any]:
    import ckpt
    from bench.gpu_io import evict
    from bench.save_load import state_bytes
    from ckpt.tier import MemoryTier, TierConfig

    state = _state(size_gb, n_tensors, dtype, dev)
    nbytes = state_bytes(state)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    shm, tmp = _shm_base(), tempfile.mkdtemp(prefix="ckpt-bench-restore-", dir=disk)
    url = os.path.join(tmp, "persistent")
    # The tier checks every piece's CRC on restore: ckpt.load is measured with and without that check.
    # "after a restart": a new tier object over the same shared memory, as a restarted process has
    # (nothing of this one's mapped); pinned ahead = MemoryTier.pin_ahead() first, timed apart
    # ("pin ahead" row), as the trainer does while it builds the model; not pinned = the pread path.
    # "same process": the tier that saved, whose slot its snapshot mapped and pinned.
    restart_pinned, restart_pread = "memory tier after a restart, pinned ahead", "memory tier after a restart, pread"
    times: dict[str, list[float]] = {restart_pinned: [], restart_pread: [], "memory tier, same process": [],
                                     "ckpt.load warm, CRC checked": [], "ckpt.load warm": [],
                                     "ckpt.load cold, CRC checked": []}
    pin_s: list[float] = []
    cfg = TierConfig(tmp, run_id="bench-restore", shm_dir=shm, replicas=0)
    try:
        tier = MemoryTier(cfg)
        tier.reset(None)
        assert tier.save(1, state).complete
        ckpt.save(state, url)
        limit = _limit(nbytes, dev)
        for r in range(-1, repeats):  # r = -1: one untimed warm-up of each (thread pools, first-call costs)
            order = list(times) if r % 2 == 0 else list(times)[::-1]
            for name in order:
                for v in target.values():
                    v.zero_()
                if "cold" in name:
                    evict(url)
                fresh = tier
                if "restart" in name:  # a new job: the old one gives the run id back first (one job per run id)
                    tier.close()
                    fresh = MemoryTier(cfg)
                if name == restart_pinned:
                    t0 = time.perf_counter()
                    fresh.pin_ahead(dev)
                    fresh.drain()
                    if r >= 0:
                        pin_s.append(time.perf_counter() - t0)
                _sync(dev)
                t0 = time.perf_counter()
                if name.startswith("memory"):
                    got = fresh.restore(target)
                    assert got is not None and got.step == 1
                else:
                    ckpt.load(target, url, verify="CRC" in name)
                _sync(dev)
                if r >= 0:
                    times[name].append(time.perf_counter() - t0)
                if r == 0:
                    assert all(torch.equal(target[k], state[k]) for k in state), f"{name}: not bitwise equal"
                if fresh is not tier:
                    fresh.close()
                    tier = MemoryTier(cfg)
        tier.clear()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    lim = limit.get("h2d_pinned_gbps", limit.get("memcpy_gbps", float("nan")))
    res: dict[str, Any] = {"bytes": nbytes, "device": str(dev), "limit": limit, "times": times,
                           "median_s": {k: median(v) for k, v in times.items()}}
    res["gbps"] = {k: gbps(nbytes, s) for k, s in res["median_s"].items()}
    res["vs_limit"] = {k: g / lim for k, g in res["gbps"].items()}
    lname = "pinned H2D" if dev.type == "cuda" else "memcpy"
    res["pin_ahead_s"] = median(pin_s)
    rows = [[k, fmt(res["median_s"][k], 3), fmt(res["gbps"][k]), fmt(res["vs_limit"][k]) + "x"] for k in times]
    rows.append(["pin ahead (before the restore above; hidden by the model build in the trainer)",
                 fmt(res["pin_ahead_s"], 3), fmt(gbps(nbytes, res["pin_ahead_s"])), ""])
    rows.append([f"{lname} (limit)", fmt(nbytes / GB / lim, 3), fmt(lim), "1.00x"])
    print_table(f"restore of {nbytes / GB:.2f} GB into {dev} tensors (median of {repeats})",
                ["source", "s", "GB/s", f"vs {lname}"], rows)
    return res


# --- 4. snapshot: the training thread's stall ----------------------------------------------------

def run_snapshot(size_gb: float, n_tensors: int, repeats: int, dev: torch.device, step_ms: float,
                 matmul: int = 512, dtype: str = "mixed") -> dict[str, Any]:
    """Four contenders in alternating blocks of 5 steps, ``repeats`` blocks each: no memory
    checkpoint ("off"); the same device-to-host copies of the state with no ckpt code ("copies":
    into preallocated pinned buffers on a side stream, fenced before the update as the tier's are;
    the physical cost of moving the bytes every step); the copies, then their CRC32 on the tier's
    thread count ("copies+crc": what verifying them costs, with no ckpt code); ``save_async`` ("on").
    Besides the medians of all steps, each block is compared with the "off" block of its own repeat
    (paired ratios): the GPU's clocks drift by more than the effect over a run, and neighbouring
    blocks share it."""
    from bench.save_load import state_bytes
    from ckpt._checksum import crc32_parallel
    from ckpt._io import byte_view
    from ckpt.tier import MemoryTier, TierConfig
    from ckpt.tier.fastload import workers_for_restore
    from ckpt.tier.inplace import CRC_NICE

    state = _state(size_gb, n_tensors, dtype, dev)
    a = torch.randn(matmul, matmul, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    a /= matmul ** 0.5  # keeps x @ a bounded step after step
    cuda = dev.type == "cuda"

    def work(n: int) -> None:
        x = a
        for _ in range(n):
            x = torch.tanh(x @ a)
        if cuda:  # what loss.item() does: the training stream, not the tier's copy stream
            torch.cuda.current_stream(dev).synchronize()

    work(4)
    t0 = time.perf_counter()
    work(20)
    per = (time.perf_counter() - t0) / 20
    n = max(1, round(step_ms / 1e3 / per))
    bufs = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in state.items()}
    stream = torch.cuda.Stream(dev) if cuda else None

    def raw_copies() -> Any:
        """The copies alone: what any memory checkpoint of this state must move (GPU: returns the event
        the next update waits for; CPU: copies at once, as the tier's snapshot does)."""
        if stream is None:
            for k, v in state.items():
                bufs[k].copy_(v)
            return None
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for k, v in state.items():
                bufs[k].copy_(v, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    crc_threads = max(1, workers_for_restore() // 2)  # as the tier's background uses
    checksums: list[Any] = []

    def raw_checksums(ev: Any) -> None:
        """The checksums alone: once the copies landed, a thread CRCs the buffers on the tier's thread
        count (niced, as the tier's are); the next step's copies wait for it."""
        def run() -> None:
            if ev is not None:
                ev.synchronize()
            crc32_parallel([byte_view(b) for b in bufs.values()], crc_threads, nice=CRC_NICE)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        checksums.append(t)

    modes = ("off", "copies", "copies+crc", "on")
    shm = _shm_base()
    steps: dict[str, list[float]] = {m: [] for m in modes}
    blocks: list[dict[str, float]] = []
    stalls: list[float] = []
    records: list[dict[str, Any]] = []
    try:
        tier = MemoryTier(TierConfig(shm, run_id="bench-snapshot", shm_dir=shm, replicas=0))
        tier.reset(None)
        step = 0
        per_block = 5
        for _ in range(2):  # untimed: the first two memory checkpoints allocate (and pin) the slots
            step += 1
            tier.save(step, state)
        raw_copies()
        _sync(dev)
        for r in range(repeats):
            block: dict[str, float] = {}
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                h = None
                fence = None
                times = []
                for _ in range(per_block):
                    t0 = time.perf_counter()
                    work(n)  # forward and backward: reads the state
                    if h is not None:
                        h.staged()  # the update below waits for the previous snapshot's copies (GPU side)
                    if fence is not None:
                        torch.cuda.current_stream(dev).wait_event(fence)
                    for v in state.values():  # the optimizer's in-place update
                        v.add_(1)
                    if mode == "on":
                        step += 1
                        t1 = time.perf_counter()
                        h = tier.save_async(step, state, deferred=True)  # its copies overlap the next work
                        stalls.append(time.perf_counter() - t1)
                    elif mode.startswith("copies"):
                        for t in checksums:
                            t.join()
                        checksums.clear()
                        fence = raw_copies()
                        if mode == "copies+crc":
                            raw_checksums(fence)
                    if cuda:
                        torch.cuda.current_stream(dev).synchronize()
                    times.append(time.perf_counter() - t0)
                if h is not None:
                    records.append(h.result().to_record())  # between blocks: none in flight while "off" runs
                for t in checksums:
                    t.join()
                checksums.clear()
                _sync(dev)
                steps[mode] += times
                block[mode] = median(times)
            blocks.append(block)
        tier.clear()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    nbytes = state_bytes(state)
    med = {m: median(steps[m]) for m in modes}
    paired = {m: sorted(b[m] / b["off"] for b in blocks) for m in modes[1:]}
    bg = median([r["write_ms"] + r["agree_ms"] for r in records])
    res = {"bytes": nbytes, "device": str(dev), "matmul": matmul, "matmuls_per_step": n, "step_s": steps,
           "blocks": blocks, "paired_ratio": {m: median(v) for m, v in paired.items()},
           "median_s": med, "median_off_s": med["off"], "median_on_s": med["on"],
           "ratio": med["on"] / med["off"], "stall_s": stalls,
           "median_stall_s": median(stalls), "background_ms": bg, "records": records}

    threads = f"{crc_threads} thread" + ("s" if crc_threads > 1 else "")

    def row(name: str, m: str, stall: str) -> list[str]:
        got = paired.get(m, [1.0])
        lo, hi, ratio = got[0], got[-1], median(got)
        return [name, fmt(med[m] * 1e3, 1), stall, fmt(med[m] / med["off"], 3) + "x",
                f"{ratio:.3f}x ({lo:.3f}-{hi:.3f})"]

    print_table(f"synthetic step (~{step_ms:.0f} ms of {n} {matmul}x{matmul} matmuls on {dev}) with save_async of "
                f"{nbytes / GB:.2f} GB every step "
                f"(median of {len(steps['on'])} steps; paired: median of {repeats} blocks' ratios to the "
                f"'off' block beside them, range)", ["run", "step ms", "stall ms", "vs off", "paired vs off"],
                [row("no memory checkpoint", "off", "-"),
                 row("the copies alone (no ckpt code: the limit)", "copies", "-"),
                 row(f"the copies, then their CRC32 on {threads} (no ckpt code)", "copies+crc", "-"),
                 row("save_async every step", "on", fmt(median(stalls) * 1e3, 2))])
    print(f"background write + agreement per memory checkpoint: median {bg:.1f} ms; "
          f"stdev of the off steps {statistics.pstdev(steps['off']) * 1e3:.1f} ms")
    return res


def main(args: argparse.Namespace) -> int:
    parts = [p for p in args.only.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(f"--only: unknown part(s) {bad}; choose from {', '.join(PARTS)}")
        return 2
    out: dict[str, Any] = {"size_gb": args.size_gb, "tensors": args.tensors, "repeats": args.repeats,
                           "dtype": args.dtype, "machine": machine_info(args.dir or tempfile.gettempdir())}
    t0 = time.perf_counter()
    # the forked and launched parts first: the parent stays CUDA-free until then
    if "peer" in parts:
        out["peer"] = run_peer(args.size_gb, args.tensors, args.repeats, args.peer_ranks, args.peer_threads)
    if "recovery" in parts:
        out["recovery"] = run_recovery(args)
    dev = _device(args.device)
    out["device"] = str(dev)
    if "restore" in parts:
        out["restore"] = run_restore(args.size_gb, args.tensors, args.repeats, dev, args.dir, args.dtype)
    if "snapshot" in parts:
        out["snapshot"] = run_snapshot(args.size_gb, args.tensors, args.repeats, dev, args.step_ms, args.matmul,
                                       args.dtype)
    out["wall_s"] = time.perf_counter() - t0
    print(f"done in {out['wall_s']:.0f} s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0
