"""``plan --plot`` and ``plan --chrome-trace``: what is drawn, files written, clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hyper_offload.cli import main
from hyper_offload.passes import ActivationTrace, GreedyResidencyPlanner
from hyper_offload.viz import PlotDependencyError, draw_plan, plot_plan

MIB = 1 << 20
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# s0 (2 MiB) idles over ops 1..3; s1, s2 are 1 MiB each. Under a 2 MiB budget s0 goes
# to the host after op 0 and comes back before op 4.
TRACE = ActivationTrace.from_accesses(
    [{0: "W"}, {1: "W"}, {1: "R", 2: "W"}, {2: "R"}, {0: "R"}],
    {0: 2 * MIB, 1: MIB, 2: MIB},
    budget_bytes=2 * MIB,
)


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.json"
    path.write_text(TRACE.to_json())
    return path


def artists(figure, gid: str) -> list:  # noqa: ANN001
    ax = figure.axes[0]
    return [a for a in (*ax.lines, *ax.collections) if a.get_gid() == gid]


def test_curves_budget_and_copies_are_drawn_where_the_plan_puts_them() -> None:
    schedule = GreedyResidencyPlanner().plan(TRACE)
    figure = draw_plan(TRACE, schedule)
    (before,) = artists(figure, "before")
    (after,) = artists(figure, "after")
    (budget,) = artists(figure, "budget")
    assert list(before.get_ydata()) == [2, 3, 4, 3, 2]  # MiB, no offload
    assert list(after.get_ydata()) == [2, 1, 2, 1, 2]  # MiB, with the plan
    assert set(budget.get_ydata()) == {2}
    (d2h,) = artists(figure, "d2h")
    (h2d,) = artists(figure, "h2d")
    assert [tuple(p) for p in d2h.get_offsets()] == [(0, 2)]  # issued after op 0
    assert [tuple(p) for p in h2d.get_offsets()] == [(4, 2)]  # issued before op 4
    assert figure.axes[0].get_ylabel() == "device-resident bytes (MiB)"


def test_a_plan_without_copies_draws_no_markers() -> None:
    roomy = TRACE.with_budget(4 * MIB)
    figure = draw_plan(roomy, GreedyResidencyPlanner().plan(roomy))
    assert not artists(figure, "d2h") and not artists(figure, "h2d")
    assert len(artists(figure, "after")) == 1


def test_plot_file_is_a_non_empty_png(tmp_path: Path) -> None:
    path = plot_plan(TRACE, GreedyResidencyPlanner().plan(TRACE), tmp_path / "plan.png")
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5_000


def test_cli_writes_the_plot_and_the_chrome_trace(trace_file: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    png, trace_json = tmp_path / "plan.png", tmp_path / "plan.trace.json"
    code = main(["plan", str(trace_file), "--budget-mb", "2",
                 "--plot", str(png), "--chrome-trace", str(trace_json)])
    assert code == 0
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    document = json.loads(trace_json.read_text())
    slices = {(e["tid"], e["name"]) for e in document["traceEvents"] if e["ph"] == "X"}
    assert {(2, "D2H s0"), (3, "H2D s0")} <= slices
    assert "trace.json: greedy plan, budget 2 MiB" in document["otherData"]["title"]
    captured = capsys.readouterr()
    assert "peak resident" in captured.out  # the summary is still printed
    # No op has a duration: the drawn times are defaulted, and the summary has no stall
    # figure (issue 51: "440 ms stall over 0.147 ms compute" on such a trace).
    assert "the trace is unpriced (no op has duration_s)" in captured.err
    assert "the trace is unpriced" in captured.out and " ms " not in captured.out


def test_cli_without_matplotlib_is_one_line_naming_the_extra(
    trace_file: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(PlotDependencyError):
        draw_plan(TRACE, GreedyResidencyPlanner().plan(TRACE))
    code = main(["plan", str(trace_file), "--budget-mb", "2", "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "pip install hyper-offload[plot]" in err


@pytest.mark.parametrize("flag", ["--plot", "--chrome-trace"])
def test_cli_unwritable_output_is_one_line(trace_file: Path, tmp_path: Path, capsys, flag: str) -> None:  # noqa: ANN001
    target = tmp_path / "missing-dir" / ("p.png" if flag == "--plot" else "t.json")
    assert main(["plan", str(trace_file), "--budget-mb", "2", flag, str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot write {flag}" in err
