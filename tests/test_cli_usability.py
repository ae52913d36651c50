"""What a new user tries first: missing paths, unknown URLs, hints, piped tables, --json, --version."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.manager import step_dir

runner = CliRunner()
CKPT = os.path.join(os.path.dirname(sys.executable), "ckpt")


def test_ls_and_gc_of_a_missing_root_are_errors(tmp_path):
    for cmd in ("ls", "gc"):
        r = runner.invoke(app, [cmd, str(tmp_path / "nope")])
        assert r.exit_code != 0 and r.output.startswith("error:") and "does not exist" in r.output


def test_unknown_protocol_is_one_line(tmp_path):
    r = runner.invoke(app, ["ls", "foo://x"])
    assert r.exit_code != 0 and r.output.startswith("error:") and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_install_hint_keeps_the_extra_name():
    p = subprocess.run([CKPT, "ls", "gs://bucket/x"], capture_output=True, text=True, timeout=60)
    if "gcsfs" in p.stderr:  # gcsfs absent here: the hint must name the extra, which must exist
        assert "ckpt[gcs]" in p.stderr
        with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")) as f:
            assert 'gcs = ["gcsfs' in f.read()


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"ckpt {ckpt.__version__}"


def test_piped_tables_show_full_values(tmp_path):
    root = tmp_path / ("a-rather-long-directory-name-" * 4)
    ckpt.save({"w": torch.zeros(2)}, str(root / step_dir(1)), step=1)
    p = subprocess.run([CKPT, "ls", str(root)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and str(root / step_dir(1)) in p.stdout  # not cut with an ellipsis


def test_gc_json_reports_removed_and_kept(tmp_path):
    root = tmp_path / "r"
    ckpt.save({"w": torch.zeros(2)}, str(root / step_dir(1)), step=1)
    os.makedirs(root / step_dir(2) / "data")
    (root / step_dir(2) / "data" / "mine.csv").write_text("x")
    os.makedirs(root / step_dir(3))
    r = runner.invoke(app, ["gc", str(root), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert [c["step"] for c in out["removed"]] == [3]
    assert [(c["step"], c["status"]) for c in out["kept_not_ours"]] == [(2, "foreign")]
    r = runner.invoke(app, ["ls", str(root), "--json"])
    assert {c["step"]: c["status"] for c in json.loads(r.output)} == {1: "committed", 2: "foreign"}


def test_verify_deep_reports_progress(tmp_path):
    url = str(tmp_path / "c")
    ckpt.save({"a": torch.arange(1000.0), "b": torch.ones(3, 300), "c": torch.zeros(0)}, url)
    calls: list[tuple[int, int]] = []
    r = ckpt.verify(url, deep=True, progress=lambda done, total: calls.append((done, total)))
    assert r.ok and len(calls) == 2  # one call per hashed (non-empty) shard
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert calls[-1] == (r.bytes_hashed, r.bytes_hashed) == (4000 + 3600, 4000 + 3600)
    assert ckpt.verify(url, progress=lambda d, t: calls.append((-1, -1))).ok and calls[-1] != (-1, -1)  # not deep
    # on a terminal the CLI draws a bar on stderr; --quiet and --json draw none
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "120"}
    cmd = [sys.executable, "-m", "ckpt.cli.app", "verify", "--deep", url]
    shown = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "verify" in shown.stderr and "7.6" in shown.stderr, shown.stderr
    quiet = subprocess.run([*cmd, "--quiet"], env=env, capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and quiet.stderr == ""
