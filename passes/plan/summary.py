"""One summary of a plan, whatever made it: the figures every report and CLI prints.

A region's plan (the compile door's region scope), the eager session's plan, a step's
plan (the compile door's step scope, ``estimate``) and ``hyper-offload plan`` all answer
the same questions: how high the device bytes go against the budget, how low they could
go (the floor: everything movable moved), how high without offload, how many bytes move
and stay, how many host bytes that takes against the host budget, which budget binds,
and what it costs in time. :class:`PlanSummary` holds those figures and derives
``binding`` and ``fits`` in one place. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Binding", "PlanSummary", "binding"]

Binding = str
"""``"device"``, ``"host"``, ``"both"`` or ``"none"`` (see :func:`binding`)."""


def binding(*, budget_bytes: int, floor_peak_bytes: int, peak_bytes: int, moved_bytes: int,
            host_forced: bool) -> Binding:
    """Which budget limits a plan.

    ``"host"``: the host budget kept bytes on the device past the device budget (more
    host memory, or recompute, helps); ``"device"``: the floor alone is over the device
    budget (only recompute or a larger budget helps), or the device budget made the plan
    move bytes and the host had room; ``"both"``: both at once; ``"none"``: nothing had
    to move. ``host_forced``: whether the host budget made the plan keep anything."""
    host = host_forced and peak_bytes > max(budget_bytes, floor_peak_bytes)
    device = floor_peak_bytes > budget_bytes
    if host:
        return "both" if device else "host"
    return "device" if device or moved_bytes else "none"


@dataclass(frozen=True)
class PlanSummary:
    """A plan's figures (bytes; *predicted*, except where a door says it measured them).

    ``moved_bytes`` is what goes to the host per step (each byte also comes back once);
    ``kept_bytes`` what a plan could have moved and keeps on the device; ``floor_peak_bytes``
    the least peak any plan of the same lowering reaches; ``peak_host_bytes`` counts host
    buffers as the pool holds them (power-of-two buckets)."""

    budget_bytes: int
    peak_bytes: int
    floor_peak_bytes: int
    peak_without_offload_bytes: int
    moved_bytes: int
    kept_bytes: int = 0
    peak_host_bytes: int = 0
    host_budget_bytes: int | None = None
    host_forced: bool = False
    """Whether the host budget made the plan keep bytes it would have moved."""
    predicted_stall_s: float = 0.0

    @property
    def fits(self) -> bool:
        """Whether the peak is within the budget (never when the floor is not)."""
        return self.peak_bytes <= self.budget_bytes

    @property
    def binding(self) -> Binding:
        return binding(budget_bytes=self.budget_bytes, floor_peak_bytes=self.floor_peak_bytes,
                       peak_bytes=self.peak_bytes, moved_bytes=self.moved_bytes,
                       host_forced=self.host_forced)

