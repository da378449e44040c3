"""The greedy residency planner of the HyperOffload design (section 4.4), in O(M log S).

Algorithm (M candidate gaps, S ops):

1. Candidates are the gaps between consecutive accesses of each storage
   (:func:`~hyper_offload.passes.planner_candidates.offload_candidates`).
2. Rank them by (distance, size, -start) descending — far-apart, large gaps first —
   with ties broken by storage id.
3. Walk the ranking; accept a candidate while any op it covers is still over budget,
   and when accepted lower those ops' resident bytes by its size.
4. Lower the accepted set to actions (:mod:`.planner_lowering`).

Step 3 is where the design's straightforward version spends O(M·S); here a
:class:`~hyper_offload.passes.segment_tree.RangeAddMaxTree` over the per-op excess makes
each test and update O(log S), and the walk stops as soon as no op is over budget.

Over budget means "above ``max(budget, required_bytes)``": an op whose own operands do
not fit (infeasible) keeps attracting candidates until everything else around it is
offloaded, which is the best any schedule can do there. It selects exactly the gaps the
design's literal "resident > budget" test selects (see ``excess_over_allowed``).

``GreedyResidencyPlanner()`` then runs the refinement of :mod:`.refine` (drop redundant
transfers, swap expensive picks for cheaper covering ones, insert one gap that
replaces several picks); ``refine=False`` is the design's exact behaviour, which the
test suite checks against a straightforward oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

from .planner_candidates import OffloadCandidate, design_rank_key
from .plan_report import PlanReport, plan_by_choice
from .refine import refine_choice
from .schedule import ResidencySchedule
from .segment_tree import RangeAddMaxTree
from .trace import ActivationTrace


def select_greedy(
    candidates: Sequence[OffloadCandidate], excess: Sequence[int]
) -> list[OffloadCandidate]:
    """The design's greedy choice: accepted candidates, in acceptance order.

    ``excess[i]`` is op ``i``'s resident bytes minus its allowance with no offload
    (positive = over); it is not modified.
    """
    if not candidates or max(excess, default=0) <= 0:
        return []
    tree = RangeAddMaxTree(excess)
    subtract_if_over = tree.add_if_max_exceeds
    chosen = []
    for cand in sorted(candidates, key=design_rank_key):
        if subtract_if_over(cand.start + 1, cand.end, 0, -cand.size):
            chosen.append(cand)
            if tree.max_all() <= 0:
                break  # nothing is over budget any more: no later candidate is accepted
    return chosen


class GreedyResidencyPlanner:
    """Implements :class:`~hyper_offload.passes.ResidencyPlanner`.

    ``refine=True`` (the default) improves the design's choice with :func:`refine_choice`
    and never moves more bytes than ``refine=False``; ``refine=False`` is the design's
    algorithm exactly.
    """

    def __init__(self, refine: bool = True) -> None:
        self.refine = refine

    def __repr__(self) -> str:
        return f"GreedyResidencyPlanner(refine={self.refine})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GreedyResidencyPlanner) and other.refine == self.refine

    def __hash__(self) -> int:
        return hash((GreedyResidencyPlanner, self.refine))

    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        return self.plan_with_report(trace).schedule

    def plan_with_report(self, trace: ActivationTrace) -> PlanReport:
        return plan_by_choice(trace, self._choose, planner=repr(self))

    def _choose(
        self, candidates: Sequence[OffloadCandidate], excess: Sequence[int]
    ) -> Sequence[OffloadCandidate]:
        chosen = select_greedy(candidates, excess)
        return refine_choice(candidates, excess, chosen) if self.refine else chosen
