"""Planner benchmark: speed against the O(M·S) oracle, bytes moved against the ILP optimum.

Prints one JSON object per line:

* ``planner.speed``   — per transformer-like trace and planner: wall and CPU seconds of
  ``plan`` (GC on, as users run it); the reference oracle is timed in the same run up to
  ``--reference-max-accesses`` and reported as skipped (by design) above it.
* ``planner.speed.saved_stack`` — the bytes-only plan (``GreedyResidencyPlanner().plan``)
  of the issue-30 trace (:func:`synthetic.saved_stack_trace`: 12,500 layers, 100,002 ops,
  250,003 accesses, budget ``max(floor, peak / 3)``): wall seconds of each of 3 runs,
  the fastest against the 1.5 s target.
* ``planner.speed.pipeline`` — the whole planning pipeline every door runs
  (``plan_residency``: both proposals of the time objective, each placed, held and
  predicted) on a ~10k-op compile-door trace with op times
  (:func:`synthetic.timed_transformer_trace`, 1,100 layers): wall seconds of each of 3
  runs, the fastest against issue 16's 5 s target. (A test asserted this figure until
  issue 45; the suite now checks only that the plan is valid, since wall time on a
  shared 2-core machine is not the code's to promise.)
* ``planner.growth``  — per planner: CPU seconds / (N log2 N) for N = accesses, per size, and
  that value at the largest size over the smallest (<= ~1: no worse than N log N).
* ``planner.quality`` — per bundled irregular trace: bytes moved (D2H + H2D, as
  ``check_schedule`` counts them) by greedy(refine=False), greedy(refine=True) and the
  exact optimum, with the ratios.
* ``planner.quality.summary`` — median and worst ratio per planner against the target
  (median <= 1.10, worst <= 1.25).
* ``planner.quality.random`` (``--random-quality N``) — the same ratios on N more seeded
  irregular traces outside the bundled set, with the worst seeds, to see how far the
  bundled figures generalise.

Run from the repository root: ``python benchmarks/planner.py [--quick]``
(``--pipeline-only``: just the ``planner.speed.pipeline`` row). ``--quick``
(< 60 s) stops at ~300k accesses and times the oracle on the smallest trace only; the
full run adds ~1M accesses and the oracle at ~100k (a few minutes in all).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hyper_offload.passes import ActivationTrace, ResidencySchedule, check_schedule
from hyper_offload.passes.plan.greedy import GreedyResidencyPlanner
from hyper_offload.passes.plan.greedy import OptimalResidencyPlanner
from hyper_offload.passes.plan.planning import backward_start, plan_residency

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "passes"))

import reference_planner  # noqa: E402  (the test suite's oracle)
from synthetic import (  # noqa: E402
    irregular_trace,
    saved_stack_trace,
    timed_transformer_trace,
    transformer_trace,
)

DATA = ROOT / "benchmarks" / "data"
ACCESSES_PER_LAYER = 26  # what transformer_trace emits per block (forward + backward)
QUICK_SIZES = (10_000, 100_000, 286_000)  # accesses; 286k is the 100k-op case
FULL_SIZES = QUICK_SIZES + (1_000_000,)
TARGET_MEDIAN, TARGET_WORST = 1.10, 1.25
SAVED_STACK_LAYERS, SAVED_STACK_TARGET_S = 12_500, 1.5
PIPELINE_LAYERS, PIPELINE_TARGET_S = 1_100, 5.0


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


@contextlib.contextmanager
def c_stdout_silenced() -> Iterator[None]:
    """HiGHS occasionally prints from C; keep stdout to JSON lines only."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def timed(plan: Callable[[ActivationTrace], ResidencySchedule], trace: ActivationTrace,
          repeat: int) -> tuple[float, float, ResidencySchedule]:
    """Best-of-``repeat`` wall and CPU seconds of ``plan(trace)``, GC on (as users run it)."""
    best_wall = best_cpu = math.inf
    schedule = None
    for _ in range(repeat):
        schedule = None  # free the previous run's schedule before timing the next
        gc.collect()  # start each run from the same heap, not from the previous garbage
        wall, cpu = time.perf_counter(), time.process_time()
        schedule = plan(trace)
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu, schedule


def speed(sizes: tuple[int, ...], reference_max_accesses: int) -> None:
    planners: dict[str, Callable[[ActivationTrace], ResidencySchedule]] = {
        "greedy(refine=True)": GreedyResidencyPlanner(refine=True).plan,
        "greedy(refine=False)": GreedyResidencyPlanner(refine=False).plan,
        "reference(O(M*S))": reference_planner.plan,
    }
    # Growth is judged on CPU seconds: wall time on a shared machine includes other
    # processes' time slices.
    per_nlogn: dict[str, list[float]] = {name: [] for name in planners}
    warmup = transformer_trace(40)  # first calls pay for imports and cold caches
    for plan in planners.values():
        plan(warmup)
    for target in sizes:
        trace = transformer_trace(max(1, round(target / ACCESSES_PER_LAYER)))
        accesses = sum(len(op.accesses) for op in trace.ops)
        base = {"bench": "planner.speed", "trace": "transformer", "ops": trace.num_ops,
                "accesses": accesses, "storages": len(trace.storage_sizes)}
        repeat = 5 if accesses < 50_000 else 3 if accesses < 400_000 else 1
        results = {}
        for name, plan in planners.items():
            if name.startswith("reference") and accesses > reference_max_accesses:
                emit({**base, "planner": name, "skipped": "by design: the O(M*S) oracle is "
                      f"timed up to {reference_max_accesses} accesses (--reference-max-accesses)"})
                continue
            slow = name.startswith("reference") and accesses > 20_000
            wall, cpu, schedule = timed(plan, trace, 1 if slow else repeat)
            checked = check_schedule(trace, schedule)
            # Keep only the schedules the identity check needs: a kept schedule is a
            # few hundred thousand live objects that every later GC pass must scan.
            results[name] = (cpu, schedule if "refine=True" not in name else None)
            del schedule
            per_nlogn[name].append(cpu / (accesses * math.log2(accesses)) * 1e9)
            emit({**base, "planner": name, "plan_s": round(wall, 4), "cpu_s": round(cpu, 4),
                  "repeat": 1 if slow else repeat, "valid": checked.ok, "bytes_moved": checked.bytes_moved,
                  "peak_resident_bytes": checked.peak_resident_bytes,
                  "budget_bytes": trace.budget_bytes})
        reference = results.get("reference(O(M*S))")
        if reference is not None:
            design_cpu, design_schedule = results["greedy(refine=False)"]
            emit({**base, "bench": "planner.speed.vs_reference", "clock": "cpu",
                  "speedup_refine_false": round(reference[0] / design_cpu, 2),
                  "speedup_refine_true": round(reference[0] / results["greedy(refine=True)"][0], 2),
                  "identical_schedule": design_schedule == reference[1]})
    for name, values in per_nlogn.items():
        if len(values) >= 2:
            emit({"bench": "planner.growth", "planner": name,
                  "cpu_ns_per_n_log2_n": [round(v, 2) for v in values],
                  "largest_size_over_smallest": round(values[-1] / values[0], 2)})


def saved_stack_speed(repeat: int = 3) -> None:
    """The issue-30 row: fastest of ``repeat`` bytes-only plans of the saved-stack trace."""
    trace = saved_stack_trace(SAVED_STACK_LAYERS)
    plan = GreedyResidencyPlanner().plan
    runs = []
    schedule = None
    for _ in range(repeat):
        schedule = None  # free the previous run's schedule before timing the next
        wall, _, schedule = timed(plan, trace, 1)
        runs.append(wall)
    checked = check_schedule(trace, schedule)
    emit({"bench": "planner.speed.saved_stack", "planner": "GreedyResidencyPlanner().plan",
          "layers": SAVED_STACK_LAYERS, "ops": trace.num_ops,
          "accesses": sum(len(op.accesses) for op in trace.ops),
          "runs_s": [round(r, 3) for r in runs], "best_s": round(min(runs), 3),
          "target_s": SAVED_STACK_TARGET_S, "meets_target": min(runs) < SAVED_STACK_TARGET_S,
          "valid": checked.ok, "bytes_moved": checked.bytes_moved,
          "budget_bytes": trace.budget_bytes})


def pipeline_speed(repeat: int = 3) -> None:
    """Issue 16's row: fastest of ``repeat`` runs of the whole pipeline on ~10k ops."""
    trace = timed_transformer_trace(PIPELINE_LAYERS)
    num_fw = backward_start(trace)
    runs, planned = [], None
    for _ in range(repeat):
        planned = None  # free the previous run's result before timing the next
        gc.collect()
        started = time.perf_counter()
        planned = plan_residency(trace, GreedyResidencyPlanner(), earliest_prefetch_op=num_fw,
                                 release_waits_for_d2h=True, latest_release_op=num_fw - 1)
        runs.append(time.perf_counter() - started)
    assert planned is not None
    emit({"bench": "planner.speed.pipeline", "pipeline": "plan_residency (time objective)",
          "layers": PIPELINE_LAYERS, "ops": trace.num_ops,
          "runs_s": [round(r, 3) for r in runs], "best_s": round(min(runs), 3),
          "target_s": PIPELINE_TARGET_S, "meets_target": min(runs) <= PIPELINE_TARGET_S,
          "valid": planned.check.ok, "bytes_d2h": planned.check.bytes_d2h})


def quality() -> None:
    paths = sorted(DATA.glob("irregular_*.json"))
    ratios: dict[str, list[float]] = {"greedy(refine=False)": [], "greedy(refine=True)": []}
    for path in paths:
        trace = ActivationTrace.from_json(path.read_text())
        with c_stdout_silenced():
            optimal = check_schedule(trace, OptimalResidencyPlanner().plan(trace))
        record: dict[str, object] = {"bench": "planner.quality", "trace": path.name,
                                     "ops": trace.num_ops, "storages": len(trace.storage_sizes),
                                     "optimal_bytes": optimal.bytes_moved}
        for refine in (False, True):
            name = f"greedy(refine={refine})"
            checked = check_schedule(trace, GreedyResidencyPlanner(refine=refine).plan(trace))
            ratio = checked.bytes_moved / optimal.bytes_moved if optimal.bytes_moved else 1.0
            ratios[name].append(ratio)
            record[f"{name}_bytes"] = checked.bytes_moved
            record[f"{name}_ratio"] = round(ratio, 4)
            record[f"{name}_valid"] = checked.ok
        emit(record)
    for name, values in ratios.items():
        median, worst = statistics.median(values), max(values)
        emit({"bench": "planner.quality.summary", "planner": name, "traces": len(values),
              "median_ratio": round(median, 4), "worst_ratio": round(worst, 4),
              "target_median": TARGET_MEDIAN, "target_worst": TARGET_WORST,
              "meets_target": median <= TARGET_MEDIAN and worst <= TARGET_WORST})


def random_quality(count: int, seed: int = 1) -> None:
    """Ratios on ``count`` seeded irregular traces (20-60 ops) outside the bundled set."""
    ratios: dict[str, list[tuple[float, int]]] = {"greedy(refine=False)": [], "greedy(refine=True)": []}
    for index in range(seed, seed + count):
        rng = random.Random(index)
        num_ops = rng.randint(20, 60)
        trace = irregular_trace(rng, num_ops=num_ops, num_storages=rng.randint(num_ops // 2, num_ops))
        with c_stdout_silenced():
            optimal = check_schedule(trace, OptimalResidencyPlanner().plan(trace)).bytes_moved
        if not optimal:
            continue  # the budget happened to hold without offload: no ratio
        for refine in (False, True):
            moved = check_schedule(trace, GreedyResidencyPlanner(refine=refine).plan(trace)).bytes_moved
            ratios[f"greedy(refine={refine})"].append((moved / optimal, index))
    for name, values in ratios.items():
        worst = sorted(values, reverse=True)[:5]
        emit({"bench": "planner.quality.random", "planner": name, "traces": len(values),
              "seeds": [seed, seed + count - 1],
              "median_ratio": round(statistics.median(r for r, _ in values), 4),
              "worst_ratio": round(worst[0][0], 4),
              "over_1.25": sum(r > TARGET_WORST for r, _ in values),
              "worst_seeds": [[s, round(r, 4)] for r, s in worst]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip ~1M accesses (< 60 s)")
    parser.add_argument("--reference-max-accesses", type=int, default=None,
                        help="largest trace the O(M*S) oracle is timed on "
                             "(default: 10k with --quick, 110k otherwise)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--pipeline-only", action="store_true",
                        help="only the planner.speed.pipeline row (~10k ops, seconds)")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--random-quality", type=int, default=0, metavar="N",
                        help="also judge N seeded irregular traces outside the bundled set")
    args = parser.parse_args()
    if args.pipeline_only:
        pipeline_speed()
        return
    cap = args.reference_max_accesses
    if cap is None:
        cap = 11_000 if args.quick else 110_000
    if not args.skip_quality:
        quality()
    if args.random_quality > 0:
        random_quality(args.random_quality)
    if not args.skip_speed:
        saved_stack_speed()
        pipeline_speed()
        speed(QUICK_SIZES if args.quick else FULL_SIZES, cap)


if __name__ == "__main__":
    main()
