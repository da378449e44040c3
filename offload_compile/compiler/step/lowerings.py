"""The backend's side of the step lifecycle: plans on the regions, and the lowerings they want.

:class:`~.controller.StepController` decides *when*; :class:`RegionLowerings` answers
*what*, from the backend's regions:

* :meth:`~RegionLowerings.plan`: the step model's plan of a timeline
  (:func:`hyper_offload.passes.plan.step.plan_step`) with each region as
  :meth:`~..region.CompiledRegion.step_floor` describes it (the floor of its partition
  where it may be lowered again);
* :meth:`~RegionLowerings.apply`: the lowerings a plan wants, made: first the recompute
  search ranked on the step for the regions
  :func:`~hyper_offload.passes.plan.step.plan.regions_to_relower` names (each region at most
  once, so a step cannot oscillate), then each region the plan lowers with a schedule of its
  own (compiled once per schedule; a schedule seen before is adopted, not compiled). A
  lowering that fails leaves the region on the lowering it runs, exact, and the region is
  never asked again.

* :meth:`~RegionLowerings.retiling` and :meth:`~RegionLowerings.retile`: sequence tiling
  chosen on the step (``tile_sequence="auto"``, below).

Recompute co-planned with the step: where the plan does not fit (the floor is over the
budget somewhere only recompute can lower) or stalls, every region of the step that saves
anything is searched once, each candidate partition planned at its floor and ranked by
:class:`StepScorer`: the step planned with that partition in the region's place (every
other region as it is) and its predicted stall, plus the step's compute. The fastest
predicted step that fits wins; with none fitting, the lowest predicted peak.

Sequence tiling chosen on the step. A region's tiling is first chosen at its compile,
from its own floor (:mod:`..tiling`). The step's floor at an op of the region is that
op's bytes plus what the rest of the step holds there, and a region the recompute search
lowered again recomputes in its backward (a larger working set): the step plan can be
over the budget at a token-wise op of a region whose own floor was under it (Llama-3-8B
at 224K tokens per rank: 70.9 GiB at the MLP's ``silu`` backward after the search, for
a 63.3 GiB budget). Then the step asks that region to be tiled again
(:meth:`~RegionLowerings.retiling`), once, from its untiled Dynamo graph, for the floor
the step needs there: its own floor less the step's excess, the spans that set it tiled
even where torch's partition alone would fit it (the step asked because the lowering it
wants does not). Before the next step's first forward the region is compiled from the
tiled graph at its floor, with torch's partition (:meth:`~RegionLowerings.retile`); the
recompute search may then search the tiled graph (the region counts as not searched
yet), and the step is planned again. A failure keeps the lowering in force (exact,
untiled or as first tiled).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from hyper_offload import progress
from hyper_offload.passes import ResidencySchedule, required_bytes
from hyper_offload.passes.analysis.predicted_timeline import op_durations
from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.passes.fx.sizes import merged_sizes
from hyper_offload.passes.plan.step import RegionFloor, StepPlan, StepTimeline, plan_step
from hyper_offload.passes.plan.step.model import SizeBucket, Slot
from hyper_offload.passes.plan.step.plan import regions_to_relower

from ..options import BackendOptions
from ..partitioner import PartitionRequest, PartitionResult
from ..recompute.candidates import PlanScore
from ..region import CompiledRegion, Lowering
from ..region_plan import GraphPlan
from ..region_report import LOGGER
from ..tiling import tile_region


__all__ = ["RegionCompiler", "RegionLowerings", "StepScorer"]


class RegionCompiler(Protocol):
    """What the lowerings need of the backend (:class:`~..backend.HyperOffloadBackend`,
    which owns them: a protocol, so the two modules do not import each other): its
    regions, options and prices, and its compile of a region for a request."""

    regions: list[CompiledRegion]
    options: BackendOptions
    throughput: DeviceThroughput | None
    fake_steps: bool

    def request(self, region: CompiledRegion, **asked: Any) -> PartitionRequest:
        """What a compile of ``region`` asks the partitioner for."""
        ...

    def compile(
        self, region: CompiledRegion, request: PartitionRequest, *, graphs_only: bool = False,
        example_inputs: Sequence[Any] | None = None,
    ) -> tuple[Callable[..., Any], PartitionResult | None]:
        """``region``'s Dynamo graph compiled for ``request``, and what the partitioner made."""
        ...


class RegionLowerings:
    """:class:`~.controller.StepLowering` over a backend's regions (module docstring)."""

    def __init__(self, backend: RegionCompiler) -> None:
        self._backend = backend
        self.failed_searches: list[int] = []
        """Regions whose recompute search raised (each region is searched once)."""
        self.retile_targets: dict[int, int] = {}
        """Regions asked to be tiled again before the next step, and the floor (bytes)
        each should reach (:meth:`retiling`)."""
        self.retiled: set[int] = set()
        """Regions ever asked to be tiled again (each region is asked once)."""

    def __repr__(self) -> str:
        return f"RegionLowerings({len(self._backend.regions)} region(s))"

    @property
    def _regions(self) -> list[CompiledRegion]:
        return self._backend.regions

    def floors(self, timeline: StepTimeline, *, in_force: bool = False,
               without: int | None = None) -> dict[int, RegionFloor]:
        """Each planned region of ``timeline`` as the step plan sees it, at the largest
        sizes it ran with (``without``: leave that region out)."""
        sizes: dict[int, list[tuple[tuple[str, int], ...]]] = {}
        for invocation, bucket in timeline.sizes.items():
            sizes.setdefault(invocation.region, []).append(bucket)
        floors = {}
        for region in self._regions:
            if region.index == without or region.index not in timeline.regions:
                continue
            floor = region.step_floor(merged_sizes(sizes.get(region.index, ())),
                                      in_force=in_force)
            if floor is not None:
                floors[region.index] = floor
        return floors

    def plan(self, timeline: StepTimeline, budget: int | None, fraction: float | None
             ) -> tuple[StepPlan, bool]:
        progress.note(f"planning the step ({len(timeline.invocations)} invocation(s))")
        plan = plan_step(timeline, self.floors(timeline), budget, budget_fraction=fraction,
                         host_budget_bytes=self._backend.options.host_budget_bytes)
        return plan, self.lowered_as(plan)

    def plan_in_force(self, timeline: StepTimeline, budget: int | None,
                      fraction: float | None) -> StepPlan:
        plan = plan_step(timeline, self.floors(timeline, in_force=True), budget,
                         budget_fraction=fraction,
                         host_budget_bytes=self._backend.options.host_budget_bytes)
        lowered = {r.index: r.step_schedule for r in self._regions if r.step_schedule is not None}
        return dataclasses.replace(plan, schedules=lowered)

    def slots(self, region: int, sizes: SizeBucket = ()) -> tuple[tuple[Slot, ...], int]:
        floor = self._regions[region].step_floor(dict(sizes), in_force=True)
        return ((), 0) if floor is None else (floor.slots, max(floor.resident, default=0))

    def lowered_as(self, plan: StepPlan) -> bool:
        return all(r.step_schedule == plan.schedules.get(r.index) for r in self._regions
                   if r.index in plan.timeline.regions)

    def recomputes(self, plan: StepPlan) -> bool:
        """Whether a region of ``plan``'s step runs a partition that recomputes more."""
        return any(r.recomputes for r in self._regions if r.index in plan.timeline.regions)

    def wants_search(self, plan: StepPlan) -> tuple[int, ...]:
        # A region running collectives on several ranks is not searched: each rank prices
        # the search with its own measured link and could pick another partition.
        ranks = torch.distributed.is_available() and torch.distributed.is_initialized() and (
            torch.distributed.get_world_size() > 1)
        done = frozenset(
            r.index for r in self._regions
            if r.relowered or r.planned is None or (ranks and r.collectives)
        )
        # Each op's own working memory matters only where the floor is over the budget.
        working = {} if plan.fits else {
            r.index: required_bytes((r.floor_plan or r.planned).fx_trace.trace)
            for r in self._regions if r.planned is not None
        }
        in_force = self.floors(plan.timeline, in_force=True)
        movable = {r: bool(f.slots) for r, f in in_force.items()}
        return regions_to_relower(plan, movable, done, working)

    def apply(self, plan: StepPlan, timeline: StepTimeline) -> bool:
        """Make the lowerings ``plan`` wants; whether a region's partition changed (the
        plans made on the old one are then stale)."""
        searched = self.wants_search(plan) if self._backend.options.recompute == "auto" else ()
        repartitioned = {index for index in searched
                         if self._search(self._regions[index], timeline, plan.budget_bytes)}
        for region in self._regions:
            # A region the search gave another partition was lowered by the search; one
            # that kept torch's partition is lowered as the plan wants, in the same pass.
            if region.index in repartitioned or region.index not in timeline.regions:
                continue
            wanted = plan.schedules.get(region.index)
            if region.lowerable and region.step_schedule != wanted:
                self._lower(region, wanted, plan.schedule_budget_bytes)
        return bool(repartitioned)

    def _lower(self, region: CompiledRegion, schedule: ResidencySchedule | None,
               budget: int) -> None:
        """Run the lowering for ``schedule`` (None: the floor's, the first compile's)."""
        if schedule in region.variants:
            region.adopt(region.variants[schedule])
            return
        assert schedule is not None and region.floor_plan is not None  # the floor is a variant
        backend = self._backend
        try:
            with region.compiling_again():
                compiled, result = backend.compile(region, backend.request(
                    region, schedule=(schedule, budget),
                    expected_ops=region.floor_plan.fx_trace.op_nodes))
            assert result is not None
            region.adopt(Lowering(compiled, result.planned, result.graphs, schedule,
                                  region.floor_plan))
            LOGGER.info("hyper_offload region %d: lowered again with the step's schedule "
                        "(%d B moved)", region.index, result.planned.check.bytes_d2h)
        except Exception as error:  # an optimisation failed: the lowering in force runs
            region.lowering_failed = True
            LOGGER.warning(
                "hyper_offload region %d: lowering it again for the step failed (%s: %s); it "
                "keeps the lowering it runs, exact as before. Fix: report it",
                region.index, type(error).__name__, error,
            )

    def _search(self, region: CompiledRegion, timeline: StepTimeline, budget: int) -> bool:
        """Search ``region``'s partitions again, ranked on the step; where the search
        chooses one other than torch's, compile the region with it. Whether it changed."""
        region.relowered = True
        progress.note(f"region {region.index}: recompute search ranked on the step")
        backend = self._backend
        report = None
        try:
            scorer = StepScorer(timeline, self.floors(timeline, without=region.index), budget,
                                region.index, backend.options.host_budget_bytes)
            with region.compiling_again():
                # The search on graphs only (no code generation; for aot_eager and fake
                # steps that is the compile), then the code of the winner.
                compiled, result = backend.compile(region, backend.request(region, scorer=scorer),
                                                   graphs_only=True)
                assert result is not None
                lowering = Lowering(compiled, result.planned, result.graphs, result.schedule,
                                    result.floor)
                report = result.planned.report.recompute
                if lowering.recomputes and not backend.fake_steps and (
                        backend.options.inner_compiler == "inductor"):
                    compiled, _ = backend.compile(region, backend.request(region, scorer=scorer))
                    lowering = lowering._replace(compiled=compiled)
        except Exception as error:  # an optimisation failed: the floor's graphs still run
            LOGGER.warning(
                "hyper_offload region %d: the step's recompute search failed (%s: %s); the "
                "region keeps its floor graphs, exact as before (the step plan made next "
                "says what it keeps and whether the budget holds). Fix: report it, or pass "
                "recompute='off'", region.index, type(error).__name__,
                str(error).splitlines()[0] if str(error) else "",
            )
            self.failed_searches.append(region.index)
            return False
        LOGGER.info("hyper_offload region %d searched on the step: %s", region.index,
                    report.describe("") if report is not None else "no search")
        if not lowering.recomputes:  # torch's partition again: the lowering in force stays
            return False
        region.adopt(lowering, new_partition=True)
        return True


    def retiling(self, plan: StepPlan) -> tuple[int, ...]:
        """Ask the region whose op sets ``plan``'s floor over its budget to be tiled again
        (module docstring), with ``tile_sequence="auto"``, once per region; the regions
        asked. Called at a step's end (records the target, compiles nothing)."""
        op = plan.floor_op
        if (self._backend.options.tile_sequence != "auto" or op is None or op.region is None
                or plan.floor_peak_bytes <= plan.budget_bytes):
            return ()
        region = self._regions[op.region]
        if region.untiled is None or region.index in self.retiled or region.planned is None:
            return ()
        own = max(required_bytes(region.planned.fx_trace.trace), default=0)
        target = max(own - (plan.floor_peak_bytes - plan.budget_bytes), 0)
        self.retiled.add(region.index)
        self.retile_targets[region.index] = target
        LOGGER.info("hyper_offload region %d: the step's floor is over its budget at %s; tiling "
                    "the region again for a floor of %d B", region.index, op.op, target)
        return (region.index,)

    def retile(self) -> bool:
        """Tile each region :meth:`retiling` asked for, for its floor, and compile it at
        that floor with torch's partition; whether any region changed."""
        targets, self.retile_targets = self.retile_targets, {}
        changed = [self._retile(self._regions[index], target)
                   for index, target in targets.items()]
        return any(changed)

    def _retile(self, region: CompiledRegion, target: int) -> bool:
        backend = self._backend
        untiled, before = region.untiled, (region.dynamo_graph, region.tiling)
        assert untiled is not None
        progress.note(f"region {region.index}: sequence tiling for the step's floor")
        try:
            with region.compiling_again():
                gm, report = tile_region(untiled, backend.options,
                                         throughput=backend.throughput, target=target)
                same = region.tiling is not None and report.spans == region.tiling.spans
                if not report.tiled or same:  # nothing to compile again
                    LOGGER.info("hyper_offload region %d: not tiled again (%s)", region.index,
                                "the tiling it runs" if same else report.stopped)
                    return False
                region.dynamo_graph, region.tiling = (gm, untiled.inputs), report
                compiled, result = backend.compile(region, backend.request(region))
            assert result is not None
        except Exception as error:  # an optimisation failed: the lowering in force runs
            region.dynamo_graph, region.tiling = before
            LOGGER.warning(
                "hyper_offload region %d: tiling it again for the step failed (%s: %s); it "
                "keeps the lowering it runs. Fix: report it, or pass tile_sequence=N or 'off'",
                region.index, type(error).__name__, error)
            return False
        region.adopt(Lowering(compiled, result.planned, result.graphs, result.schedule,
                              result.floor), new_partition=True)  # another graph
        region.relowered = False  # the recompute search may search the tiled graph
        LOGGER.info("hyper_offload region %d tiled again for the step: %s", region.index, report)
        return True


class StepScorer:
    """The objective of ``region``'s re-lowering: a candidate partition's floor put in the
    region's place on ``timeline`` (and lowerable, as the backend would), the step
    planned under ``budget_bytes`` and its predicted compute, stall, fit and peak.
    ``schedules[id(plan)]``: the schedule (and the budget it was checked under) the step
    plan made for the region with that candidate, if any: the lowering the backend
    compiles when the candidate wins. ``regions``: every other region as the step plan
    sees it now; ``host_budget_bytes``: the host budget every step plan keeps."""

    def __init__(
        self, timeline: StepTimeline, regions: Mapping[int, RegionFloor], budget_bytes: int,
        region: int, host_budget_bytes: int | None = None,
    ) -> None:
        self.timeline, self.regions, self.budget_bytes = timeline, dict(regions), budget_bytes
        self.region, self.host_budget_bytes = region, host_budget_bytes
        invocations = [i.region for i in timeline.invocations]
        self.others_s = sum(
            sum(op_durations(regions[r].trace)) for r in invocations
            if r != region and r in regions
        )
        self.count = invocations.count(region)
        self.schedules: dict[int, tuple[ResidencySchedule, int]] = {}

    def __call__(self, plan: GraphPlan) -> PlanScore:
        candidate = plan.fx_trace.region_floor(plan.schedule, lowerable=True)
        step = plan_step(self.timeline, {**self.regions, self.region: candidate},
                         self.budget_bytes, host_budget_bytes=self.host_budget_bytes)
        if self.region in step.schedules:
            self.schedules[id(plan)] = (step.schedules[self.region], step.schedule_budget_bytes)
        return PlanScore(self.others_s + self.count * plan.compute_s, step.predicted_stall_s,
                         step.fits, step.peak_bytes)
