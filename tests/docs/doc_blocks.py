"""Extract the fenced code blocks of a markdown file and run them as a reader would, top to bottom.

Which blocks run:

- ```` ```python ```` blocks run in one namespace per file, in order (a later block sees what an
  earlier one defined);
- ```` ```bash ````, ```` ```sh ```` and ```` ```console ```` blocks run each ``ckpt ...`` command
  line through the ``ckpt`` command (``\\`` continuations joined, ``#`` comments and ``$`` prompts
  dropped); a line that is not a ``ckpt`` command makes the block unrunnable here: it must be marked;
- every other fence (``text``, ``json``, ``toml``, none) is shown output or data, not run.

Directives, HTML comments the rendered page does not show, on the line(s) right before a fence:

- ``<!-- doc-test: skip (why) -->``: the next block is not run (it needs GPUs, S3 credentials,
  several nodes, a peer library that is not installed ...); the reason is reported;
- ``<!-- doc-test: setup`` ... ``-->``: Python code between the two lines runs at that place in
  the file, in the file's namespace, e.g. to make a checkpoint a block reads without showing the
  reader a step that is not the point of the example. Setup code (only) may use ``REPO``, the
  repository root as a ``pathlib.Path`` (e.g. to copy a fixture of ``tests/fixtures``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

RUN_LANGS = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "console": "shell",
             "shell": "shell"}
_FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)")
_SKIP = re.compile(r"^\s*<!--\s*doc-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->\s*$")
_SETUP = re.compile(r"^\s*<!--\s*doc-test:\s*setup\b(?P<rest>.*)$")
_DIRECTIVE = re.compile(r"<!--\s*doc-test:")


class DocFormatError(ValueError):
    """A markdown file's code blocks or doc-test directives cannot be read (names the line)."""


@dataclass(frozen=True, slots=True)
class Block:
    """One code block: ``kind`` is python, shell, setup (hidden Python) or other (never run);
    ``line`` is the 1-based line of its opening fence (of the comment, for setup)."""

    path: str
    line: int
    lang: str
    kind: str
    code: str
    skip: str | None = None  # why it is not run, from its skip directive

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def parse(text: str, path: str = "<md>") -> list[Block]:
    """Every fenced block and setup directive of a markdown text, in order.

    Raises DocFormatError for an unclosed fence or setup comment, a doc-test comment that is
    neither directive, or a skip directive that no code block follows."""
    lines = text.splitlines()
    out: list[Block] = []
    pending_skip: tuple[int, str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            indent, ticks, lang = fence.groups()
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j].strip().startswith(ticks) and lines[j].strip().strip("`") == ""), None)
            if end is None:
                raise DocFormatError(f"{path}:{i + 1}: the ``` fence opened here is never closed")
            body = "\n".join(_dedent(lines[k], indent) for k in range(i + 1, end))
            lang = lang.lower()
            kind = RUN_LANGS.get(lang, "other")
            skip = pending_skip[1] if pending_skip else None
            if skip is not None and kind == "other":
                raise DocFormatError(f"{path}:{pending_skip[0]}: a skip directive before a ```{lang} block, "
                                     "which never runs anyway: remove it")
            out.append(Block(path, i + 1, lang, kind, body + "\n", skip))
            pending_skip = None
            i = end + 1
            continue
        skip = _SKIP.match(line)
        setup = _SETUP.match(line)
        if skip:
            pending_skip = (i + 1, skip.group("why").strip())
        elif setup:
            if setup.group("rest").strip():
                raise DocFormatError(f"{path}:{i + 1}: write the setup code on the lines after "
                                     "'<!-- doc-test: setup', and '-->' alone on the last line")
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
            if end is None:
                raise DocFormatError(f"{path}:{i + 1}: the doc-test setup comment opened here is never closed "
                                     "by a '-->' line")
            out.append(Block(path, i + 1, "python", "setup", "\n".join(lines[i + 1:end]) + "\n"))
            i = end + 1
            continue
        elif _DIRECTIVE.search(line):
            raise DocFormatError(f"{path}:{i + 1}: unknown doc-test directive {line.strip()!r}; use "
                                 "'<!-- doc-test: skip (why) -->' or '<!-- doc-test: setup' ... '-->'")
        elif line.strip() and pending_skip is not None:
            raise DocFormatError(f"{path}:{pending_skip[0]}: a skip directive must come right before a code block")
        i += 1
    if pending_skip is not None:
        raise DocFormatError(f"{path}:{pending_skip[0]}: a skip directive with no code block after it")
    return out


def _dedent(line: str, indent: str) -> str:
    return line[len(indent):] if indent and line.startswith(indent) else line


def shell_commands(block: Block) -> list[list[str]]:
    """The argv of each command of a shell block (continuations joined, comments and prompts dropped).

    Raises DocFormatError naming the line when a command is not ``ckpt ...`` or does not parse."""
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(block.code.splitlines()):
        text = raw.rstrip()
        if not buf:
            start = n
            if block.lang == "console":
                if not text.startswith("$ "):
                    continue  # shown output of the command above
                text = text[2:]
        if text.endswith("\\"):
            buf += text[:-1] + " "
            continue
        logical.append((start, buf + text))
        buf = ""
    if buf:
        logical.append((start, buf))
    out = []
    for n, text in logical:
        try:
            argv = shlex.split(text, comments=True)
        except ValueError as e:
            raise DocFormatError(f"{block.path}:{block.line + 1 + n}: cannot parse {text.strip()!r}: {e}") from None
        if not argv:
            continue
        if argv[0] != "ckpt":
            raise DocFormatError(f"{block.path}:{block.line + 1 + n}: {argv[0]!r} is not a ckpt command; a "
                                 "shell block runs only `ckpt ...` lines: mark the block "
                                 "'<!-- doc-test: skip (why) -->' if it cannot run in the test")
        out.append(argv)
    return out


def doc_files(root: Path) -> list[Path]:
    """README.md and docs/*.md, the files whose blocks run."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]
