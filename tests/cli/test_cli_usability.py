"""What a new user tries first: missing paths, unknown URLs, hints, piped tables, --json, --version."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.manager import step_dir

runner = CliRunner()
CKPT = os.path.join(os.path.dirname(sys.executable), "ckpt")


def test_ls_and_gc_of_a_missing_root_are_errors(tmp_path):
    for cmd in ("ls", "gc"):
        r = runner.invoke(app, [cmd, str(tmp_path / "nope")])
        assert r.exit_code == 2 and r.output.startswith("error:") and "no such file or directory" in r.output


def test_unknown_protocol_is_one_line(tmp_path):
    r = runner.invoke(app, ["ls", "foo://x"])
    assert r.exit_code != 0 and r.output.startswith("error:") and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.multiproc
def test_install_hint_keeps_the_extra_name():
    p = subprocess.run([CKPT, "ls", "gs://bucket/x"], capture_output=True, text=True, timeout=60)
    if "gcsfs" in p.stderr:  # gcsfs absent here: the hint must name the extra, which must exist
        assert "ckpt[gcs]" in p.stderr
        with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")) as f:
            assert 'gcs = ["gcsfs' in f.read()


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"ckpt {ckpt.__version__}"


@pytest.mark.slow
@pytest.mark.multiproc
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


@pytest.mark.slow
@pytest.mark.multiproc
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


# ---- issue 30 (6): first-hour rough edges, fixed as a class in ckpt/cli/common.py ----

# every command that reads a path, with the least arguments it takes; {src} is the path, {dst} an output
COMMANDS = {
    "inspect": ["{src}"], "verify": ["{src}"], "ls": ["{src}"], "gc": ["{src}"],
    "plan": ["{src}", "--to", "tp=2"], "reshard": ["{src}", "{dst}", "--to", "tp=2"], "diff": ["{src}", "{src}"],
    "import": ["{src}", "{dst}"], "export": ["{src}", "{dst}", "--format", "dcp"],
    "export-hf": ["{src}", "{dst}"], "import-hf": ["{src}", "{dst}"],
}


def _sig(name):
    import inspect as _inspect

    cmd = next(c for c in app.registered_commands if (c.name or c.callback.__name__) == name)
    return _inspect.signature(cmd.callback)


def test_every_reading_command_is_covered():
    """A new command with an input path must join COMMANDS (and so the tests below)."""
    from ckpt.cli.common import INPUT_ARGS

    reading = {c.name for c in app.registered_commands if c.name and set(_sig(c.name).parameters) & set(INPUT_ARGS)}
    assert reading - {"train", "demo"} <= set(COMMANDS), reading - set(COMMANDS)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(COMMANDS)), leaf=st.from_regex(r"[a-z][a-z0-9_-]{0,12}", fullmatch=True))
def test_a_missing_path_is_one_code_and_one_message_everywhere(name, leaf):
    """Whatever the command: exit 2, the same one line, and no output directory created."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "missing-" + leaf), os.path.join(tmp, "out")
        args = [a.format(src=src, dst=dst) for a in COMMANDS[name]]
        r = runner.invoke(app, [name, *args])
        assert r.exit_code == 2, (name, r.output)
        assert r.output == f"error: {src}: no such file or directory (nothing to read there; check the path)\n"
        assert not os.path.exists(dst)


KWARG_HINTS = sorted({m for p in Path(ckpt.__file__).parent.rglob("*.py") if "cli" not in p.parts
                      for m in re.findall(r"\b([a-z_]+=(?:True|False))", p.read_text())})


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_library_hints_name_the_commands_flags(name):
    """Every ``name=True/False`` the library's messages may carry reads as the command's own flag where
    the command has one (and is left for the Python API where it has none)."""
    from ckpt.cli.common import _flags, cli_message

    sig = _sig(name)
    flags = _flags(sig)
    for hint in KWARG_HINTS:
        kw, value = hint.split("=")
        flag = flags.get(kw if value == "True" else "no_" + kw)
        out = cli_message(f"x: refused; pass {hint} (--some-flag) to go on", sig)
        if flag:
            assert hint not in out and flag[0] in out, (name, hint, out)
        else:
            assert out == f"x: refused; pass {hint} (--some-flag) to go on"


def test_existing_dst_error_names_the_flag(tmp_path):
    src = str(tmp_path / "c")
    ckpt.save({"w": torch.zeros(4)}, src, step=1)
    for name, args in (("reshard", [src, str(tmp_path / "d"), "--to", "single"]),
                       ("export", [src, str(tmp_path / "e"), "--format", "dcp", "-q"]),
                       ("import", [str(tmp_path / "e"), str(tmp_path / "f"), "-q"])):
        assert runner.invoke(app, [name, *args]).exit_code == 0
        r = runner.invoke(app, [name, *args])
        assert r.exit_code == 6 and "--overwrite" in r.output and "overwrite=True" not in r.output, r.output


def _corrupt(url: str) -> None:
    data = next((Path(url) / "data").iterdir())
    b = bytearray(data.read_bytes())
    b[-5] ^= 1
    data.write_bytes(b)


def test_a_refused_write_leaves_no_dst_it_created(tmp_path):
    src = str(tmp_path / "c")
    ckpt.save({"model.layers.0.mlp.down_proj.weight": torch.randn(8, 8)}, src, step=1)
    _corrupt(src)
    r = runner.invoke(app, ["reshard", src, str(tmp_path / "dst"), "--to", "tp=2"])
    assert r.exit_code == 3 and "--no-verify-source" in r.output and "verify_source" not in r.output
    assert not (tmp_path / "dst").exists()
    (tmp_path / "mine").mkdir()  # a DST that was there before is the user's: kept
    r = runner.invoke(app, ["reshard", src, str(tmp_path / "mine"), "--to", "tp=2"])
    assert r.exit_code == 3 and (tmp_path / "mine").is_dir()


def test_handle_errors_removes_only_the_empty_directories_it_created(tmp_path):
    """The rule itself, on a command that creates DST (and a subdirectory, and maybe a file) then refuses."""
    import typer

    from ckpt.cli.common import handle_errors
    from ckpt.errors import LayoutError

    @handle_errors
    def make(dst: str = typer.Argument(...), leave_file: bool = typer.Option(False, "--leave-file")) -> None:
        os.makedirs(os.path.join(dst, "data", "tmp"))
        if leave_file:
            Path(dst, "data", "user.bin").write_bytes(b"x")
        raise LayoutError("refused")

    cmd = typer.Typer()
    cmd.command()(make)
    cmd.command("other")(lambda: None)
    assert runner.invoke(cmd, ["make", str(tmp_path / "a")]).exit_code == 5
    assert not (tmp_path / "a").exists()
    assert runner.invoke(cmd, ["make", str(tmp_path / "b"), "--leave-file"]).exit_code == 5
    assert sorted(p.name for p in (tmp_path / "b").rglob("*")) == ["data", "user.bin"]  # files never removed


def test_dst_a_file_or_unwritable_is_one_line(tmp_path):
    src = str(tmp_path / "c")
    ckpt.save({"w": torch.zeros(4)}, src, step=1)
    (tmp_path / "afile").write_text("x")
    for dst in (tmp_path / "afile", tmp_path / "afile" / "below"):
        r = runner.invoke(app, ["export", src, str(dst), "--format", "dcp", "-q"])
        assert r.exit_code == 4 and r.output.startswith("error:") and "Traceback" not in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and "directory" in r.output
    assert (tmp_path / "afile").read_text() == "x"


def test_timings_show_each_figure_in_its_unit(tmp_path):
    from ckpt.cli.inspect_verify import figure

    url = str(tmp_path / "c")
    ckpt.save({"w": torch.zeros(1024)}, url, step=1)
    r = runner.invoke(app, ["inspect", url, "--timings"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    rows = {line.split("│")[1].strip(): line for line in r.output.splitlines() if line.count("│") > 3}
    assert "KiB" in rows["bytes"] and " s " not in rows["bytes"]
    assert rows["persist"].count(" s ") == 3
    assert figure("replica_bytes", 2048) == "2.0 KiB" and figure("wait_ms", 1.5) == "1.5 ms"
    assert figure("cast", 3) == "3" and figure("stage", 0.5) == "0.5000 s"


def test_ls_of_a_root_without_steps_says_so(tmp_path):
    r = runner.invoke(app, ["ls", str(tmp_path), "--no-memory"])
    assert r.exit_code == 0 and r.output == f"no checkpoints under {tmp_path} (no step-N directories)\n"
    assert "Exit codes:" in runner.invoke(app, ["--help"], env={"COLUMNS": "400"}).output
