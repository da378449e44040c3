"""The one planning pipeline every front door runs: plan → check → place prefetches → check.

The compile backend (per region, and ``hyper_offload.estimate`` through it), the eager
session's warmup and ``hyper-offload plan`` all call :func:`plan_residency`, so the same
trace, planner and ``earliest_prefetch_op`` give the same schedule whichever door asked::

    for each of planner.proposals(trace)         (or just planner.plan(trace))
      planned                                    stage "plan"
        └─ check_schedule                        (ScheduleError naming the stage and door)
      delay_releases(..., latest_op=L)           stage "delay_releases" (doors whose
        └─ check_schedule                        releases wait for their D2H)
      hoist_prefetches(..., earliest_op=E)       stage "place_prefetches" (timed on the
        └─ check_schedule                        door's timeline, releases placed)
      predict_timeline(...)                      the one timeline model
      (doors whose releases wait: the proposal also undelayed, placed as elsewhere)
    keep the least predicted stall, then the fewest bytes moved, then the first
    where the host budget binds and the trace has a disk tier:
      the same with more host room, then
      spill_to_disk(...)                         stage "spill_to_disk" (host copies
        └─ check_schedule                        that wait longest go to files)
      keep the lowest device peak, then the least stall

Placement (:func:`~.placement.hoist_prefetches`) moves each ``COPY_H2D`` earlier:
as late as the timeline model says its copy still arrives in time, never earlier than
the budget allows, in the order the reloads are waited for, never before the op after
the storage's release nor before op ``E``; each ``WAIT_H2D`` stays at the reading op.
The objective is step time: a planner that proposes several schedules (the default
greedy planner offers its bytes choice and a time-ranked one) gets the one that stalls
least on the timeline model; a planner with only ``plan`` is placed as it is.
``E`` is the door's knob: the compile path
passes the first backward op (a reload cannot start in the forward graph, which has
already returned by then), the eager session 0 (the step is one timeline), the CLI what
the trace's op names say (:func:`backward_start`). Pure: no torch, no device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from hyper_offload.errors import ConfigurationError, PlanningError

from ..analysis.predicted_timeline import predict_timeline
from ..analysis.validator import Rule, ScheduleError, ScheduleReport, check_schedule
from ..ir.schedule import OpLimit, ResidencySchedule
from ..ir.trace import BACKWARD_GRAPH, FORWARD_GRAPH, ActivationTrace, StorageId
from .host_budget import host_curve, spill_to_disk
from .placement import PrefetchError, delay_releases, hoist_prefetches, prefetch_leads
from .report import ResidencyPlanner, binding

__all__ = [
    "PlannedSchedule",
    "PlanningError",
    "PlanningStage",
    "backward_start",
    "plan_residency",
    "prefetch_leads",
]


class PlanningStage(str, Enum):
    """A stage of :func:`plan_residency` whose schedule ``check_schedule`` judges."""

    PLAN = "plan"
    DELAY_RELEASES = "delay_releases"
    PLACE_PREFETCHES = "place_prefetches"
    SPILL_TO_DISK = "spill_to_disk"

    def __repr__(self) -> str:
        return self.value

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    PlanningStage.PLAN: "the planner's schedule",
    PlanningStage.PLACE_PREFETCHES: "the hoisted schedule",
    PlanningStage.DELAY_RELEASES: "the schedule with delayed releases",
    PlanningStage.SPILL_TO_DISK: "the schedule with host copies spilled to disk",
}


_PASSES = {
    PlanningStage.PLACE_PREFETCHES: "prefetch.hoist_prefetches",
    PlanningStage.DELAY_RELEASES: "release_delay.delay_releases",
    PlanningStage.SPILL_TO_DISK: "disk_tier.spill_to_disk",
}


@dataclass(frozen=True)
class PlannedSchedule:
    """What :func:`plan_residency` decided for one trace.

    Invariants: ``check == check_schedule(trace, schedule)`` and ``check.ok``;
    ``planned_check == check_schedule(trace, planned)`` and ``planned_check.ok``;
    ``schedule`` differs from ``planned`` only in where ``COPY_H2D`` actions sit and, for
    a door whose releases wait for their D2H, where ``RELEASE_DEVICE`` of an offloaded
    storage sits (later, never at or past its reload nor past ``latest_release_op``),
    and in the disk tier's actions (``SPILL_TO_DISK`` / ``LOAD_FROM_DISK`` /
    ``RELEASE_DISK``, the disk stage's): same device actions, same bytes moved, every
    ``WAIT_H2D`` in place; a reload that placement moved starts at op
    ``earliest_prefetch_op`` or later, and so does a load from disk.
    """

    trace: ActivationTrace
    schedule: ResidencySchedule
    check: ScheduleReport
    planned: ResidencySchedule
    """The planner's schedule, before placement (``COPY_H2D`` next to its ``WAIT_H2D``)."""
    planned_check: ScheduleReport
    earliest_prefetch_op: OpLimit
    predicted_stall_s: float = 0.0
    """The timeline model's stall of ``schedule``
    (:func:`~..analysis.predicted_timeline.predict_timeline` with this door's
    ``release_waits_for_d2h``): the least among the proposals."""
    proposals: int = 1
    """How many schedules the planner proposed (``planned`` is the one kept)."""
    host_budget_bytes: int | None = None
    """The host budget the plan keeps (bucketed bytes, :mod:`.host_budget`); None: none."""
    peak_host_bytes: int = 0
    """The most bucketed bytes ``schedule`` holds in host buffers at once
    (:func:`~.host_budget.host_curve`); at most ``host_budget_bytes``."""
    requested_budget_bytes: int | None = None
    """The device budget asked for. ``trace.budget_bytes`` is higher only where the host
    budget left bytes on the device (``binding == "host"``): the plan is checked under
    the budget it really reaches, and the door warns with both figures."""

    @property
    def binding(self) -> str:
        """Which budget shapes the plan: ``"host"`` (the host budget kept bytes on the
        device past its budget), ``"device"`` (the device budget made it offload and the
        host had room), ``"none"`` (nothing had to move)."""
        requested = self.requested_budget_bytes
        budget = self.trace.budget_bytes if requested is None else requested
        return binding(budget_bytes=budget, floor_peak_bytes=0,
                       peak_bytes=self.check.peak_resident_bytes, moved_bytes=self.check.bytes_moved,
                       host_forced=self.trace.budget_bytes > budget)


def plan_residency(
    trace: ActivationTrace,
    planner: ResidencyPlanner,
    *,
    earliest_prefetch_op: OpLimit = 0,
    default_op_duration_s: float | None = None,
    release_waits_for_d2h: bool = False,
    latest_release_op: OpLimit | None = None,
    where: str = "hyper_offload",
    host_budget_bytes: int | None = None,
    fixed: frozenset[StorageId] = frozenset(),
) -> PlannedSchedule:
    """Plan ``trace`` under its budget with ``planner`` and check; where a release waits
    for its D2H (``release_waits_for_d2h``: the compile lowering), hold each release until
    its copy is predicted done, within budget and never past ``latest_release_op``
    (:mod:`.placement`), and check again; place the prefetches on the door's timeline
    (no reload before ``earliest_prefetch_op``) and check again. With several proposals
    (module docstring) the one predicted to stall least is kept.

    ``earliest_prefetch_op`` and ``latest_release_op`` are one op for every storage or
    one per storage (:mod:`..ir.schedule`: a step laid out as one trace has a pair per
    invocation). ``where`` names the caller in errors (``"hyper_offload region 3"``,
    ``"eager warmup"``).
    ``default_op_duration_s``: see :func:`..analysis.predicted_timeline.op_durations`.
    ``host_budget_bytes`` (None: the planner's own ``host_budget_bytes``, if it has
    one): proposals holding more bucketed host bytes at once are
    dropped (:mod:`.host_budget`; a planner that keeps none raises); a proposal the host
    budget kept over the device budget is checked under the device bytes it reaches
    (:attr:`PlannedSchedule.binding` ``"host"``). Where the host budget binds and
    ``trace`` has a disk tier (``trace.disk_budget_bytes``), the disk stage
    (:func:`_with_disk_tier`) plans again with more host room and spills what does not
    fit to disk (:mod:`.host_budget`), keeping whichever plan reaches the lowest device
    peak (then stalls least).
    ``fixed``: storages whose actions no placement stage moves (a lowering compiled
    already: a step's regions invoked several times run their own schedule).
    Raises :class:`PlanningError` (a ``ScheduleError``) naming ``where`` and the stage
    when a stage's schedule breaks a rule; exceptions of ``planner.plan`` propagate.
    """
    if min(_ops(earliest_prefetch_op), default=0) < 0:
        raise ConfigurationError(
            f"{where}: plan_residency(earliest_prefetch_op={earliest_prefetch_op}): must be >= 0 "
            "(0: reloads may start anywhere on the step's timeline)"
        )
    if host_budget_bytes is None:
        host_budget_bytes = getattr(planner, "host_budget_bytes", None)
    door = _Door(earliest_prefetch_op, default_op_duration_s, release_waits_for_d2h,
                 latest_release_op, where, fixed)
    planned = _plan_once(trace, planner, door, host_budget_bytes)
    if host_budget_bytes is not None and trace.disk_budget_bytes > 0 and (
            planned.binding == "host"):
        planned = _with_disk_tier(trace, planned, planner, door, host_budget_bytes)
    return planned


@dataclass(frozen=True)
class _Door:
    """The door's knobs of :func:`plan_residency`, passed to every stage."""

    earliest_prefetch_op: OpLimit
    default_op_duration_s: float | None
    release_waits_for_d2h: bool
    latest_release_op: OpLimit | None
    where: str
    fixed: frozenset[StorageId] = frozenset()

    def stall(self, trace: ActivationTrace, schedule: ResidencySchedule) -> float:
        return predict_timeline(
            trace, schedule, default_op_duration_s=self.default_op_duration_s,
            release_waits_for_d2h=self.release_waits_for_d2h,
        ).exposed_transfer_s


def _plan_once(
    trace: ActivationTrace, planner: ResidencyPlanner, door: _Door, host_budget_bytes: int | None
) -> PlannedSchedule:
    """Plan, check, hold releases, place prefetches, check; the least stalling proposal."""
    proposals = _proposals(planner, trace)
    requested = trace.budget_bytes
    if host_budget_bytes is not None:
        proposals = _within_host(trace, proposals, host_budget_bytes, planner, door.where)
        trace, proposals = _reached_budget(trace, proposals)
    # Where releases wait for their D2H, holding them (release_delay) is a heuristic that
    # can cost time (it may leave a reload no room to start early): each proposal is also
    # placed as planned, as a door whose releases do not wait would place it, and the
    # timeline model judges both. So the door never stalls more than the plan undelayed.
    # With every storage fixed nothing is placed: one variant is the other.
    fixed = door.fixed
    placeable = not fixed.issuperset(trace.storage_sizes)
    variants = ([True, False] if door.release_waits_for_d2h and placeable
                else [door.release_waits_for_d2h])
    placed = [
        _place(trace, planned, planner, door.earliest_prefetch_op, door.default_op_duration_s,
               door.latest_release_op, door.where, delayed=delayed, fixed=fixed)
        for planned in proposals
        for delayed in variants
    ]
    stalls = [door.stall(trace, schedule) for _, _, schedule, _ in placed]
    best = min(range(len(placed)), key=lambda i: (stalls[i], placed[i][3].bytes_moved, i))
    planned, planned_check, schedule, check = placed[best]
    return PlannedSchedule(
        trace=trace, schedule=schedule, check=check, planned=planned,
        planned_check=planned_check, earliest_prefetch_op=door.earliest_prefetch_op,
        predicted_stall_s=stalls[best], proposals=len(proposals),
        host_budget_bytes=host_budget_bytes, peak_host_bytes=host_curve(trace, schedule).peak,
        requested_budget_bytes=requested,
    )


_DISK_TRIES = 4
"""Host budgets the disk stage plans with at most (a bisection from host + disk)."""


def _with_disk_tier(
    trace: ActivationTrace, base: PlannedSchedule, planner: ResidencyPlanner, door: _Door,
    host_budget_bytes: int,
) -> PlannedSchedule:
    """The host budget binds ``base``: plan again as if the host had up to the disk
    budget more room (``planner.with_host_budget``), spill what that holds past the real
    host budget to disk (:func:`.host_budget.spill_to_disk`, stage ``"spill_to_disk"``,
    checked), and keep the plan with the lowest device peak (no lower than the budget
    asked for), then the least predicted stall, then the fewest bytes spilled; ``base``
    among them. Host budgets tried: ``host + disk`` first, then a bisection down to
    ``host`` (the most room whose spilled plan keeps the host budget)."""
    rebudget = getattr(planner, "with_host_budget", None)
    if rebudget is None:
        return base  # a planner that cannot be asked for another host budget
    requested = trace.budget_bytes

    def key(plan: PlannedSchedule) -> tuple[int, float, int]:
        return (max(plan.check.peak_resident_bytes, requested), plan.predicted_stall_s,
                plan.check.bytes_to_disk)

    best, low, high = base, host_budget_bytes, host_budget_bytes + trace.disk_budget_bytes
    room = high
    for _ in range(_DISK_TRIES):
        spilled = _spilled(trace, rebudget(room), door, room, host_budget_bytes)
        if spilled is None:
            high = room
        else:
            low = room
            best = min(best, spilled, key=key)
            if room == host_budget_bytes + trace.disk_budget_bytes:
                break  # the most room there is, and it fits
        room = (low + high) // 2
        if room <= low:
            break
    return best


def _spilled(
    trace: ActivationTrace, planner: ResidencyPlanner, door: _Door, room: int, host: int
) -> PlannedSchedule | None:
    """``trace`` planned with ``room`` host bytes, then spilled to disk down to ``host``;
    None when the spills cannot bring it there."""
    planned = _plan_once(trace, planner, door, room)
    schedule = spill_to_disk(
        planned.trace, planned.schedule, host_budget_bytes=host,
        earliest_load_op=door.earliest_prefetch_op,
        default_op_duration_s=door.default_op_duration_s,
        release_waits_for_d2h=door.release_waits_for_d2h,
    )
    peak = host_curve(planned.trace, schedule).peak
    if peak > host:
        return None
    check = check_schedule(planned.trace, schedule)
    _require_ok(check, schedule, PlanningStage.SPILL_TO_DISK, door.where, planner)
    return dataclasses.replace(
        planned, schedule=schedule, check=check, host_budget_bytes=host,
        peak_host_bytes=peak, predicted_stall_s=door.stall(planned.trace, schedule),
    )


def _within_host(
    trace: ActivationTrace,
    proposals: list[ResidencySchedule],
    host_budget_bytes: int,
    planner: ResidencyPlanner,
    where: str,
) -> list[ResidencySchedule]:
    """The proposals that keep the host budget; none: a planner that ignores it."""
    peaks = [host_curve(trace, p).peak for p in proposals]
    kept = [p for p, peak in zip(proposals, peaks) if peak <= host_budget_bytes]
    if kept:
        return kept
    raise PlanningError(
        f"{where}: every schedule of {planner!r} holds more host bytes at once than the "
        f"host budget ({min(peaks)} > {host_budget_bytes} B, in pool buckets): the planner "
        "ignores OffloadConfig.max_host_activation_mb. Use GreedyResidencyPlanner("
        "host_budget_bytes=...) (the default planner gets it from the config) or raise "
        "max_host_activation_mb",
        where=where, stage=PlanningStage.PLAN, schedule=proposals[0], report=None,
    )


def _reached_budget(
    trace: ActivationTrace, proposals: list[ResidencySchedule]
) -> tuple[ActivationTrace, list[ResidencySchedule]]:
    """The proposals that meet the device budget, if any does (then ``trace`` as it is);
    else every proposal, with ``trace`` under the most device bytes one of them reaches:
    the ops a proposal leaves over the budget are those the host budget made it keep
    (every other rule is still judged by ``check_schedule``)."""
    peaks = []
    for proposal in proposals:
        report = check_schedule(trace, proposal)
        over = any(v.rule in _BUDGET_RULES for v in report.violations)
        peaks.append(report.peak_resident_bytes if over else None)
    within = [p for p, peak in zip(proposals, peaks) if peak is None]
    if within:
        return trace, within
    return trace.with_budget(max(p for p in peaks if p is not None)), proposals


_BUDGET_RULES = (Rule.OVER_BUDGET, Rule.TRANSIENT_OVER_BUDGET)


def _ops(limit: OpLimit) -> list[int]:
    return [limit] if isinstance(limit, int) else list(limit.values())


def _proposals(planner: ResidencyPlanner, trace: ActivationTrace) -> list[ResidencySchedule]:
    propose = getattr(planner, "proposals", None)
    if propose is None:
        return [planner.plan(trace)]
    proposals = list(propose(trace))
    if not proposals:
        raise ConfigurationError(
            f"{planner!r}.proposals(trace) returned no schedule; return at least plan(trace)"
        )
    return proposals


def _place(
    trace: ActivationTrace,
    planned: ResidencySchedule,
    planner: ResidencyPlanner,
    earliest_prefetch_op: OpLimit,
    default_op_duration_s: float | None,
    latest_release_op: OpLimit | None,
    where: str,
    *,
    delayed: bool,
    fixed: frozenset[StorageId] = frozenset(),
) -> tuple[ResidencySchedule, ScheduleReport, ResidencySchedule, ScheduleReport]:
    """One proposal through the stages: ``(planned, its check, placed, its check)``.
    ``delayed``: releases are held until their D2H is predicted done and prefetches are
    placed on the timeline where releases wait; otherwise both stay as for a door whose
    releases do not wait."""
    planned_check = check_schedule(trace, planned)
    _require_ok(planned_check, planned, PlanningStage.PLAN, where, planner)
    schedule = planned
    if delayed:
        schedule = delay_releases(
            trace, schedule, latest_op=latest_release_op,
            default_op_duration_s=default_op_duration_s, fixed=fixed,
        )
        check = check_schedule(trace, schedule)
        _require_ok(check, schedule, PlanningStage.DELAY_RELEASES, where, planner)
    try:
        schedule = hoist_prefetches(
            trace, schedule, earliest_op=earliest_prefetch_op,
            default_op_duration_s=default_op_duration_s,
            release_waits_for_d2h=delayed, fixed=fixed,
        )
    except PrefetchError as error:
        raise PlanningError(
            f"{where}: step {PlanningStage.PLACE_PREFETCHES.value!r}: {error}",
            where=where, stage=PlanningStage.PLACE_PREFETCHES, schedule=schedule, report=None,
        ) from None
    check = check_schedule(trace, schedule)
    _require_ok(check, schedule, PlanningStage.PLACE_PREFETCHES, where, planner)
    return planned, planned_check, schedule, check


def _require_ok(
    report: ScheduleReport,
    schedule: ResidencySchedule,
    stage: PlanningStage,
    where: str,
    planner: ResidencyPlanner,
) -> None:
    if report.ok:
        return
    try:
        report.raise_if_invalid()
    except ScheduleError as error:
        details = str(error)
    fix = (
        f"fix the planner {planner!r} or use the default GreedyResidencyPlanner"
        if stage is PlanningStage.PLAN
        else f"{_PASSES[stage]} broke a schedule check_schedule accepted: a bug in "
        f"passes/plan/{_PASSES[stage].split('.')[0]}.py, please report it"
    )
    raise PlanningError(
        f"{where}: {stage.description} (step {stage.value!r}) is one that check_schedule "
        f"rejects; {fix}. The {details}",
        where=where, stage=stage, schedule=schedule, report=report,
    )


def backward_start(trace: ActivationTrace) -> int:
    """Where a compile-path trace's backward graph begins, else 0.

    A trace whose ops are all named ``"fw:..."`` then ``"bw:..."`` (what
    :func:`..fx.graph_trace.build_fx_trace` writes, kept by its JSON) gives the index of its
    first ``"bw:"`` op (``num_ops`` when there is none): the compile path's
    ``earliest_prefetch_op``. Any other naming (eager traces, hand-written JSON) is one
    timeline: 0.
    """
    forward, backward = f"{FORWARD_GRAPH}:", f"{BACKWARD_GRAPH}:"
    names = [op.name for op in trace.ops]
    num_fw = 0
    while num_fw < len(names) and names[num_fw].startswith(forward):
        num_fw += 1
    if num_fw == 0 or not all(n.startswith(backward) for n in names[num_fw:]):
        return 0
    return num_fw
