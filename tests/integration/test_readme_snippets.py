"""README's Python snippets run as written (issue 45): every ``python`` block is marked
runnable or says why not, and each runnable one executes on tiny configs.

The marker convention is documented in :mod:`.readme_setups`; the snippet runs in a
fresh namespace holding its setup's names, with the working directory a temporary
folder (snippets write files), and a traceback points at README's line.
"""

from __future__ import annotations

import ast
import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from . import readme_setups
from .import_graph import REPO

README = REPO / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_MARKER = re.compile(r"<!--\s*(runnable|not runnable:)(.*?)-->\n\Z", re.S)
"""A marker comment ending on the line right above the fence."""


@dataclass(frozen=True)
class Snippet:
    line: int
    """README line of the block's first code line."""
    code: str
    runnable: bool
    setup: str | None
    substitutions: tuple[tuple[str, str], ...]
    reason: str

    def prepared(self) -> str:
        """The code with the marker's substitutions applied (each must match)."""
        code = self.code
        for old, new in self.substitutions:
            assert old in code, f"README.md:{self.line}: substitution {old!r} matches nothing"
            code = code.replace(old, new)
        return code


def _parse_marker(kind: str, body: str, line: int) -> tuple[str | None, tuple, str]:
    if kind.startswith("not"):
        return None, (), body.strip()
    first, *rest = body.strip("\n").split("\n")
    words = dict(word.split("=", 1) for word in first.split())
    assert set(words) <= {"setup"}, f"README.md:{line}: unknown marker keys {set(words)}"
    substitutions = []
    for text in filter(str.strip, rest):
        old, arrow, new = text.strip().partition(" => ")
        assert arrow, f"README.md:{line}: expected OLD => NEW, got {text.strip()!r}"
        substitutions.append((ast.literal_eval(old), ast.literal_eval(new)))
    return words.get("setup"), tuple(substitutions), ""


def snippets(text: str) -> list[Snippet]:
    """Every ``python`` block of ``text`` with the marker right above it (module docstring)."""
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start(1)) + 1
        before = text[:match.start()]
        marker = _MARKER.match(before, max(before.rfind("<!--"), 0))
        if marker is None:
            found.append(Snippet(line, match.group(1), False, None, (), ""))
            continue
        setup, substitutions, reason = _parse_marker(marker.group(1), marker.group(2), line)
        found.append(Snippet(line, match.group(1), not reason, setup, substitutions, reason))
    return found


SNIPPETS = snippets(README.read_text())
RUNNABLE = [s for s in SNIPPETS if s.runnable]


def test_every_python_block_is_marked_runnable_or_says_why_not() -> None:
    unmarked = [s.line for s in SNIPPETS if not s.runnable and not s.reason]
    assert SNIPPETS and unmarked == [], (
        f"README.md lines {unmarked}: put <!-- runnable [setup=NAME] --> or "
        "<!-- not runnable: REASON --> right above each ```python block")


def test_the_parser_reads_markers_and_substitutions() -> None:
    text = ('<!-- runnable setup=classifier\n  ".cuda()" => ""\n-->\n```python\nx = 1\n```\n'
            "<!-- not runnable: needs two GPUs -->\n```python\ny = 2\n```\n```python\nz\n```\n")
    first, second, third = snippets(text)
    assert (first.runnable, first.setup, first.substitutions) == (True, "classifier",
                                                                  ((".cuda()", ""),))
    assert (second.runnable, second.reason) == (False, "needs two GPUs")
    assert (third.runnable, third.reason, third.line) == (False, "", 12)


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[f"line{s.line}" for s in RUNNABLE])
def test_the_snippet_runs(snippet: Snippet, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    # Padded so that a traceback names README's own line numbers.
    code = compile("\n" * (snippet.line - 1) + snippet.prepared(), str(README), "exec")
    setup = getattr(readme_setups, snippet.setup) if snippet.setup else contextlib.nullcontext
    torch._dynamo.reset()
    try:
        with setup() as names:
            exec(code, {"__name__": "readme_snippet", **(names or {})})  # noqa: S102
    finally:
        torch._dynamo.reset()
