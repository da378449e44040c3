"""Every link and every name README.md and docs/*.md point at exists (issue 51): relative
links to files that exist, ``#anchors`` that are headings of the target (as GitHub makes
them), repository paths named in code spans, and ``hyper_offload.*`` names that import.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from .doc_blocks import DOCUMENTS, without_fences
from .import_graph import REPO

_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")
_SPAN = re.compile(r"`([^`\n]+)`")
_REPO_PATH = re.compile(
    r"(?:offload_compile|passes|runtime|tests|benchmarks|examples|scripts|docs|\.ci)/[\w./-]*"
    r"|(?:README|CHANGELOG)\.md|Makefile|pyproject\.toml")
_NAME = re.compile(r"hyper_offload(?:\.[A-Za-z_]\w*)+")
_OUTPUTS = ("out/", "benchmarks/data/")
"""Folders whose files commands write (they need not exist in a clone)."""


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and
    underscores kept), spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (outside code blocks), repeats numbered."""
    found: set[str] = set()
    for line in without_fences(path.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match is None:
            continue
        base = slug(match.group(1))
        anchor, count = base, 0
        while anchor in found:
            count += 1
            anchor = f"{base}-{count}"
        found.add(anchor)
    return found


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def _link_problems(path: Path) -> list[str]:
    problems = []
    text = without_fences(path.read_text())
    for number, line in enumerate(text.splitlines(), 1):
        for _, target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            where = f"{_shown(path)}:{number}: ({target})"
            if not linked.exists():
                problems.append(f"{where} no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{where} no heading #{anchor} in {linked.name}")
    return problems


def _resolves(name: str) -> bool:
    """Whether ``hyper_offload.a.b.c`` is a module or an attribute of one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                value = getattr(value, attribute)
        except AttributeError:
            return False
        return True
    return False


def _path_exists(named: str) -> bool:
    """A file or folder of the repository, a module without its ``.py``, or a module's
    attribute (``passes/ir/host.host_bucket_bytes``)."""
    module = named.rsplit(".", 1)[0] if "." in Path(named).name else named
    return any((REPO / candidate).exists()
               for candidate in (named, named + ".py", module + ".py", module))


def _checked_text(path: Path) -> list[str]:
    """The lines whose spans name what must exist: fenced blocks blanked, and the first
    cell of a ``| was | is |`` table's rows (old names, on purpose) dropped."""
    lines, history = [], False
    for line in without_fences(path.read_text()).splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2 and cells[1].strip() == "was":
            history = True
        elif not line.startswith("|"):
            history = False
        lines.append("|".join(cells[2:]) if history else line)
    return lines


def _name_problems(path: Path) -> list[str]:
    problems = []
    for number, line in enumerate(_checked_text(path), 1):
        where = f"{_shown(path)}:{number}"
        for span in _SPAN.findall(line):
            for found in _REPO_PATH.finditer(span):
                named = found.group(0).rstrip(".")
                if not named.startswith(_OUTPUTS) and not _path_exists(named):
                    problems.append(f"{where}: no path {named}")
            if not span.startswith((".venv/", "python", "make ", "hyper-offload", "torchrun")):
                for found in _NAME.finditer(span):
                    if not _resolves(found.group(0)):
                        problems.append(f"{where}: {found.group(0)} does not import")
    return problems


@pytest.mark.parametrize("path", DOCUMENTS, ids=[p.name for p in DOCUMENTS])
def test_every_link_reaches_a_file_and_a_heading(path: Path) -> None:
    assert _link_problems(path) == []


@pytest.mark.parametrize("path", DOCUMENTS, ids=[p.name for p in DOCUMENTS])
def test_every_path_and_library_name_named_exists(path: Path) -> None:
    assert _name_problems(path) == []


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    assert slug("`torch.compile` in ten lines") == "torchcompile-in-ten-lines"
    assert slug("Eager: `OffloadSession`") == "eager-offloadsession"
    page = REPO / "docs" / "index.md"
    broken = tmp_path / "page.md"
    broken.write_text(f"[a]({page}#no-such-heading) [b](missing.md) [c](#here)\n# Here\n"
                      "`hyper_offload.no_such_name` `examples/no_such.py` `out/any.json`\n")
    assert [p.split(": ", 1)[1] for p in _link_problems(broken)] == [
        f"({page}#no-such-heading) no heading #no-such-heading in index.md",
        "(missing.md) no such file"]
    assert sorted(p.split(": ", 1)[1] for p in _name_problems(broken)) == [
        "hyper_offload.no_such_name does not import", "no path examples/no_such.py"]
