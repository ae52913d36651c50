"""What checksumming costs a save: ``ckpt.save`` with and without CRC-32, on the same state.

The "without" runs replace the ``zlib`` that ``ckpt.io`` uses with a stand-in whose ``crc32`` returns
at once (this process only; the checkpoints written that way carry wrong checksums and are deleted).
Runs alternate (with, without, without, with, ...) so drift in the disk or the page cache hits both
sides alike; figures are medians, and the best (minimum) times are given too: on a shared machine
the noise is one-sided (other jobs only ever slow a run down). Every save is durable (ckpt fsyncs
the data file, the manifest and the directories) and is preceded by ``sync`` so that no earlier
write-back lands inside it.

Process CPU time (all threads) is recorded too: the hash runs on the calling thread while a second
thread writes, so it is hidden only when a core is free; on a busy machine it costs its CPU time.

Two places by default: ``--dir`` (a temporary directory on the disk holding $TMPDIR), where the disk
bounds the save, and /dev/shm (tmpfs: memory speed), where hashing has nowhere to hide. Also reported:
single-thread CRC-32 throughput of this machine's zlib on the state's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import types
import zlib
from typing import Any

from bench.common import GB, fmt, gbps, machine_info, median, print_table, remove


def _noop_crc32(data: Any, value: int = 0) -> int:
    return value


class _NoCRC:
    """``ckpt.io.zlib`` replaced by a stand-in without a real crc32, for the duration of a block."""

    def __enter__(self) -> None:
        import importlib

        self.io = importlib.import_module("ckpt.io")
        self.real = self.io.zlib
        self.io.zlib = types.SimpleNamespace(crc32=_noop_crc32)

    def __exit__(self, *exc: Any) -> None:
        self.io.zlib = self.real


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--tensors", type=int, default=100, help="number of tensors (default 100)")
    p.add_argument("--repeats", type=int, default=6, help="saves per mode and place (default 6)")
    p.add_argument("--dir", default=None, help="disk directory to save into (default: a temporary directory)")
    p.add_argument("--places", default="disk,shm", help="comma-separated: disk, shm (default both)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")


def _crc_throughput(state: dict[str, Any]) -> float:
    from ckpt.io import byte_view

    nbytes = 0
    t0 = time.perf_counter()
    for t in state.values():
        mv = byte_view(t)
        zlib.crc32(mv)
        nbytes += len(mv)
    return gbps(nbytes, time.perf_counter() - t0)


def run(size_gb: float, n_tensors: int, repeats: int, places: dict[str, str]) -> dict[str, Any]:
    import ckpt
    from bench.save_load import make_state, state_bytes

    state = make_state(int(size_gb * (1 << 30)), n_tensors)
    nbytes = state_bytes(state)
    res: dict[str, Any] = {"bytes": nbytes, "tensors": n_tensors, "repeats": repeats,
                           "crc32_gbps": _crc_throughput(state), "places": {}}
    for place, base in places.items():
        times: dict[str, list[float]] = {"crc": [], "nocrc": []}
        cpu: dict[str, list[float]] = {"crc": [], "nocrc": []}  # process CPU seconds (all threads)
        for r in range(repeats):
            for mode in (("crc", "nocrc") if r % 2 == 0 else ("nocrc", "crc")):
                url = os.path.join(base, f"hashcost-{mode}-{r}")
                remove(url)
                os.sync()
                c0 = time.process_time()
                t0 = time.perf_counter()
                if mode == "crc":
                    ckpt.save(state, url)
                else:
                    with _NoCRC():
                        ckpt.save(state, url)
                times[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
                if mode == "crc" and r == 0:
                    assert ckpt.verify(url, deep=True).ok, "the measured save did not checksum correctly"
                remove(url)
        med = {m: median(v) for m, v in times.items()}
        res["places"][place] = {
            "dir": base, "times": times, "median_s": med, "cpu_s": cpu,
            "median_cpu_s": {m: median(v) for m, v in cpu.items()},
            "gbps": {m: gbps(nbytes, s) for m, s in med.items()},
            "overhead_pct": 100.0 * (med["crc"] - med["nocrc"]) / med["nocrc"],
            "min_s": {m: min(v) for m, v in times.items()},
            "overhead_min_pct": 100.0 * (min(times["crc"]) - min(times["nocrc"])) / min(times["nocrc"]),
        }
        print(f"{place}: with crc {med['crc']:.3f} s, without {med['nocrc']:.3f} s, "
              f"overhead {res['places'][place]['overhead_pct']:+.1f}%", flush=True)
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
    try:
        res = run(args.size_gb, args.tensors, args.repeats, places)
        res["machine"] = machine_info(tmp)
    finally:
        remove(tmp)
        if shm:
            remove(shm)
    rows = []
    for place, p in res["places"].items():
        rows.append([place, fmt(p["median_s"]["crc"], 3), fmt(p["median_s"]["nocrc"], 3),
                     fmt(p["gbps"]["crc"]), fmt(p["gbps"]["nocrc"]), f"{p['overhead_pct']:+.1f}%",
                     fmt(p["min_s"]["crc"], 3), fmt(p["min_s"]["nocrc"], 3), f"{p['overhead_min_pct']:+.1f}%",
                     fmt(p["median_cpu_s"]["crc"], 3), fmt(p["median_cpu_s"]["nocrc"], 3)])
    print_table(f"ckpt.save of {res['bytes'] / GB:.2f} GB ({res['tensors']} tensors), median of {res['repeats']}; "
                f"CRC-32 alone: {res['crc32_gbps']:.2f} GB/s on one core",
                ["place", "with crc32 s", "without s", "with GB/s", "without GB/s", "overhead", "best with s",
                 "best without s", "best overhead", "CPU s with", "CPU s without"], rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 0
