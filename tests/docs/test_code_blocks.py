"""Every code block of README.md and docs/*.md runs, so that the examples cannot rot.

One test per file (its name is the test id): its Python blocks run in order in one namespace, its
shell blocks' ``ckpt ...`` lines through the ``ckpt`` command, all in a fresh working directory
(the docs use relative paths, so everything they write lands there). A block that cannot run here
is marked ``<!-- doc-test: skip (why) -->`` in the markdown; the test reports how many it skipped
and why. The rules of extraction are in :mod:`tests.docs.doc_blocks`.

The ``ckpt`` lines run in this process (``ckpt.cli.app:app``, the console script's own app, through
typer's runner): a fresh interpreter per line would spend most of the budget importing torch.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ckpt.cli.app import app
from tests.docs.doc_blocks import Block, DocFormatError, doc_files, parse, shell_commands

ROOT = Path(__file__).resolve().parents[2]
FILES = doc_files(ROOT)
# over ~5 s on 2 cores: they export and reload Hugging Face models, or convert peers' checkpoints
SLOW = {"README.md", "HF.md", "INTEROP.md", "TRAINER.md"}
MULTIPROC = {"README.md"}  # its trainer block runs torchrun


def _param(path: Path) -> Any:
    marks = [pytest.mark.slow] if path.name in SLOW else []
    marks += [pytest.mark.multiproc] if path.name in MULTIPROC else []
    return pytest.param(path, id=path.name, marks=marks)


def run_ckpt(argv: list[str], block: Block) -> None:
    """One ``ckpt ...`` line of ``block``; fails the test (with the command's output) unless it exits 0."""
    result = CliRunner().invoke(app, argv[1:])
    print(f"$ {' '.join(argv)}\n{result.output}", end="")  # shown with the test's output (-s, or a failure)
    if result.exit_code != 0:
        detail = "".join(traceback.format_exception(*result.exc_info)) if result.exc_info and not isinstance(
            result.exception, SystemExit) else ""
        pytest.fail(f"{block.where}: `{' '.join(argv)}` exited {result.exit_code}:\n{result.output}{detail}",
                    pytrace=False)


def run_python(block: Block, namespace: dict[str, Any]) -> None:
    """Execute a Python block in the file's namespace; fails the test naming the block on any error."""
    code = compile(block.code, f"{block.where} ({block.kind})", "exec")
    try:
        exec(code, namespace)
    except Exception:
        pytest.fail(f"{block.where}: the ```python block raised:\n{traceback.format_exc()}", pytrace=False)


def run_file(path: Path) -> tuple[dict[Block, float], list[Block]]:
    """Run every block of ``path`` in order in the current directory; ``({block run: seconds}, blocks skipped)``."""
    blocks = parse(path.read_text(), str(path.relative_to(ROOT)))
    namespace: dict[str, Any] = {"__name__": "__doc_test__", "REPO": ROOT}
    ran: dict[Block, float] = {}
    skipped = []
    for block in blocks:
        if block.kind == "other":
            continue
        if block.skip is not None:
            skipped.append(block)
            continue
        t = time.perf_counter()
        if block.kind == "shell":
            for argv in shell_commands(block):
                run_ckpt(argv, block)
        else:
            run_python(block, namespace)
        ran[block] = time.perf_counter() - t
    return ran, skipped


@pytest.mark.parametrize("path", [_param(p) for p in FILES])
def test_code_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                         record_property: Any) -> None:
    monkeypatch.chdir(tmp_path)
    # the memory tier's shared memory and the trainer's threads stay inside this test
    monkeypatch.setenv("CKPT_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ran, skipped = run_file(path)
    slowest = sorted(ran.items(), key=lambda kv: -kv[1])[:3]
    summary = (f"{path.name}: ran {len(ran)} block(s) in {sum(ran.values()):.1f} s"
               + "".join(f"; {b.where} {s:.1f} s" for b, s in slowest) + f"; skipped {len(skipped)}"
               + "".join(f"\n  skipped {b.where}: {b.skip}" for b in skipped))
    record_property("doc_blocks", summary)
    print(summary)


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in FILES])
def test_blocks_are_runnable_or_marked(path: Path) -> None:
    """Fast: every file parses, and every shell block not marked skip holds only ``ckpt`` lines."""
    for block in parse(path.read_text(), path.name):
        if block.kind == "shell" and block.skip is None:
            shell_commands(block)


def test_skip_reasons_and_setup_parse() -> None:
    text = ("<!-- doc-test: skip (needs 2 GPUs) -->\n```python\nimport torch\n```\n"
            "<!-- doc-test: setup\nx = 1\n-->\n```bash\nckpt ls runs \\\n  --json   # comment\n```\n"
            "```text\nnot run\n```\n")
    blocks = parse(text)
    assert [(b.kind, b.skip, b.line) for b in blocks] == [
        ("python", "needs 2 GPUs", 2), ("setup", None, 5), ("shell", None, 8), ("other", None, 12)]
    assert blocks[1].code == "x = 1\n"
    assert shell_commands(blocks[2]) == [["ckpt", "ls", "runs", "--json"]]


@pytest.mark.parametrize("text, message", [
    ("```python\nx = 1\n", "never closed"),
    ("<!-- doc-test: skip (why) -->\n\n", "no code block after it"),
    ("<!-- doc-test: skip (why) -->\nprose\n```python\n```\n", "right before a code block"),
    ("<!-- doc-test: skip (why) -->\n```text\nout\n```\n", "never runs anyway"),
    ("<!-- doc-test: skp (why) -->\n", "unknown doc-test directive"),
    ("<!-- doc-test: setup\nx = 1\n", "never closed"),
    ("```bash\nscripts/demo.sh\n```\n", "not a ckpt command"),
])
def test_bad_markdown_is_refused_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(DocFormatError, match=message):
        for block in parse(text, "x.md"):
            if block.kind == "shell":
                shell_commands(block)


_WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-./=", min_size=1, max_size=8)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["python", "bash", "console", "text", ""]), st.booleans(),
                          st.lists(st.lists(_WORD, min_size=1, max_size=4), min_size=1, max_size=3)),
                max_size=5))
def test_generated_markdown_round_trips(spec: list[tuple[str, bool, list[list[str]]]]) -> None:
    """Blocks written into markdown (prose between them, some marked skip) come back in order, with
    their language, skip reason, opening line and ``ckpt`` argv."""
    lines, expected = ["# title", ""], []
    for n, (lang, skip, commands) in enumerate(spec):
        runs = lang in ("python", "bash", "console")
        if skip and runs:
            lines.append(f"<!-- doc-test: skip (reason {n}) -->")
        lines.append(f"```{lang}")
        start = len(lines)
        for words in commands:
            lines.append(("$ " if lang == "console" else "") + " ".join(["ckpt", *words]))
        lines += ["```", "", f"prose {n}", ""]
        expected.append((lang, f"reason {n}" if skip and runs else None, start, [["ckpt", *w] for w in commands]))
    blocks = parse("\n".join(lines))
    assert [(b.lang, b.skip, b.line) for b in blocks] == [(e[0], e[1], e[2]) for e in expected]
    for block, e in zip(blocks, expected, strict=True):
        if block.kind == "shell":
            assert shell_commands(block) == e[3]
