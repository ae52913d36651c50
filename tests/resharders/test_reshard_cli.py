"""``ckpt plan`` / ``ckpt reshard`` / ``ckpt diff`` on the command line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.cli.reshard import parse_size, short_layout
from ckpt.errors import StateError
from ckpt.layout import Layout
from tests.resharders.moe_states import config, save_single

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture
def src(tmp_path):
    url = str(tmp_path / "src")
    save_single(url)
    return url


def test_plan_table_and_json(src):
    r = runner.invoke(app, ["plan", src, "--to", "tp=2,ep=2,pp=2"])
    assert r.exit_code == 0, r.output
    assert "single (1 ranks) -> tp=2,ep=2,pp=2 (8 ranks)" in r.output and "largest single read" in r.output
    assert len([ln for ln in r.output.splitlines() if ln.startswith("│ ")]) == 8  # one row per target rank
    r = runner.invoke(app, ["plan", src, "--to", "ep=4", "--json"])
    d = json.loads(r.output)
    assert d["target"]["world_size"] == 4 and len(d["ranks"]) == 4
    assert d["totals"]["bytes_read"] == d["totals"]["tensor_bytes"]
    mv = d["ranks"][0]["writes"][0]
    assert mv["reads"] and all(len(x) == 3 for x in mv["reads"])


def test_reshard_then_diff(src, tmp_path):
    dst = str(tmp_path / "dst")
    r = runner.invoke(app, ["reshard", src, dst, "--to", "tp=2,dp=2,zero=1", "--memory-budget", "8MiB",
                            "--workers", "3"])
    assert r.exit_code == 0, r.output
    assert "ok:" in r.output and ckpt.inspect(dst).world_size == 4
    r = runner.invoke(app, ["diff", src, dst])
    assert r.exit_code == 0 and "equal" in r.output
    r = runner.invoke(app, ["diff", src, dst, "--json"])
    assert json.loads(r.output)["ok"] is True
    other = str(tmp_path / "other")
    save_single(other, seed=1)
    r = runner.invoke(app, ["diff", src, other])
    assert r.exit_code == 1 and "DIFFERENT" in r.output and "model.lm_head.weight" in r.output
    r = runner.invoke(app, ["reshard", src, dst, "--to", "tp=2"])
    assert r.exit_code == 6 and "overwrite" in r.output


def test_errors_are_one_line(src, tmp_path):
    r = runner.invoke(app, ["plan", src, "--to", "ep=3"])
    assert r.exit_code == 5 and "choose ep in [1, 2, 4]" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["plan", src, "--to", "tp=two"])
    assert r.exit_code == 5 and "not an integer" in r.output
    r = runner.invoke(app, ["reshard", src, str(tmp_path / "d"), "--to", "tp=2", "--memory-budget", "lots"])
    assert r.exit_code == 5 and "size 'lots'" in r.output
    odd = str(tmp_path / "odd")
    save_single(odd, config(num_experts=6))
    r = runner.invoke(app, ["reshard", odd, str(tmp_path / "d"), "--to", "ep=4"])
    assert r.exit_code == 5 and "6 experts" in r.output
    r = runner.invoke(app, ["plan", src, "--to", "tp=2", "--rules", str(tmp_path / "none.toml")])
    assert r.exit_code == 5 and "cannot read rules file" in r.output
    s = ckpt.inspect(src).tensors["model.lm_head.weight"].shards[0]
    with open(f"{src}/{s.file}", "r+b") as f:
        f.seek(s.offset)
        f.write(b"\x00\x01\x02\x03")
    r = runner.invoke(app, ["reshard", src, str(tmp_path / "e"), "--to", "tp=2"])
    assert r.exit_code == 3 and "model.lm_head.weight" in r.output and "checksum mismatch" in r.output


def test_sizes_and_layout_names():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("512MiB") == 512 << 20 and parse_size("1.5g") == 15 * 10**8
    assert parse_size("4096") == 4096
    with pytest.raises(StateError):
        parse_size("2 parsecs")
    assert short_layout(Layout()) == "single" and short_layout(Layout.parse("tp=2,dp=2,zero=1")) == "tp=2,dp=2,zero=1"
    assert short_layout({"tp": 2, "ep": 1}) == "tp=2" and short_layout(None) == "-"


def test_reshard_json_and_user_files_in_dst_are_refused(src, tmp_path):
    dst = str(tmp_path / "j")
    r = runner.invoke(app, ["reshard", src, dst, "--to", "tp=2", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["layout"] and out["files"] >= 1 and out["tensor_bytes"] > 0 and out["gb_per_s"] > 0
    user = tmp_path / "u"
    (user / "data").mkdir(parents=True)
    (user / "data" / "train.jsonl").write_text("{}\n")
    r = runner.invoke(app, ["reshard", src, str(user), "--to", "tp=2"])
    assert r.exit_code != 0 and r.output.startswith("error:") and "train.jsonl" in r.output
    assert (user / "data" / "train.jsonl").read_text() == "{}\n"


def test_to_without_zero_keeps_the_source_zero_stage(src, tmp_path):
    z1 = str(tmp_path / "z1")
    r = runner.invoke(app, ["reshard", src, z1, "--to", "dp=2,zero=1", "--json"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["reshard", z1, str(tmp_path / "a"), "--to", "tp=2,dp=2", "--json"])
    assert r.exit_code == 0, r.output
    assert "zero=1" in json.loads(r.output)["layout"]
    r = runner.invoke(app, ["reshard", z1, str(tmp_path / "b"), "--to", "tp=2,dp=2,zero=0", "--json"])
    assert r.exit_code == 0, r.output
    assert "zero" not in json.loads(r.output)["layout"]


def test_plan_reshard_and_diff_accept_sp(src, tmp_path):
    """sp replicates parameters: an sp layout is a replica (and ZeRO range) change, nothing else."""
    r = runner.invoke(app, ["plan", src, "--to", "sp=2,tp=2,zero=1"])
    assert r.exit_code == 0, r.output
    assert "-> tp=2,sp=2,zero=1 (4 ranks)" in r.output and "dp/tp/pp/ep/sp" in r.output
    dst, back = str(tmp_path / "sp"), str(tmp_path / "back")
    assert runner.invoke(app, ["reshard", src, dst, "--to", "sp=2,tp=2,zero=1"]).exit_code == 0
    m = ckpt.inspect(dst)
    assert m.world_size == 4 and m.layout is not None and m.layout["sp"] == 2
    assert runner.invoke(app, ["reshard", dst, back, "--to", "dp=1,zero=0"]).exit_code == 0
    r = runner.invoke(app, ["diff", src, back])
    assert r.exit_code == 0 and "equal" in r.output
    r = runner.invoke(app, ["plan", src, "--to", "sp=0"])
    assert r.exit_code == 5 and "sp=0 must be a positive integer" in r.output
