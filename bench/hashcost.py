"""What checksumming costs a save: ``ckpt.save`` with and without CRC-32, on the same state.

Three modes: ``isal`` (what ckpt uses: ISA-L's CRC-32, same values as zlib), ``zlib`` (the standard
library's, what ckpt used before) and ``none`` (``ckpt._io.crc32`` replaced by a stand-in that returns
at once; this process only: the checkpoints written that way carry wrong checksums and are deleted).
Runs alternate (with, without, without, with, ...) so drift in the disk or the page cache hits both
sides alike; figures are medians, and the best (minimum) times are given too: on a shared machine
the noise is one-sided (other jobs only ever slow a run down). Every save is durable (ckpt fsyncs
the data file, the manifest and the directories) and is preceded by ``sync`` so that no earlier
write-back lands inside it.

Process CPU time (all threads) is recorded too: the hash runs on the calling thread while a second
thread writes, so it is hidden only when a core is free; on a busy machine it costs its CPU time.

``--busy N`` starts N processes that spin on a core each for the whole run: with N = the number of
cores, the hash can no longer hide on a free core (the case where the target, under 10% of a save,
is hard).

Two places by default: ``--dir`` (a temporary directory on the disk holding $TMPDIR), where the disk
bounds the save, and /dev/shm (tmpfs: memory speed), where hashing has nowhere to hide. Also reported:
single-thread CRC-32 throughput of this machine's zlib on the state's bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
import zlib
from typing import Any

from bench.common import GB, fmt, gbps, machine_info, median, print_table, remove


def _noop_crc32(data: Any, value: int = 0) -> int:
    return value


class _CRC:
    """``ckpt._io.crc32`` replaced by ``fn`` (None: left as is) for the duration of a block."""

    def __init__(self, fn: Any):
        self.fn = fn

    def __enter__(self) -> None:
        import importlib

        self.io = importlib.import_module("ckpt._io")
        self.real = self.io.crc32
        if self.fn is not None:
            self.io.crc32 = self.fn

    def __exit__(self, *exc: Any) -> None:
        self.io.crc32 = self.real


MODES = {"isal": None, "zlib": zlib.crc32, "none": _noop_crc32}


def _spin() -> None:
    while True:
        pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--tensors", type=int, default=100, help="number of tensors (default 100)")
    p.add_argument("--repeats", type=int, default=6, help="saves per mode and place (default 6)")
    p.add_argument("--dir", default=None, help="disk directory to save into (default: a temporary directory)")
    p.add_argument("--places", default="disk,shm", help="comma-separated: disk, shm (default both)")
    p.add_argument("--busy", type=int, default=0, help="processes spinning on a core each during the run")
    p.add_argument("--modes", default="isal,zlib,none", help="comma-separated: isal, zlib, none")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")


def _crc_throughput(state: dict[str, Any], fn: Any) -> float:
    from ckpt._io import byte_view

    nbytes = 0
    t0 = time.perf_counter()
    for t in state.values():
        mv = byte_view(t)
        fn(mv)
        nbytes += len(mv)
    return gbps(nbytes, time.perf_counter() - t0)


def run(size_gb: float, n_tensors: int, repeats: int, places: dict[str, str], modes: list[str]) -> dict[str, Any]:
    import ckpt
    from bench.save_load import make_state, state_bytes
    from ckpt._checksum import crc32

    state = make_state(int(size_gb * (1 << 30)), n_tensors)
    nbytes = state_bytes(state)
    res: dict[str, Any] = {"bytes": nbytes, "tensors": n_tensors, "repeats": repeats, "modes": modes,
                           "crc32_gbps": {"isal": _crc_throughput(state, crc32),
                                          "zlib": _crc_throughput(state, zlib.crc32)}, "places": {}}
    for place, base in places.items():
        times: dict[str, list[float]] = {m: [] for m in modes}
        cpu: dict[str, list[float]] = {m: [] for m in modes}  # process CPU seconds (all threads)
        for r in range(repeats):
            for mode in (modes if r % 2 == 0 else modes[::-1]):  # alternate the order
                url = os.path.join(base, f"hashcost-{mode}-{r}")
                remove(url)
                os.sync()
                c0 = time.process_time()
                t0 = time.perf_counter()
                with _CRC(MODES[mode]):
                    ckpt.save(state, url)
                times[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
                if mode != "none" and r == 0:
                    assert ckpt.verify(url, deep=True).ok, "the measured save did not checksum correctly"
                remove(url)
        med = {m: median(v) for m, v in times.items()}
        base_s = med.get("none")
        res["places"][place] = {
            "dir": base, "times": times, "median_s": med, "cpu_s": cpu,
            "median_cpu_s": {m: median(v) for m, v in cpu.items()},
            "gbps": {m: gbps(nbytes, s) for m, s in med.items()},
            "overhead_pct": {m: 100.0 * (med[m] - base_s) / base_s for m in modes} if base_s else {},
            "min_s": {m: min(v) for m, v in times.items()},
        }
        print(f"{place}: " + ", ".join(f"{m} {med[m]:.3f} s" for m in modes), flush=True)
    return res


def main(args: argparse.Namespace) -> int:
    wanted = args.places.split(",")
    tmp = tempfile.mkdtemp(prefix="ckpt-hashcost-", dir=args.dir)
    places: dict[str, str] = {}
    if "disk" in wanted:
        places["disk"] = tmp
    shm = None
    if "shm" in wanted and os.path.isdir("/dev/shm"):
        shm = tempfile.mkdtemp(prefix="ckpt-hashcost-", dir="/dev/shm")
        places["shm (tmpfs)"] = shm
    busy = [mp.get_context("fork").Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for b in busy:
        b.start()
    modes = args.modes.split(",")
    try:
        res = run(args.size_gb, args.tensors, args.repeats, places, modes)
        res["machine"] = machine_info(tmp)
        res["busy_processes"] = args.busy
    finally:
        for b in busy:
            b.kill()
        remove(tmp)
        if shm:
            remove(shm)
    rows = []
    for place, p in res["places"].items():
        for m in modes:
            ov = p["overhead_pct"].get(m)
            rows.append([place, m, fmt(p["median_s"][m], 3), fmt(p["gbps"][m]), fmt(p["min_s"][m], 3),
                         "" if ov is None or m == "none" else f"{ov:+.1f}%", fmt(p["median_cpu_s"][m], 3)])
    speeds = ", ".join(f"{k} {v:.1f} GB/s" for k, v in res["crc32_gbps"].items())
    print_table(f"ckpt.save of {res['bytes'] / GB:.2f} GB ({res['tensors']} tensors), median of {res['repeats']}, "
                f"{args.busy} busy processes; CRC-32 alone on one core: {speeds}",
                ["place", "crc32", "median s", "GB/s", "best s", "vs none", "CPU s"], rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 0
