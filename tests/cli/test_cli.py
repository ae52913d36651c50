"""CLI: inspect and verify on good checkpoints, and verify catching corruption."""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture
def good(tmp_path):
    url = str(tmp_path / "c")
    state = {"model": {"w": torch.randn(64, 32), "b": torch.randn(32).bfloat16()}, "step": 12}
    ckpt.save(state, url, step=12, user_metadata={"arch": "tiny"})
    return url


def test_inspect_table_and_json(good):
    r = runner.invoke(app, ["inspect", good])
    assert r.exit_code == 0, r.output
    assert "model.w" in r.output and "float32" in r.output and "step 12" in r.output
    r = runner.invoke(app, ["inspect", good, "--json"])
    d = json.loads(r.output)
    assert d["step"] == 12 and d["tensors"]["model.w"] == {"dtype": "float32", "shape": [64, 32], "shards": 1,
                                                             "bytes": 64 * 32 * 4}
    assert d["total_bytes"] == 64 * 32 * 4 + 32 * 2 and d["user_metadata"] == {"arch": "tiny"}


def test_verify_good(good):
    r = runner.invoke(app, ["verify", good, "--deep"])
    assert r.exit_code == 0, r.output
    assert "ok" in r.output
    r = runner.invoke(app, ["verify", good, "--json"])
    assert json.loads(r.output)["ok"] is True


def _data_file(url: str) -> str:
    (f,) = os.listdir(os.path.join(url, "data"))
    return os.path.join(url, "data", f)


def test_verify_deep_catches_flipped_byte(good):
    m = ckpt.inspect(good)
    s = m.tensors["model.w"].shards[0]
    path = _data_file(good)
    with open(path, "r+b") as f:
        f.seek(s.offset + 100)
        b = f.read(1)
        f.seek(s.offset + 100)
        f.write(bytes([b[0] ^ 0x01]))
    assert runner.invoke(app, ["verify", good]).exit_code == 0  # shallow: sizes and headers still fine
    r = runner.invoke(app, ["verify", good, "--deep"])
    assert r.exit_code == 1
    assert "checksum mismatch" in r.output and "model.w" in r.output


def test_verify_catches_truncated_file(good):
    path = _data_file(good)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    r = runner.invoke(app, ["verify", good])
    assert r.exit_code == 1 and "truncated" in r.output and os.path.basename(path) in r.output


def test_verify_catches_deleted_file(good):
    path = _data_file(good)
    os.unlink(path)
    r = runner.invoke(app, ["verify", good, "--json"])
    assert r.exit_code == 1
    probs = json.loads(r.output)["problems"]
    assert probs[0]["kind"] == "missing-file" and probs[0]["file"].endswith(os.path.basename(path))


@pytest.mark.multiproc
def test_verify_catches_overlapping_shard(tmp_path):
    url = str(tmp_path / "c")
    # Build a valid 2-shard checkpoint, then edit the manifest so the second shard overlaps the first.
    from tests.dist_utils import run_ranks

    run_ranks(2, _save_rows, url)
    from tests.manifest_edit import edit_manifest

    # rows [2, 6) overlap rows [0, 4)
    edit_manifest(url, lambda d: d["tensors"]["w"]["shards"][1]["box"].__setitem__(0, [2, 0]))
    r = runner.invoke(app, ["verify", url])
    assert r.exit_code == 1
    assert "coverage" in r.output and "overlap" in r.output and "'w'" in r.output


def _save_rows(rank: int, world: int, url: str) -> None:
    g = torch.arange(32.0).reshape(8, 4)
    ckpt.save({"w": ckpt.Shard(g[rank * 4 : rank * 4 + 4].clone(), (8, 4), (rank * 4, 0))}, url)


def test_inspect_missing_is_one_line_error(tmp_path):
    for cmd in ("inspect", "verify"):  # the same error line and exit code for both
        r = runner.invoke(app, [cmd, str(tmp_path / "nope")])
        assert r.exit_code == 2
        assert r.output.startswith("error:") and "no such file or directory" in r.output
        assert "may not have finished" not in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["verify", str(tmp_path)])  # a directory without a manifest
    assert r.exit_code == 2 and "no committed checkpoint" in r.output
