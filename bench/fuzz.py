"""Long fuzzing run of the parsers of untrusted bytes, and a census of single-fault corruptions.

Fuzzing (hypothesis-driven; targets and strategies in tests/fuzz/targets.py): random bytes, mutations
of valid seeds and structure-aware inputs go to the manifest codec, the safetensors header parser, the
object codec, and ``ckpt.verify(deep=True)`` on a whole checkpoint built around a hostile manifest.
Every input is timed and its peak traced allocation measured; escapes are split into reported bugs
(``KNOWN_ESCAPES``) and unexpected ones. The process runs under an address-space limit so that a
runaway allocation fails with MemoryError instead of taking the machine down.

Corruption census (``--corruption``): on the suite's two sample checkpoints, every byte of every file is
flipped with each of 9 masks (the 8 single bits and 0xFF), every file is truncated to every shorter
length, and every file is deleted; each fault is classified and judged as in
tests/integrity/test_corruption.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from bench.common import fmt, print_table

BUDGET = {"manifest": 40_000, "header": 25_000, "object": 20_000, "verify": 15_000}
CHUNK = 2_500


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inputs", type=int, default=sum(BUDGET.values()),
                   help=f"total inputs, split over targets like {BUDGET} (default {sum(BUDGET.values())})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem-limit-gib", type=float, default=8.0,
                   help="address-space limit for this process (default 8 GiB; 0: none)")
    p.add_argument("--no-corruption", action="store_true", help="skip the corruption census")
    p.add_argument("--only", default=None, help="comma-separated targets (manifest,header,object,verify)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fuzz(total: int, seed: int, only: list[str] | None, root: str) -> dict[str, Any]:
    from tests.fuzz.targets import TARGETS, Stats, VerifyTarget, campaign, make_seeds, strategies

    seeds = make_seeds()
    strats = strategies(seeds, big=True)
    scale = total / sum(BUDGET.values())
    out: dict[str, Any] = {}
    for target, budget in BUDGET.items():
        if only and target not in only:
            continue
        fn = VerifyTarget(root) if target == "verify" else TARGETS[target]
        per = max(1, int(budget * scale) // len(strats[target]))
        for sname, strat in strats[target]:
            stats = Stats()
            t0 = time.perf_counter()
            done, chunk_seed = 0, seed
            while done < per:
                n = min(CHUNK, per - done)
                part = campaign(target, fn, strat, n, seed=chunk_seed)
                stats.merge(part)
                done += max(part.inputs, 1)
                chunk_seed += 1
            wall = time.perf_counter() - t0
            d = stats.to_dict()
            d["wall_s"] = round(wall, 1)
            out[f"{target}/{sname}"] = d
            _log(f"{target}/{sname}: {d['inputs']} inputs in {wall:.0f} s, accepted {d['accepted']}, "
                 f"rejected {sum(d['rejected'].values())}, known bugs {d['known_bugs']}, "
                 f"unexpected {d['unexpected_escapes']}, slow {d['slow_inputs']}, over-alloc {d['over_alloc_bound']}")
    return out


def corruption_census(root: str) -> dict[str, Any]:
    import ckpt
    from tests.fuzz.targets import known_bug
    from tests.integrity.corruption import KNOWN, Sample, judge
    from tests.integrity.sample import header_change, header_span, plain, save_two_rank_sample, single_file_state

    single = os.path.join(root, "single")
    state = single_file_state()
    ckpt.save(state, single, step=7, user_metadata={"model": "tiny", "layers": 2})
    two = os.path.join(root, "two")
    samples = {"single": Sample(single, plain(state)), "two-rank": Sample(two, save_two_rank_sample(two))}
    masks = [1 << b for b in range(8)] + [0xFF]
    res: dict[str, Any] = {}
    for name, s in samples.items():
        kinds: Counter[str] = Counter()
        bad: Counter[str] = Counter()
        examples: list[str] = []
        t0 = time.perf_counter()
        for rel in s.files:
            for pos in range(len(s.raw[rel])):
                for mask in masks:
                    try:
                        kind, problems = judge(s, rel, pos, mask)
                    except Exception as e:  # noqa: BLE001 - an escape is a finding, recorded and counted
                        bug = known_bug("verify", e)
                        kind = f"escape:{bug or type(e).__name__}"
                        problems = [f"{type(e).__name__}: {e}"]
                    kinds[kind] += 1
                    if problems:
                        bad[kind] += 1
                        if kind not in KNOWN and kind != "header:dtype-shape" and len(examples) < 10 \
                                and not kind.startswith("escape:object-numpy-dtype"):
                            examples.append(f"{rel} byte {pos} ^ {mask:#04x} ({kind}): {problems}")
        flips = sum(kinds.values())
        verify_missed = 0
        for rel in s.files:  # header dtype/shape flips: judged separately (verify does not compare them)
            raw = s.raw[rel]
            if rel == "manifest.msgpack":
                continue
            lo, hi = header_span(raw)
            for pos in range(lo, hi):
                for mask in masks:
                    b = bytearray(raw)
                    b[pos] ^= mask
                    if header_change(raw[lo:hi], bytes(b)[lo:hi]) == "dtype-shape" and s.check(rel, bytes(b)).verify_ok:
                        verify_missed += 1
        truncations = deletions = trunc_missed = del_missed = 0
        for rel in s.files:
            raw = s.raw[rel]
            for n in range(len(raw)):
                out = s.check(rel, raw[:n])
                truncations += 1
                trunc_missed += out.verify_ok or not out.verified_load_failed
            out = s.check(rel, None)
            deletions += 1
            del_missed += out.verify_ok or not out.verified_load_failed
        res[name] = {"files": {f: len(s.raw[f]) for f in s.files}, "flips": flips,
                     "flips_by_class": dict(sorted(kinds.items())),
                     "flips_violating_by_class": dict(sorted(bad.items())),
                     "dtype_shape_flips_passing_verify": verify_missed, "unexpected_examples": examples,
                     "truncations": truncations, "truncations_missed": trunc_missed,
                     "deletions": deletions, "deletions_missed": del_missed,
                     "wall_s": round(time.perf_counter() - t0, 1)}
        _log(f"corruption census {name}: {flips} flips, {truncations} truncations, {deletions} deletions "
             f"in {res[name]['wall_s']} s; violations by class {dict(bad)}")
    return res


def main(args: argparse.Namespace) -> int:
    import torch  # noqa: F401 - imported before the address-space limit is set

    if args.mem_limit_gib > 0:
        lim = int(args.mem_limit_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, resource.getrlimit(resource.RLIMIT_AS)[1]))
    root = tempfile.mkdtemp(prefix="ckpt-fuzz-")
    t0 = time.perf_counter()
    res: dict[str, Any] = {"fuzz": fuzz(args.inputs, args.seed, args.only.split(",") if args.only else None, root)}
    if not args.no_corruption:
        res["corruption"] = corruption_census(root)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    rows = []
    for k, d in res["fuzz"].items():
        rows.append([k, str(d["inputs"]), str(d["accepted"]), str(sum(d["rejected"].values())),
                     ", ".join(f"{b}: {n}" for b, n in d["known_bugs"].items()) or "-",
                     str(d["unexpected_escapes"]), str(d["slow_inputs"]), str(d["over_alloc_bound"]),
                     fmt(d["max_seconds"], 3), fmt(d["max_alloc_per_input_byte"], 0), f"{d['wall_s']:.0f}"])
    print_table("fuzzing: outcomes per target/strategy", ["target/strategy", "inputs", "accepted",
                "CheckpointError", "reported bugs hit", "unexpected", "slow", "over alloc", "max s",
                "max alloc B/B", "wall s"], rows)
    total = sum(d["inputs"] for d in res["fuzz"].values())
    unexpected = sum(d["unexpected_escapes"] for d in res["fuzz"].values())
    print(f"{total} inputs fuzzed, {unexpected} unexpected escapes")
    for d in res["fuzz"].values():
        for e in d["escape_examples"] + d["slow_examples"] + d["alloc_examples"]:
            print(f"  {e}")
    for name, c in res.get("corruption", {}).items():
        print_table(f"corruption census: {name} sample", ["class", "faults", "violations"],
                    [[k, str(v), str(c["flips_violating_by_class"].get(k, 0))] for k, v in c["flips_by_class"].items()]
                    + [["truncations", str(c["truncations"]), str(c["truncations_missed"])],
                       ["deletions", str(c["deletions"]), str(c["deletions_missed"])]])
        print(f"  header dtype/shape flips that pass verify: {c['dtype_shape_flips_passing_verify']}")
        for e in c["unexpected_examples"]:
            print(f"  UNEXPECTED: {e}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if unexpected else 0
