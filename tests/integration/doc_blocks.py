"""The documents users read (README.md and docs/*.md), their fenced code blocks and the
commands they name, as the doc tests see them.

A ``python`` or ``bash`` block carries an HTML comment ending on the line right above
its fence (rendered nowhere, visible in the source)::

    <!-- runnable setup=NAME
      "llama_7b" => "llama_tiny"
    -->

``setup=NAME`` (optional) names what the block assumes exists (a python block: a
context manager of :mod:`.readme_setups`; a bash block: a command of
``test_doc_commands.SETUPS`` run first in the fresh clone); each following line is
``OLD => NEW``, two Python string literals: a substitution the test applies before
running the block (a tiny model for a 7B one), which must match. A block that is not run
says why instead: ``<!-- not runnable: REASON -->``; the commands of a bash block are
checked without running them either way (``test_doc_commands``).
"""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .import_graph import REPO

DOCUMENTS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

_FENCE = re.compile(r"^```(python|bash)\n(.*?)^```", re.M | re.S)
_ANY_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_MARKER = re.compile(r"<!--\s*(runnable|not runnable:)(.*?)-->\n\Z", re.S)
"""A marker comment ending on the line right above the fence."""

COMMAND_PREFIXES = (".venv/bin/", "python ", "python3 ", "make ", "hyper-offload ", "torchrun ",
                    "bash ", "CPU_SMOKE=", "TORCH_CUDA_SANITIZER=", "pip ")
"""How a code span, an indented line or a bash line that is a command begins."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    """Document line of the block's first code line."""
    language: str
    code: str
    runnable: bool
    setup: str | None
    substitutions: tuple[tuple[str, str], ...]
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def prepared(self) -> str:
        """The code with the marker's substitutions applied (each must match)."""
        code = self.code
        for old, new in self.substitutions:
            assert old in code, f"{self.where}: substitution {old!r} matches nothing"
            code = code.replace(old, new)
        return code


def _parse_marker(kind: str, body: str, where: str) -> tuple[str | None, tuple, str]:
    if kind.startswith("not"):
        return None, (), body.strip()
    first, *rest = body.strip("\n").split("\n")
    words = dict(word.split("=", 1) for word in first.split())
    assert set(words) <= {"setup"}, f"{where}: unknown marker keys {set(words)}"
    substitutions = []
    for text in filter(str.strip, rest):
        old, arrow, new = text.strip().partition(" => ")
        assert arrow, f"{where}: expected OLD => NEW, got {text.strip()!r}"
        substitutions.append((ast.literal_eval(old), ast.literal_eval(new)))
    return words.get("setup"), tuple(substitutions), ""


def blocks(text: str, path: Path = REPO / "README.md") -> list[Block]:
    """Every ``python`` and ``bash`` block of ``text`` with the marker right above it."""
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start(2)) + 1
        before = text[:match.start()]
        marker = _MARKER.match(before, max(before.rfind("<!--"), 0))
        language, code = match.group(1), match.group(2)
        if marker is None:
            found.append(Block(path, line, language, code, False, None, (), ""))
            continue
        where = f"{path.name}:{line}"
        setup, substitutions, reason = _parse_marker(marker.group(1), marker.group(2), where)
        found.append(Block(path, line, language, code, not reason, setup, substitutions, reason))
    return found


def all_blocks(language: str) -> list[Block]:
    return [b for path in DOCUMENTS for b in blocks(path.read_text(), path)
            if b.language == language]


def without_fences(text: str) -> str:
    """``text`` with every fenced block blanked (line numbers kept)."""
    return _ANY_FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


@dataclass(frozen=True)
class Command:
    where: str
    text: str

    def words(self) -> list[str]:
        """The command split as the shell would, environment assignments dropped."""
        words = shlex.split(self.text.replace("[", " ").replace("]", " "), comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words.pop(0)
        return words


def _shell_lines(code: str) -> Iterator[tuple[int, str]]:
    """Logical lines of a shell block (backslash continuations joined), with their offset."""
    pending, start = "", 0
    for offset, line in enumerate(code.splitlines()):
        if not pending:
            start = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def commands(path: Path) -> list[Command]:
    """Every command ``path`` names: each line of its bash blocks, each indented (code)
    line and each code span that begins like a command (:data:`COMMAND_PREFIXES`)."""
    text = path.read_text()
    name = path.relative_to(REPO)
    found = [Command(f"{name}:{b.line + offset}", line.strip())
             for b in blocks(text, path) if b.language == "bash"
             for offset, line in _shell_lines(b.code)
             if line.strip() and not line.strip().startswith("#")]
    prose = without_fences(text)
    for number, line in enumerate(prose.splitlines(), 1):
        if line.startswith("    ") and line.strip().startswith(COMMAND_PREFIXES):
            found.append(Command(f"{name}:{number}", line.strip()))
        for span in re.findall(r"`([^`\n]+)`", line):
            if span.startswith(COMMAND_PREFIXES):
                found.append(Command(f"{name}:{number}", span))
    return found
