"""``hyper-offload plan TRACE.json --budget-mb X``: plan a trace and summarise the result.

Planning is the pipeline every door shares, :func:`hyper_offload.passes.plan_residency`
(plan -> check -> place prefetches -> check), so ``--schedule-out`` is the schedule the
compile backend or the eager session would run for the same trace and planner. Where
reloads may start: a trace dumped from the compile path (op names ``fw:...`` then
``bw:...``) gets the backend's rules, no reload before its first backward op, and
releases delayed until their D2H is predicted done, inside the forward; any other
trace is one timeline (earliest op 0). ``--earliest-prefetch-op`` overrides where
reloads may start.

Exit codes: 0 when the schedule is valid and meets the budget, 1 when the budget is
infeasible (some op's own operands exceed it; the best schedule is still reported),
2 for bad input (missing file, malformed trace, negative or non-finite budget, an option
the chosen planner does not take, an unwritable ``--schedule-out``, an
``--earliest-prefetch-op`` outside the trace) or a planner that gives up (the exact
planner without scipy or past its time limit), or ``--plot`` without matplotlib / an
unwritable ``--plot`` or ``--chrome-trace`` path, 3 if a stage of the pipeline (the
planner, or the prefetch placement) produced a schedule the validator rejects (a bug:
please report it; the stage is named on stderr). Every error is one line on stderr,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from hyper_offload.passes import (
    ActivationTrace,
    PlanningError,
    ResidencyPlanner,
    ResidencySchedule,
    ScheduleReport,
    TraceFormatError,
    check_schedule,
    plan_residency,
    predict_timeline,
    resident_bytes_without_offload,
)
from hyper_offload.passes.analysis.liveness import stall_lower_bound
from hyper_offload.passes.plan.planning import backward_start

MIB = 1 << 20
EXIT_OK, EXIT_INFEASIBLE, EXIT_BAD_INPUT, EXIT_INVALID_SCHEDULE = 0, 1, 2, 3


def _planners() -> dict[str, type]:
    from hyper_offload.passes import GreedyResidencyPlanner, OptimalResidencyPlanner

    # "optimal" solves the exact integer program (needs scipy; small traces only).
    return {"greedy": GreedyResidencyPlanner, "optimal": OptimalResidencyPlanner}


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="plan a JSON activation trace under a device budget",
        description="Plan an activation trace (JSON, see hyper_offload.passes.ir.trace) under a "
        "device budget and print what the schedule moves.",
    )
    parser.add_argument("trace", type=Path, help="trace file written by ActivationTrace.to_json")
    parser.add_argument("--budget-mb", type=float, required=True,
                        help="device budget for resident activation bytes, in MiB")
    parser.add_argument("--planner", choices=sorted(_planners()), default="greedy")
    parser.add_argument("--no-refine", action="store_true",
                        help="greedy only: the design's plain greedy, without the refinement pass")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--schedule-out", type=Path, help="also write the schedule as JSON here")
    parser.add_argument("--earliest-prefetch-op", type=int, default=None, metavar="OP",
                        help="no reload (COPY_H2D) starts before this op; default: the first "
                        "backward op of a compile-path trace (op names fw:/bw:), else 0")
    parser.add_argument("--plot", type=Path, default=None,
                        help="draw resident bytes per op before/after the plan, the budget and "
                        "the copies to this image (needs the plot extra: matplotlib)")
    parser.add_argument("--chrome-trace", type=Path, default=None,
                        help="write the plan's predicted timeline (compute and copy-stream "
                        "tracks) as a Chrome/Perfetto trace JSON here")
    parser.set_defaults(run=run)


class _BadInput(Exception):
    """A user error: printed as one line, exit code 2."""


def _load(path: Path, budget_mb: float) -> ActivationTrace:
    if not 0 <= budget_mb < math.inf:  # also false for NaN
        raise _BadInput(f"--budget-mb must be a finite number >= 0, got {budget_mb:g}")
    try:
        text = path.read_text()
    except OSError as error:
        raise _BadInput(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise _BadInput(f"{path}: not a UTF-8 text file; expected a JSON trace") from None
    try:
        trace = ActivationTrace.from_json(text)
    except TraceFormatError as error:
        raise _BadInput(f"{path}: {error}") from None
    return trace.with_budget(int(budget_mb * MIB))


def _make_planner(name: str, no_refine: bool) -> ResidencyPlanner:
    planner_type = _planners()[name]
    if name == "greedy":
        return planner_type(refine=not no_refine)
    if no_refine:
        raise _BadInput(f"--no-refine applies to --planner greedy only, not {name!r}; drop it")
    return planner_type()


def _earliest_prefetch_op(trace: ActivationTrace, requested: int | None) -> int:
    if requested is None:
        return backward_start(trace)
    if not 0 <= requested <= trace.num_ops:
        raise _BadInput(f"--earliest-prefetch-op must be between 0 and the trace's "
                        f"{trace.num_ops} ops, got {requested}")
    return requested


def _plan(
    planner: ResidencyPlanner, trace: ActivationTrace, earliest: int, where: str
) -> tuple[ResidencySchedule, PlanningError | None]:
    """The shared pipeline's schedule, or the schedule a stage got wrong and why (a bug:
    the caller reports it and exits 3)."""
    from hyper_offload.passes import OptimalPlannerError

    try:
        planned = plan_residency(
            trace, planner, earliest_prefetch_op=earliest, where=where, **_release_rules(trace)
        )
    except PlanningError as error:  # a bug in the planner (or the placement pass)
        return error.schedule, error
    except (OptimalPlannerError, ImportError) as error:  # the exact planner gave up
        raise _BadInput(f"{planner!r}: {error}") from None
    return planned.schedule, None


def _release_rules(trace: ActivationTrace) -> dict[str, Any]:
    """A compile-path trace keeps the backend's rules: its releases wait for their D2H
    (the lowering's wait_transfer) and must happen inside the forward graph."""
    forward_ops = backward_start(trace)
    if forward_ops == 0:
        return {"release_waits_for_d2h": False, "latest_release_op": None}
    return {"release_waits_for_d2h": True, "latest_release_op": forward_ops - 1}


def _write_schedule(path: Path, schedule: ResidencySchedule) -> None:
    try:
        path.write_text(schedule.to_json(indent=1))
    except OSError as error:
        raise _BadInput(f"cannot write --schedule-out {path}: {error.strerror or error}") from None


def _write_views(args: argparse.Namespace, trace: ActivationTrace, schedule: ResidencySchedule) -> None:
    """``--chrome-trace`` and ``--plot``: one-line errors for missing matplotlib or paths."""
    title = f"{args.trace.name}: {args.planner} plan, budget {args.budget_mb:g} MiB"
    if args.chrome_trace is not None:
        from hyper_offload.passes import write_chrome_trace

        try:
            document = write_chrome_trace(args.chrome_trace, trace, schedule, title=title)
        except OSError as error:
            raise _BadInput(f"cannot write --chrome-trace {args.chrome_trace}: "
                            f"{error.strerror or error}") from None
        missing = sum(op.duration_s is None for op in trace.ops)
        if missing == trace.num_ops:  # the times show the order of events, nothing more
            print(f"hyper-offload plan: note: the trace is unpriced (no op has duration_s); "
                  f"{document.name} draws every op at 1 µs: read its order, not its times",
                  file=sys.stderr)
        elif missing:  # predicted times are only as good as the durations behind them
            print(f"hyper-offload plan: note: {missing} of {trace.num_ops} ops have no "
                  f"duration_s; {document.name} gives them the mean of the known durations",
                  file=sys.stderr)
    if args.plot is not None:
        from hyper_offload.viz import PlotDependencyError, plot_plan

        try:
            plot_plan(trace, schedule, args.plot, title=title)
        except PlotDependencyError as error:
            raise _BadInput(str(error)) from None
        except (OSError, ValueError) as error:  # unwritable path, unknown image suffix
            raise _BadInput(f"cannot write --plot {args.plot}: {error}") from None


def run(args: argparse.Namespace) -> int:
    try:
        trace = _load(args.trace, args.budget_mb)
        earliest = _earliest_prefetch_op(trace, args.earliest_prefetch_op)
        planner = _make_planner(args.planner, args.no_refine)
        schedule, failure = _plan(planner, trace, earliest, args.trace.name)
        if args.schedule_out is not None:
            _write_schedule(args.schedule_out, schedule)
        _write_views(args, trace, schedule)
    except _BadInput as error:
        print(f"hyper-offload plan: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    report = check_schedule(trace, schedule)
    baseline_peak = max(resident_bytes_without_offload(trace), default=0)
    result = {**_result(trace, report, baseline_peak), **_timing(trace, schedule, report, earliest)}
    print(json.dumps(result) if args.json else _human(result, report))
    if failure is not None:  # one line naming the stage; the summary shows the violations
        print(f"hyper-offload plan: error: {str(failure).splitlines()[0]}", file=sys.stderr)
        return EXIT_INVALID_SCHEDULE
    if not report.ok:
        return EXIT_INVALID_SCHEDULE
    return EXIT_OK if report.feasible else EXIT_INFEASIBLE


def _result(trace: ActivationTrace, report: ScheduleReport, baseline_peak: int) -> dict[str, Any]:
    return {
        "num_ops": trace.num_ops,
        "num_storages": len(trace.storage_sizes),
        "peak_resident_bytes_without_offload": baseline_peak,
        **report.summary(),
    }


def _timing(
    trace: ActivationTrace, schedule: ResidencySchedule, report: ScheduleReport, earliest: int
) -> dict[str, Any]:
    """The schedule on the one timeline model, priced by the trace's ``duration_s`` and
    bandwidths, with the door's rules, and the lower bound no schedule under the budget
    beats. None for a schedule the validator rejects (it has no timeline to speak of) and
    for an unpriced trace (no op has ``duration_s``: every op would be priced at the same
    default, so a stall against that "compute" means nothing)."""
    keys = ("compute_s", "predicted_stall_s", "stall_lower_bound_s", "ops_with_default_duration")
    priced = any(op.duration_s is not None for op in trace.ops)
    if report.violations or not priced:
        return {**dict.fromkeys(keys), "priced": priced}
    rules = _release_rules(trace)
    timeline = predict_timeline(
        trace, schedule, release_waits_for_d2h=rules["release_waits_for_d2h"]
    )
    bound = stall_lower_bound(trace, earliest_prefetch_op=earliest, **rules)
    return {
        "compute_s": timeline.compute_s,
        "predicted_stall_s": timeline.exposed_transfer_s,
        "stall_lower_bound_s": bound.stall_s,
        "ops_with_default_duration": sum(op.estimated for op in timeline.ops),
        "priced": True,
    }


def _mib(nbytes: int) -> str:
    """Human-readable bytes: MiB for anything from 1 MiB on, KiB or B below."""
    if nbytes >= MIB:
        return f"{nbytes / MIB:,.2f} MiB"
    return f"{nbytes / 1024:,.2f} KiB" if nbytes >= 1024 else f"{nbytes} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def _mib_flag_at_least(nbytes: int) -> str:
    """A ``--budget-mb`` value (2 decimals, rounded up) whose budget holds ``nbytes``."""
    hundredths = -(-nbytes * 100 // MIB)  # ceil without float rounding
    while int(hundredths / 100 * MIB) < nbytes:  # the CLI's own MiB -> bytes conversion
        hundredths += 1
    return f"{hundredths / 100:.2f}"


def _human(result: dict[str, Any], report: ScheduleReport) -> str:
    lines = [
        f"ops: {result['num_ops']}   storages: {result['num_storages']}   "
        f"budget: {_mib(result['budget_bytes'])}",
        f"peak resident: {_mib(result['peak_resident_bytes_without_offload'])} without offload"
        f" -> {_mib(result['peak_resident_bytes'])} with the schedule",
        f"moved: D2H {_mib(result['bytes_d2h'])}, H2D {_mib(result['bytes_h2d'])} "
        f"in {result['num_transfers']} transfers; peak host {_mib(result['peak_host_bytes'])}",
        f"ops over budget: {result['ops_over_budget']}",
    ]
    if not result["priced"]:
        lines.append("predicted stall: none predicted, the trace is unpriced (no op has "
                     "duration_s; a trace from the compile or eager door has them)")
    elif result["predicted_stall_s"] is not None:
        lines.append(
            f"predicted stall: {_ms(result['predicted_stall_s'])} over {_ms(result['compute_s'])} "
            f"of compute, no schedule under {_ms(result['stall_lower_bound_s'])}"
            + (f" ({result['ops_with_default_duration']} ops without duration_s priced at the "
               "default)" if result["ops_with_default_duration"] else "")
        )
    if report.infeasible_ops:
        worst = max(report.infeasible_ops, key=lambda op: op.excess_bytes)
        lines.append(
            f"INFEASIBLE: {len(report.infeasible_ops)} op(s) need more than the budget on their own "
            f"(worst: op {worst.op_index} needs {_mib(worst.required_bytes)}, "
            f"{_mib(worst.excess_bytes)} over); raise the budget to at least "
            f"--budget-mb {_mib_flag_at_least(worst.required_bytes)}"
        )
        shown = ", ".join(f"op {op.op_index} (+{op.excess_bytes} B)" for op in report.infeasible_ops[:10])
        lines.append(f"  ops that cannot fit: {shown}" + (" ..." if len(report.infeasible_ops) > 10 else ""))
    if report.violations:
        lines.append(f"INVALID schedule ({len(report.violations)} violations), first: {report.violations[0]}")
    return "\n".join(lines)
