"""``ckpt gc --memory`` removes what no job can restore from the memory tier (a replaced root's copies,
incomplete copies, leftover views) and nothing else; ``ckpt ls`` never hangs on a tier.json that is
a FIFO or otherwise not a regular file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt.cli.app import app
from ckpt.tier import gc_memory, list_memory
from ckpt.tier.nodes import run_id_for, step_name
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]


def _age(path: Path, seconds: float) -> None:
    """Make everything under ``path`` look untouched for ``seconds``."""
    past = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (past, past), follow_symlinks=False)


def test_gc_memory_removes_only_what_no_job_can_restore(shm: str, tmp_path: Path,
                                                        save_memory: Callable[..., None]) -> None:
    root = str(tmp_path / "ckpts")
    run_ranks(4, save_memory, shm, root, (1, 2))
    tier = Path(shm) / f"ckpt-{run_id_for(root)}"
    before = {(m.step, m.node, m.owner, m.kind) for m in list_memory(root, shm)}
    assert len(before) == 8
    # an incomplete copy (a write cut short) and a killed restore's view: garbage once old enough
    cut = tier / "node-0" / "rank-0" / step_name(3)
    shutil.copytree(tier / "node-0" / "rank-0" / step_name(2), cut)
    (cut / "manifest.msgpack").unlink()
    view = tier / "view-1-deadbeef"
    view.mkdir()
    (view / "manifest.msgpack").write_bytes(b"x")
    assert gc_memory(root, shm, min_age=300) == []  # just written: a job may be using them
    _age(cut, 3600)
    _age(view, 3600)
    r = CliRunner().invoke(app, ["gc", root, "--memory", "--shm-dir", shm, "--min-age", "300", "--json"])
    assert r.exit_code == 0, r.output
    removed = json.loads(r.output)["memory_removed"]
    assert {(Path(m["path"]).name, m["reason"].split(" ")[0]) for m in removed} == {
        (step_name(3), "incomplete"), ("view-1-deadbeef", "a")}
    assert not cut.exists() and not view.exists()
    assert len(list(tier.rglob(".slots"))) == 8  # ranks with copies keep their slots
    assert {(m.step, m.node, m.owner, m.kind) for m in list_memory(root, shm)} == before  # committed copies stay
    # the root emptied and reused by a new run: its lineage is new, the old copies can never be restored
    shutil.rmtree(root)
    os.makedirs(root)
    Path(root, ".ckpt-lineage").write_text("a-new-run")
    _age(tier, 3600)
    dry = gc_memory(root, shm, min_age=300, dry_run=True)
    assert len(dry) == 8 and all("lineage" in m.reason for m in dry) and tier.exists()
    # the spare slots (the files copies are written and received into) go with their directories
    assert len(list(tier.rglob(".slots"))) == 8
    assert len(gc_memory(root, shm, min_age=300)) == 8
    assert not tier.exists()  # nothing left of the run: its directory and tier.json are gone too


def test_ls_memory_never_hangs_on_a_tier_json_that_is_not_a_regular_file(shm: str, tmp_path: Path) -> None:
    run = Path(shm) / "ckpt-fifo"
    run.mkdir()
    os.mkfifo(run / "tier.json")  # opening it for reading would block forever without O_NONBLOCK
    (Path(shm) / "ckpt-dev").mkdir()
    os.symlink("/dev/zero", Path(shm) / "ckpt-dev" / "tier.json")  # never ends if read
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "ckpt.cli.app", "ls", str(tmp_path), "--shm-dir", shm, "--json"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout) == [], proc.stderr
    assert list_memory(None, shm) == [] and gc_memory(None, shm, min_age=0) == []
    assert (run / "tier.json").exists()  # not ours: left alone
