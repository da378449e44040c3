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
   meet the budget, also with partitions that recompute more (time-bounded), keeping
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
from hyper_offload.errors import ConfigurationError, ConfigurationTypeError
from hyper_offload import passes
from hyper_offload.config import OffloadConfig
from hyper_offload.passes import ActivationTrace, ResidencySchedule, required_bytes
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
from .options import BackendOptions, parse_backend_options
from .recompute_search import Scorer, search_region
from .region_plan import GraphPlan, PlannedRegion, lower_region
from .region_report import LOGGER, RegionReport, log_region_report
from .saved_bytes import node_saved_tensors
from .step_model import Invocation, StepRecorder, StepTimeline
from .step_plan import RegionProfile, StepPlan, held_inputs, plan_step, region_profile
from .step_recompute import regions_to_relower, step_scorer
from .step_report import StepReport, build_step_report, log_step_plan
from .step_timeline import RegionFloor, predicted_step_stall

__all__ = ["HyperOffloadBackend", "backend", "hyper_offload_backend", "shared_backend"]

# The code that decides a region's rewritten graphs: every planning pass (the op
# declarations included, in passes/ir/) and this package. Its hash is in the
# partitioner's cache key, so an edited planner or lowering never reuses a stale cached
# graph (paths read from the imported modules, so they hold in the repository and when
# installed).
_PLANNING_CODE = (Path(passes.__file__).parent, Path(__file__).parent)


class _Region:
    """Per-region state: its plan and, under the step scope, its floor profile."""

    def __init__(
        self,
        index: int,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        runtime: TransferRuntime,
    ) -> None:
        self.index = index
        self.runtime = runtime
        """The backend's runtime (every region of a backend shares it and its pool)."""
        self.planned: PlannedRegion | None = None
        self.attempted: GraphPlan | None = None
        """The plan last handed to the lowering, also when lowering it raised (which
        storages it meant to move: ``hyper_offload.check`` bisects them)."""
        self.dynamo_graph = (gm, _fake_example_inputs(gm, example_inputs))
        """What Dynamo handed over, its example inputs as Dynamo's fake values: the step
        scope may lower the region again from it. Never the real inputs: a region's input
        is often an activation (the logits a loss region takes), whose autograd graph
        holds the whole step's saved tensors and host copies, for as long as the region
        lives."""
        self.tracing_context = torch._guards.TracingContext.try_get()
        """Dynamo's context of the compile (its fake mode and ``ShapeEnv``, each input's
        symbolic sizes): a re-lowering runs in it, so it sees the region's sizes as the
        first lowering did (a region recompiled under automatic dynamic stays symbolic, a
        data-dependent size stays an unbacked symbol planned at its bound), not as the
        sizes of the example inputs Dynamo handed over."""
        self.collectives = any(is_collective(node) for node in gm.graph.nodes)
        """Whether the region runs collectives: its Dynamo graph, or once lowered its
        AOTAutograd graphs (tensor parallel's DTensor ops become collectives there)."""
        self.compiled: Callable[..., Any] | None = None
        """What runs the region's forward (a re-lowering replaces it)."""
        self.relower_requested = False
        """The step asked for this region's re-lowering with the recompute search ranked
        on the step (:mod:`.step_recompute`); done before the next step's first forward."""
        self.scorer: Scorer | None = None
        """That search's objective, while the re-lowering compiles."""
        self.relowered = False
        self.compile_seconds = 0.0
        """Seconds from Dynamo's hand-over to the end of the first plan (the time bound of
        a re-lowering's search)."""
        self.activation_inputs = activation_inputs(example_inputs)
        """AOTAutograd's names of the graph inputs that are activations (may move)."""
        self.compile_started = time.perf_counter()
        """When Dynamo handed the region over (the recompute search's time bound)."""
        self.from_cache = False
        """True when the compiled code came from AOTAutograd's cache (no partitioner ran)."""
        self.graphs: tuple[fx.GraphModule, fx.GraphModule] | None = None  # lowered fw, bw
        self.unbounded_sizes = unbounded_sizes(example_inputs)
        """Graph inputs that are sizes with no upper bound: ``{input index: (symbol,
        the size the plan assumes)}`` (:mod:`hyper_offload.passes.fx.sizes`)."""
        self.size_warned = False

    def set_planned(self, planned: PlannedRegion) -> None:
        """Adopt a (new) plan: the floor profile and trace are derived from it again."""
        self.planned = planned
        for derived in ("profile", "floor", "slot_names"):
            self.__dict__.pop(derived, None)

    @property
    def where(self) -> str:
        """The region in ``verify``'s errors."""
        return f"compile door, region {self.index}"

    @functools.cached_property
    def slot_names(self) -> dict[int, str]:
        """``copy_d2h`` slot (a storage of the region's trace) -> the graph node that made
        it, for ``verify``'s errors."""
        if self.planned is None:
            return {}
        names: dict[int, str] = {}
        for name, storage in self.planned.fx_trace.node_storage.items():
            names.setdefault(int(storage), f"of {name} (slot {int(storage)})")
        return names

    @functools.cached_property
    def profile(self) -> RegionProfile:
        """The floor profile the step plan lays out (no ops for a region never planned:
        an inference graph, or a cached one whose plan was not stored)."""
        if self.planned is None:
            return RegionProfile(self.index, 0, (), ())
        trace = self.planned.fx_trace
        return region_profile(
            self.index, trace.num_fw_ops, self.planned.check.resident_bytes,
            self.planned.schedule, trace.trace,
            held_inputs(trace.node_storage, trace.activation_inputs),
        )

    @functools.cached_property
    def floor(self) -> RegionFloor:
        """The region's floor trace and schedule (empty for a region never planned)."""
        if self.planned is None:
            return RegionFloor(ActivationTrace((), {}, 0), ResidencySchedule((), ()), 0)
        trace = self.planned.fx_trace
        return RegionFloor(trace.trace, self.planned.schedule, trace.num_fw_ops)

    def check_sizes(self, args: Sequence[Any]) -> None:
        """Warn once if a call's size exceeds what the plan assumed for an unbounded one
        (a smaller size needs fewer bytes under the same plan: no warning)."""
        if self.size_warned:
            return
        for index, (symbol, planned) in self.unbounded_sizes.items():
            if index < len(args) and isinstance(args[index], int) and args[index] > planned:
                self.size_warned = True
                LOGGER.warning(
                    "hyper_offload region %d: planned for %s <= %d (no bound was declared, so "
                    "the plan assumes the size at the compile) but runs with %s=%d; results "
                    "stay exact, resident bytes grow with the size and may exceed the "
                    "budget. Fix: declare the largest size, torch._dynamo.mark_dynamic(tensor, "
                    "dim, min=2, max=N) (a larger size then recompiles and is planned again)",
                    self.index, symbol, planned, symbol, args[index],
                )
                return


def _fake_example_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """``example_inputs`` with each tensor replaced by the fake value Dynamo traced it as
    (its placeholder's ``example_value``, of the region's fake mode, symbolic sizes
    included); a real tensor is kept only where Dynamo recorded none."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    fakes = [node.meta.get("example_value") for node in placeholders]
    if len(fakes) != len(example_inputs):
        return list(example_inputs)
    return [
        fake if isinstance(value, torch.Tensor) and isinstance(fake, torch.Tensor) else value
        for value, fake in zip(example_inputs, fakes)
    ]


def activation_inputs(example_inputs: Sequence[Any]) -> frozenset[str]:
    """The forward placeholders (AOTAutograd names the i-th graph input ``primals_<i+1>``)
    of inputs that are activations: tensors an autograd graph made (a block's input, the
    previous block's output), not parameters, buffers or data, which the caller keeps
    anyway. Dynamo guards a region on ``requires_grad``, not on who made a tensor: a leaf
    passed where an activation was compiled moves too, exact but for no memory."""
    return frozenset(
        f"primals_{i + 1}" for i, value in enumerate(example_inputs)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
        and value.grad_fn is not None
    )


class _RegionForward:
    """What Dynamo calls for a region: its compiled forward, with the runtime current."""

    def __init__(
        self, compiled: Callable[..., Any], region: _Region, backend: HyperOffloadBackend
    ) -> None:
        region.compiled = compiled
        self._region = region
        self._backend = backend

    def __call__(self, *args: Any) -> Any:
        region, backend = self._region, self._backend
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
        self, backend: HyperOffloadBackend, region: _Region, plan_key: str | None
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
        relowering = region.scorer is not None
        choice = search_region(
            gm, partition, num_fwd_outputs=num_fwd_outputs, options=options,
            bandwidth=self._backend.bandwidth, region=region.index, floor=options.step_scoped,
            throughput=self._backend.throughput,
            activation_inputs=region.activation_inputs if options.step_scoped else frozenset(),
            spent_s=region.compile_seconds if relowering else started - region.compile_started,
            score=region.scorer,
        )
        fw, bw = choice.fw, choice.bw
        region.attempted = choice.plan
        region.set_planned(lower_region(
            fw, bw, choice.plan, num_fwd_outputs=num_fwd_outputs, options=options,
            region=region.index, recompute=choice.report,
            search_seconds=time.perf_counter() - started,
        ))
        if not relowering:
            region.compile_seconds = time.perf_counter() - region.compile_started
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
        self.regions: list[_Region] = []
        self.planning_code = region_cache.source_digest(_PLANNING_CODE)
        self._verify = VerifySteps(options.config.verify)
        self.runtime = TransferRuntime(
            pool=PinnedMemoryPool(options.config.max_host_bytes), verify=self._verify.next_step
        )
        self.recorder = StepRecorder(self._on_step)
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
            plan, self.replans, self.recorder.steps, self.step_stall_s, relowered
        )

    def run_invocation(
        self, region: _Region, compiled: Callable[..., Any], args: Sequence[Any]
    ) -> Any:
        """Run one forward of ``region`` as an invocation of the step: keep what the step
        plan keeps for it, and record it."""
        recorder = self.recorder
        recorder.poll()
        invocation = recorder.begin_forward(region.index)
        with self.runtime.keeping(self._keep_for(invocation), where=region.where,
                                  slot_names=region.slot_names):
            outputs = compiled(*args)
        leaves = {
            id(a.untyped_storage()) for a in args
            if isinstance(a, torch.Tensor) and a.grad_fn is None
        }
        recorder.end_forward(invocation, outputs, functools.partial(self._retained, leaves))
        return outputs

    def _count_verified_step(self) -> None:
        """A step ended: count it if it was checked; ``verify="first_steps:N"`` turns the
        checks off after N (copies already checksummed are still checked at their waits)."""
        self._verify.step_done(self.runtime.verify)
        self.runtime.verify = self._verify.next_step

    def _keep_for(self, invocation: Invocation) -> frozenset[int]:
        """What the plan keeps for ``invocation``, while this step's forwards so far are
        the planned step's; the floor (nothing kept) once the step departs from it."""
        plan = self.step_plan
        if plan is None:
            return frozenset()
        so_far = (*self.recorder.current_forwards(), invocation)
        if plan.timeline.invocations[: len(so_far)] != so_far:
            return frozenset()
        return plan.keep_for(invocation)

    def _retained(self, leaves: set[int], node: Any) -> int:
        """Device bytes ``node`` holds that no plan moves (``StepTimeline.retained_bytes``)."""
        storages: dict[int, int] = {}
        for tensor in node_saved_tensors(node):
            storage = tensor.untyped_storage()
            if (id(storage) in leaves or is_host_labelled(tensor) or tensor.device.type == "meta"
                    or self.runtime.is_kept(tensor)):
                continue
            # A data-dependent size (estimate's fake steps: nonzero's rows) counts at
            # its bound, as the region's plan counts it.
            storages[id(storage)] = planning_size(storage.nbytes(), "a saved tensor")
        return sum(storages.values())

    def _on_step(self, timeline: StepTimeline) -> None:
        """A step ended: plan it again when it differs from the one planned; where the
        plan cannot fit or stalls, ask for recompute (:mod:`.step_recompute`)."""
        self._count_verified_step()
        plan = self.step_plan
        if plan is not None and plan.timeline == timeline:
            return
        fraction = self.options.budget_fraction
        budget = self._budget_pin
        if budget is None and fraction is None:
            budget = self.options.config.budget_bytes
        plan = self._adopt_plan(timeline, budget, fraction)
        profiles = {r.index: r.profile for r in self.regions}
        if self.options.recompute != "auto":
            return
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
            r.index: required_bytes(r.floor.trace) for r in self.regions
        }
        todo = regions_to_relower(plan, self.step_stall_s, profiles, done, working)
        if not todo:
            return
        # Done before the next step's first forward, then that step is planned at once
        # (relower_requested), under the budget resolved here.
        self._budget_pin = plan.budget_bytes
        self._relower_step = timeline
        for index in todo:
            self.regions[index].relower_requested = True
        # (The step plan in force stays until then: a region the search leaves as it is
        # keeps its graphs and the plan its decisions.)
        LOGGER.info(
            "hyper_offload step plan %d %s: re-lowering region(s) %s with the recompute "
            "search ranked on the step", self.replans,
            "does not fit" if not plan.fits else "stalls", ", ".join(map(str, todo)),
        )

    def _scorer_for(self, region: _Region, timeline: StepTimeline) -> Scorer:
        """The step objective for ``region``'s re-lowering on ``timeline``, against the
        other regions as they are lowered now (one pass of coordinate descent,
        .step_recompute)."""
        assert self._budget_pin is not None
        return step_scorer(
            timeline, {r.index: r.profile for r in self.regions},
            {r.index: r.floor for r in self.regions}, self._budget_pin, region.index,
        )

    def _adopt_plan(
        self, timeline: StepTimeline, budget: int | None, fraction: float | None = None
    ) -> StepPlan:
        """Plan ``timeline`` with the regions as lowered now, and put the plan in force
        (its predicted stall, the re-plan count, one log line)."""
        plan = plan_step(
            timeline, {r.index: r.profile for r in self.regions}, budget,
            budget_fraction=fraction,
        )
        self.step_stall_s = predicted_step_stall(
            timeline, {r.index: r.floor for r in self.regions}, plan.keep_for
        )
        self.step_plan = plan
        self.replans += 1
        log_step_plan(plan, self.replans, self.step_stall_s)
        return plan

    def relower_if_requested(self) -> None:
        """Re-lower every region the last step asked for (:meth:`_on_step`), one after
        the other, and plan the step again when one of them changed partition: the step
        about to start runs planned, not at the floor. Runs at every forward: nothing
        to do but one check almost always."""
        timeline = self._relower_step
        if timeline is None:
            return
        self._relower_step = None  # before compiling: a forward inside it finds nothing
        requested = [r for r in self.regions if r.relower_requested]
        if sum(self.relower(region, timeline) for region in requested):
            self._adopt_plan(timeline, self._budget_pin)

    def relower(self, region: _Region, timeline: StepTimeline) -> bool:
        """Search ``region``'s partitions again, ranked on the step; where the search
        chooses one other than torch's, compile the region with it (its plan, profile
        and compiled forward follow). Whether the region changed."""
        region.relower_requested, region.relowered = False, True
        before = (region.planned, region.graphs)
        gm, example_inputs = region.dynamo_graph
        try:
            region.scorer = self._scorer_for(region, timeline)
            # The search on graphs only (no code generation; for aot_eager and fake steps
            # that is the compile). No plan cache entry (the choice depends on the step),
            # and AOTAutograd's cache must not serve the floor's graphs for another
            # partition.
            from torch._functorch import config as functorch_config

            with (functorch_config.patch(enable_autograd_cache=False),
                  torch._guards.tracing(region.tracing_context)):
                searched = self._compile(region, gm, example_inputs, None, graphs_only=True)
                report = region.planned.report.recompute if region.planned else None
                changed = _recomputes(region)
                if not changed:
                    pass
                elif self.fake_steps or self.options.inner_compiler != "inductor":
                    region.compiled = searched
                else:  # Inductor: the same search again, then code generation
                    region.compiled = self._compile(region, gm, example_inputs, None)
        except Exception as error:  # an optimisation failed: the floor's graphs still run
            LOGGER.warning(
                "hyper_offload region %d: the step's recompute search failed (%s: %s); the "
                "region keeps its floor graphs, exact as before. Fix: report it, or pass "
                "recompute='off'", region.index, type(error).__name__, error,
            )
            report, changed = None, False
        finally:
            region.scorer = None
        if not changed:  # torch's partition again, or a failure: the floor's plan stays
            region.set_planned(before[0])  # type: ignore[arg-type]
            region.graphs = before[1]
        LOGGER.info(
            "hyper_offload region %d searched on the step: %s", region.index,
            report.describe("") if report is not None else "no search",
        )
        return changed

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if _on_meta(example_inputs):
            return self._compile_on_meta(gm, example_inputs)
        region = _Region(next(self._counter), gm, example_inputs, self.runtime)
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
        return _RegionForward(compiled, region, self)

    def _compile_on_meta(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[..., Any]:
        """A graph on the meta device, compiled as plain ``torch.compile`` with the inner
        compiler: a meta tensor has no bytes, so there is nothing to move (and no host
        copy a backward could reach). No region, report or step: ``estimate`` gives what
        a real step would keep and move."""
        if not self._meta_warned:
            self._meta_warned = True
            LOGGER.warning(
                "hyper_offload: a region computes on the meta device, whose tensors hold no "
                "bytes: nothing to move, so it is compiled as plain torch.compile with %s (no "
                "region report). For what a real step would keep and move, use "
                "hyper_offload.estimate(model, example_inputs, budget=...); to train, "
                "materialize the model first (model.to_empty(device=...))",
                self.options.inner_compiler,
            )
        if self.options.inner_compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs,
                              config_patches=self.options.inductor_patches() or None)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    def _compile(
        self, region: _Region, gm: fx.GraphModule, example_inputs: Sequence[Any],
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


def _on_meta(example_inputs: Sequence[Any]) -> bool:
    """Whether a graph computes on the meta device (estimate's fake tensors are on the
    device they model, never meta)."""
    return any(isinstance(value, torch.Tensor) and value.device.type == "meta"
               for value in example_inputs)


def _recomputes(region: _Region) -> bool:
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
