"""The ``hyper_offload`` torch.compile backend.

``torch.compile(model, backend="hyper_offload", options={...})`` (registered through the
``torch_dynamo_backends`` entry point; one backend per option set, :mod:`.backend_registry`)
or ``torch.compile(model, backend=hyper_offload.backend(config))``. For every region
Dynamo hands over:

1. AOTAutograd captures the joint graph; :func:`~.recompute_search.choose_partition`
   partitions it with the stock min-cut partitioner (the user's
   ``activation_memory_budget`` applies) and plans it: under ``budget_scope="step"``
   (the default) at its floor (:mod:`.step_plan`); under ``"region"`` under the whole
   budget, and with ``recompute="auto"`` (the default), where that plan stalls or cannot
   meet the budget, also with partitions that recompute more (work-bounded), keeping
   the fastest predicted step;
2. :func:`~.region_plan.lower_region` lowers the chosen plan onto the
   ``hyper_offload::`` transfer ops and checks the lowered graphs again;
3. the inner compiler (Inductor, or aot_eager's nop compiler) compiles both graphs.

Every region of a backend shares its :class:`TransferRuntime` and pinned pool. The
callable returned to Dynamo makes the runtime current around the forward (under the step
scope: keeping what the step plan keeps for this invocation, and recording it in the
step); the backward needs nothing around
it (its transfer ops reach the runtime through the host copies they read), so the
compiled graphs carry no per-process state and AOTAutograd's and Inductor's caches may
serve them to another region or process: a warm restart runs the partitioner for no
region. The partitioner's ``uuid()`` (a hash of the planning sources and the options)
keeps a plain ``torch.compile``, or other options, from sharing those entries, and
:mod:`.region_cache` stores each region's plan so that a cached region still reports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

# The compiled graphs call the transfer ops: importing .ops registers their real kernels
# (the package itself loads lazily and registers nothing).
import hyper_offload.runtime.ops  # noqa: F401
from hyper_offload.errors import ConfigurationError, ConfigurationTypeError, OffloadRuntimeError
from hyper_offload import passes
from hyper_offload.config import OffloadConfig
from hyper_offload.passes import ResidencySchedule, ScheduleError, required_bytes
from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.passes.fx.sizes import planning_size, unbounded_sizes
from hyper_offload.runtime import PinnedMemoryPool, TransferRuntime
from hyper_offload.runtime.bandwidth import TransferBandwidth, profile_transfer_bandwidth
from hyper_offload.runtime.memory_meter import is_host_labelled
from hyper_offload.runtime.verify import VerifySteps

from . import region_cache
from .backend_registry import BackendRegistry
from .collectives import is_collective
from .fake_capture import compile_graphs_only
from .meta_graphs import compile_on_meta, on_meta
from .options import BackendOptions, parse_backend_options
from .recompute_search import Scorer, search_region
from .region_plan import GraphPlan, PlannedRegion, lower_region, plan_with_schedule
from .region_report import LOGGER, RegionReport, log_region_report
from .saved_bytes import node_saved_tensors
from .step_model import Invocation, StepObserver, StepRecorder, StepTimeline
from .step_plan import StepPlan, plan_step
from .size_buckets import Bucket, merged_sizes
from .step_planner import plan_step_schedules, region_floor_profile
from .step_trace import RegionTrace
from .step_recompute import StepScorer, regions_to_relower
from .step_report import StepReport, build_step_report, log_step_plan
from .step_timeline import RegionFloor, predicted_step_stall
from .region_state import CompiledRegion, Lowering
from .tiling import tile_region, tiling_source
from .tiling_step import request_retiling, retile

__all__ = ["HyperOffloadBackend", "backend", "hyper_offload_backend", "shared_backend"]

# The code that decides a region's rewritten graphs: every planning pass (the op
# declarations included, in passes/ir/) and this package. Its hash is in the
# partitioner's cache key, so an edited planner or lowering never reuses a stale cached
# graph (paths read from the imported modules, so they hold in the repository and when
# installed).
_PLANNING_CODE = (Path(passes.__file__).parent, Path(__file__).parent)


class _RegionForward:
    """What Dynamo calls for a region: its compiled forward, with the runtime current."""

    def __init__(
        self, compiled: Callable[..., Any], region: CompiledRegion, backend: HyperOffloadBackend
    ) -> None:
        region.compiled = compiled
        self._region = region
        self._backend = backend

    def __call__(self, *args: Any) -> Any:
        region, backend = self._region, self._backend
        if not backend.options.step_scoped:  # the step scope plans each call's own sizes
            region.check_sizes(args)
        backend.relower_if_requested()  # the step asked for recompute (.step_recompute)
        compiled = region.compiled
        assert compiled is not None
        # Copies seen complete drop their hold on host copies whose graph died (a step
        # that raised, a forward without backward): buffers come back at the next forward.
        backend.collect()
        # Fake arguments: Dynamo propagating shapes through a compiled region (DDPOptimizer
        # runs each compiled submodule on fake tensors while it compiles the next one).
        # That is no invocation of a step; it moves nothing either (fake kernels). Only
        # estimate's backend runs whole steps on fake tensors.
        if backend.options.step_scoped and torch.is_grad_enabled() and (
                backend.fake_steps or torch._guards.detect_fake_mode(args) is None):
            return backend.run_invocation(region, compiled, args)
        with backend.runtime.keeping(frozenset(), where=region.where,
                                     slot_names=region.slot_names):
            return compiled(*args)


class _OffloadPartitioner(CustomPartitionerFn):
    """Stock min-cut partition (searched with recompute), then :func:`lower_region`."""

    def __init__(
        self, backend: HyperOffloadBackend, region: CompiledRegion, plan_key: str | None
    ) -> None:
        self._backend = backend
        self._region = region
        self._plan_key = plan_key

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        region, options = self._region, self._backend.options
        num_fwd_outputs = kwargs["num_fwd_outputs"]

        def partition(joint: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        started = time.perf_counter()
        choice = search_region(
            gm, partition, num_fwd_outputs=num_fwd_outputs, options=options,
            bandwidth=self._backend.bandwidth, region=region.index, floor=options.step_scoped,
            throughput=self._backend.throughput,
            activation_inputs=region.activation_inputs if options.step_scoped else frozenset(),
            score=region.scorer,
        )
        fw, bw = choice.fw, choice.bw
        schedule, plan = _step_lowering(region, choice.plan)
        if options.step_scoped:
            region.floor_plan = choice.plan
        region.step_schedule = schedule
        region.attempted = plan
        region.set_planned(lower_region(
            fw, bw, plan, num_fwd_outputs=num_fwd_outputs, options=options,
            region=region.index, recompute=choice.report,
            search_seconds=time.perf_counter() - started,
        ))
        region.graphs = (fw, bw)
        region.collectives = region.collectives or any(
            is_collective(node) for graph in (fw, bw) for node in graph.graph.nodes
        )
        if self._plan_key is not None:  # an inner compiler with a cache (Inductor)
            region_cache.store_plan(self._plan_key, region.planned)
        log_region_report(region.planned.report)
        return fw, bw

    def __deepcopy__(self, memo: dict[int, Any]) -> _OffloadPartitioner:
        # Inductor deep-copies config values when it snapshots its config; this object
        # carries its region (runtime, locks) by reference on purpose.
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Inductor pickles its config into cache keys: stand for this object by its
        # uuid (its region's runtime and locks neither pickle nor belong in a key).
        return (str, (repr(self.uuid()),))

    def uuid(self) -> Any:
        return (self._backend.planning_code, self._backend.options.cache_key())


class HyperOffloadBackend:
    """A configured ``hyper_offload`` backend: pass it as ``torch.compile(backend=...)``.

    Every region it compiles shares one :class:`TransferRuntime` and host pool and, under
    ``budget_scope="step"``, one step: ``recorder`` learns it, ``step_plan`` (None until
    a step was seen) keeps each invocation's slots under the one budget, and
    ``step_report`` shows it. ``reports`` lists one :class:`RegionReport` per compiled
    region, in compile order (a recompilation adds one). ``regions`` keeps the plans.
    """

    def __init__(
        self,
        options: BackendOptions,
        *,
        link: TransferBandwidth | None = None,
        throughput: DeviceThroughput | None = None,
        fake_steps: bool = False,
        observer: StepObserver | None = None,
    ) -> None:
        self.options = options
        self.link = link
        """Copy bandwidth plans are priced with, overriding the options' and the probe's."""
        self.throughput = throughput
        """Op prices (default: the roofline of each region's device)."""
        self.fake_steps = fake_steps
        """``hyper_offload.estimate``'s backend: regions are partitioned, planned and
        lowered as always but no code is generated (graphs run as FX on fake tensors),
        and steps run on fake tensors are the step (:mod:`.step_estimate`)."""
        self.regions: list[CompiledRegion] = []
        self.planning_code = region_cache.source_digest(_PLANNING_CODE)
        self._verify = VerifySteps(options.config.verify)
        self.runtime = TransferRuntime(
            pool=PinnedMemoryPool(options.host_budget_bytes,
                                  pageable_fallback=options.config.pageable_fallback),
            verify=self._verify.next_step,
        )
        self.recorder = StepRecorder(self._on_step, observer)
        """Learns the step; with an ``observer`` (estimate's :class:`~.eager_between.
        EagerMeter`) each step also carries the eager code's bytes between regions."""
        self.step_plan: StepPlan | None = None
        self.step_stall_s = 0.0
        """The step plan's predicted stall (seconds, the regions' device prices)."""
        self.replans = 0
        """Step plans made so far (one per step whose shape or bytes changed)."""
        self._bandwidth: dict[torch.device, TransferBandwidth] = {}
        self._counter = itertools.count()
        self._budget_pin: int | None = None
        """The step budget in bytes once a re-lowering was asked for (.step_recompute)."""
        self._relower_step: StepTimeline | None = None
        self._meta_warned = False
        self._interim = False
        """Whether the plan in force waits for lowerings the step plan asked for."""
        self._plans: dict[tuple[Any, ...], StepPlan] = {}
        """Plans made, by step (events, retained bytes, sizes): a step seen before (a size
        bucket, :mod:`.size_buckets`) is not planned again."""
        self.plans_made = 0
        """Step plans made so far (``replans`` counts those put in force)."""
        self._plain_peaks: dict[tuple[Any, ...], int] = {}
        """Per step shape: its peak without offload on torch's partitions (before any
        re-lowering with recompute, whose choice depends on the link)."""

    def __repr__(self) -> str:
        return f"HyperOffloadBackend({self.options})"

    @property
    def verified_steps(self) -> int:
        """Steps whose transfers were checked (``verify``; counted under the step scope)."""
        return self._verify.verified

    @property
    def reports(self) -> list[RegionReport]:
        return [r.planned.report for r in self.regions if r.planned is not None]

    def bandwidth(self, fw: fx.GraphModule) -> TransferBandwidth:
        """The copy bandwidth plans are priced with: ``transfer_bandwidth_gbps`` when
        given, else the region's device's, measured once per device."""
        from hyper_offload.passes.fx.graph_trace import device_of, fw_outputs

        if self.link is not None:
            return self.link
        if self.options.transfer_bandwidth_gbps is not None:
            gbps = self.options.transfer_bandwidth_gbps
            return TransferBandwidth(gbps, gbps, measured=False)
        device = device_of(fw_outputs(fw))
        if device not in self._bandwidth:
            self._bandwidth[device] = profile_transfer_bandwidth(device)
        return self._bandwidth[device]

    def collect(self) -> None:
        """Let the runtime observe finished copies (see ``TransferRuntime.collect``)."""
        self.runtime.collect()

    @property
    def step_report(self) -> StepReport | None:
        """The step plan in force, per region and invocation (None before a step ran)."""
        plan = self.step_plan
        if plan is None:
            return None
        relowered = tuple(r.index for r in self.regions if r.relowered and _recomputes(r))
        return build_step_report(
            plan, self.replans, self.recorder.steps, self.step_stall_s, relowered,
            plain_peak=self._plain_peaks.get(plan.timeline.shape_key),
            op_origin=lambda region, op: self.regions[region].op_origin(op),
            tiled=tuple(r.index for r in self.regions if r.tiling is not None and r.tiling.tiled
                        and r.index in plan.timeline.regions),
        )

    def run_invocation(
        self, region: CompiledRegion, compiled: Callable[..., Any], args: Sequence[Any]
    ) -> Any:
        """Run one forward of ``region`` as an invocation of the step: keep what the step
        plan keeps for it, and record it."""
        recorder = self.recorder
        recorder.poll()
        invocation = recorder.begin_forward(region.index)
        bucket = region.bucket(args)
        observer = recorder.observer  # estimate's: the region counts its inputs and ops
        inside = observer.region(args) if observer is not None else contextlib.nullcontext()
        with inside, self.runtime.keeping(self._keep_for(invocation, bucket),
                                          where=region.where, slot_names=region.slot_names):
            outputs = compiled(*args)
        leaves = {
            id(a.untyped_storage()) for a in args
            if isinstance(a, torch.Tensor) and a.grad_fn is None
        }
        recorder.end_forward(invocation, outputs,
                             functools.partial(self._retained, leaves, region), bucket)
        return outputs

    def _count_verified_step(self) -> None:
        """A step ended: count it if it was checked; ``verify="first_steps:N"`` turns the
        checks off after N (copies already checksummed are still checked at their waits)."""
        self._verify.step_done(self.runtime.verify)
        self.runtime.verify = self._verify.next_step

    def _keep_for(self, invocation: Invocation, bucket: Bucket = ()) -> frozenset[int]:
        """What a plan keeps for ``invocation`` (its sizes: ``bucket``): the plan in force,
        else the latest plan made, while this step's forwards so far are that plan's (same
        invocations, same sizes) and the regions run the lowerings it was made for; the
        floor (nothing kept) where no plan is. A plan found this way is put in force."""
        so_far = (*self.recorder.current_forwards(), invocation)
        sizes = {**self.recorder.current_sizes(), invocation: bucket}
        for plan in (self.step_plan, *reversed(self._plans.values())):
            if plan is None or plan.timeline.invocations[: len(so_far)] != so_far:
                continue
            if any(plan.timeline.sizes.get(i, ()) != sizes[i] for i in so_far):
                continue
            if not self._lowered_as(plan):
                continue
            if plan is not self.step_plan:  # a size bucket seen before: its plan, as made
                self.step_plan, self._interim = plan, False
                self.step_stall_s = plan.predicted_stall_s
            return plan.keep_for(invocation)
        return frozenset()

    def _lowered_as(self, plan: StepPlan) -> bool:
        """Whether every region runs the lowering ``plan`` was made for."""
        return all(r.step_schedule == plan.schedules.get(r.index) for r in self.regions
                   if r.index in plan.timeline.regions)

    def _retained(self, leaves: set[int], region: CompiledRegion, node: Any) -> int:
        """Device bytes ``node`` holds that no plan moves (``StepTimeline.retained_bytes``):
        its saved device storages, less what the lowering in force keeps that its floor
        would move (so a region lowered for the step measures as its floor)."""
        storages: dict[int, int] = {}
        for tensor in node_saved_tensors(node):
            storage = tensor.untyped_storage()
            if (id(storage) in leaves or is_host_labelled(tensor) or tensor.device.type == "meta"
                    or self.runtime.is_kept(tensor)):
                continue
            # A data-dependent size (estimate's fake steps: nonzero's rows) counts at
            # its bound, as the region's plan counts it.
            storages[id(storage)] = planning_size(storage.nbytes(), "a saved tensor")
        return max(sum(storages.values()) - region.kept_across_bytes, 0)

    def _on_step(self, timeline: StepTimeline) -> None:
        """A step ended: plan it again when it differs from the one planned (or the plan in
        force waits for lowerings); where the plan cannot fit or stalls, ask for recompute
        (:mod:`.step_recompute`)."""
        self._count_verified_step()
        plan = self.step_plan
        retiling = plan is not None and request_retiling(plan, self.regions, self.options)
        if retiling:  # .tiling_step: done before the next step's first forward
            self._budget_pin, self._relower_step = plan.budget_bytes, timeline
        if plan is not None and plan.timeline == timeline and not (self._interim or retiling):
            return
        cached = self._plans.get(_timeline_key(timeline))
        if cached is not None and self._lowered_as(cached) and not retiling:
            self._adopt(cached, interim=False)  # a step seen before: its plan, not made again
            return
        fraction = self.options.budget_fraction
        budget = self._budget_pin
        if budget is None and fraction is None:
            budget = self.options.config.budget_bytes
        plan = self._plan_step(timeline, budget, fraction)
        if request_retiling(plan, self.regions, self.options):  # done before the relowering
            self._budget_pin, self._relower_step = plan.budget_bytes, timeline
        if self.options.recompute != "auto":
            return
        todo = self._to_search(plan)
        if not todo:
            return
        # Done before the next step's first forward, then that step is planned at once
        # (relower_requested), under the budget resolved here.
        self._budget_pin = plan.budget_bytes
        self._relower_step = timeline
        for index in todo:
            self.regions[index].relower_requested = True
            self.regions[index].lowering_requested = None  # the search lowers it
        LOGGER.info(
            "hyper_offload step plan %d %s: re-lowering region(s) %s with the recompute "
            "search ranked on the step", self.replans,
            "does not fit" if not plan.fits else "stalls", ", ".join(map(str, todo)),
        )

    def _to_search(self, plan: StepPlan) -> tuple[int, ...]:
        """Regions the recompute search should re-lower for ``plan`` (.step_recompute)."""
        # A region running collectives on several ranks is not searched: each rank prices
        # the search with its own measured link and could pick another partition.
        ranks = torch.distributed.is_available() and torch.distributed.is_initialized() and (
            torch.distributed.get_world_size() > 1)
        done = frozenset(
            r.index for r in self.regions
            if r.relowered or r.planned is None or (ranks and r.collectives)
        )
        # Each op's own working memory matters only where the floor is over the budget.
        working = {} if plan.fits else {
            r.index: required_bytes((r.floor_plan or r.planned).fx_trace.trace)
            for r in self.regions if r.planned is not None
        }
        profiles = {r.index: r.profile for r in self.regions}
        return regions_to_relower(plan, plan.predicted_stall_s, profiles, done, working)

    def _lowerable(self, region: CompiledRegion) -> bool:
        """Whether the step plan may lower ``region`` again with a schedule of its own:
        its partition is torch's (compiling again reproduces it) and its sizes are
        numbers (one schedule fits every call)."""
        return (region.floor_plan is not None and region.static_sizes
                and not _recomputes(region))

    def _step_inputs(
        self, timeline: StepTimeline, searched: int | None = None
    ) -> tuple[dict[int, RegionTrace], dict[int, tuple[int, ...]], frozenset[int]] | None:
        """Each region as the step planner sees it, its bytes curve, and those it may lower
        again; None when a region of ``timeline`` was never planned here (a cache served
        it without a plan): then only keeping on the lowerings in force is planned."""
        lowerable = frozenset(r.index for r in self.regions if self._lowerable(r))
        sizes: dict[int, list[Bucket]] = {}
        for invocation, bucket in timeline.sizes.items():
            sizes.setdefault(invocation.region, []).append(bucket)
        regions, resident = {}, {}
        for region in self.regions:
            if region.index == searched:
                continue
            traced = region.step_trace(region.index in lowerable,
                                       merged_sizes(sizes.get(region.index, ())))
            if traced is None:
                continue
            regions[region.index], resident[region.index] = traced
        if any(r not in regions and r != searched for r in timeline.regions):
            return None
        return regions, resident, lowerable

    def _plan_step(
        self, timeline: StepTimeline, budget: int | None, fraction: float | None = None,
        *, request: bool = True,
    ) -> StepPlan:
        """Plan ``timeline`` (:func:`~.step_planner.plan_step_schedules`). If every region
        runs the lowering the plan wants, put it in force; else put in force the plan of
        keeping on the lowerings as they are, and (``request``) ask for the lowerings the
        plan wants before the next step's first forward. Returns the plan wanted."""
        inputs = self._step_inputs(timeline)
        if inputs is None:
            return self._adopt(self._keeping_plan(timeline, budget, fraction), interim=False)
        regions, resident, lowerable = inputs
        key = _timeline_key(timeline)
        target = self._plans.get(key)
        if target is None or target.budget_bytes != (budget or target.budget_bytes):
            target = plan_step_schedules(timeline, regions, resident, budget,
                                         budget_fraction=fraction, tailor=lowerable,
                                         host_budget_bytes=self.options.host_budget_bytes)
            self.plans_made += 1
            self._plans[key] = target
        wanted = {
            r.index: target.schedules.get(r.index) for r in self.regions
            if r.index in lowerable and r.index in timeline.regions
        }
        changes = [i for i, schedule in wanted.items() if self.regions[i].step_schedule != schedule]
        if not changes:
            return self._adopt(target, interim=False)
        self._adopt(self._keeping_plan(timeline, target.budget_bytes), interim=True)
        if request:
            self._budget_pin = target.budget_bytes
            self._relower_step = timeline
            for index in changes:
                self.regions[index].lowering_requested = (
                    wanted[index], target.schedule_budget_bytes)
        return target

    def _keeping_plan(
        self, timeline: StepTimeline, budget: int | None, fraction: float | None = None
    ) -> StepPlan:
        """Keeping slots on the lowerings in force, priced on the timeline model (a
        region of symbolic sizes at the sizes ``timeline`` ran with)."""
        profiles, floors = {r.index: r.profile for r in self.regions}, {}
        for region in self.regions:
            floors[region.index] = region.floor
            at = [b for i, b in timeline.sizes.items() if i.region == region.index]
            traced = region.step_trace(False, merged_sizes(at)) if at else None
            if traced is not None:
                trace, resident = traced
                profiles[region.index] = region_floor_profile(region.index, trace, resident)
                floors[region.index] = RegionFloor(trace.trace, trace.floor, trace.num_fw_ops)
        plan = plan_step(timeline, profiles, budget, budget_fraction=fraction,
                         host_budget_bytes=self.options.host_budget_bytes)
        stall = predicted_step_stall(timeline, floors, plan.keep_for)
        lowered = {r.index: r.step_schedule for r in self.regions if r.step_schedule is not None}
        return dataclasses.replace(plan, predicted_stall_s=stall, schedules=lowered)

    def _adopt(self, plan: StepPlan, *, interim: bool) -> StepPlan:
        """Put ``plan`` in force (its predicted stall, the re-plan count, one log line);
        ``interim``: it waits for lowerings (the step is planned again at its end)."""
        self.step_plan, self._interim = plan, interim
        self.step_stall_s = plan.predicted_stall_s
        if not any(_recomputes(r) for r in self.regions if r.index in plan.timeline.regions):
            self._plain_peaks.setdefault(plan.timeline.shape_key, plan.peak_without_offload_bytes)
        self.replans += 1
        log_step_plan(plan, self.replans, self.step_stall_s)
        return plan

    def _scorer_for(self, region: CompiledRegion, timeline: StepTimeline) -> Scorer:
        """The step objective for ``region``'s re-lowering on ``timeline``, against the
        other regions as they are lowered now (one pass of coordinate descent,
        .step_recompute)."""
        assert self._budget_pin is not None
        inputs = self._step_inputs(timeline, searched=region.index)
        if inputs is None:
            raise OffloadRuntimeError(f"hyper_offload region {region.index}: a region of the step "
                             "was never planned here; the step's search needs every plan")
        regions, resident, lowerable = inputs
        return StepScorer(timeline, regions, resident, self._budget_pin, region.index,
                          lowerable, self.options.host_budget_bytes)

    def relower_if_requested(self) -> None:
        """Re-lower every region the last step asked for (:meth:`_on_step`): the recompute
        search first, then the lowerings made for the step; then plan the step again, so
        the step about to start runs planned. Runs at every forward: nothing to do but
        one check almost always."""
        timeline = self._relower_step
        if timeline is None:
            return
        self._relower_step = None  # before compiling: a forward inside it finds nothing
        changed = sum(retile(r, functools.partial(self._compile, r), self.options,
                             self.throughput) for r in self.regions if r.retile_target is not None)
        if changed:
            self._plans.clear()  # made on the graphs before the tiling
        changed += sum(self.relower(r, timeline) for r in self.regions if r.relower_requested)
        changed += sum(self.lower_for_step(r) for r in self.regions
                       if r.lowering_requested is not None)
        if changed or self._interim:
            self._plan_step(timeline, self._budget_pin, request=False)

    def lower_for_step(self, region: CompiledRegion) -> bool:
        """Run the lowering the step asked for: compiled once per schedule (the floor's is
        the first compile's). Whether the region changed; on a failure it keeps the
        lowering it runs (exact either way)."""
        asked = region.lowering_requested
        region.lowering_requested = None
        if asked is None:
            return False
        schedule, budget = asked
        if schedule in region.variants:
            region.adopt(region.variants[schedule], schedule)
            return True
        before = (Lowering(region.compiled, region.planned, region.graphs), region.step_schedule,
                  region.floor_plan)
        gm, example_inputs = region.dynamo_graph
        try:
            assert schedule is not None  # the floor is always a variant
            region.lower_with = (schedule, budget)
            with region.compiling_again():  # no plan cache entry either
                compiled = self._compile(region, gm, example_inputs, None)
            assert region.planned is not None
            region.adopt(Lowering(compiled, region.planned, region.graphs), schedule)
            LOGGER.info("hyper_offload region %d: lowered again with the step's schedule "
                        "(%d B moved)", region.index, region.planned.check.bytes_d2h)
            return True
        except Exception as error:  # an optimisation failed: the lowering in force runs
            LOGGER.warning(
                "hyper_offload region %d: lowering it again for the step failed (%s: %s); it "
                "keeps the lowering it runs, exact as before. Fix: report it",
                region.index, type(error).__name__, error,
            )
            region.floor_plan = before[2]
            region.adopt(before[0], before[1])
            return False
        finally:
            region.lower_with = None

    def relower(self, region: CompiledRegion, timeline: StepTimeline) -> bool:
        """Search ``region``'s partitions again, ranked on the step; where the search
        chooses one other than torch's, compile the region with it (its plan, profile
        and compiled forward follow; lowered with the schedule the step plan made for
        it, when it made one). Whether the region changed."""
        region.relower_requested, region.relowered = False, True
        before = (Lowering(region.compiled, region.planned, region.graphs), region.step_schedule,
                  region.floor_plan)
        gm, example_inputs = region.dynamo_graph
        report, changed = None, False
        try:
            region.scorer = self._scorer_for(region, timeline)
            # The search on graphs only (no code generation; for aot_eager and fake steps
            # that is the compile). No plan cache entry (the choice depends on the step).
            with region.compiling_again():
                searched = self._compile(region, gm, example_inputs, None, graphs_only=True)
                report = region.planned.report.recompute if region.planned else None
                changed = _recomputes(region)
                if changed and not self.fake_steps and self.options.inner_compiler == "inductor":
                    searched = self._compile(region, gm, example_inputs, None)  # + codegen
            if changed:
                assert region.planned is not None
                region.variants = {}  # another partition: the earlier lowerings are not its
                self._plans.clear()  # nor are the plans made on them
                region.adopt(Lowering(searched, region.planned, region.graphs),
                             region.step_schedule)
        except Exception as error:  # an optimisation failed: the floor's graphs still run
            LOGGER.warning(
                "hyper_offload region %d: the step's recompute search failed (%s: %s); the "
                "region keeps its floor graphs, exact as before. Fix: report it, or pass "
                "recompute='off'", region.index, type(error).__name__, error,
            )
            report, changed = None, False
        finally:
            region.scorer = None
        if not changed:  # torch's partition again, or a failure: the lowering in force stays
            region.floor_plan = before[2]
            region.adopt(before[0], before[1])
        LOGGER.info(
            "hyper_offload region %d searched on the step: %s", region.index,
            report.describe("") if report is not None else "no search",
        )
        return changed

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if on_meta(example_inputs):  # nothing to move: plain torch.compile, warned once
            warn, self._meta_warned = not self._meta_warned, True
            return compile_on_meta(gm, example_inputs, self.options, warn=warn)
        tiling = source = None
        if self.options.tile_sequence != "off":  # before the region: it is the tiled graph
            source = tiling_source(gm, example_inputs)
            gm, tiling = tile_region(source, self.options, throughput=self.throughput)
        region = CompiledRegion(next(self._counter), gm, example_inputs, self.runtime)
        region.tiling, region.untiled = tiling, source
        self.regions.append(region)
        plan_key = None
        if self.options.inner_compiler == "inductor" and not self.fake_steps:
            plan_key = region_cache.cache_key(
                gm, example_inputs, self.options.cache_key(), self.planning_code
            )
        if self.options.drops_cudagraphs and region.index == 0:
            LOGGER.warning(
                "hyper_offload: mode=%r asks for CUDA graphs; hyper_offload regions run "
                "without them (their transfers keep host-side state a graph replay would "
                "skip); the mode's other Inductor settings apply", self.options.mode,
            )
        compiled = self._compile(region, gm, example_inputs, plan_key)
        if region.planned is None and plan_key is not None:  # AOTAutograd's cache served it
            region.set_planned(region_cache.load_plan(plan_key))
            region.from_cache = region.planned is not None
            if region.planned is not None:
                LOGGER.info("hyper_offload region %d: compiled code and plan served "
                            "from the cache", region.index)
                log_region_report(region.planned.report)
                if self.options.step_scoped:  # the cached plan is the region's floor
                    planned = region.planned
                    region.floor_plan = GraphPlan(planned.fx_trace, planned.schedule,
                                                  planned.check, 0.0)
        if region.planned is not None:
            region.variants[None] = Lowering(compiled, region.planned, region.graphs)
        return _RegionForward(compiled, region, self)

    def _compile(
        self, region: CompiledRegion, gm: fx.GraphModule, example_inputs: Sequence[Any],
        plan_key: str | None, *, graphs_only: bool = False,
    ) -> Callable[..., Any]:
        """``gm`` compiled with this backend's partitioner for ``region``: graphs only
        (estimate's fake steps, a re-lowering's search), aot_eager (no cache, always
        planned) or Inductor."""
        partitioner = _OffloadPartitioner(self, region, plan_key)
        if self.fake_steps or graphs_only or self.options.inner_compiler != "inductor":
            # aot_eager's compile *is* the graphs, run as written
            return compile_graphs_only(
                gm, example_inputs, partitioner, self.options.inner_compiler,
                self.options.inductor_patches(),
            )
        return _compile_inductor(gm, example_inputs, partitioner, self.options)


def _timeline_key(timeline: StepTimeline) -> tuple[Any, ...]:
    """A step's key in the plan cache: its events, retained bytes, sizes and eager bytes."""
    return (timeline.events, tuple(sorted(timeline.retained_bytes.items())),
            tuple(sorted(timeline.sizes.items())), timeline.between)


def _step_lowering(
    region: CompiledRegion, floor: GraphPlan
) -> tuple[ResidencySchedule | None, GraphPlan]:
    """The schedule a compile of ``region`` lowers with (None: its partition's floor
    ``floor``) and its plan: the schedule made for the step that was asked for
    (``region.lower_with``), or the one the step's re-lowering search priced with the
    chosen partition (:class:`~.step_recompute.StepScorer`), checked on this compile's
    trace. Raises ``ScheduleError`` when the trace is not the one the step planned."""
    asked = region.lower_with
    if asked is None and region.scorer is not None:
        asked = getattr(region.scorer, "schedules", {}).get(id(floor))
    if asked is None:
        return None, floor
    if region.lower_with is not None and region.floor_plan is not None and (
            region.floor_plan.fx_trace.op_nodes != floor.fx_trace.op_nodes):
        raise ScheduleError(
            f"hyper_offload region {region.index}: the graphs traced again differ from those "
            "the step plan was made for; the region keeps the lowering it runs"
        )
    schedule, budget = asked
    return schedule, plan_with_schedule(floor, schedule, budget, region=region.index)


def _recomputes(region: CompiledRegion) -> bool:
    """Whether ``region``'s plan chose a partition that recomputes more than torch's."""
    report = region.planned.report.recompute if region.planned is not None else None
    return report is not None and bool(report.recomputed or report.spliced)


def _compile_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: Any, options: BackendOptions,
) -> Callable[..., Any]:
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # The mode's settings go through compile_fx's config_patches, which also wraps the
    # inner compile: the backward is compiled lazily, at the first backward, outside
    # this ``with`` (the partitioner runs inside it, at the forward's compile).
    with inductor_config.patch(custom_partitioner_fn=partitioner):
        return compile_fx(gm, example_inputs, config_patches=options.inductor_patches() or None)


def backend(config: OffloadConfig | None = None, **options: Any) -> HyperOffloadBackend:
    """A configured backend object: ``torch.compile(model, backend=hyper_offload.backend(
    OffloadConfig(max_resident_activation_mb=512), inner_compiler="aot_eager"))``.

    ``options`` are the keys ``options=`` accepts besides the ``OffloadConfig`` fields
    (``inner_compiler``, ``max_resident_activation_fraction``); with ``config`` given,
    its ``max_resident_activation_mb`` is replaced by the fraction when one is passed.
    """
    if config is not None:
        if not isinstance(config, OffloadConfig):
            raise ConfigurationTypeError(
                f"hyper_offload.backend: config must be an OffloadConfig, got "
                f"{type(config).__name__}; pass options as keywords instead"
            )
        fields = {
            "max_offload_activation_mb": config.max_offload_activation_mb,
            "planner": config.planner,
        }
        if "max_resident_activation_fraction" not in options:
            fields["max_resident_activation_mb"] = config.max_resident_activation_mb
        options = {**fields, **options}
    return HyperOffloadBackend(parse_backend_options(options))


def hyper_offload_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The function Dynamo calls for ``backend="hyper_offload"`` (entry point);
    ``torch.compile``'s ``mode=`` arrives as ``mode``."""
    options = dict(options or {})
    if mode is not None:
        if options.get("mode", mode) != mode:
            raise ConfigurationError(
                f"hyper_offload: torch.compile(mode={mode!r}) and options['mode']="
                f"{options['mode']!r} disagree; pass the mode once"
            )
        options["mode"] = mode
    parsed = parse_backend_options(options)
    shared = _SHARED_BACKENDS.get(parsed.cache_key(), lambda: HyperOffloadBackend(parsed))
    return shared(gm, example_inputs)


# The backends of backend="hyper_offload", one per option set (see .backend_registry):
# a cache, not configuration. torch._dynamo.reset() calls this function's ``reset``.
_SHARED_BACKENDS: BackendRegistry[HyperOffloadBackend] = BackendRegistry()
hyper_offload_backend.reset = _SHARED_BACKENDS.clear  # type: ignore[attr-defined]


def shared_backend(options: dict[str, Any] | None = None) -> HyperOffloadBackend | None:
    """The backend ``backend="hyper_offload"`` with these ``options`` uses now, if any:
    how to read its ``step_report`` and ``reports`` after ``torch.compile(model,
    backend="hyper_offload", options=...)``."""
    parsed = parse_backend_options(options)
    return _SHARED_BACKENDS.peek(parsed.cache_key())
