"""The Python snippets of README.md and docs/*.md run as written (issues 45, 51): every
``python`` block is marked runnable or says why not, and each runnable one executes on
tiny configs.

The marker convention is documented in :mod:`.doc_blocks`, the setups in
:mod:`.readme_setups`; the snippet runs in a fresh namespace holding its setup's names,
with the working directory a temporary folder (snippets write files), and a traceback
points at the document's own line.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from . import readme_setups
from .doc_blocks import DOCUMENTS, Block, all_blocks, blocks

SNIPPETS = all_blocks("python")
RUNNABLE = list({(s.setup, s.prepared()): s for s in reversed(SNIPPETS) if s.runnable}.values())[::-1]
"""Each runnable snippet once: README repeats a few of the guide's (the same code with the
same setup is the same test; it runs at its first place)."""


def test_every_python_block_is_marked_runnable_or_says_why_not() -> None:
    unmarked = [s.where for s in SNIPPETS if not s.runnable and not s.reason]
    assert SNIPPETS and unmarked == [], (
        f"{unmarked}: put <!-- runnable [setup=NAME] --> or "
        "<!-- not runnable: REASON --> right above each ```python block")
    assert {s.path.name for s in SNIPPETS} >= {"README.md", "compile.md", "eager.md"}
    assert len(RUNNABLE) < len([s for s in SNIPPETS if s.runnable])  # README repeats some
    assert len(DOCUMENTS) > 10  # README and the user guide


def test_the_parser_reads_markers_and_substitutions() -> None:
    text = ('<!-- runnable setup=classifier\n  ".cuda()" => ""\n-->\n```python\nx = 1\n```\n'
            "<!-- not runnable: needs two GPUs -->\n```python\ny = 2\n```\n```python\nz\n```\n"
            "<!-- runnable -->\n```bash\nmake demo-plan\n```\n")
    first, second, third, fourth = blocks(text)
    assert (first.runnable, first.setup, first.substitutions) == (True, "classifier",
                                                                  ((".cuda()", ""),))
    assert (second.runnable, second.reason) == (False, "needs two GPUs")
    assert (third.runnable, third.reason, third.line) == (False, "", 12)
    assert (fourth.language, fourth.runnable, fourth.code) == ("bash", True, "make demo-plan\n")


@pytest.mark.parametrize("snippet", RUNNABLE,
                         ids=[f"{s.path.stem}-line{s.line}" for s in RUNNABLE])
def test_the_snippet_runs(snippet: Block, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    # Padded so that a traceback names the document's own line numbers.
    code = compile("\n" * (snippet.line - 1) + snippet.prepared(), str(snippet.path), "exec")
    setup = getattr(readme_setups, snippet.setup) if snippet.setup else contextlib.nullcontext
    torch._dynamo.reset()
    try:
        with setup() as names:
            exec(code, {"__name__": "readme_snippet", **(names or {})})  # noqa: S102
    finally:
        torch._dynamo.reset()
