"""Crash harness, long run: SIGKILL a checkpointing process at random moments and at every step of a
save, and audit what it left behind (the suite runs 20 random + 17 targeted trials of the same thing).

Each trial forks a child that opens a CheckpointManager (startup gc, restore + bitwise check of the
newest checkpoint), then saves steps forever (sync and async alternate between trials; keep_last=2).
Random trials kill it after a uniform random delay; targeted trials make it kill itself at a chosen
point (planning, staging, a data write, the data fsync, before/after the manifest rename, before the
lease removal, retention gc, mid-directory removal). After each kill: every step directory with a
manifest must verify deep and load bitwise-equal to its step's values, and ``latest()`` must exist,
never go back, and load. See tests/integrity/crash_harness.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from bench.common import machine_info, print_table, remove


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=500, help="random-delay kills (default 500)")
    p.add_argument("--targeted-rounds", type=int, default=10,
                   help="rounds of one kill per (kill point, mode) (default 10: 170 trials)")
    p.add_argument("--max-delay", type=float, default=0.25, help="random delay upper bound in s (default 0.25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the summary and trials as JSON here")


def main(args: argparse.Namespace) -> int:
    from tests.integrity.crash_harness import KILL_POINTS, run_trials, summarize

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="ckpt-crash-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        trials = run_trials(os.path.join(base, "root"), random_trials=args.trials,
                            targeted_rounds=args.targeted_rounds, seed=args.seed, max_delay=args.max_delay,
                            log=lambda m: print(m, file=sys.stderr, flush=True))
        info = machine_info(base)
    finally:
        remove(base)
    wall = time.perf_counter() - t0
    s = summarize(trials)
    print_table("crash harness: trials", ["", "count"], [
        ["trials (random + targeted)", f"{s['trials']} ({s['random']} + {s['targeted']})"],
        ["sync / async", f"{s['by_mode'].get('sync', 0)} / {s['by_mode'].get('async', 0)}"],
        ["checkpoints audited (verify deep + bitwise load)", str(s["checkpoints_audited"])],
        ["partial saves found (files, no manifest; gc removed them)", str(s["partial_saves_seen"])],
        ["empty step directories left at the end (gc does not see them)", str(s["empty_dirs_left"])],
        ["saves failed by the lease/retention race (bug 16, fixed)", str(s["lease_races"])],
        ["newest step reached", str(s["latest_step"])],
        ["trials with a failure", str(s["trials_failed"])],
        ["wall time", f"{wall:.0f} s"],
    ])
    print_table("random kills by the phase they interrupted", ["phase", "kills"],
                [[k, str(v)] for k, v in sorted(s["kills_by_phase"].items(), key=lambda kv: -kv[1])])
    print_table("targeted kills", ["point", "what", "kills"],
                [[p, KILL_POINTS[p], str(s["kills_by_point"].get(p, 0))] for p in KILL_POINTS])
    for f in s["failures"]:
        print(f"FAILURE: {f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"summary": s, "wall_s": wall, "machine": info, "trials": [t.to_dict() for t in trials]},
                      f, indent=1)
    return 1 if s["trials_failed"] else 0
