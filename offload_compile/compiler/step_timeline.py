"""The step as one trace: every invocation's ops and transfers, for the timeline model.

:mod:`.step_plan` decides what each invocation keeps; this module answers what that
costs in time. :func:`step_trace` lays the regions' floor traces end to end in the order
the step ran them (each invocation's storages its own), and their floor schedules with
them, minus every action on a slot the invocation keeps (its bytes then simply stay
until its last backward use, where the floor releases them too). The result goes to
:func:`~hyper_offload.passes.analysis.predicted_timeline.predict_timeline`, the one
timeline model every door uses, so a step plan's *predicted* stall is priced exactly as
a region's is.

Ops are priced as their region traced them (the region's device), unless ``durations``
re-prices them (``benchmarks/step_budget.py`` prices the step as a GPU would run it).
Memory is not modelled here (a region's model outputs stay "retained" to the end of the
laid-out trace, which is conservative); :mod:`.step_plan` accounts the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from hyper_offload.passes.analysis.predicted_timeline import predict_timeline
from hyper_offload.passes.ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from hyper_offload.passes.ir.trace import ActivationTrace, StorageAccess, TraceOp

from .step_model import Invocation, StepEventKind, StepTimeline

__all__ = ["RegionFloor", "predicted_step_stall", "step_trace"]

# Actions a kept slot drops (the final RELEASE_DEVICE, in the backward, stays).
_MOVES = frozenset({ActionKind.COPY_D2H, ActionKind.COPY_H2D, ActionKind.WAIT_H2D,
                    ActionKind.RELEASE_HOST})


class RegionFloor(NamedTuple):
    """A region's floor trace and schedule, and where its backward starts."""

    trace: ActivationTrace
    schedule: ResidencySchedule
    num_fw_ops: int


def step_trace(
    timeline: StepTimeline,
    floors: Mapping[int, RegionFloor],
    keep: Callable[[Invocation], frozenset[int]],
    *,
    durations: Mapping[int, Sequence[float]] | None = None,
    bandwidth_gbps: tuple[float, float] | None = None,
) -> tuple[ActivationTrace, ResidencySchedule]:
    """The step's trace and schedule (module docstring). ``durations[r][i]`` re-prices op
    ``i`` of region ``r``; ``bandwidth_gbps`` (D2H, H2D) replaces the regions' links."""
    ops: list[TraceOp] = []
    pre: list[tuple[ResidencyAction, ...]] = []
    post: list[tuple[ResidencyAction, ...]] = []
    ids: dict[tuple[Invocation, int], int] = {}
    sizes: dict[int, int] = {}
    retained: set[int] = set()
    for kind, invocation in timeline.events:
        floor = floors[invocation.region]
        kept = keep(invocation)
        span = (range(floor.num_fw_ops) if kind is StepEventKind.FORWARD
                else range(floor.num_fw_ops, floor.trace.num_ops))

        def sid(storage: int, invocation: Invocation = invocation, floor: RegionFloor = floor) -> int:
            key = (invocation, storage)
            if key not in ids:
                ids[key] = len(ids)
                sizes[ids[key]] = floor.trace.storage_sizes[storage]
                if storage in floor.trace.retained:
                    retained.add(ids[key])
            return ids[key]

        for index in span:
            op = floor.trace.ops[index]
            duration = durations[invocation.region][index] if durations else op.duration_s
            ops.append(TraceOp(
                op.name, tuple(StorageAccess(sid(a.storage), a.kind) for a in op.accesses),
                tuple(sid(s) for s in op.outputs), duration,
            ))
            forward = index < floor.num_fw_ops
            for slots, out in ((floor.schedule.pre[index], pre), (floor.schedule.post[index], post)):
                out.append(tuple(
                    ResidencyAction(a.kind, sid(a.storage)) for a in slots
                    if not _dropped(a, kept, forward)
                ))
    d2h, h2d = bandwidth_gbps or (floors[timeline.events[0].invocation.region].trace.d2h_bandwidth_gbps,
                                  floors[timeline.events[0].invocation.region].trace.h2d_bandwidth_gbps)
    trace = ActivationTrace(tuple(ops), sizes, budget_bytes=0, retained=frozenset(retained),
                            d2h_bandwidth_gbps=d2h, h2d_bandwidth_gbps=h2d)
    return trace, ResidencySchedule(tuple(pre), tuple(post))


def _dropped(action: ResidencyAction, kept: frozenset[int], forward: bool) -> bool:
    """Whether a kept slot drops ``action``: every move, and the forward's release."""
    if action.storage not in kept:
        return False
    return action.kind in _MOVES or (action.kind is ActionKind.RELEASE_DEVICE and forward)


def predicted_step_stall(
    timeline: StepTimeline,
    floors: Mapping[int, RegionFloor],
    keep: Callable[[Invocation], frozenset[int]],
    **pricing: object,
) -> float:
    """Seconds the step waits for copies (*predicted*, the one timeline model; the
    compile lowering's releases wait for their D2H)."""
    trace, schedule = step_trace(timeline, floors, keep, **pricing)  # type: ignore[arg-type]
    return predict_timeline(trace, schedule, release_waits_for_d2h=True).exposed_transfer_s
