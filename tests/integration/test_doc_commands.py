"""Every command README.md and docs/*.md name works as written from a fresh clone after
``make setup`` (issue 51: ``hyper-offload plan ...`` was "command not found").

Two levels, decided per command by what it costs (measured on the project's 2-core
machine; the table in docs/development.md, "Commands in the docs"):

* **checked**: every command named anywhere (bash blocks, indented lines, code spans):
  a ``make`` target exists in the Makefile; a repository script exists and takes every
  ``--flag`` given; ``.venv/bin/hyper-offload`` parses with the CLI's own parser (the
  subcommand, every flag, a ``MODULE.py:FACTORY`` that defines the factory); a bare
  ``hyper-offload`` or ``python`` for a repository script is refused (neither is on
  PATH after ``make setup``: ``.venv/bin/...`` is).
* **run**: each bash block marked runnable (:mod:`.doc_blocks`), in a fresh clone of the
  working tree (its files copied, ``.venv`` linked), in document order, with the
  marker's substitutions (a tiny model for a 7B one) and its setup command first
  (:data:`SETUPS`); it must exit 0.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hyper_offload.cli import build_parser

from .doc_blocks import DOCUMENTS, Block, Command, all_blocks, commands
from .import_graph import REPO

SETUPS = {"demo_trace": "make demo-plan"}
"""What a runnable bash block's ``setup=NAME`` runs first: ``demo_trace`` writes
``out/transformer_trace.json`` as ``make demo`` does (its second command), without the
minute of training before it."""

BASH = all_blocks("bash")
RUNNABLE = [b for b in BASH if b.runnable]
MAKE_TARGETS = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
_SCRIPT_FOLDERS = ("examples/", "benchmarks/", "scripts/", "tests/")


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if re.fullmatch(r"--[a-z][\w-]*(=.*)?", w)]


def _script_problems(script: str, args: list[str]) -> list[str]:
    path = REPO / script
    if not path.is_file():
        return [f"no script {script}"]
    source = path.read_text()
    # A script may hand its flags to a module beside it (peers.py --search: peers_search.py).
    for name in re.findall(r"^\s*(?:from|import) (\w+)", source, re.M):
        if (path.parent / f"{name}.py").is_file():
            source += (path.parent / f"{name}.py").read_text()
    return [f"{script} takes no {flag}" for flag in _flags(args)
            if f'"{flag}"' not in source and f"'{flag}'" not in source]


def _cli_problems(args: list[str]) -> list[str]:
    """``hyper-offload ARGS``: the subcommand, its flags and its MODULE:FACTORY target."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "plan" in a.choices)
    if not args or args[0] not in subparsers.choices:
        return [f"hyper-offload has no subcommand {args[:1]}"]
    options = subparsers.choices[args[0]]._option_string_actions
    problems = [f"hyper-offload {args[0]} takes no {flag}" for flag in _flags(args)
                if flag not in options]
    for target in (a for a in args[1:] if re.fullmatch(r"[\w./-]+\.py:\w+", a)):
        file, factory = target.split(":")
        if not (REPO / file).is_file():
            problems.append(f"no file {file}")
        elif factory not in {n.name for n in ast.parse((REPO / file).read_text()).body
                             if isinstance(n, ast.FunctionDef)}:
            problems.append(f"{file} defines no {factory}()")
    return problems


def check(command: Command) -> list[str]:
    """What is wrong with ``command`` as written (module docstring); [] when nothing."""
    words = command.words()
    if not words:
        return []
    program, args = words[0], words[1:]
    if program == "make":
        return [f"no make target {t}" for t in args if not t.startswith("-")
                and t not in MAKE_TARGETS]
    if program == "hyper-offload" and len(args) <= 1:  # the tool's name, not a command
        return _cli_problems(args) if args else []
    if program in ("hyper-offload", "torchrun"):
        return [f"{program} is not on PATH after make setup: write .venv/bin/{program}"]
    if program == ".venv/bin/hyper-offload":
        return _cli_problems(args) if args else []
    if program in ("python", "python3", ".venv/bin/python", ".venv/bin/torchrun"):
        if args[:2] == ["-m", "hyper_offload"]:
            return _cli_problems(args[2:]) if args[2:] else []
        scripts = [a for a in args if a.endswith((".py", ".sh")) and a.startswith(_SCRIPT_FOLDERS)]
        if not scripts:
            return []  # python -m pytest, another project's module (torchtitan)
        if not program.startswith(".venv/"):
            return [f"{program} has no torch after make setup: write .venv/bin/{program}"]
        return _script_problems(scripts[0], args[args.index(scripts[0]) + 1:])
    if program == "bash":
        return [] if (REPO / args[0]).is_file() else [f"no script {args[0]}"]
    return []


@pytest.mark.parametrize("path", DOCUMENTS, ids=[p.name for p in DOCUMENTS])
def test_every_command_named_is_written_to_work(path: Path) -> None:
    named = commands(path)
    problems = [f"{c.where}: {c.text!r}: {p}" for c in named for p in check(c)]
    assert problems == []


def test_every_bash_block_is_marked_runnable_or_says_why_not() -> None:
    unmarked = [b.where for b in BASH if not b.runnable and not b.reason]
    assert BASH and unmarked == [], (
        f"{unmarked}: put <!-- runnable [setup=NAME] --> or <!-- not runnable: REASON --> "
        "right above each ```bash block")
    assert all(b.setup in SETUPS for b in RUNNABLE if b.setup)


def test_readme_keeps_the_test_command_ci_runs() -> None:
    assert "make test" in (REPO / ".ci" / "run").read_text()
    readme = [b for b in BASH if b.path.name == "README.md"]
    assert any(line.split("#")[0].strip() == "make test"
               for b in readme for line in b.code.splitlines())


def test_the_checker_refuses_what_does_not_work() -> None:
    def problems(text: str) -> list[str]:
        return check(Command("here", text))

    assert problems("hyper-offload plan out/t.json --budget-mb 600") == [
        "hyper-offload is not on PATH after make setup: write .venv/bin/hyper-offload"]
    assert problems(".venv/bin/hyper-offload plan out/t.json --budget-mb 600") == []
    assert problems(".venv/bin/hyper-offload plan t.json --budget 6") == [
        "hyper-offload plan takes no --budget"]
    assert problems(".venv/bin/hyper-offload estimate examples/llama_model.py:llama_99b") == [
        "examples/llama_model.py defines no llama_99b()"]
    assert problems("make demo test-extended") == []
    assert problems("make demo-train") == ["no make target demo-train"]
    assert problems("python examples/train_gpt.py") == [
        "python has no torch after make setup: write .venv/bin/python"]
    assert problems(".venv/bin/python examples/train_gpt.py --mode both --no-such") == [
        "examples/train_gpt.py takes no --no-such"]
    assert problems("CPU_SMOKE=1 bash scripts/gpu_check.sh") == []


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working tree as a fresh clone sees it (tracked and new files, mtimes kept so
    that make finds the venv up to date), with a ``.venv`` whose parts link this one's."""
    root = tmp_path_factory.mktemp("clone")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    venv = root / ".venv"
    venv.mkdir()
    for part in (REPO / ".venv").iterdir():
        if part.name != ".ready":
            (venv / part.name).symlink_to(part)
    (venv / ".ready").touch()  # newer than pyproject.toml: make runs no setup
    return root


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{b.path.stem}-line{b.line}" for b in RUNNABLE])
def test_the_block_runs_from_a_fresh_clone(block: Block, clone: Path) -> None:
    script = "\n".join(filter(None, [SETUPS.get(block.setup or ""), block.prepared()]))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=clone,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, f"{block.where}:\n{script}\n{done.stdout}\n{done.stderr}"
