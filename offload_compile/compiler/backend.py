"""The ``hyper_offload`` torch.compile backend.

``torch.compile(model, backend="hyper_offload", options={...})`` (registered through the
``torch_dynamo_backends`` entry point; one backend per option set, :mod:`.registry`)
or ``torch.compile(model, backend=hyper_offload.backend(config))``. For every region
Dynamo hands over:

0. with ``tile_sequence`` (not "off"), sequence tiling may split its token-wise ops
   into tiles first (:mod:`.tiling`; not bit-exact): the region is the tiled graph;
1. AOTAutograd captures the joint graph; :class:`~.partitioner.OffloadPartitioner`
   partitions it with the stock min-cut partitioner (the user's
   ``activation_memory_budget`` applies) and plans it: under ``budget_scope="step"``
   (the default) at its floor; under ``"region"`` under the whole budget, and with
   ``recompute="auto"`` (the default), where that plan stalls or cannot meet the budget,
   also with partitions that recompute more, keeping the fastest predicted step;
2. the plan is lowered onto the ``hyper_offload::`` transfer ops and checked again;
3. the inner compiler (Inductor, or aot_eager's nop compiler) compiles both graphs.

Under the step scope, :class:`~.step.controller.StepController` owns the step's lifecycle
(it learns the step, plans it with the step model, and asks for the lowerings the plan
wants); :class:`~.step.lowerings.RegionLowerings` answers it from the regions.

Every region of a backend shares its :class:`TransferRuntime` and pinned pool. The
callable returned to Dynamo makes the runtime current around the forward (under the step
scope: keeping what the step plan keeps for this invocation); the backward needs nothing
around it (its transfer ops reach the runtime through the host copies they read), so the
compiled graphs carry no per-process state and AOTAutograd's and Inductor's caches may
serve them to another region or process. The partitioner's ``uuid()`` (a hash of the
planning sources and the options) keeps a plain ``torch.compile``, or other options,
from sharing those entries, and the partitioner stores each region's plan
(:func:`~.partitioner.store_plan`) so that a cached region still reports it.

**Graphs on the meta device** are compiled as plain ``torch.compile``, nothing planned
(:func:`on_meta`, :func:`compile_on_meta`). A meta tensor has no bytes, so a region
computing on the meta device has nothing to move (and no host copy a backward could
reach): the backend compiles such a graph with its inner compiler alone, no region,
report or step. ``hyper_offload.estimate`` gives what a real step would keep and move
(its fake tensors are on the device they model, never meta).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

# The compiled graphs call the transfer ops: importing .ops registers their real kernels.
import hyper_offload.runtime.ops  # noqa: F401
from hyper_offload import passes
from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.passes.fx.sizes import planning_size
from hyper_offload.runtime import PinnedMemoryPool, TransferRuntime
from hyper_offload.runtime.device import TransferBandwidth, profile_transfer_bandwidth
from hyper_offload.runtime.disk_store import DiskStore
from hyper_offload.runtime.memory_meter import is_host_labelled
from hyper_offload.runtime.saved_bytes import node_saved_tensors
from hyper_offload.runtime.verify import VerifySteps

from .fake_capture import compile_graphs_only
from .options import BackendOptions
from .partitioner import (
    OffloadPartitioner, PartitionRequest, PartitionResult, cache_key, load_plan, source_digest,
)
from .region import CompiledRegion, Lowering
from .region_plan import GraphPlan
from .region_report import LOGGER, RegionReport, log_region_report
from .step.controller import StepController
from .step.lowerings import RegionLowerings
from .step_report import StepReport, build_step_report
from .tiling import tile_region, tiling_source

__all__ = ["HyperOffloadBackend"]

# The code that decides a region's rewritten graphs: every planning pass and this package.
# Its hash is in the partitioner's cache key, so an edited planner or lowering never reuses
# a stale cached graph.
_PLANNING_CODE = (Path(passes.__file__).parent, Path(__file__).parent)


class _RegionForward:
    """What Dynamo calls for a region: its compiled forward, with the runtime current."""

    def __init__(self, region: CompiledRegion, backend: HyperOffloadBackend) -> None:
        self._region = region
        self._backend = backend

    def __call__(self, *args: Any) -> Any:
        region, backend = self._region, self._backend
        step_scoped = backend.options.step_scoped
        if not step_scoped:  # the step scope plans each call's own sizes
            region.check_sizes(args)
        grad = torch.is_grad_enabled()
        # Fake arguments: Dynamo propagating shapes through a compiled region
        # (DDPOptimizer runs each compiled submodule on fake tensors while it compiles
        # the next one). That is no invocation of a step; only estimate's backend runs
        # whole steps on fake tensors.
        stepping = step_scoped and grad and (
            backend.fake_steps or torch._guards.detect_fake_mode(args) is None)
        if step_scoped:
            backend.controller.recorder.release_failed_pass()
        backend.runtime.collect()
        if step_scoped and (stepping or not grad):
            backend.controller.before_forward(grad, region.index)
        if stepping:
            return backend.run_invocation(region, args)
        compiled = region.compiled
        assert compiled is not None
        with backend.runtime.keeping(frozenset(), where=region.where,
                                     slot_names=region.slot_names):
            return compiled(*args)


class HyperOffloadBackend:
    """A configured ``hyper_offload`` backend: pass it as ``torch.compile(backend=...)``.

    Every region it compiles shares one :class:`TransferRuntime` and host pool and, under
    ``budget_scope="step"``, one step (:attr:`controller`). ``reports`` lists one
    :class:`RegionReport` per compiled region, in compile order (a recompilation adds
    one); ``regions`` keeps the regions. A deep copy or an unpickled copy is a fresh
    backend with the same options (no regions, no plans): what a framework that copies
    its arguments (Lightning's ``torch.compile`` wrapper) gets.
    """

    def __init__(
        self,
        options: BackendOptions,
        *,
        link: TransferBandwidth | None = None,
        throughput: DeviceThroughput | None = None,
        fake_steps: bool = False,
        fake_mode: Any = None,
    ) -> None:
        self.options = options
        self.link = link
        """Copy bandwidth plans are priced with, overriding the options' and the probe's."""
        self.throughput = throughput
        """Op prices (default: the roofline of each region's device)."""
        self.fake_steps = fake_steps
        """``hyper_offload.estimate``'s backend: regions are partitioned, planned and
        lowered as always but no code is generated, and steps run on fake tensors (of
        ``fake_mode``) are the step."""
        self.regions: list[CompiledRegion] = []
        self.planning_code = source_digest(_PLANNING_CODE)
        self._verify = VerifySteps(options.config.verify)
        config = options.config
        self.runtime = TransferRuntime(
            pool=PinnedMemoryPool(options.host_budget_bytes,
                                  pageable_fallback=config.pageable_fallback),
            verify=self._verify.next_step,
            disk=DiskStore(config.disk_dir, budget_bytes=config.disk_budget_bytes)  # type: ignore[arg-type]
            if config.disk_budget_bytes else None,
        )
        self._bandwidth: dict[torch.device, TransferBandwidth] = {}
        self._counter = itertools.count()
        self._meta_warned = False
        self.lowerings = RegionLowerings(self)
        self.controller = StepController(
            self.lowerings, device=self._step_device, fake_mode=fake_mode,
            budget_bytes=options.config.budget_bytes, fraction=options.budget_fraction,
            recompute=options.recompute == "auto", on_step=self._count_verified_step,
        )

    def __repr__(self) -> str:
        return f"HyperOffloadBackend({self.options})"

    def __deepcopy__(self, memo: dict[int, Any]) -> HyperOffloadBackend:
        return _fresh_backend(self.options, self.link, self.throughput, self.fake_steps)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_fresh_backend, (self.options, self.link, self.throughput, self.fake_steps))

    def measuring(self) -> Any:
        """``with backend.measuring(): loss = model(x); loss.backward()``: the step run
        inside also measures the eager code between this backend's regions (an LM head and
        loss left outside per-block compiled blocks), and the step plan counts it, as
        ``hyper_offload.estimate`` does. Needed once per step shape (later steps of the
        shape reuse the figure); a step run without it plans what the regions hold."""
        return self.controller.measuring()

    # ------------------------------------------------------------------ reports

    @property
    def reports(self) -> list[RegionReport]:
        return [r.planned.report for r in self.regions if r.planned is not None]

    @property
    def verified_steps(self) -> int:
        """Steps whose transfers were checked (``verify``; counted under the step scope)."""
        return self._verify.verified

    @property
    def plans_made(self) -> int:
        """Step plans made so far (one per step shape and sizes seen; a cached one is
        adopted, not made again)."""
        return self.controller.plans_made

    @property
    def step_plan(self) -> Any:
        """The step plan in force (None before a step was planned)."""
        return self.controller.plan

    @property
    def step_report(self) -> StepReport | None:
        """The step plan in force, per region and invocation (None before a step ran)."""
        controller = self.controller
        plan = controller.plan
        if plan is None:
            return None
        relowered = tuple(r.index for r in self.regions if r.relowered and r.recomputes)
        return build_step_report(
            plan, controller.replans, controller.steps, plan.predicted_stall_s, relowered,
            plain_peak=controller.plain_peaks.get(plan.timeline.shape_key),
            op_origin=lambda region, op: self.regions[region].op_origin(op),
            op_operands=lambda region, op: self.regions[region].op_operands(op),
            tiled=tuple(r.index for r in self.regions if r.tiling is not None and r.tiling.tiled
                        and r.index in plan.timeline.regions),
        )

    # ------------------------------------------------------------------ runtime

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
        """What the next forward does first, now: the autograd engine lets go of the nodes
        a backward pass that raised left to it (an empty backward pass where invocations
        are outstanding: :meth:`~.step.recorder.StepRecorder.release_failed_pass`),
        and the runtime observes finished copies (``TransferRuntime.collect``), so that
        host copies whose graph died (a step that raised, a forward without backward)
        give their buffers back. Call it after catching an error in a step to have the
        step's host buffers back before the next one."""
        if self.options.step_scoped:
            self.controller.recorder.release_failed_pass(after_a_backward_only=False)
        self.runtime.collect()

    def _step_device(self) -> torch.device:
        """The device the step's eager code is measured on (its regions')."""
        for region in self.regions:
            for value in region.dynamo_graph[1]:
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    return value.device
        return torch.device("cpu")

    def _count_verified_step(self, _timeline: object) -> None:
        """A step ended: count it if it was checked; ``verify="first_steps:N"`` turns the
        checks off after N (copies already checksummed are still checked at their waits)."""
        self._verify.step_done(self.runtime.verify)
        self.runtime.verify = self._verify.next_step

    def run_invocation(self, region: CompiledRegion, args: Sequence[Any]) -> Any:
        """Run one forward of ``region`` as an invocation of the step: keep what the step
        plan keeps for it, and record it."""
        recorder = self.controller.recorder
        invocation = recorder.begin_forward(region.index)
        bucket = region.bucket(args)
        observer = recorder.observer  # while the step is measured: the region's own ops
        inside = observer.region(args) if observer is not None else contextlib.nullcontext()
        compiled = region.compiled
        assert compiled is not None
        with inside, self.runtime.keeping(self.controller.keep_for(invocation, bucket),
                                          where=region.where, slot_names=region.slot_names):
            outputs = compiled(*args)
        leaves = {
            id(a.untyped_storage()) for a in args
            if isinstance(a, torch.Tensor) and a.grad_fn is None
        }
        recorder.end_forward(invocation, outputs,
                             functools.partial(self._retained, leaves, region), bucket)
        return outputs

    def _retained(self, leaves: set[int], region: CompiledRegion, node: Any) -> int:
        """Device bytes ``node`` holds that no plan moves: its saved device storages, less
        what the lowering in force keeps that its floor would move."""
        storages: dict[int, int] = {}
        for tensor in node_saved_tensors(node):
            storage = tensor.untyped_storage()
            if (id(storage) in leaves or is_host_labelled(tensor) or tensor.device.type == "meta"
                    or self.runtime.is_kept(tensor)):
                continue
            storages[id(storage)] = planning_size(storage.nbytes(), "a saved tensor")
        return max(sum(storages.values()) - region.kept_across_bytes, 0)

    # ------------------------------------------------------------------ compiling

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if on_meta(example_inputs):  # nothing to move: plain torch.compile, warned once
            warn, self._meta_warned = not self._meta_warned, True
            return compile_on_meta(gm, example_inputs, self.options, warn=warn)
        tiling = untiled = None
        if self.options.tile_sequence != "off":  # before the region: it is the tiled graph
            untiled = tiling_source(gm, example_inputs)
            gm, tiling = tile_region(untiled, self.options, throughput=self.throughput)
        region = CompiledRegion(next(self._counter), gm, example_inputs, tiling=tiling,
                                untiled=untiled)
        self.regions.append(region)
        plan_key = None
        if self.options.inner_compiler == "inductor" and not self.fake_steps:
            plan_key = cache_key(
                gm, example_inputs, self.options.cache_key(), self.planning_code
            )
        if self.options.drops_cudagraphs and region.index == 0:
            LOGGER.warning(
                "hyper_offload: mode=%r asks for CUDA graphs; hyper_offload regions run "
                "without them (their transfers keep host-side state a graph replay would "
                "skip); the mode's other Inductor settings apply", self.options.mode,
            )
        compiled, result = self.compile(region, self.request(region, plan_key=plan_key),
                                        example_inputs=example_inputs)
        if result is not None:
            region.adopt(Lowering(compiled, result.planned, result.graphs, result.schedule,
                                  result.floor))
        elif plan_key is not None:  # AOTAutograd's cache served it: no partitioner ran
            self._adopt_cached(region, compiled, plan_key)
        else:  # an inference graph: nothing saved, nothing planned
            region.compiled = compiled
        return _RegionForward(region, self)

    def _adopt_cached(self, region: CompiledRegion, compiled: Callable[..., Any],
                      plan_key: str) -> None:
        region.compiled = compiled
        planned = load_plan(plan_key)
        if planned is None:
            return
        region.from_cache = True
        LOGGER.info("hyper_offload region %d: compiled code and plan served from the cache",
                    region.index)
        log_region_report(planned.report)
        floor = (GraphPlan(planned.fx_trace, planned.schedule, planned.check, 0.0)
                 if self.options.step_scoped else None)  # the cached plan is the floor
        region.adopt(Lowering(compiled, planned, None, None, floor))

    def request(self, region: CompiledRegion, **asked: Any) -> PartitionRequest:
        """What a compile of ``region`` asks the partitioner for (``asked``: a schedule,
        a scorer, a plan key; see :class:`PartitionRequest`)."""
        step = self.options.step_scoped
        return PartitionRequest(
            region=region.index, options=self.options, bandwidth=self.bandwidth,
            throughput=self.throughput, planning_code=self.planning_code,
            activation_inputs=region.activation_inputs if step else frozenset(),
            floor=step, **asked,
        )

    def compile(
        self, region: CompiledRegion, request: PartitionRequest, *, graphs_only: bool = False,
        example_inputs: Sequence[Any] | None = None,
    ) -> tuple[Callable[..., Any], PartitionResult | None]:
        """``region``'s Dynamo graph compiled for ``request`` (with ``example_inputs``:
        Dynamo's own, at the first compile; else the region's fake ones): graphs only
        (estimate's fake steps, a search), aot_eager (always planned) or Inductor; and
        what the partitioner made (None when it did not run: a cache, an inference graph)."""
        gm, fakes = region.dynamo_graph
        example_inputs = fakes if example_inputs is None else example_inputs
        partitioner = OffloadPartitioner(request)
        try:
            if self.fake_steps or graphs_only or self.options.inner_compiler != "inductor":
                compiled = compile_graphs_only(
                    gm, example_inputs, partitioner, self.options.inner_compiler,
                    self.options.inductor_patches(),
                )
            else:
                compiled = _compile_inductor(gm, example_inputs, partitioner, self.options)
        finally:
            region.attempted = partitioner.attempted or region.attempted
        return compiled, partitioner.result


def _fresh_backend(options: BackendOptions, link: TransferBandwidth | None,
                   throughput: DeviceThroughput | None, fake_steps: bool = False
                   ) -> HyperOffloadBackend:
    """A new backend with these options (how a copy or an unpickled backend is made: no
    regions, no step, its own runtime and pool)."""
    return HyperOffloadBackend(options, link=link, throughput=throughput, fake_steps=fake_steps)


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


def on_meta(example_inputs: Sequence[Any]) -> bool:
    """Whether a graph computes on the meta device."""
    return any(isinstance(value, torch.Tensor) and value.device.type == "meta"
               for value in example_inputs)


def compile_on_meta(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions, *, warn: bool
) -> Callable[..., Any]:
    """``gm`` compiled with ``options``' inner compiler alone; ``warn``: say once (the
    caller keeps the flag) why nothing is planned and what to use instead."""
    if warn:
        LOGGER.warning(
            "hyper_offload: a region computes on the meta device, whose tensors hold no "
            "bytes: nothing to move, so it is compiled as plain torch.compile with %s (no "
            "region report). For what a real step would keep and move, use "
            "hyper_offload.estimate(model, example_inputs, budget=...); to train, "
            "materialize the model first (model.to_empty(device=...))",
            options.inner_compiler,
        )
    if options.inner_compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=options.inductor_patches() or None)
    from torch._dynamo.backends.debugging import aot_eager

    return aot_eager(gm, example_inputs)
