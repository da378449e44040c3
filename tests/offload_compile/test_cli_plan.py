"""``hyper-offload plan``: summaries, JSON output, and one-line errors on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_offload.cli import main
from hyper_offload.passes import ActivationTrace

MIB = 1 << 20


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    # s0 (2 MiB) lives across ops 1..3 without being used there; s1, s2 are 1 MiB each.
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {1: "W"}, {1: "R", 2: "W"}, {2: "R"}, {0: "R"}],
        {0: 2 * MIB, 1: MIB, 2: MIB},
        budget_bytes=0,
    )
    path = tmp_path / "trace.json"
    path.write_text(trace.to_json())
    return path


def test_json_summary_reports_the_planned_figures(trace_file: Path, capsys) -> None:
    assert main(["plan", str(trace_file), "--budget-mb", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["feasible"] is True and result["violations"] == []
    assert result["budget_bytes"] == 2 * MIB
    assert result["peak_resident_bytes_without_offload"] == 4 * MIB
    assert result["peak_resident_bytes"] <= 2 * MIB
    assert result["bytes_d2h"] == result["bytes_h2d"] == 2 * MIB
    assert result["num_transfers"] == 2
    assert result["ops_over_budget"] == 0


def test_human_summary(trace_file: Path, capsys) -> None:
    assert main(["plan", str(trace_file), "--budget-mb", "2"]) == 0
    out = capsys.readouterr().out
    assert "peak resident: 4.00 MiB without offload -> 2.00 MiB with the schedule" in out
    assert "D2H 2.00 MiB, H2D 2.00 MiB in 2 transfers" in out


def test_infeasible_budget_lists_the_ops_and_exits_1(trace_file: Path, capsys) -> None:
    assert main(["plan", str(trace_file), "--budget-mb", "1.5", "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["feasible"] is False
    assert result["violations"] == []
    assert {op["op_index"] for op in result["infeasible_ops"]} == {0, 2, 4}
    assert all(op["excess_bytes"] == MIB // 2 for op in result["infeasible_ops"])
    assert main(["plan", str(trace_file), "--budget-mb", "1.5"]) == 1
    assert "INFEASIBLE: 3 op(s)" in capsys.readouterr().out


def test_schedule_out_writes_a_loadable_schedule(trace_file: Path, tmp_path: Path) -> None:
    from hyper_offload.passes import ResidencySchedule, check_schedule

    out = tmp_path / "schedule.json"
    assert main(["plan", str(trace_file), "--budget-mb", "2", "--schedule-out", str(out)]) == 0
    trace = ActivationTrace.from_json(trace_file.read_text()).with_budget(2 * MIB)
    assert check_schedule(trace, ResidencySchedule.from_json(out.read_text())).ok


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hyper_offload", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda d: [str(d / "missing.json"), "--budget-mb", "1"], "cannot read"),
        (lambda d: [str(d / "bad.json"), "--budget-mb", "1"], "not valid JSON"),
        (lambda d: [str(d / "wrong.json"), "--budget-mb", "1"], "trace.ops[0].accesses['0']"),
        (lambda d: [str(d / "trace.json"), "--budget-mb", "-1"], "--budget-mb must be >= 0"),
    ],
)
def test_bad_input_is_one_line_without_traceback(tmp_path: Path, trace_file: Path, make_args, message) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    doc = json.loads(trace_file.read_text())
    doc["ops"][0]["accesses"] = {"0": "maybe"}
    (tmp_path / "wrong.json").write_text(json.dumps(doc))
    done = _run_cli("plan", *make_args(tmp_path))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
