"""``hyper-offload plan``: summaries, JSON output, and one-line errors on bad input."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_offload.cli import main
from hyper_offload.passes import ActionKind, ActivationTrace

MIB = 1 << 20


def _small_trace(duration_s: float | None) -> ActivationTrace:
    # s0 (2 MiB) lives across ops 1..3 without being used there; s1, s2 are 1 MiB each.
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {1: "W"}, {1: "R", 2: "W"}, {2: "R"}, {0: "R"}],
        {0: 2 * MIB, 1: MIB, 2: MIB},
        budget_bytes=0,
    )
    ops = tuple(dataclasses.replace(op, duration_s=duration_s) for op in trace.ops)
    return dataclasses.replace(trace, ops=ops)


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    """A priced trace: every op takes 50 µs."""
    path = tmp_path / "trace.json"
    path.write_text(_small_trace(50e-6).to_json())
    return path


@pytest.fixture
def unpriced_trace_file(tmp_path: Path) -> Path:
    """The same trace without durations (as ``make demo-plan`` writes one)."""
    path = tmp_path / "unpriced.json"
    path.write_text(_small_trace(None).to_json())
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
    # timed with the trace's duration_s and bandwidths: never under the lower bound
    assert result["compute_s"] > 0
    assert 0 <= result["stall_lower_bound_s"] <= result["predicted_stall_s"]


def test_human_summary(trace_file: Path, capsys) -> None:
    assert main(["plan", str(trace_file), "--budget-mb", "2"]) == 0
    out = capsys.readouterr().out
    assert "peak resident: 4.00 MiB without offload -> 2.00 MiB with the schedule" in out
    assert "D2H 2.00 MiB, H2D 2.00 MiB in 2 transfers" in out
    assert "predicted stall: " in out and "of compute, no schedule under " in out


def test_an_unpriced_trace_gets_no_stall_figures(unpriced_trace_file: Path, capsys) -> None:
    """Without op durations every op would be priced at the 1 µs default and the copies
    at the link's speed: the demo's trace printed "549 ms stall over 0.147 ms of
    compute" (issue 51). An unpriced trace says so instead, in both outputs."""
    assert main(["plan", str(unpriced_trace_file), "--budget-mb", "2"]) == 0
    out = capsys.readouterr().out
    assert "the trace is unpriced" in out and " ms" not in out
    assert main(["plan", str(unpriced_trace_file), "--budget-mb", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["priced"] is False and result["bytes_d2h"] == 2 * MIB
    assert result["predicted_stall_s"] is result["compute_s"] is None


def test_a_priced_trace_gets_its_stall_against_its_compute(trace_file: Path, capsys) -> None:
    assert main(["plan", str(trace_file), "--budget-mb", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["priced"] is True and result["ops_with_default_duration"] == 0
    assert result["compute_s"] == pytest.approx(5 * 50e-6)


def test_chrome_trace_of_an_unpriced_trace_says_its_times_are_not_times(
    unpriced_trace_file: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "plan.trace.json"
    assert main(["plan", str(unpriced_trace_file), "--budget-mb", "2",
                 "--chrome-trace", str(out)]) == 0
    assert out.is_file()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the trace is unpriced" in err[0], err


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


@pytest.fixture
def bad_inputs(tmp_path: Path, trace_file: Path) -> Path:
    """Next to ``trace.json``: files that are broken in one way each."""
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    doc = json.loads(trace_file.read_text())
    doc["ops"][0]["accesses"] = {"0": "maybe"}
    (tmp_path / "wrong.json").write_text(json.dumps(doc))
    doc["ops"][0]["accesses"] = {"--0": "W"}
    (tmp_path / "bad_id.json").write_text(json.dumps(doc))
    return tmp_path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.json", "--budget-mb", "1"], "cannot read"),
        (["bad.json", "--budget-mb", "1"], "not valid JSON"),
        (["deep.json", "--budget-mb", "1"], "nested too deeply"),
        (["wrong.json", "--budget-mb", "1"], "trace.ops[0].accesses['0']"),
        (["bad_id.json", "--budget-mb", "1"], "storage id '--0' is not an integer"),
        (["trace.json", "--budget-mb", "-1"], "--budget-mb must be a finite number >= 0"),
        (["trace.json", "--budget-mb", "nan"], "--budget-mb must be a finite number >= 0, got nan"),
        (["trace.json", "--budget-mb", "inf"], "--budget-mb must be a finite number >= 0, got inf"),
        (["trace.json", "--budget-mb", "2", "--schedule-out", "no/such/dir/s.json"],
         "cannot write --schedule-out"),
        (["trace.json", "--budget-mb", "2", "--planner", "optimal", "--no-refine"],
         "--no-refine applies to --planner greedy only"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(bad_inputs: Path, args, message, capsys) -> None:
    argv = [str(bad_inputs / a) if a.endswith(".json") else a for a in args]
    assert main(["plan", *argv]) == 2  # an exception escaping main() fails the test too
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err
    assert lines[0].startswith("hyper-offload plan: error: ")
    assert captured.out == ""


def test_exact_planner_giving_up_is_one_line(trace_file: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # as if scipy were missing
    assert main(["plan", str(trace_file), "--budget-mb", "2", "--planner", "optimal"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs scipy" in lines[0]


def test_module_entry_point_reports_bad_input_without_traceback(bad_inputs: Path) -> None:
    # One real process: ``python -m hyper_offload`` exits 2 with one line on stderr.
    done = _run_cli("plan", str(bad_inputs / "wrong.json"), "--budget-mb", "1")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "trace.ops[0].accesses['0']" in lines[0], done.stderr


def test_optimal_planner_from_the_cli_moves_no_more_than_greedy(trace_file: Path, capsys) -> None:
    results = {}
    for planner in ("greedy", "optimal"):
        assert main(["plan", str(trace_file), "--budget-mb", "2", "--planner", planner, "--json"]) == 0
        results[planner] = json.loads(capsys.readouterr().out)
    assert results["optimal"]["violations"] == []
    moved = {name: r["bytes_d2h"] + r["bytes_h2d"] for name, r in results.items()}
    assert moved["optimal"] <= moved["greedy"] == 4 * MIB


def test_infeasible_summary_suggests_a_budget_that_fits(tmp_path: Path, capsys) -> None:
    # One op needs 1.5 MiB + 3 bytes: "1.50" would still be 3 bytes short.
    path = tmp_path / "tight.json"
    trace = ActivationTrace.from_accesses([{0: "W", 1: "W"}], {0: MIB, 1: MIB // 2 + 3}, budget_bytes=0)
    path.write_text(trace.to_json())
    assert main(["plan", str(path), "--budget-mb", "1"]) == 1
    out = capsys.readouterr().out
    assert "raise the budget to at least --budget-mb 1.51" in out
    assert main(["plan", str(path), "--budget-mb", "1.51"]) == 0


class _BrokenPlanner:
    """A planner with a bug: it releases a storage's device bytes with no host copy."""

    def __init__(self, refine: bool = True) -> None:
        self.refine = refine

    def plan(self, trace: ActivationTrace):  # noqa: ANN201
        from hyper_offload.passes import GreedyResidencyPlanner, ResidencyAction, ResidencySchedule

        good = GreedyResidencyPlanner().plan(trace)
        post = [list(slot) for slot in good.post]
        post[0] = [ResidencyAction(ActionKind.RELEASE_DEVICE, 0)]  # drops s0's only copy
        return ResidencySchedule(tuple(tuple(s) for s in good.pre), tuple(tuple(s) for s in post))


class _NoCopyPlanner(_BrokenPlanner):
    """Waits for reloads it never starts: a schedule the timeline model cannot run."""

    def plan(self, trace: ActivationTrace):  # noqa: ANN201
        from hyper_offload.passes import GreedyResidencyPlanner, ResidencySchedule

        good = GreedyResidencyPlanner().plan(trace)
        pre = [[a for a in slot if a.kind is not ActionKind.COPY_H2D] for slot in good.pre]
        return ResidencySchedule(pre, good.post)


@pytest.mark.parametrize(
    "planner", [_BrokenPlanner, _NoCopyPlanner], ids=["drops-a-copy", "never-starts-a-reload"]
)
@pytest.mark.parametrize("as_json", [False, True])
def test_a_schedule_the_validator_rejects_exits_3_without_a_timeline(
    trace_file: Path, capsys, monkeypatch, as_json: bool, planner: type  # noqa: ANN001
) -> None:
    from hyper_offload.cli import plan as cli_plan

    monkeypatch.setattr(cli_plan, "_planners", lambda: {"greedy": planner})
    args = ["plan", str(trace_file), "--budget-mb", "2"] + (["--json"] if as_json else [])
    assert main(args) == cli_plan.EXIT_INVALID_SCHEDULE == 3
    out = capsys.readouterr().out
    if as_json:
        result = json.loads(out)
        assert result["violations"] and result["predicted_stall_s"] is None
    else:
        assert "INVALID schedule" in out and "predicted stall" not in out


def test_plan_emits_the_schedule_of_the_shared_pipeline_and_of_the_compile_backend(
    tmp_path: Path, capsys
) -> None:
    """One pipeline for every door: a compile-path trace, dumped to JSON, planned by the
    CLI gives the schedule the backend lowered for it, and the one ``plan_residency``
    gives called directly (the CLI reads where the backward begins from the op names,
    as the backend passes its forward's op count)."""
    import torch

    import hyper_offload
    from hyper_offload.passes import GreedyResidencyPlanner, ResidencySchedule, plan_residency
    from hyper_offload.passes.plan.planning import backward_start, prefetch_leads
    from tests.compiler.compile_models import mlp

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mlp(layers=3, d=64)
    # 192 KiB: under the region's 224 KiB peak, above the 128 KiB its largest op needs.
    backend = hyper_offload.backend(
        inner_compiler="aot_eager", max_resident_activation_mb=192 / 1024, budget_scope="region"
    )
    torch.compile(model, backend=backend)(torch.randn(128, 64)).pow(2).sum().backward()
    torch._dynamo.reset()
    (region,) = backend.regions
    planned = region.planned
    assert planned is not None and planned.check.ok
    fx_trace, budget = planned.fx_trace, planned.fx_trace.trace.budget_bytes
    assert backward_start(fx_trace.trace) == fx_trace.num_fw_ops > 0
    reloads = prefetch_leads(planned.schedule)
    assert reloads, "the budget forced no reload: the test proves nothing"
    assert all(copy >= fx_trace.num_fw_ops for _, copy, _ in reloads)

    trace_path, out = tmp_path / "mlp_trace.json", tmp_path / "schedule.json"
    trace_path.write_text(fx_trace.trace.to_json())
    budget_mb = repr(budget / MIB)  # exact: MIB is a power of two
    assert main(["plan", str(trace_path), "--budget-mb", budget_mb, "--schedule-out", str(out)]) == 0
    assert "moved: D2H" in capsys.readouterr().out
    from_cli = ResidencySchedule.from_json(out.read_text())

    loaded = ActivationTrace.from_json(trace_path.read_text()).with_budget(int(float(budget_mb) * MIB))
    assert loaded == fx_trace.trace
    direct = plan_residency(
        loaded, GreedyResidencyPlanner(), earliest_prefetch_op=backward_start(loaded)
    ).schedule
    assert from_cli == direct == planned.schedule


def _fw_bw_trace(tmp_path: Path, names: list[str]) -> Path:
    """Storage 0 (800 B) idle over ops 1..8, forced out by storage 1 (ops 1..4) under a
    1000-byte budget: room for its reload from op 6 on (op 5 and the op before it); op
    durations (0.4 µs, H2D at 1 GB/s) start it at op 7, as late as still hides it."""
    from hyper_offload.passes import TraceOp

    ops = [{0: "W"}, {1: "W"}, {1: "R"}, {1: "R"}, {1: "R"},
           {2: "W"}, {2: "R"}, {2: "R"}, {2: "R"}, {0: "R", 2: "R"}]
    base = ActivationTrace.from_accesses(ops, {0: 800, 1: 500, 2: 100}, budget_bytes=0)
    trace = ActivationTrace(
        ops=tuple(TraceOp(n, op.accesses, op.outputs, 4e-7) for n, op in zip(names, base.ops)),
        storage_sizes=base.storage_sizes, budget_bytes=0, h2d_bandwidth_gbps=1.0,
    )
    path = tmp_path / "fw_bw.json"
    path.write_text(trace.to_json())
    return path


@pytest.mark.parametrize(
    ("compile_names", "extra", "copy_op"),
    [(True, [], 8), (True, ["--earliest-prefetch-op", "0"], 7), (False, [], 7),
     (False, ["--earliest-prefetch-op", "9"], 9)],
    ids=["compile-trace", "compile-trace-override", "one-timeline", "one-timeline-override"],
)
def test_reloads_start_where_the_trace_says_backward_begins(
    tmp_path: Path, compile_names: bool, extra: list[str], copy_op: int
) -> None:
    from hyper_offload.passes import ResidencySchedule
    from hyper_offload.passes.plan.planning import prefetch_leads

    names = [f"fw:n{i}" for i in range(8)] + ["bw:n8", "bw:n9"] if compile_names else [
        f"op{i}" for i in range(10)]
    out = tmp_path / "schedule.json"
    path = _fw_bw_trace(tmp_path, names)
    budget_mb = repr(1000 / MIB)
    assert main(["plan", str(path), "--budget-mb", budget_mb, "--schedule-out", str(out), *extra]) == 0
    schedule = ResidencySchedule.from_json(out.read_text())
    assert prefetch_leads(schedule) == [(0, copy_op, 9)]  # (storage, COPY_H2D op, WAIT_H2D op)


def test_earliest_prefetch_op_outside_the_trace_is_bad_input(trace_file: Path, capsys) -> None:
    assert main(["plan", str(trace_file), "--budget-mb", "2", "--earliest-prefetch-op", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--earliest-prefetch-op must be between 0 and the trace's 5 ops" in err[0]
