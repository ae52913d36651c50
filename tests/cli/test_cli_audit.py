"""Audit of every ``ckpt`` command against bad input: the user-facing contract, checked the same way for all.

Commands are discovered from the app's click tree (a new command is covered automatically; one whose
arguments or options this file cannot classify fails :func:`test_every_command_and_option_is_classified`
until it is added to the tables below). Each is run in-process through typer's runner against generated
bad inputs: a missing path, a path below a regular file, a FIFO or a regular file where a directory is
read, an empty directory, a foreign directory (user files only), a damaged manifest (truncated,
bit-flipped, zeroed, random bytes; hypothesis; also a damaged torch.save file and HF config.json), a
FIFO where the manifest or an input file (--rules, --config ...) should be (must not hang: a watchdog
opens the FIFO's other end after FIFO_WAIT_S and the case fails), an output that is, lies inside or
holds the input (with --overwrite too), out-of-range or malformed option values (ranges read from the
options themselves, NaN for every float, tables below for text values), conflicting options, and
click's own refusals. For every case:

- a non-zero exit, no traceback, no exception other than ``SystemExit``;
- stderr is ONE ``error: ...`` line naming the input (or the flag) and what to do (verify and diff may
  instead exit 1 with their report on stdout, naming the input);
- with ``--json``, stdout is strict JSON (no NaN/Infinity): the command's report, or the error object
  ``{"error": {"message", "type", "exit_code"}}`` (ckpt/cli/common.py);
- nothing changes: every file under the sandbox (input, output location, cwd, TMPDIR, memory-tier base)
  is byte-identical afterwards and no file or directory appears.

We run as root, so unreadable-permission cases are not generated.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import ckpt
from ckpt.cli.app import app
from ckpt.cli.common import INPUT_ARGS, OUTPUT_ARGS
from ckpt.manager import step_dir
from ckpt.manifest import MANIFEST_NAME
from tests.integrity.corruption import minor_version_only

runner = CliRunner()
GROUP = typer.main.get_command(app)
COMMANDS: dict[str, Any] = dict(GROUP.commands)  # type: ignore[attr-defined]
FIFO_WAIT_S = 1.5  # a command still blocked on a FIFO after this long counts as hung

# ---------------------------------------------------------------- what each argument and option is

# input arguments: which kind of good input they take (the bad cases are derived from it)
INPUT_KIND = {"url": "ckpt", "src": "ckpt", "a": "ckpt", "b": "ckpt", "root": "root", "hf_dir": "hf"}
# import reads other tools' checkpoints (a torch.save file here); export-hf needs a model's checkpoint
INPUT_KIND_OF = {("import", "src"): "torch", ("export-hf", "src"): "hfckpt"}
# commands whose exit 1 is a report on stdout (problems found, checkpoints differ), not an error
REPORTERS = {"verify", "diff"}
# required options: a valid value
REQUIRED = {"to": "single", "fmt": "dcp"}
# options naming a path the command reads: (command, option) -> kind of file
PATH_OPTIONS = {
    ("plan", "rules"): "file", ("reshard", "rules"): "file", ("import", "rules"): "file",
    ("export", "rules"): "file", ("export-hf", "tokenizer"): "dir", ("export-hf", "config"): "file",
    ("export-hf", "source_names"): "file", ("import-hf", "names"): "file", ("train", "init_from"): "ckpt",
}
# options whose value is free text or a path the command creates: nothing to call out of range
FREE = {"storage_option", "shm_dir", "run_id", "metrics", "plot", "ckpt_dir", "out", "seed"}
# malformed values of string (or unranged number) options, by option name
BAD_VALUES: dict[str, list[str]] = {
    "to": ["tp=0", "tp=-2", "tp=x", "warp=2", "tp"],
    "stages": ["0", "-1,2", "x"],
    "memory_budget": ["0", "-1", "2XB", "1e999GB"],
    "max_shard_size": ["0", "-5GB", "lots"],
    "max_staging": ["0", "-1", "lots"],
    "fmt": ["zip"],
    "dtype": ["int4"],
    "names": ["nonsense"],
    "source_names": ["nonsense"],
    "config": ["huge"],  # train's model config (export-hf's --config is a path: PATH_OPTIONS)
    "memory_busy": ["sometimes"],
    "schedule": ["zigzag"],
    "device": ["tpu"],
    "moe_dispatch": ["broadcast"],
    "stop_after": ["-1"],
    "fail_at_step": ["-1"],
    "lr": ["-1", "nan", "0"],
    "storage_option": ["novalue"],
}
# conflicting or meaningless combinations, by command
CONFLICTS: dict[str, list[list[str]]] = {
    "train": [["--fail-node", "0"], ["--fail-at-step", "1", "--fail-rank", "4"], ["--steps", "3", "--stop-after", "9"],
              ["--memory-max-overhead", "0.5"]],
}
# numeric options whose whole type range is valid
UNRANGED_OK = {"seed"}


def _params(name: str) -> list[Any]:
    return list(COMMANDS[name].params)


def _range(p: Any) -> tuple[Any, Any]:
    """A numeric option's (min, max) (typer's own parameter model, else click's range type)."""
    src = p if hasattr(p, "type_descriptor") else getattr(p, "type", None)
    return getattr(src, "min", None), getattr(src, "max", None)


def _is_float(p: Any) -> bool:
    td = getattr(p, "type_descriptor", None)
    if td is not None:
        return td.annotation is float or "float" in str(td.annotation)
    return "float" in type(p.type).__name__.lower()


def _is_argument(p: Any) -> bool:
    return p.param_type_name == "argument"


def _is_flag(p: Any) -> bool:
    return bool(getattr(p, "is_flag", False))


def _flag(name: str, opt: str) -> str:
    return next(o for p in _params(name) if p.name == opt for o in p.opts if o.startswith("--"))


def _has(name: str, opt: str) -> bool:
    return any(p.name == opt for p in _params(name))


def _input_args(name: str) -> list[str]:
    return [p.name for p in _params(name) if _is_argument(p) and p.name in INPUT_ARGS]


def _kind(name: str, arg: str) -> str:
    return INPUT_KIND_OF.get((name, arg), INPUT_KIND.get(arg, "?"))


def test_every_command_and_option_is_classified() -> None:
    """A new command or option must be placed in the tables above (so the audit below covers it)."""
    assert set(COMMANDS) >= {"inspect", "verify", "ls", "gc", "plan", "reshard", "diff", "import", "export",
                             "import-hf", "export-hf", "train", "demo"}
    for name, cmd in COMMANDS.items():
        for p in cmd.params:
            if _is_argument(p):
                assert p.name in INPUT_ARGS or p.name in OUTPUT_ARGS, (name, p.name, "an argument of unknown role")
                if p.name in INPUT_ARGS:
                    assert _kind(name, p.name) != "?", (name, p.name, "add its kind to INPUT_KIND")
                continue
            if p.required:
                assert p.name in REQUIRED, (name, p.name, "a required option: add a valid value to REQUIRED")
            if _is_flag(p):
                continue
            ranged = _range(p) != (None, None)
            known = ranged or p.name in BAD_VALUES or p.name in FREE or (name, p.name) in PATH_OPTIONS
            assert known or p.name in UNRANGED_OK, (name, p.name, "no bad value known: add it to BAD_VALUES / FREE")


# ---------------------------------------------------------------- fixtures: good inputs, the sandbox


def _save_ckpt(path: Path) -> str:
    ckpt.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4).bfloat16()}, "step": 1},
              str(path), step=1)
    return str(path)


def _make_hf(d: Path) -> str:
    """A tiny Llama model directory (config.json + model.safetensors), written by hand."""
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    h, inter, vocab = 8, 16, 16
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "vocab_size": vocab, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 64}
    p = "model.layers.0."
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,),
              p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (4, h),
              p + "self_attn.v_proj.weight": (4, h), p + "self_attn.o_proj.weight": (h, h),
              p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
              p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
              p + "post_attention_layernorm.weight": (h,)}
    save_file({k: torch.randn(s, generator=g) for k, s in shapes.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _hf_ckpt(path: Path) -> str:
    """A checkpoint export-hf accepts: the tiny Llama's weights with the metadata import-hf records."""
    from safetensors.torch import load_file

    d = _make_hf(path.parent / "hf-src")
    cfg = json.loads((Path(d) / "config.json").read_text())
    weights = load_file(str(Path(d) / "model.safetensors"))
    shutil.rmtree(d)
    meta = {"hf_adapter": "llama", "hf_config": cfg | {"attention_bias": False, "mlp_bias": False, "head_dim": 4},
            "names": "ckpt", "rules": "hf-decoder", "layout": {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "sp": 1, "zero": 0},
            "source": {"format": "huggingface", "url": d}}
    ckpt.save({"model": weights}, str(path), step=0, user_metadata=meta)
    return str(path)


def _make_good(kind: str, base: Path) -> tuple[str, Path]:
    """A good input of ``kind`` under ``base``: (the path to pass, the file whose damage makes it bad)."""
    if kind == "ckpt":
        url = _save_ckpt(base / "ckpt")
        return url, Path(url) / MANIFEST_NAME
    if kind == "hfckpt":
        url = _hf_ckpt(base / "hfckpt")
        return url, Path(url) / MANIFEST_NAME
    if kind == "root":
        _save_ckpt(base / "root" / step_dir(1))
        return str(base / "root"), base / "root" / step_dir(1) / MANIFEST_NAME
    if kind == "hf":
        d = _make_hf(base / "hf")
        return d, Path(d) / "config.json"
    if kind == "torch":
        torch.save({"model": {"w": torch.arange(6.0)}, "step": 3}, str(base / "model.pt"))
        return str(base / "model.pt"), base / "model.pt"
    if kind == "file":
        (base / "input.toml").write_text("[rules]\n")
        return str(base / "input.toml"), base / "input.toml"
    if kind == "dir":
        (base / "tok").mkdir()
        (base / "tok" / "tokenizer.json").write_text("{}")
        return str(base / "tok"), base / "tok" / "tokenizer.json"
    raise AssertionError(kind)


class Sandbox:
    """A directory holding everything a run may touch: inputs, the output location, the cwd, TMPDIR and
    the memory-tier base. :meth:`snapshot` lists every entry with its type, mode and content hash."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inp = root / "in"
        self.inp.mkdir(parents=True)
        for d in ("cwd", "tmp", "shm"):
            (root / d).mkdir()
        self.fifos: list[str] = []
        self.good: dict[str, str] = {}

    def out(self, name: str = "out") -> str:
        return str(self.root / name)

    def snapshot(self) -> dict[str, tuple[Any, ...]]:
        snap: dict[str, tuple[Any, ...]] = {}
        for d, dirs, files in os.walk(self.root):
            for n in dirs + files:
                p = os.path.join(d, n)
                s = os.lstat(p)
                rel = os.path.relpath(p, self.root)
                if stat.S_ISREG(s.st_mode):
                    with open(p, "rb") as f:
                        snap[rel] = ("file", s.st_mode, hashlib.sha256(f.read()).hexdigest())
                elif stat.S_ISLNK(s.st_mode):
                    snap[rel] = ("link", os.readlink(p))
                else:
                    snap[rel] = ("other", s.st_mode)
        return snap


@contextlib.contextmanager
def sandbox() -> Iterator[Sandbox]:
    """A fresh sandbox as the cwd, TMPDIR and $CKPT_SHM_DIR (plain context manager: usable in hypothesis tests)."""
    old_cwd, old_tempdir, old_env = os.getcwd(), tempfile.tempdir, {k: os.environ.get(k) for k in ("CKPT_SHM_DIR",)}
    with tempfile.TemporaryDirectory() as tmp:
        box = Sandbox(Path(tmp) / "box")
        os.chdir(box.root / "cwd")
        tempfile.tempdir = str(box.root / "tmp")
        os.environ["CKPT_SHM_DIR"] = str(box.root / "shm")
        try:
            yield box
        finally:
            os.chdir(old_cwd)
            tempfile.tempdir = old_tempdir
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(autouse=True, scope="module")
def _no_training() -> Iterator[None]:
    """A bad input that reached the trainer would start torchrun: make that a loud failure instead."""
    import ckpt.trainer.demo as demo
    import ckpt.trainer.launch as launch

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("bad input reached the trainer (it should have been refused before)")

    saved = (launch.launch, demo.run_demo)
    launch.launch, demo.run_demo = refuse, refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        launch.launch, demo.run_demo = saved  # type: ignore[assignment]


# ---------------------------------------------------------------- running a case and checking the contract


def invoke(args: list[str], fifos: Sequence[str] = ()) -> tuple[Any, list[str]]:
    """Run ``ckpt ARGS`` in-process; a FIFO still blocking a reader (or writer) after FIFO_WAIT_S is
    opened from the other side, so the run ends, and reported as hung."""
    done, hung = threading.Event(), []

    def unblock() -> None:
        while not done.wait(FIFO_WAIT_S):
            for f in fifos:
                for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
                    try:
                        fd = os.open(f, flags)
                    except OSError:
                        continue
                    if flags & os.O_WRONLY:
                        hung.append(f)  # a reader was blocked on it
                    os.close(fd)

    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    try:
        r = runner.invoke(app, args)
    finally:
        done.set()
        t.join()
    return r, hung


def strict_json(text: str) -> Any:
    def refuse(c: str) -> Any:
        raise ValueError(f"not JSON: {c}")

    return json.loads(text, parse_constant=refuse)


def check(box: Sandbox, args: list[str], *, expect_error: bool = True, names: tuple[str, ...] = (),
          output: str | None = None) -> Any:
    """Run one case under the contract (see the module docstring); returns the runner's result. With
    ``output`` (and ``expect_error=False``), a run that succeeds may create that path (only that)."""
    before = box.snapshot()
    r, hung = invoke(args, box.fifos)
    case = f"ckpt {' '.join(args)}\n--- exit {r.exit_code}; stdout:\n{r.stdout}\n--- stderr:\n{r.stderr}"
    assert not hung, f"hung on FIFO {hung}: {case}"
    assert r.exception is None or isinstance(r.exception, SystemExit), f"{r.exception!r}: {case}"
    assert "Traceback" not in r.stdout + r.stderr, case
    after = box.snapshot()
    if output is not None and r.exit_code == 0:
        rel = os.path.relpath(output, box.root)
        after = {k: v for k, v in after.items() if k != rel and not k.startswith(rel + os.sep)}
    assert after == before, f"changed: {sorted(set(after.items()) ^ set(before.items()))}: {case}"
    if expect_error:
        assert r.exit_code != 0, case
    report = r.exit_code == 1 and args[0] in REPORTERS  # verify / diff: the report says what is wrong
    if r.exit_code != 0 and not report:
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line: {case}"
        if names:
            assert any(n in lines[0] for n in names), f"the error names none of {names}: {case}"
        if "--json" in args:
            err = strict_json(r.stdout)["error"]  # the error object, with the stderr line's message
            assert err["exit_code"] == r.exit_code and lines[0] == f"error: {err['message']}", case
        else:
            assert r.stdout == "", case
    elif "--json" in args:
        strict_json(r.stdout)
    if report and names:
        assert any(n in r.stdout for n in names), f"the report names none of {names}: {case}"
    return r


def command_args(box: Sandbox, name: str, *, bad: dict[str, str] | None = None, json_out: bool = False,
                 extra: Sequence[str] = ()) -> list[str]:
    """``[name, ...]``: good inputs (made under the sandbox) and fresh outputs, except where ``bad`` gives a value."""
    bad = bad or {}
    args: list[str] = [name]
    for p in _params(name):
        if _is_argument(p):
            if p.name in bad:
                args.append(bad[p.name])
            elif p.name in OUTPUT_ARGS:
                args.append(box.out(p.name))
            else:
                args.append(good_input(box, _kind(name, p.name)))
        elif p.required:
            args += [_flag(name, p.name), bad.get(p.name, REQUIRED[p.name])]
    for opt, value in bad.items():
        if not any(p.name == opt and _is_argument(p) or p.name == opt and p.required for p in _params(name)):
            args += [_flag(name, opt), value]
    if json_out and _has(name, "json_out"):
        args.append("--json")
    return args + list(extra)


def good_input(box: Sandbox, kind: str) -> str:
    """A good input of ``kind`` in the sandbox (made once per sandbox)."""
    if kind not in box.good:
        (box.inp / f"good-{kind}").mkdir()
        box.good[kind] = _make_good(kind, box.inp / f"good-{kind}")[0]
    return box.good[kind]


# ---------------------------------------------------------------- bad inputs

BAD_PATHS = ["missing", "below-a-file", "a-fifo", "a-random-file", "empty-dir", "foreign-dir", "manifest-fifo",
             "manifest-is-a-dir", "manifest-empty"]


def make_bad(box: Sandbox, kind: str, case: str) -> tuple[str, bool]:
    """A bad input of ``kind``: (path, whether an error is required). A root (ls, gc) that is empty, foreign
    or holds a damaged checkpoint is a valid root whose entry is reported: exit 0 allowed, nothing changed."""
    base = box.inp / case
    base.mkdir()
    if case == "missing":
        return str(base / "nope"), True
    if case == "below-a-file":
        (base / "afile").write_text("user data\n")
        return str(base / "afile" / "child"), True
    if case == "a-fifo":
        os.mkfifo(base / "fifo")
        box.fifos.append(str(base / "fifo"))
        return str(base / "fifo"), True
    if case == "a-random-file":
        (base / "blob").write_bytes(os.urandom(300))
        return str(base / "blob"), True
    if case == "empty-dir":
        (base / "empty").mkdir()
        return str(base / "empty"), kind != "root"
    if case == "foreign-dir":
        (base / "mine" / "data").mkdir(parents=True)
        (base / "mine" / "notes.txt").write_text("user notes\n")
        (base / "mine" / "data" / "x.bin").write_bytes(os.urandom(64))
        return str(base / "mine"), kind != "root"
    path, manifest = _make_good(kind, base)
    if case == "manifest-fifo":
        manifest.unlink()
        os.mkfifo(manifest)
        box.fifos.append(str(manifest))
    elif case == "manifest-is-a-dir":
        manifest.unlink()
        manifest.mkdir()
    elif case == "manifest-empty":
        manifest.write_bytes(b"")
    else:
        raise AssertionError(case)
    return path, kind != "root"


def _cases_for_inputs() -> list[tuple[str, str, str]]:
    return [(name, arg, case) for name in sorted(COMMANDS) for arg in _input_args(name) for case in BAD_PATHS]


@pytest.mark.parametrize(("name", "arg", "case"), _cases_for_inputs())
def test_bad_input_path(name: str, arg: str, case: str) -> None:
    with sandbox() as box:
        kind = _kind(name, arg)
        path, required = make_bad(box, kind, case)
        for json_out in (False, True):
            check(box, command_args(box, name, bad={arg: path}, json_out=json_out), expect_error=required,
                  names=(path, os.path.basename(path)))




def _path_option_cases() -> list[Any]:
    out = []
    for n, o in sorted(PATH_OPTIONS):
        for c in ("missing", "below-a-file", "empty-dir", "fifo", "random-bytes"):
            marks: list[Any] = []  # (rules + random bytes was a bug: load_rules let a UnicodeDecodeError out)
            out.append(pytest.param(n, o, c, marks=marks))
    return out


@pytest.mark.parametrize(("name", "opt", "case"), _path_option_cases())
def test_bad_input_path_option(name: str, opt: str, case: str) -> None:
    """Options naming a file or directory the command reads (--rules, --config, --init-from ...)."""
    with sandbox() as box:
        kind = PATH_OPTIONS[(name, opt)]
        base = box.inp / f"opt-{case}"
        base.mkdir()
        if case == "fifo":
            path = str(base / "fifo")
            os.mkfifo(path)
            box.fifos.append(path)
        elif case == "random-bytes":
            path = str(base / "blob.json")
            Path(path).write_bytes(bytes(range(256)) * 2)
        elif case == "empty-dir" and kind == "dir":
            return  # an empty tokenizer directory is a valid (empty) one
        else:
            path, _ = make_bad(box, kind, case)
        check(box, command_args(box, name, bad={opt: path}, json_out=True), names=(path, os.path.basename(path)))


# ---------------------------------------------------------------- damaged manifests (hypothesis)

READERS = sorted((n, a) for n in COMMANDS for a in _input_args(n) if _kind(n, a) in ("ckpt", "hf", "torch"))


@st.composite
def damage(draw: st.DrawFn, data: bytes) -> bytes:
    how = draw(st.sampled_from(["truncate", "flip", "random", "zero-run"]))
    if how == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "flip":
        i, bit = draw(st.integers(0, len(data) - 1)), draw(st.integers(0, 7))
        return data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1:]
    if how == "zero-run":
        i = draw(st.integers(0, len(data) - 1))
        n = draw(st.integers(1, 16))
        out = data[:i] + bytes(min(n, len(data) - i)) + data[i + n:]
        return out if out != data else data[:-1]
    out = draw(st.binary(min_size=0, max_size=2 * len(data)))
    return out if out != data else out + b"\0"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_damaged_manifest_is_refused_and_left_alone(data: st.DataObject) -> None:
    name, arg = data.draw(st.sampled_from(READERS), label="command")
    json_out = data.draw(st.booleans(), label="json")
    with sandbox() as box:
        kind = _kind(name, arg)
        path, manifest = _make_good(kind, box.inp)
        raw = manifest.read_bytes()
        damaged = data.draw(damage(raw), label="damaged")
        # the one harmless manifest flip: a newer minor version reads the same (tests/integrity/corruption.py)
        assume(kind not in ("ckpt", "hfckpt") or not minor_version_only(raw, damaged))
        manifest.write_bytes(damaged)
        # no checksum covers a torch.save zip's headers or an HF config.json: a flip in a field nothing reads
        # ("version needed", "architectures" next to "model_type") is harmless, and the import may go on
        harmless_ok = kind in ("torch", "hf")
        r = check(box, command_args(box, name, bad={arg: path}, json_out=json_out), expect_error=not harmless_ok,
                  names=(path, os.path.basename(path), manifest.name), output=box.out("dst"))
        if r.exit_code == 0 and kind == "torch":  # then it must have imported exactly what the file holds
            try:  # (a flip in a pickled name, "model" -> "lodel", makes another valid file: nothing checks it)
                held = torch.load(path, weights_only=True, map_location="cpu")
            except Exception:  # noqa: BLE001 - torch refuses it: then only what was saved may come out
                held = {"model": {"w": torch.arange(6.0)}, "step": 3}
            if isinstance(held, dict) and set(held) == {"model", "step"} and set(held["model"]) == {"w"}:
                got = ckpt.load({"model": {"w": torch.zeros(6)}, "step": 0}, box.out("dst"))
                assert torch.equal(got["model"]["w"], held["model"]["w"]) and got["step"] == held["step"]
            else:
                assert "model.w" not in ckpt.inspect(box.out("dst")).tensors
        if kind in ("ckpt", "hfckpt") and name not in REPORTERS | {"import"}:
            # 3 when the damage shows as corruption (not msgpack, a checksum); 2 when what is left decodes to
            # something that is not a manifest of ours (a flipped envelope key: "format is None")
            assert r.exit_code in (2, 3), r.stderr


def test_a_flipped_manifest_is_exit_3_and_a_truncated_one_exit_2(tmp_path: Path) -> None:
    """As the README says: a checksum that does not match is integrity (3); bytes that do not decode as a
    manifest at all are "manifest" (2, ManifestError: the library's type for them, tests/integrity)."""
    url = _save_ckpt(tmp_path / "c")
    manifest = Path(url) / MANIFEST_NAME
    data = manifest.read_bytes()
    manifest.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # in the checksummed body
    assert runner.invoke(app, ["inspect", url]).exit_code == 3
    manifest.write_bytes(data[: len(data) // 2])
    r = runner.invoke(app, ["inspect", url])
    assert r.exit_code == 2 and "corrupted" in r.stderr


# ---------------------------------------------------------------- options out of range, conflicts


def _bad_option_values(p: Any) -> list[str]:
    vals = list(BAD_VALUES.get(p.name, []))
    lo, hi = _range(p)
    is_float = _is_float(p)
    if lo is not None:
        vals.append(str(lo - 1) if not is_float else str(lo - 0.5))
    if hi is not None:
        vals.append(str(hi + 1))
    if is_float:
        vals.append("nan")
    return list(dict.fromkeys(vals))


def _option_cases() -> list[tuple[str, str, str]]:
    out = []
    for name in sorted(COMMANDS):
        for p in _params(name):
            if _is_argument(p) or _is_flag(p) or p.name in FREE or (name, p.name) in PATH_OPTIONS:
                continue
            if p.name == "config" and name != "train":
                continue
            out += [(name, p.name, v) for v in _bad_option_values(p)]
    return out


@pytest.mark.parametrize(("name", "opt", "value"), _option_cases())
def test_out_of_range_option(name: str, opt: str, value: str) -> None:
    with sandbox() as box:
        flag = _flag(name, opt)
        check(box, command_args(box, name, bad={opt: value}, json_out=True), names=(flag,))


@pytest.mark.parametrize(("name", "extra"), [(n, e) for n, es in sorted(CONFLICTS.items()) for e in es])
def test_conflicting_options(name: str, extra: list[str]) -> None:
    with sandbox() as box:
        check(box, command_args(box, name, json_out=True, extra=extra), names=tuple(a for a in extra if "--" in a))


WRITERS = sorted(n for n in COMMANDS if any(p.name in OUTPUT_ARGS for p in _params(n) if _is_argument(p)))


@pytest.mark.parametrize("how", ["same", "inside", "holds", "same-overwrite"])
@pytest.mark.parametrize("name", WRITERS)
def test_output_overlapping_the_input_is_refused(name: str, how: str) -> None:
    """DST is SRC, lies inside it or holds it: refused before anything is written (with --overwrite too)."""
    with sandbox() as box:
        arg = _input_args(name)[0]
        src = good_input(box, _kind(name, arg))
        out = next(p.name for p in _params(name) if _is_argument(p) and p.name in OUTPUT_ARGS)
        dst = {"inside": os.path.join(src, "out"), "holds": os.path.dirname(src)}.get(how, src)
        extra = ["--overwrite"] if how == "same-overwrite" and _has(name, "overwrite") else []
        r = check(box, command_args(box, name, bad={arg: src, out: dst}, json_out=True, extra=extra), names=(dst,))
        assert r.exit_code == 5, r.stderr


def test_usage_errors_are_one_line_and_json() -> None:
    """Click's own refusals (missing argument, unknown option or command) follow the same contract."""
    with sandbox() as box:
        for args in (["inspect"], ["inspect", "x", "--bogus"], ["bogus-command"], ["gc", "x", "--keep-last", "0"],
                     ["inspect", "--json"], ["diff", "a", "--json"]):
            r = check(box, args)
            assert r.exit_code == 2, r.stderr


def test_print_json_is_strict() -> None:
    """Non-finite floats (e.g. ``diff --atol inf``) are written as strings, never as bare NaN / Infinity."""
    import io
    import sys

    from ckpt.cli.common import print_json

    buf, old = io.StringIO(), sys.stdout
    sys.stdout = buf
    try:
        print_json({"a": math.inf, "b": [math.nan, -math.inf, 1.5]})
    finally:
        sys.stdout = old
    assert strict_json(buf.getvalue()) == {"a": "inf", "b": ["nan", "-inf", 1.5]}


def test_every_command_takes_json() -> None:
    assert [n for n in sorted(COMMANDS) if not _has(n, "json_out")] == []


def test_diff_reports_progress(tmp_path: Path) -> None:
    """``diff(progress=)`` (the CLI's bar) counts the bytes of the tensors both sides hold, once each,
    up to their total; a tensor only one side holds adds nothing."""
    from ckpt.resharders.diff import diff

    a = _save_ckpt(tmp_path / "a")
    ckpt.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "x": torch.ones(8)}, "step": 1},
              str(tmp_path / "b"), step=1)
    seen: list[tuple[int, int]] = []
    report = diff(a, str(tmp_path / "b"), progress=lambda done, total: seen.append((done, total)))
    assert not report.ok  # "b" and "x" are on one side only
    assert seen[-1] == (48, 48) and [d for d, _ in seen] == sorted(d for d, _ in seen)  # w: 12 float32
    assert len(seen) == 3  # one call per key of either side: model.b, model.w, model.x


# ---------------------------------------------------------------- regressions of what the audit found


def test_option_errors_name_the_flag() -> None:
    """A library message about a value the user gave an option is prefixed with that option's flag."""
    import inspect

    from ckpt.cli.common import cli_message
    from ckpt.cli.reshard import reshard_cmd

    sig = inspect.signature(reshard_cmd.__wrapped__)
    bound = {"to": "tp=0", "memory_budget": "2GB", "rules": None}
    assert cli_message("layout: tp=0 must be a positive integer", sig, bound) == \
        "--to: layout: tp=0 must be a positive integer"
    bound = {"to": "tp=2", "memory_budget": "-1"}
    assert cli_message("size '-1': expected a number", sig, bound) == "--memory-budget: size '-1': expected a number"
    assert cli_message("--memory-budget: size '-1'", sig, bound) == "--memory-budget: size '-1'"  # named already
    assert cli_message("x: checksum mismatch in shard 1", sig, bound) == "x: checksum mismatch in shard 1"
    assert cli_message("layout: tp=2 must divide", sig, {"to": "tp=2", "memory_budget": "2GB"}) == \
        "--to: layout: tp=2 must divide"


def test_train_and_demo_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """--json on the trainer's commands: one JSON object on stdout, the commentary on stderr."""
    import ckpt.trainer.demo as demo

    with sandbox() as box:
        run = box.inp / "run"
        ckpt.save({"x": torch.zeros(2)}, str(run / step_dir(4)), step=4)
        r = runner.invoke(app, ["train", "--steps", "6", "--stop-after", "4", "--ckpt-dir", str(run), "--json"])
        assert r.exit_code == 0, r.output
        out = strict_json(r.stdout)
        assert out["trained"] is False and out["latest"] == 4 and out["ckpt_dir"] == str(run)
        assert r.stderr.startswith("nothing to train:")
        report = demo.DemoReport(out_dir="d", ckpt_dir="d/ckpts", metrics="d/metrics.jsonl", final_checkpoint="x",
                                 eval_loss=1.5, wall_s=3.0)
        monkeypatch.setattr(demo, "run_demo", lambda *a, **k: report)
        monkeypatch.setattr(demo, "summarize", lambda rep: ["line"])
        r = runner.invoke(app, ["demo", "--json"])
        assert r.exit_code == 0, r.output
        assert strict_json(r.stdout) == report.to_dict() and "final checkpoint: x" in r.stderr


def test_ls_of_a_checkpoint_says_to_list_its_root() -> None:
    with sandbox() as box:
        url = _save_ckpt(box.inp / "c")
        r = runner.invoke(app, ["ls", url, "--no-memory"])
        assert r.exit_code == 0 and f"`ckpt inspect {url}`" in r.stdout and f"`ckpt ls {box.inp}`" in r.stdout
