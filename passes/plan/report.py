"""``PlanReport`` and the one pipeline every gap-choosing planner shares.

A planner that offloads whole gaps differs from another only in *which* gaps it picks:
candidates and per-op excess come from :mod:`..analysis.candidates`, the pick from the
planner, and the schedule from :func:`~.choice_lowering.lower_offload_choice`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..analysis.candidates import OffloadCandidate, budget_excess, offload_candidates
from ..analysis.liveness import InfeasibleOp
from ..ir.schedule import ResidencySchedule
from ..ir.trace import ActivationTrace, StorageId
from .choice_lowering import lower_offload_choice

#: Picks the gaps to offload from all candidates and the per-op bytes over budget.
ChooseGaps = Callable[[Sequence[OffloadCandidate], Sequence[int]], Sequence[OffloadCandidate]]


@dataclass(frozen=True)
class PlanReport:
    """What a planner decided, and why it could not do better where it could not.

    ``chosen`` are the offloaded gaps in acceptance order; ``infeasible_ops`` the ops
    whose own operands exceed the budget (with the excess bytes); ``plan_seconds`` the
    wall time of the analysis and lowering.
    """

    schedule: ResidencySchedule
    chosen: tuple[OffloadCandidate, ...]
    infeasible_ops: tuple[InfeasibleOp, ...]
    num_candidates: int
    planner: str
    plan_seconds: float

    @property
    def feasible(self) -> bool:
        return not self.infeasible_ops

    def __repr__(self) -> str:
        return (
            f"PlanReport({self.planner}: {len(self.chosen)}/{self.num_candidates} gaps offloaded, "
            f"{len(self.infeasible_ops)} infeasible ops, {self.plan_seconds * 1e3:.1f} ms)"
        )


def plan_by_choice(
    trace: ActivationTrace,
    choose: ChooseGaps,
    *,
    planner: str,
    movable: frozenset[StorageId] | None = None,
) -> PlanReport:
    """Analyse ``trace``, let ``choose`` pick gaps (of ``movable`` storages only, when
    given), lower the pick; time the whole."""
    started = time.perf_counter()
    candidates = offload_candidates(trace, movable)
    excess, infeasible = budget_excess(trace)
    chosen = choose(candidates, excess)
    return PlanReport(
        schedule=lower_offload_choice(trace, chosen),
        chosen=tuple(chosen),
        infeasible_ops=tuple(infeasible),
        num_candidates=len(candidates),
        planner=planner,
        plan_seconds=time.perf_counter() - started,
    )
