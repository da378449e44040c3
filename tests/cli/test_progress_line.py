"""The progress line of long commands (issue 51, item 4): what ``estimate`` is doing, on a
terminal only, rewritten in place, erased at the end; nothing when piped, nothing in logs.

A fake terminal is a text stream whose ``isatty()`` is true: what the line writes is
then exactly what a terminal would receive.
"""

from __future__ import annotations

import io
import logging
import re
import sys
from pathlib import Path

import pytest

from hyper_offload.cli import main
from hyper_offload.progress import ProgressLine, listening, note, progress_line

CLEAR = "\r\x1b[2K"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_each_note_rewrites_the_line_and_the_end_erases_it() -> None:
    terminal = FakeTerminal()
    with progress_line("hyper-offload estimate", terminal):
        note("capturing the step on fake tensors")
        note("region 0: partitioning and planning")
    assert terminal.getvalue() == (
        f"{CLEAR}hyper-offload estimate: capturing the step on fake tensors (0 s)"
        f"{CLEAR}hyper-offload estimate: region 0: partitioning and planning (0 s){CLEAR}")


def test_the_line_is_erased_when_the_work_raises() -> None:
    terminal = FakeTerminal()
    with pytest.raises(KeyError), progress_line("x", terminal):
        note("working")
        raise KeyError("boom")
    assert terminal.getvalue().endswith(CLEAR)


def test_nothing_is_written_to_a_pipe_or_a_file() -> None:
    piped = io.StringIO()  # isatty() is False, as for a pipe or a log file
    with progress_line("x", piped):
        note("capturing")
    assert piped.getvalue() == ""


def test_elapsed_seconds_and_a_line_cut_to_the_terminal_width() -> None:
    times = iter([10.0, 52.4])
    terminal = FakeTerminal()
    line = ProgressLine(terminal, "estimate", clock=lambda: next(times))
    line("x" * 300)  # a wrapped line could not be rewritten in place
    written = terminal.getvalue().removeprefix(CLEAR)
    assert written == ("estimate: " + "x" * 300)[:79]  # 80 columns when the size is unknown
    line = ProgressLine(FakeTerminal(), "estimate", clock=iter([0.0, 42.4]).__next__)
    line("planning the step")
    assert line._stream.getvalue().endswith("estimate: planning the step (42 s)")


def test_notes_without_a_listener_go_nowhere_and_listeners_nest() -> None:
    heard: list[str] = []
    note("nobody listens")
    with listening(heard.append):
        note("outer")
        with listening(lambda stage: heard.append(f"inner {stage}")):
            note("a")
        note("b")
    note("after")
    assert heard == ["outer", "inner a", "b"]


FACTORY = '''
import torch


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
'''


@pytest.fixture(scope="module")
def factory(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("models") / "models.py"
    path.write_text(FACTORY)
    return f"{path}:mlp"


def _estimate(factory: str) -> list[str]:
    return ["estimate", factory, "--input-shape", "8,16", "--budget-fraction", "0.5",
            "--inner-compiler", "aot_eager", "--recompute", "off"]


def test_estimate_on_a_terminal_says_what_it_is_doing(factory, capsys, caplog, monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with caplog.at_level(logging.DEBUG):
        assert main(_estimate(factory)) in (0, 1)
    lines = [line for line in terminal.getvalue().split(CLEAR) if line]
    assert all(line.startswith("hyper-offload estimate: ") and len(line) < 80 for line in lines)
    stages = [re.sub(r" \(\d+ s\)$", "", line.removeprefix("hyper-offload estimate: "))
              for line in lines]
    expected = iter(["loading torch and the compile door", "building ",
                     "capturing the step on fake tensors", "running one step on fake tensors",
                     "region 0: partitioning and planning", "planning the step (1 invocation(s))",
                     "pricing the step"])
    want = next(expected)
    for stage in stages:  # every expected stage, in this order (others may come between)
        if want is not None and stage.startswith(want):
            want = next(expected, None)
    assert want is None, f"no {want!r} in {stages}"
    assert terminal.getvalue().endswith(CLEAR)  # erased before the report is printed
    out = capsys.readouterr().out
    assert out.startswith("Sequential on cpu") and "\r" not in out
    assert not any("partitioning and planning" in r.getMessage() for r in caplog.records)


def test_estimate_piped_prints_the_report_only(factory, capsys) -> None:
    assert main(_estimate(factory)) in (0, 1)
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "partitioning" not in captured.err
    assert captured.out.startswith("Sequential on cpu")


def test_the_progress_module_is_a_leaf() -> None:
    source = Path(__file__).resolve().parents[2] / "offload_compile" / "progress.py"
    imports = re.findall(r"^(?:from|import) (\S+)", source.read_text(), re.M)
    # The standard library only (the progress line included: os, sys, time, typing).
    assert {name.split(".")[0] for name in imports} <= {*sys.stdlib_module_names, "__future__"}
    assert "hyper_offload" not in {name.split(".")[0] for name in imports}
