"""The gap-choosing planners: the greedy residency planner of the HyperOffload design with
its time-aware ranking, and the exact integer program that is its yardstick.

**Time-aware ranking** of offload candidates: prefer gaps whose copies fit their windows.
The design's greedy ranks gaps by distance and size only, so it may pick a gap whose
D2H cannot finish before its bytes must be gone (a large tensor produced just before
the peak) or whose reload cannot finish between the last op that needs it gone and its
reader. On the timeline model such a pick stalls compute whatever the placement does.
:func:`time_rank_key` ranks every gap that *fits* both windows ahead of every gap that
does not, and keeps the design's order within each tier::

    D2H window   from the end of the gap's d2h_op to the start of the first op in the
                 gap that is over budget (the bytes must be gone by then)
    H2D window   from the start of the op after the last over-budget op in the gap (not
                 before ``earliest_prefetch_op``) to the start of its reader
    fits         bytes / bandwidth <= window, for both

A window is judged alone (the copy stream's other traffic is the placement's and the
timeline model's business), so this is a ranking, never a promise: the pipeline predicts
every proposal and keeps the one that stalls least (:func:`~.planning.plan_residency`).

**The greedy residency planner** of the HyperOffload design (section 4.4), in O(M log S).

Algorithm (M candidate gaps, S ops):

1. Candidates are the gaps between consecutive accesses of each storage
   (:func:`~..analysis.liveness.offload_candidates`).
2. Rank them by (distance, size, -start) descending — far-apart, large gaps first —
   with ties broken by storage id.
3. Walk the ranking; accept a candidate while any op it covers is still over budget,
   and when accepted lower those ops' resident bytes by its size.
4. Lower the accepted set to actions (:func:`~.report.lower_offload_choice`).

Step 3 is where the design's straightforward version spends O(M·S); here a
:class:`~.segment_tree.RangeAddMaxTree` over the per-op excess makes
each test and update O(log S), and the walk stops as soon as no op is over budget.

Over budget means "above ``max(budget, required_bytes)``": an op whose own operands do
not fit (infeasible) keeps attracting candidates until everything else around it is
offloaded, which is the best any schedule can do there. It selects exactly the gaps the
design's literal "resident > budget" test selects (see ``excess_over_allowed``).

``GreedyResidencyPlanner()`` then runs the refinement of :mod:`.refine` (drop redundant
transfers, swap expensive picks for cheaper covering ones, insert one gap that
replaces several picks) and the exact fill at the peak of :mod:`.refine`;
``refine=False`` is the design's exact behaviour, which the test suite checks against a
straightforward oracle.

Objective. ``plan`` is always the bytes choice above. With ``objective="time"`` (the
default) :meth:`GreedyResidencyPlanner.proposals` also offers the same walk over a
time-aware ranking (:func:`time_rank_key`: gaps whose copies fit their windows first), and
the shared pipeline keeps whichever proposal its timeline model predicts to stall
least, fewer bytes breaking ties (:func:`~.planning.plan_residency`).

**The exact minimum-bytes offload choice** (:class:`OptimalResidencyPlanner`), as an
integer program (HiGHS via scipy). This is the yardstick the greedy planner is measured
against, and a planner in its own right for small traces (its solve time grows fast with
the number of gaps). Variables::

    x_g in {0, 1}   gap g is offloaded        (costs size_g: its H2D)
    y_e in {0, 1}   write epoch e is copied   (costs size_e: its D2H)

    minimise   sum_g size_g x_g + sum_e size_e y_e
    subject to x_g <= y_epoch(g)                                    for every gap g
               sum_{g covers i} size_g x_g >= excess_i              for every op i

with ``excess_i = resident_without_offload_i - max(budget, required_bytes_i)`` (only
ops with positive excess give a row). The objective is exactly ``bytes_d2h + bytes_h2d``
of the lowered schedule (:func:`~.report.lower_offload_choice`), which ``check_schedule`` counts.

scipy is not a dependency of the library: it is imported on first use, with an error
that says how to install it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import reduce
from itertools import accumulate
from typing import Any

from hyper_offload.errors import ConfigurationError, OptimalPlannerError, OptionalDependencyError

from ..analysis.liveness import OffloadCandidate, design_rank_key
from ..analysis.predicted_timeline import op_start_times
from ..ir.schedule import OpLimit, ResidencySchedule, op_limit
from ..ir.trace import ActivationTrace, StorageId
from .report import PlanReport, lower_offload_choice, plan_by_choice
from .host_budget import HostLedger, fit_host_budget
from .refine import fill_peak, refine_choice
from .planning import backward_start
from .segment_tree import RangeAddMaxTree

__all__ = [
    "GreedyResidencyPlanner",
    "OBJECTIVES",
    "OptimalResidencyPlanner",
    "copy_fits",
    "select_greedy",
    "solve_optimal_choice",
    "time_rank_key",
]


RankKey = Callable[[OffloadCandidate], tuple[int, ...]]


def copy_fits(
    trace: ActivationTrace,
    candidates: Sequence[OffloadCandidate],
    excess: Sequence[int],
    *,
    earliest_prefetch_op: OpLimit = 0,
) -> list[bool]:
    """For each candidate, whether its D2H and its H2D each fit their window alone
    (``earliest_prefetch_op``: one op, or one per storage, :mod:`..ir.schedule`)."""
    num_ops = trace.num_ops
    clock = op_start_times(trace)
    next_over = [num_ops] * (num_ops + 1)  # first op >= i over budget
    for op in range(num_ops - 1, -1, -1):
        next_over[op] = op if excess[op] > 0 else next_over[op + 1]
    prev_over = [-1] * num_ops  # last op <= i over budget
    for op in range(num_ops):
        prev_over[op] = op if excess[op] > 0 else (prev_over[op - 1] if op else -1)
    d2h_rate, h2d_rate = trace.d2h_bandwidth_gbps * 1e9, trace.h2d_bandwidth_gbps * 1e9
    fits = []
    for gap in candidates:
        first = next_over[gap.start + 1]
        last = prev_over[gap.end - 1]
        if first >= gap.end:  # covers no op over budget: nothing has to be gone in time
            fits.append(True)
            continue
        reload_from = min(max(last + 1, op_limit(earliest_prefetch_op, gap.storage, 0)), gap.end)
        d2h_window = clock[first] - clock[gap.d2h_op + 1]
        h2d_window = clock[gap.end] - clock[reload_from]
        fits.append(gap.size / d2h_rate <= d2h_window and gap.size / h2d_rate <= h2d_window)
    return fits


def time_rank_key(
    trace: ActivationTrace,
    candidates: Sequence[OffloadCandidate],
    excess: Sequence[int],
    *,
    earliest_prefetch_op: OpLimit = 0,
) -> RankKey:
    """A sort key (ascending) for :func:`~.greedy.select_greedy`: fitting gaps
    first, then the design's order (:func:`~..analysis.liveness.design_rank_key`)."""
    fits = dict(
        zip(candidates, copy_fits(trace, candidates, excess, earliest_prefetch_op=earliest_prefetch_op))
    )
    return lambda gap: (0 if fits[gap] else 1, *design_rank_key(gap))


OBJECTIVES = ("time", "bytes")


def select_greedy(
    candidates: Sequence[OffloadCandidate],
    excess: Sequence[int],
    key: Callable[[OffloadCandidate], Any] = design_rank_key,
    host: HostLedger | None = None,
) -> list[OffloadCandidate]:
    """The design's greedy choice: accepted candidates, in acceptance order.

    ``excess[i]`` is op ``i``'s resident bytes minus its allowance with no offload
    (positive = over); it is not modified. ``key`` orders the walk (ascending; the
    design's order by default). ``host``: a candidate is accepted only if the ledger
    has host room for it too (:mod:`.host_budget`); the walk then goes on to the next
    one, so a gap the host cannot take leaves its ops to other gaps.
    """
    if not candidates or max(excess, default=0) <= 0:
        return []
    tree = RangeAddMaxTree(excess)
    subtract_if_over = tree.add_if_max_exceeds
    chosen = []
    for cand in sorted(candidates, key=key):
        if host is not None and not host.fits(cand):
            if tree.max(cand.start + 1, cand.end) > 0:
                host.rejected += 1  # the device wanted it: the host budget binds here
            continue
        if subtract_if_over(cand.start + 1, cand.end, 0, -cand.size):
            if host is not None:
                host.take(cand)
            chosen.append(cand)
            if tree.max_all() <= 0:
                break  # nothing is over budget any more: no later candidate is accepted
    return chosen


class GreedyResidencyPlanner:
    """Implements :class:`~hyper_offload.passes.ResidencyPlanner`.

    ``refine=True`` (the default) improves the design's choice with :func:`refine_choice`
    and never moves more bytes than ``refine=False``; ``refine=False`` is the design's
    algorithm exactly. ``objective``: ``"time"`` (default) proposes the bytes choice and
    the time-ranked one to the pipeline, ``"bytes"`` the bytes choice only.

    Two keywords serve a trace that is more than one region (the compile door's step,
    :mod:`hyper_offload.passes.plan.step.layout`): ``movable`` restricts the gaps to those
    storages' (None: every storage may move), and ``earliest_prefetch_op`` is where the
    time ranking assumes each storage's reload may start (one op or one per storage,
    :mod:`..ir.schedule`; None: where the trace's ``bw:`` ops begin, ``backward_start``).

    ``host_budget_bytes``: the most bucketed bytes host buffers may hold at once
    (:mod:`.host_budget`; None: no host budget). Every proposal keeps it; where it stops
    a gap the device budget wanted, the device stays over its budget there (the doors
    report the host limit, and the compile door's ``recompute="auto"`` recomputes).
    """

    def __init__(
        self,
        refine: bool = True,
        objective: str = "time",
        *,
        movable: frozenset[StorageId] | None = None,
        earliest_prefetch_op: OpLimit | None = None,
        host_budget_bytes: int | None = None,
    ) -> None:
        if objective not in OBJECTIVES:
            raise ConfigurationError(
                f"GreedyResidencyPlanner(objective={objective!r}): expected one of "
                f"{', '.join(map(repr, OBJECTIVES))} ('time': least predicted stall, "
                "'bytes': fewest bytes moved)"
            )
        self.refine = refine
        self.objective = objective
        self.movable = None if movable is None else frozenset(movable)
        self.earliest_prefetch_op = earliest_prefetch_op
        HostLedger(0, host_budget_bytes)  # validates it
        self.host_budget_bytes = host_budget_bytes

    def with_host_budget(self, host_budget_bytes: int | None) -> GreedyResidencyPlanner:
        """This planner keeping another host budget (the disk stage of
        :func:`~.planning.plan_residency` plans with the room its disk tier adds)."""
        return GreedyResidencyPlanner(
            self.refine, self.objective, movable=self.movable,
            earliest_prefetch_op=self.earliest_prefetch_op, host_budget_bytes=host_budget_bytes,
        )

    def __repr__(self) -> str:
        extra = "" if self.movable is None else f", movable={len(self.movable)} storages"
        if self.host_budget_bytes is not None:
            extra += f", host_budget_bytes={self.host_budget_bytes}"
        return (f"GreedyResidencyPlanner(refine={self.refine}, objective={self.objective!r}"
                f"{extra})")

    def _key(self) -> tuple[object, ...]:
        limit = self.earliest_prefetch_op
        limit = limit if limit is None or isinstance(limit, int) else tuple(sorted(limit.items()))
        return (self.refine, self.objective, self.movable, limit, self.host_budget_bytes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GreedyResidencyPlanner) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash((GreedyResidencyPlanner, *self._key()))

    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        return self.plan_with_report(trace).schedule

    def plan_with_report(self, trace: ActivationTrace) -> PlanReport:
        return plan_by_choice(trace, self._choose, planner=repr(self), movable=self.movable)

    def proposals(self, trace: ActivationTrace) -> list[ResidencySchedule]:
        """The schedules the pipeline should place, predict and choose among: the bytes
        choice first, then (objective ``"time"``) the time-ranked one, and that one before
        its peak fill (:mod:`.refine`, which may cost time), each if it differs."""
        proposals = [self.plan(trace)]
        if self.objective == "time":
            unfilled: list[Sequence[OffloadCandidate]] = []

            def choose_by_time(
                candidates: Sequence[OffloadCandidate], excess: Sequence[int]
            ) -> Sequence[OffloadCandidate]:
                earliest = self.earliest_prefetch_op
                key = time_rank_key(
                    trace, candidates, excess,
                    earliest_prefetch_op=backward_start(trace) if earliest is None else earliest,
                )
                picked = select_greedy(candidates, excess, key, self._ledger(len(excess)))
                chosen = self._fit(excess, self._refined(candidates, excess, picked, fill=False))
                filled = (self._fit(excess, fill_peak(candidates, excess, chosen)) if self.refine
                          else chosen)
                if filled != chosen:
                    unfilled.append(chosen)
                return filled

            timed = plan_by_choice(
                trace, choose_by_time, planner=repr(self), movable=self.movable
            ).schedule
            for schedule in (timed, *(lower_offload_choice(trace, c) for c in unfilled)):
                if schedule not in proposals:
                    proposals.append(schedule)
        return proposals

    def _choose(
        self, candidates: Sequence[OffloadCandidate], excess: Sequence[int]
    ) -> Sequence[OffloadCandidate]:
        picked = select_greedy(candidates, excess, host=self._ledger(len(excess)))
        return self._fit(excess, self._refined(candidates, excess, picked))

    def _ledger(self, num_ops: int) -> HostLedger | None:
        budget = self.host_budget_bytes
        return None if budget is None else HostLedger(num_ops, budget)

    def _fit(
        self, excess: Sequence[int], chosen: Sequence[OffloadCandidate]
    ) -> list[OffloadCandidate]:
        """``chosen`` within the host budget: refinement and the peak fill swap and add
        gaps by device bytes alone, so the final choice is filtered once more."""
        return fit_host_budget(len(excess), chosen, self.host_budget_bytes)[0]

    def _refined(
        self,
        candidates: Sequence[OffloadCandidate],
        excess: Sequence[int],
        chosen: list[OffloadCandidate],
        *,
        fill: bool = True,
    ) -> Sequence[OffloadCandidate]:
        """``chosen`` refined (:mod:`.refine`) and, with ``fill``, filled exactly at the
        peak (:mod:`.refine`); ``refine=False`` leaves the design's choice as it is."""
        if not self.refine:
            return chosen
        refined = refine_choice(candidates, excess, chosen)
        return fill_peak(candidates, excess, refined) if fill else refined


# ---------------------------------------------------------------- the exact planner

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
