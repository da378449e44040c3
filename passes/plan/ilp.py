"""The exact minimum-bytes offload choice, as an integer program (HiGHS via scipy).

This is the yardstick the greedy planner is measured against, and a planner in its own
right for small traces (its solve time grows fast with the number of gaps). Variables::

    x_g in {0, 1}   gap g is offloaded        (costs size_g: its H2D)
    y_e in {0, 1}   write epoch e is copied   (costs size_e: its D2H)

    minimise   sum_g size_g x_g + sum_e size_e y_e
    subject to x_g <= y_epoch(g)                                    for every gap g
               sum_{g covers i} size_g x_g >= excess_i              for every op i

with ``excess_i = resident_without_offload_i - max(budget, required_bytes_i)`` (only
ops with positive excess give a row). The objective is exactly ``bytes_d2h + bytes_h2d``
of the lowered schedule (:mod:`.choice_lowering`), which ``check_schedule`` counts.

scipy is not a dependency of the library: it is imported on first use, with an error
that says how to install it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import reduce
from itertools import accumulate
from typing import Any

from hyper_offload.errors import OptimalPlannerError, OptionalDependencyError

from ..analysis.liveness import OffloadCandidate
from ..ir.schedule import ResidencySchedule
from ..ir.trace import ActivationTrace
from .report import PlanReport, plan_by_choice


def _import_scipy() -> tuple[Any, Any, Any]:
    """``(milp, LinearConstraint, coo_matrix)``, or an ImportError that says what to do."""
    try:
        from scipy.optimize import LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError as error:  # raised here so the library itself never needs scipy
        raise OptionalDependencyError(
            "OptimalResidencyPlanner needs scipy (HiGHS MILP); install it with "
            "`pip install 'scipy>=1.11'` or `pip install hyper-offload[test]`"
        ) from error
    return milp, LinearConstraint, coo_matrix


def solve_optimal_choice(
    candidates: Sequence[OffloadCandidate],
    excess: Sequence[int],
    *,
    time_limit_s: float | None = None,
) -> list[OffloadCandidate]:
    """The minimum-bytes set of candidates that brings every op within its allowance.

    Raises :class:`OptimalPlannerError` if HiGHS does not prove optimality (for example
    when ``time_limit_s`` runs out).
    """
    rows = [i for i, e in enumerate(excess) if e > 0]
    if not rows or not candidates:
        return []
    import numpy as np  # scipy depends on numpy, so it is present whenever scipy is

    milp, LinearConstraint, coo_matrix = _import_scipy()
    # Divide every byte count by their gcd: coefficients stay small exact integers, far
    # from HiGHS's feasibility tolerance.
    unit = reduce(math.gcd, [c.size for c in candidates] + [excess[i] for i in rows])
    epochs = sorted({c.epoch for c in candidates})
    epoch_column = {e: len(candidates) + k for k, e in enumerate(epochs)}
    epoch_size = {c.epoch: c.size for c in candidates}
    num_vars = len(candidates) + len(epochs)
    cost = np.array([c.size // unit for c in candidates] + [epoch_size[e] // unit for e in epochs])

    # Budget rows, one per over-budget op: the offloaded bytes covering it >= its excess.
    row_of = {op: r for r, op in enumerate(rows)}
    coverage = [
        (row_of[op], k, cand.size // unit)
        for k, cand in enumerate(candidates)
        for op in range(cand.start + 1, cand.end)
        if op in row_of
    ]
    rows_i, cols_i, values = zip(*coverage) if coverage else ((), (), ())
    budget_rows = LinearConstraint(
        coo_matrix((values, (rows_i, cols_i)), shape=(len(rows), num_vars)),
        lb=np.array([excess[i] // unit for i in rows]),
        ub=np.inf,
    )
    # Linking rows: x_g - y_epoch(g) <= 0 (a reload needs its epoch's copy).
    gaps = list(range(len(candidates)))
    link_rows = LinearConstraint(
        coo_matrix(
            ([1.0] * len(gaps) + [-1.0] * len(gaps),
             (gaps + gaps, gaps + [epoch_column[c.epoch] for c in candidates])),
            shape=(len(gaps), num_vars),
        ),
        lb=-np.inf,
        ub=0.0,
    )
    result = milp(
        cost,
        constraints=[budget_rows, link_rows],
        integrality=np.ones(num_vars),
        bounds=(0, 1),
        options={} if time_limit_s is None else {"time_limit": time_limit_s},
    )
    if result.status != 0 or result.x is None:
        raise OptimalPlannerError(
            f"solve_optimal_choice: HiGHS did not prove an optimum ({result.message}); "
            "the trace may be too large for the exact planner, use GreedyResidencyPlanner"
        )
    chosen = [cand for k, cand in enumerate(candidates) if result.x[k] > 0.5]
    _check_covers(chosen, excess)
    return chosen


def _check_covers(chosen: Sequence[OffloadCandidate], excess: Sequence[int]) -> None:
    """Re-check the rounded solution in exact integers (the solver works in floats)."""
    delta = [0] * (len(excess) + 1)
    for cand in chosen:
        delta[cand.start + 1] += cand.size
        delta[cand.end] -= cand.size
    for op, (over, covered) in enumerate(zip(excess, accumulate(delta))):
        if over > covered:
            raise OptimalPlannerError(
                f"solve_optimal_choice: the rounded HiGHS solution leaves op {op} over its "
                f"allowance by {over - covered} bytes (solver tolerance); "
                "use GreedyResidencyPlanner for this trace"
            )


class OptimalResidencyPlanner:
    """Implements :class:`~hyper_offload.passes.ResidencyPlanner` with the exact ILP.

    Meant for small traces (hundreds of gaps) and as the quality yardstick; needs scipy.
    """

    def __init__(self, *, time_limit_s: float | None = 60.0) -> None:
        self.time_limit_s = time_limit_s

    def __repr__(self) -> str:
        return f"OptimalResidencyPlanner(time_limit_s={self.time_limit_s})"

    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        return self.plan_with_report(trace).schedule

    def plan_with_report(self, trace: ActivationTrace) -> PlanReport:
        return plan_by_choice(
            trace,
            lambda candidates, excess: solve_optimal_choice(
                candidates, excess, time_limit_s=self.time_limit_s
            ),
            planner=repr(self),
        )
