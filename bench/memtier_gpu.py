"""The memory tier on N GPUs (NCCL) as 2 simulated nodes, issue 20 part 2: what ``--memory-every 1``
costs per step at >= 8 GB of state per GPU, and a lost node recovered from peer copies against a
restore from persistent storage, with the host-to-device bandwidth of the same machine as the limit.

Two runs of the embedded trainer (``--config 800m``: 782M parameters; under ``dp=4,zero=0`` each GPU
holds fp32 weights, gradients and AdamW moments, 12.5 GB, and checkpoints 9.4 GB of it), each started
through torchrun by a restart loop like ``ckpt train``'s (``--launcher fork`` forks the ranks instead,
for quick CPU runs), same steps, same synchronous persistent saves every ``--save-every`` steps, node 1
(ranks 2 and 3) lost after ``--fail-at`` steps (``fail_node``: its memory-tier directory deleted, its ranks
SIGKILLed), then restarted:

- **storage**: no memory tier; the restart restores the newest persistent checkpoint. Between the
  attempts the checkpoint files are evicted from the page cache (``drop_caches`` as root, else
  ``posix_fadvise(DONTNEED)`` per file after an fsync), so the restore reads the disk;
- **memory**: ``--memory-every 1`` with 1 peer copy, ``--memory-busy wait`` (the trainer's default:
  a memory checkpoint due while the previous one still runs waits for it); the restart restores the
  newest memory checkpoint, node 1's ranks fetching their pieces from node 0's copies (``tier:
  memory-peer``). ``--memory-busy wait,skip`` adds a run with ``skip`` (a checkpoint due while the
  previous one runs is skipped: no waiting, fewer memory checkpoints, more steps lost).

Figures (from the trainer's metrics file: ``step_ms`` per step, ``memory_checkpoint`` and
``recovery`` records):

- **step time**: median ``step_ms`` of attempt 0's steps, the first step and those with a persistent
  save left out; also of their later half (``step_ms_late``: past the first memory checkpoints,
  which allocate, map and pin their slots: use ``--steps 24`` or more to see the settled cost).
  The memory tier copies each rank's pieces into host buffers on the training thread
  (``snapshot_ms``) and writes them to ``/dev/shm``, copies them to the peer node and agrees in the
  background (``write_ms``, ``replicate_ms``); the step pays the snapshot plus, with ``busy=wait``,
  the wait for the previous checkpoint (``ckpt_stall_ms``). Slowdown = memory / storage. The
  simulated nodes share the host, so each copy is read by the peer from the sender's files
  (``ckpt.tier.localcopy``; ``replicate GB/s per rank``); ``CKPT_TIER_LOCAL_COPY=0`` in the
  environment streams it through gloo instead, as before.
- **recovery**: ``restart_ms`` (the restart loop seeing the attempt end -> the restore starting:
  process start, imports, process group, model build), ``restore_ms``, ``first_step_ms``;
  restart-to-next-step = their sum (``total_ms - detect_ms``); ``steps_lost``; rank 0's
  ``pin_ahead_ms`` (mapping and pinning its newest memory step while the model is built) and the part
  of it the restore waited for (``pin_ahead_wait_ms``, inside ``restore_ms``); restore bandwidth =
  the bytes all ranks restored / ``restore_ms`` / ranks, against the pinned host-to-device copy
  bandwidth of one GPU measured in the same run (``--h2d-gib``; on CPU a memcpy of the same size).

    python -m bench memtier-gpu --device cuda --ranks 4 --json memtier_gpu.json    # 4 GPUs, ~3-4 min
    python -m bench memtier-gpu --device cpu --quick --launcher fork              # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

from bench.common import drop_caches, fmt, machine_info, median, print_tables, write_json_atomic
from bench.ranks import fork_ranks, in_child, nccl_version


def bandwidth(device: str, nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """Pinned host -> device (and back) copy bandwidth of one GPU, or memcpy bandwidth on CPU; GB/s."""
    import torch

    n = max(nbytes // 4, 1)
    out: dict[str, Any] = {"bytes": n * 4, "device": device}
    if device == "cuda":
        dev = torch.device("cuda", 0)
        host = torch.ones(n, dtype=torch.float32).pin_memory()
        gpu = torch.empty(n, dtype=torch.float32, device=dev)
        times, back = [], []
        for _ in range(repeats + 1):
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            gpu.copy_(host, non_blocking=True)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            host.copy_(gpu, non_blocking=True)
            torch.cuda.synchronize(dev)
            back.append(time.perf_counter() - t)
        out.update(h2d_gbps=n * 4 / median(times[1:]) / 1e9, d2h_gbps=n * 4 / median(back[1:]) / 1e9,
                   gpu=torch.cuda.get_device_name(dev), gpus=torch.cuda.device_count(), torch=torch.__version__,
                   cuda=torch.version.cuda, nccl=nccl_version())
        return out
    a, b = torch.ones(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    out.update(memcpy_gbps=n * 4 / median(times[1:]) / 1e9, torch=torch.__version__)
    return out


def evict(root: str) -> dict[str, Any]:
    """Get ``root``'s files out of the page cache: drop_caches when allowed, else fsync + fadvise."""
    t = time.perf_counter()
    why = drop_caches()
    how = "drop_caches"
    if why is not None:
        how = "fadvise"
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                try:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return {"how": how, "seconds": round(time.perf_counter() - t, 3), "drop_caches_refused": why}


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field in bytes (0 when absent)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def own_tmpfs(size: int) -> str | None:
    """A private tmpfs of ``size`` bytes mounted under the temporary directory (root only), for a host
    whose /dev/shm is smaller than the memory tier needs (sized at boot from a small MemTotal, as on
    VMs whose memory grows as it is used); None when it cannot be mounted."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    d = tempfile.mkdtemp(prefix="ckpt-bench-memtier-tmpfs-")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "ckpt-bench", d], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        os.rmdir(d)
        print(f"  could not mount a tmpfs: {done.stderr.strip()}", flush=True)
        return None
    return d


def pretouch(d: str, nbytes: int, threads: int = 8) -> float:
    """Write ``nbytes`` of zeros into files under ``d`` (a tmpfs) and delete them: on a VM whose memory
    grows as it is first used (a few GB/s), that growth is paid here and not inside the timed steps."""
    from concurrent.futures import ThreadPoolExecutor

    chunk = 64 << 20
    zeros = bytes(chunk)
    each = nbytes // threads // chunk

    def fill(i: int) -> None:
        path = os.path.join(d, f"pretouch-{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for _ in range(each):
                os.write(fd, zeros)
        except OSError:
            pass  # full: what was written was touched
        finally:
            os.close(fd)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, range(threads)))
    for i in range(threads):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(d, f"pretouch-{i}"))
    return time.perf_counter() - t


def attempts(cfg: Any, layout: Any, launcher: str, device: str, log: str, between: Any = None) -> list[int]:
    """Run the job until an attempt ends cleanly (at most 2 attempts, as fault injection kills only
    the first), writing the launcher's ``attempt_end`` records; returns the exit codes."""
    from bench.trainer_gpu import _train_worker
    from ckpt.trainer.launch import FATAL_ENV, torchrun_command
    from ckpt.trainer.metrics import MetricsLog

    codes = []
    for attempt in range(2):
        if launcher == "fork":
            rc = fork_ranks(layout.world_size, _train_worker, cfg.to_dict(), str(layout), False, device=device,
                            env={"CKPT_ATTEMPT": str(attempt)})
        else:
            fatal = tempfile.mkdtemp(prefix="ckpt-fatal-")
            env = {**os.environ, "CKPT_ATTEMPT": str(attempt), FATAL_ENV: fatal, "OMP_NUM_THREADS": "1"}
            with open(log, "a") as f:
                rc = subprocess.run(torchrun_command(cfg, layout), env=env, stdout=f, stderr=subprocess.STDOUT,
                                    check=False).returncode
            shutil.rmtree(fatal, ignore_errors=True)
        codes.append(rc)
        if rc != 0 and between is not None:
            between()
        MetricsLog(cfg.metrics_file).write({"event": "attempt_end", "attempt": attempt, "rc": rc})
        if rc == 0:
            break
    return codes


def summarize(metrics: str) -> dict[str, Any]:
    """Step times, memory checkpoints, the recovery record of one run's metrics file."""
    from ckpt.trainer.metrics import read_metrics

    recs = read_metrics(metrics)
    attempt, steps, saves = -1, {0: [], 1: []}, set()  # type: ignore[var-annotated]
    complete0: list[int] = []  # memory checkpoints complete before the failure (attempt 0)
    for r in recs:
        ev = r.get("event")
        if ev == "start":
            attempt += 1
        elif ev == "save":
            saves.add((attempt, r["step"]))
        elif ev == "memory_checkpoint" and attempt == 0 and r.get("complete"):
            complete0.append(r["step"])
        elif ev is None and "step_ms" in r and attempt in steps:
            steps[attempt].append(r)
    timed_recs = [r for r in steps[0] if r["step"] > 1 and (0, r["step"]) not in saves]
    timed = [r["step_ms"] for r in timed_recs]
    mem = [r for r in recs if r.get("event") == "memory_checkpoint"]
    rec = next((r for r in recs if r.get("event") == "recovery"), None)
    # the later half: past the first memory checkpoints, which allocate and pin their slots
    out: dict[str, Any] = {"step_ms": median(timed), "step_ms_all": timed,
                           "step_ms_late": median(timed[len(timed) // 2:]),
                           "stall_ms": median([r.get("ckpt_stall_ms", 0.0) for r in timed_recs]),
                           "steps_attempt0": [[r["step"], r["step_ms"]] for r in steps[0]],
                           "steps_attempt1": [[r["step"], r["step_ms"]] for r in steps[1]],
                           "memory_checkpoints": len(mem), "memory_complete": sum(1 for r in mem if r["complete"]),
                           "memory_complete_before_failure": complete0}
    if mem:
        out["memory_bytes_per_step"] = median([r["bytes"] for r in mem])
        out["replica_bytes_per_step"] = median([r["replica_bytes"] for r in mem])
        out["memory_write_ms"] = median([r["max_write_ms"] for r in mem])
        out["memory_replicate_ms"] = median([r["max_replicate_ms"] for r in mem])
        out["memory_wait_ms"] = median([r.get("wait_ms", 0.0) for r in mem])
        out["memory_snapshot_ms"] = median([r.get("snapshot_ms", 0.0) for r in mem])
        out["memory_steps"] = [r["step"] for r in mem if r["complete"]]
        out["memory_interval_s"] = interval_s(out["memory_steps"], out["steps_attempt0"])
        out["memory_warnings"] = [r.get("warning") for r in mem if not r["complete"]][:3]
        if any("budget_gbps" in r for r in mem):  # a budget or a governor: rank 0's, checkpoint by checkpoint
            out["memory_budget_gbps"] = [[r["step"], r.get("budget_gbps"), r.get("overhead")] for r in mem]
    if rec is not None:
        out["recovery"] = rec
        if "total_ms" in rec:
            out["restart_to_step_ms"] = rec["total_ms"] - rec.get("detect_ms", 0.0)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.trainer_gpu import param_count
    from ckpt.layout import Layout
    from ckpt.trainer.config import TrainConfig
    from ckpt.trainer.model import CONFIGS

    quick = args.quick
    name = args.config or ("tiny" if quick else "800m")
    model = CONFIGS[name]
    layout = Layout.parse(args.layout or f"dp={args.ranks},zero=0")
    if layout.world_size != args.ranks:
        raise SystemExit(f"--layout {layout} has {layout.world_size} ranks, not --ranks {args.ranks}")
    p = param_count(model)
    opt_share = layout.dp * layout.ep * layout.sp if layout.zero else 1  # dense params' ZeRO group (dp-only: exact)
    per_rank = (8 * p + 8 * p // opt_share) if layout.tp == layout.pp == layout.ep == 1 else None
    work = args.work_dir or tempfile.mkdtemp(prefix="ckpt-bench-memtier-")
    os.makedirs(work, exist_ok=True)
    need = 4 * args.ranks * 12 * p  # own + peer copy, old + new, of every rank's weights and AdamW moments
    base = args.shm_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    mounted = None
    if per_rank and args.shm_dir is None and shutil.disk_usage(base).free < need * 1.05:
        mounted = own_tmpfs(int(need * 1.1))
        if mounted:
            print(f"{base} has {shutil.disk_usage(base).free / 1e9:.0f} GB free, the memory tier needs up to "
                  f"{need / 1e9:.0f} GB: using a tmpfs of our own at {mounted} (unmounted at the end)", flush=True)
            base = mounted
    shm = tempfile.mkdtemp(prefix="ckpt-bench-memtier-shm-", dir=base)
    res: dict[str, Any] = {"device": args.device, "ranks": args.ranks, "nodes": 2, "layout": str(layout),
                           "model": name, "parameters": p, "state_bytes_per_rank": per_rank,
                           "seq": args.seq, "global_batch": args.global_batch or 2 * layout.dp * layout.ep,
                           "steps": args.steps, "save_every": args.save_every, "fail_at": args.fail_at,
                           "launcher": args.launcher, "work_dir": work, "shm_dir": shm,
                           "shm_free_bytes": shutil.disk_usage(shm).free,
                           "disk_free_bytes": shutil.disk_usage(work).free, "own_tmpfs": mounted,
                           "mem_total_bytes": meminfo_bytes("MemTotal")}
    if per_rank and need > res["shm_free_bytes"]:
        print(f"WARNING: {shm} has {res['shm_free_bytes'] / 1e9:.0f} GB free, the memory tier may need up to "
              f"{need / 1e9:.0f} GB: memory checkpoints that do not fit are skipped (pass --shm-dir)", flush=True)
    if per_rank:
        print(f"{name}: {p / 1e6:.0f}M parameters; under {layout}: {per_rank / 1e9:.2f} GB of fp32 weights, grads "
              f"and AdamW state per rank; shm free {res['shm_free_bytes'] / 1e9:.0f} GB", flush=True)
    t_all = time.perf_counter()
    try:
        # host memory the runs touch: the tier's shared memory at its peak, every rank's pinned snapshot
        # buffers and its CPU model skeleton
        host_need = need + args.ranks * 16 * p
        if per_rank and (args.pretouch == "on" or args.pretouch == "auto" and res["mem_total_bytes"] < host_need):
            size = min(host_need, int(shutil.disk_usage(shm).free * 0.95))
            why = ("--pretouch on" if args.pretouch == "on" else f"MemTotal {res['mem_total_bytes'] / 2**30:.0f} GiB "
                   f"< the {host_need / 2**30:.0f} GiB the runs touch: a VM that grows its memory on first use")
            print(f"touching {size / 2**30:.1f} GiB of host memory first ({why})", flush=True)
            res["pretouch"] = {"bytes": size, "seconds": round(pretouch(shm, size), 1),
                               "mem_total_after": meminfo_bytes("MemTotal")}
            print(f"  touched in {res['pretouch']['seconds']} s; MemTotal now "
                  f"{res['pretouch']['mem_total_after'] / 2**30:.0f} GiB", flush=True)
        res["work_fs"] = machine_info(work)
        res["shm_fs"] = machine_info(shm)
        print(f"persistent checkpoints in {work} ({res['work_fs'].get('fs_type', '?')}, "
              f"{res['disk_free_bytes'] / 1e9:.0f} GB free); memory tier in {shm} "
              f"({res['shm_fs'].get('fs_type', '?')})", flush=True)
        try:
            res["bandwidth"] = in_child(bandwidth, args.device, int(args.h2d_gib * 2**30))
        except RuntimeError as e:  # the runs still say what they measured; the ratio is left out
            res["bandwidth"] = {"error": str(e)}
        bw = res["bandwidth"]
        print(f"bandwidth: {json.dumps({k: v for k, v in bw.items() if k.endswith('gbps') or k == 'gpu'})}",
              flush=True)
        busy = [b.strip() for b in args.memory_busy.split(",") if b.strip()]
        variants = parse_variants(args.tier_variants)
        runs = ["storage"] + [("memory" if b == "wait" else f"memory-{b}") + ("" if v == "plain" else f"+{v}")
                              for b in busy for v in variants]
        res["runs"] = runs
        fail_at = args.fail_at or None  # 0: no node is lost
        for kind in runs:
            stage, gbps, overhead = variants.get(kind.partition("+")[2] or "plain", (False, None, None))
            t = time.perf_counter()
            ckpt_dir = os.path.join(work, kind)
            shutil.rmtree(ckpt_dir, ignore_errors=True)
            cfg = TrainConfig(model=model, seq_len=args.seq, global_batch=res["global_batch"], microbatches=1,
                              steps=args.steps, save_every=args.save_every, async_save=False, warmup=1,
                              ckpt_dir=ckpt_dir, fail_at_step=fail_at, fail_node=1 if fail_at else None, nodes=2,
                              device=args.device, memory_every=1 if kind != "storage" else None, replicas=1,
                              shm_dir=shm, memory_busy="skip" if kind.startswith("memory-skip") else "wait",
                              memory_stage_on_device=stage, memory_max_gbps=gbps,
                              memory_max_overhead=overhead if kind.startswith("memory-skip") else None,
                              metrics_path=os.path.join(work, f"{kind}.metrics.jsonl"))
            if os.path.exists(cfg.metrics_file or ""):
                os.unlink(cfg.metrics_file or "")
            cfg.check_layout(layout)
            mem_note = f", memory checkpoint every step (busy={cfg.memory_busy})" if kind != "storage" else ""
            lost = f"node 1 lost after step {fail_at}" if fail_at else "no node lost"
            print(f"== {kind}: {layout}, {args.steps} steps, persistent save every {args.save_every}, {lost}"
                  f"{mem_note}", flush=True)
            evicted: dict[str, Any] = {}

            def between(d: str = ckpt_dir, kind: str = kind, evicted: dict[str, Any] = evicted) -> None:
                if kind == "storage":
                    evicted.update(evict(d))

            codes = attempts(cfg, layout, args.launcher, args.device, os.path.join(work, f"{kind}.log"), between)
            out = summarize(cfg.metrics_file or "")
            out.update(exit_codes=codes, wall_s=round(time.perf_counter() - t, 1), evicted=evicted or None)
            res[kind] = out
            rec = out.get("recovery") or {}
            print(f"  {kind}: exit codes {codes}; step {out['step_ms']:.1f} ms (median of {out['step_ms_all']}), "
                  f"checkpoint stall {out['stall_ms']:.1f} ms; complete memory checkpoints at steps "
                  f"{out.get('memory_steps', [])}; "
                  f"recovery tier {rec.get('tier')} from step {rec.get('step')}, lost {rec.get('steps_lost')}, "
                  f"restart {rec.get('restart_ms')} ms + restore {rec.get('restore_ms')} ms + first step "
                  f"{rec.get('first_step_ms')} ms, {rec.get('bytes', 0) / 1e9:.2f} GB restored; {out['wall_s']} s"
                  + (f"; memory tier warnings: {out['memory_warnings']}" if out.get("memory_warnings") else "")
                  + (f"; [step, rank 0's budget GB/s, measured slowdown]: {out['memory_budget_gbps']}"
                     if out.get("memory_budget_gbps") else ""),
                  flush=True)
            if codes[-1] != 0:
                log = os.path.join(work, f"{kind}.log")
                if os.path.exists(log):
                    with open(log) as f:
                        print("  last lines of the workers' log:\n" + "".join(f.readlines()[-30:]), flush=True)
            shutil.rmtree(ckpt_dir, ignore_errors=True)  # disk: the next run needs the room
            res["wall_s"] = round(time.perf_counter() - t_all, 1)
            if args.json:
                write_json_atomic(args.json, res)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if mounted:
            subprocess.run(["umount", mounted], check=False)
            with contextlib.suppress(OSError):
                os.rmdir(mounted)
        if not args.work_dir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = round(time.perf_counter() - t_all, 1)
    derive(res)
    if args.json:
        write_json_atomic(args.json, res)
    return res


def interval_s(complete: list[int], steps: list[list[float]]) -> float | None:
    """Mean seconds of training between consecutive complete memory checkpoints (the steps they
    were taken at; ``steps``: ``[step, step_ms]``); None with fewer than two."""
    if len(complete) < 2:
        return None
    ms = {int(s): t for s, t in steps}
    return sum(ms.get(s, 0.0) for s in range(complete[0] + 1, complete[-1] + 1)) / 1e3 / (len(complete) - 1)


Variant = tuple[bool, float | None, float | None]  # (stage_on_device, max_gbps, max_overhead)


def parse_variants(text: str) -> dict[str, Variant]:
    """``--tier-variants``: ``plain`` (the defaults), ``stage`` (``memory_stage_on_device``), then
    optionally ``@G`` (a budget of G GB/s per rank: ``memory_max_gbps``) and ``%P`` (a governor keeping
    the slowdown within P percent: ``memory_max_overhead``; with ``@G`` its ceiling), e.g. ``stage@2``,
    ``stage%5``, ``%5@4``; comma-separated; by name, in order."""
    import re

    out: dict[str, Variant] = {}
    for name in (v.strip() for v in text.split(",")):
        if not name:
            continue
        m = re.fullmatch(r"(plain|stage|)((?:[@%][^@%]*)*)", name)
        parts = re.findall(r"([@%])([^@%]*)", m.group(2)) if m else []
        kinds = [k for k, _ in parts]
        if m is None or len(set(kinds)) != len(kinds) or (m.group(1) == "plain" and parts) or \
                (not m.group(1) and not parts):
            raise SystemExit(f"--tier-variants: {name!r}: use plain, stage, then optionally @G (GB/s per rank) and "
                             "%P (percent slowdown), e.g. stage@2, stage%5")
        got: dict[str, float] = {}
        for k, v in parts:
            try:
                got[k] = float(v)
            except ValueError:
                raise SystemExit(f"--tier-variants: {name!r}: {v!r} is not a number") from None
            if not got[k] > 0 or (k == "%" and not got[k] < 100):
                raise SystemExit(f"--tier-variants: {name!r}: {k}{v} must be positive (and a percent below 100)")
        overhead = got["%"] / 100 if "%" in got else None
        out[name] = (m.group(1) == "stage", got.get("@"), overhead)
    return out or {"plain": (False, None, None)}


def _label(k: str) -> str:
    busy, _, variant = k.partition("+")
    return f"busy={'skip' if busy == 'memory-skip' else 'wait'}" + (f", {variant}" if variant else "")


def derive(res: dict[str, Any]) -> None:
    """Slowdown and restore bandwidths (per rank, and over the H2D / memcpy limit)."""
    s = res.get("storage", {})
    mems = [res[k] for k in res.get("runs", []) if k != "storage" and k in res]
    for m in mems:
        if s.get("step_ms") and m.get("step_ms"):
            m["slowdown"] = m["step_ms"] / s["step_ms"]
        if s.get("step_ms_late") and m.get("step_ms_late"):
            m["slowdown_late"] = m["step_ms_late"] / s["step_ms_late"]
        if m.get("memory_replicate_ms"):  # each rank's copy to its peer (same host: read from its files)
            m["replicate_gbps_per_rank"] = (m["replica_bytes_per_step"] / res["ranks"] / 1e9
                                            / (m["memory_replicate_ms"] / 1e3))
    if res.get("memory", {}).get("slowdown"):
        res["slowdown"] = res["memory"]["slowdown"]
    bw = res.get("bandwidth", {})
    limit = bw.get("h2d_gbps") or bw.get("memcpy_gbps")
    for run in (s, *mems):
        rec = run.get("recovery")
        if rec and rec.get("restore_ms"):
            per_rank = rec["bytes"] / res["ranks"] / (rec["restore_ms"] / 1e3) / 1e9
            run["restore_gbps_per_rank"] = per_rank
            if limit:
                run["restore_vs_limit"] = per_rank / limit


def tables(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    nan = float("nan")
    s = res.get("storage", {})
    mems = [(k, res[k]) for k in res.get("runs", []) if k != "storage" and k in res]
    bw = res.get("bandwidth", {})
    limit_name = "H2D" if bw.get("h2d_gbps") else "memcpy"
    limit = bw.get("h2d_gbps") or bw.get("memcpy_gbps") or nan
    step_rows = [["no memory tier", fmt(s.get("step_ms", nan), 1), fmt(s.get("stall_ms", nan), 1), "-", "-", "-",
                  "-", "-", "-", "1.00", fmt(s.get("step_ms_late", nan), 1), "1.00", "-"]]
    for k, m in mems:
        step_rows.append([f"--memory-every 1, {_label(k)}",
                          fmt(m.get("step_ms", nan), 1), fmt(m.get("stall_ms", nan), 1),
                          fmt(m.get("memory_bytes_per_step", nan) / res["ranks"] / 1e9, 3),
                          str(m.get("memory_complete", 0)),
                          fmt(m.get("memory_snapshot_ms", nan), 0), fmt(m.get("memory_write_ms", nan), 0),
                          fmt(m.get("memory_replicate_ms", nan), 0), fmt(m.get("replicate_gbps_per_rank", nan), 2),
                          fmt(m.get("slowdown", nan), 2), fmt(m.get("step_ms_late", nan), 1),
                          fmt(m.get("slowdown_late", nan), 2), fmt(m.get("memory_interval_s") or nan, 1)])
    rec_rows = []
    for label, run in (("persistent storage", s),
                       *((f"memory tier, {_label(k)}", m) for k, m in mems)):
        r = run.get("recovery") or {}
        rec_rows.append([label, str(r.get("tier", "-")), str(r.get("step", "-")), str(r.get("steps_lost", "-")),
                         fmt(r.get("restart_ms", nan), 0), fmt(r.get("pin_ahead_ms", nan), 0),
                         fmt(r.get("pin_ahead_wait_ms", nan), 0), fmt(r.get("restore_ms", nan), 0),
                         fmt(r.get("first_step_ms", nan), 0), fmt(run.get("restart_to_step_ms", nan), 0),
                         fmt(r.get("bytes", nan) / 1e9, 3), fmt(run.get("restore_gbps_per_rank", nan), 3),
                         fmt(run.get("restore_vs_limit", nan), 3)])
    return [
        (f"step time, {res['model']} under {res['layout']} ({res['ranks']} ranks, 2 simulated nodes)",
         ["run", "step ms", "stall ms", "memory ckpt GB/rank", "complete ckpts logged", "snapshot ms", "write ms",
          "replicate ms", "replicate GB/s per rank", "slowdown", "later half step ms", "later half slowdown",
          "s between ckpts"],
         step_rows),
        (f"node 1 lost after step {res['fail_at'] or '-'}: restart to the next step ({limit_name} {fmt(limit, 1)} GB/s"
         + (" per GPU)" if limit_name == "H2D" else ")"),
         ["restore from", "tier", "step", "steps lost", "restart ms", "pin ahead ms", "of it waited ms",
          "restore ms", "first step ms",
          "restart-to-step ms", "GB restored", "GB/s per rank", f"vs {limit_name}"], rec_rows),
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--ranks", type=int, default=4, help="ranks (2 simulated nodes of ranks / 2)")
    p.add_argument("--quick", action="store_true", help="tiny model (CPU smoke run)")
    p.add_argument("--config", default=None, help="model config (default 800m; tiny with --quick)")
    p.add_argument("--layout", default=None, help="default dp=RANKS,zero=0 (every GPU holds the whole state)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=None, help="default 2 samples per data-parallel rank")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=3, help="synchronous persistent saves (both runs)")
    p.add_argument("--fail-at", type=int, default=5, help="node 1 is lost after this many steps (0: never)")
    p.add_argument("--launcher", default="torchrun", choices=("torchrun", "fork"),
                   help="torchrun (new processes per attempt, as ckpt train) or forked ranks (faster, CPU tests)")
    p.add_argument("--memory-busy", default="wait",
                   help="memory runs: wait (a checkpoint due while the previous runs waits for it), skip, or "
                        "wait,skip for both (one more run, ~1 min on GPUs)")
    p.add_argument("--tier-variants", default="plain",
                   help="memory runs per busy mode: plain or stage (GPU state staged in device memory first), "
                        "then optionally @G (a background budget of G GB/s per rank) and %%P (a governor keeping "
                        "the slowdown within P percent; busy=skip runs only), e.g. stage@2,stage%%5")
    p.add_argument("--pretouch", default="auto", choices=("auto", "on", "off"),
                   help="touch the host memory the runs need first (auto: when MemTotal is below it)")
    p.add_argument("--h2d-gib", type=float, default=1.0, help="size of the bandwidth probe")
    p.add_argument("--shm-dir", default=None, help="memory tier base (default /dev/shm)")
    p.add_argument("--work-dir", default=None, help="persistent checkpoints, metrics, logs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp work dir (metrics, logs)")
    p.add_argument("--json", default=None, help="write the results here (rewritten after each run)")


def main(args: argparse.Namespace) -> int:
    if args.quick and args.h2d_gib == 1.0:
        args.h2d_gib = 0.25
    res = run(args)
    print_tables(tables(res))
    print(f"total wall time {res.get('wall_s', 0):.0f} s", flush=True)
    runs = res.get("runs", [])
    ok = bool(runs) and all(res.get(k, {}).get("exit_codes", [1])[-1] == 0 for k in runs)
    tiers = [res.get(k, {}).get("recovery", {}).get("tier") for k in runs]
    # a memory run restores from the peers' copies, or from storage when none of its memory checkpoints
    # completed after the newest persistent one before the failure (busy=skip with a replication
    # slower than the steps: the first one was still in flight)
    def expected(k: str) -> bool:
        r = res.get(k, {})
        rec = r.get("recovery", {})
        if rec.get("tier") == "memory-peer":
            return True
        return rec.get("tier") == "storage" and not [s for s in r.get("memory_complete_before_failure", [])
                                                     if s > int(rec.get("step", -1))]

    if not args.fail_at:  # no node lost: nothing restored to check
        return 0 if ok else 1
    return 0 if ok and tiers[0] == "storage" and all(expected(k) for k in runs[1:]) else 1
