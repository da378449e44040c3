"""The planner protocol: anything with ``plan(trace) -> ResidencySchedule`` plugs in."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .schedule import ResidencySchedule
from .trace import ActivationTrace


@runtime_checkable
class ResidencyPlanner(Protocol):
    """Decides what to move and when; never touches a device.

    Contract: the returned schedule has one pre/post slot per op of ``trace`` and passes
    ``check_schedule(trace, schedule)`` with no violation other than those the trace's
    infeasible ops force.
    """

    def plan(self, trace: ActivationTrace) -> ResidencySchedule: ...
