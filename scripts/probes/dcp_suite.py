r"""Run PyTorch's test/distributed/checkpoint files against DCP and against ckpt.dcp (import swapped).

Usage: .venv/bin/python scripts/probes/dcp_suite.py [FILE ...] [--timeout S] [--only dcp|ckpt]
(CKPT_DCP_SUITE: the work folder, default /tmp/dcp_suite)
Test files live in /tmp/dcp_suite/src/ (fetched from pytorch/pytorch, never committed). For each one
the driver writes two copies, dcp/<file> (as is) and ckpt/<file> (imports rewritten), runs each with
pytest under `timeout`, and prints a per-test table; results accumulate in results.json.

Rewrite rule: what `sed -i s/torch\.distributed\.checkpoint/ckpt.dcp/g` does to a code base: every
`torch.distributed.checkpoint` becomes `ckpt.dcp` (imports of the package and of its submodules:
`ckpt.dcp.<x>` is DCP's submodule <x>, except that state_dict_saver / state_dict_loader carry ckpt's
save / async_save / save_state_dict / load / load_state_dict). Nothing else changes.
Options: --timeout S (per file and variant, default 900); --only dcp|ckpt (rerun one variant, keep the other's
stored results).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = os.environ.get("CKPT_DCP_SUITE", "/tmp/dcp_suite")  # PyTorch's test files (src/), expecttest (deps/)
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PY = sys.executable


def rewrite(src: str) -> str:
    return src.replace("torch.distributed.checkpoint", "ckpt.dcp")


def run(rel: str, variant: str, timeout: int) -> dict[str, str]:
    with open(os.path.join(HERE, "src", rel)) as f:
        src = f.read()
    out_dir = os.path.join(HERE, variant, os.path.dirname(rel))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, os.path.basename(rel))
    with open(path, "w") as f:
        f.write(rewrite(src) if variant == "ckpt" else src)
    xml = path + ".xml"
    log = path + ".log"
    if os.path.exists(xml):
        os.remove(xml)
    env = dict(os.environ, PYTHONPATH=f"{HERE}/deps:{REPO}", CUDA_VISIBLE_DEVICES="",
               TORCH_SHOW_CPP_STACKTRACES="0", OMP_NUM_THREADS="1")
    cmd = ["timeout", str(timeout), PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--rootdir", out_dir, f"--junitxml={xml}", path]
    with open(log, "w") as lf:
        rc = subprocess.run(cmd, cwd=out_dir, env=env, stdout=lf, stderr=subprocess.STDOUT).returncode
    res: dict[str, str] = {}
    if os.path.exists(xml):
        for tc in ET.parse(xml).getroot().iter("testcase"):
            name = f"{tc.get('classname', '').split('.')[-1]}::{tc.get('name')}"
            kids = {c.tag for c in tc}
            res[name] = ("fail" if kids & {"failure", "error"} else "skip" if "skipped" in kids else "pass")
    else:
        res["<file>"] = f"no result (rc {rc})"
    return res


def main() -> None:
    args = sys.argv[1:]
    timeout = 900
    if "--timeout" in args:
        i = args.index("--timeout")
        timeout = int(args[i + 1])
        del args[i:i + 2]
    only = None
    if "--only" in args:
        i = args.index("--only")
        only = args[i + 1]
        del args[i:i + 2]
    files = args or sorted(os.path.relpath(os.path.join(d, f), os.path.join(HERE, "src"))
                           for d, _, fs in os.walk(os.path.join(HERE, "src")) for f in fs if f.endswith(".py"))
    db_path = os.path.join(HERE, "results.json")
    db: dict[str, dict[str, dict[str, str]]] = {}
    if os.path.exists(db_path):
        with open(db_path) as f:
            db = json.load(f)
    for rel in files:
        prev = db.get(rel, {})
        dcp = prev["dcp"] if only == "ckpt" else run(rel, "dcp", timeout)
        ck = prev["ckpt"] if only == "dcp" else run(rel, "ckpt", timeout)
        db[rel] = {"dcp": dcp, "ckpt": ck}
        with open(db_path, "w") as f:
            json.dump(db, f, indent=1, sort_keys=True)
    for rel in sorted(db):
        dcp, ck = db[rel]["dcp"], db[rel]["ckpt"]
        passing = [t for t, r in dcp.items() if r == "pass"]
        both = [t for t in passing if ck.get(t) == "pass"]
        print(f"{rel}: {len(dcp)} tests, pass vs DCP {len(passing)}, of those pass vs ckpt.dcp {len(both)}")
        for t in sorted(dcp):
            if dcp[t] == "pass" and ck.get(t) != "pass":
                print(f"    FAILS on ckpt.dcp: {t} ({ck.get(t)})")


if __name__ == "__main__":
    main()
