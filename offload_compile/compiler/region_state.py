"""One compiled region of the ``hyper_offload`` backend: its plans and its lowerings.

A region is what Dynamo hands the backend once (a graph and its example inputs). Under
``budget_scope="step"`` it may run several *lowerings* over its life, all exact, all of
one partition of its joint graph:

* its **floor** (every movable saved activation copied out), the first one, made before
  anything was known of the step;
* a lowering with a **schedule made for the step** (:mod:`.step_planner`), where the step
  plan asks for one: compiled when first asked for, kept by schedule, so a schedule seen
  before is never compiled again (``variants``);
* after the recompute search ranked on the step (:mod:`.step_recompute`), the chosen
  partition's lowering (floor or made for the step), which replaces the others.

``planned`` is the lowering in force (what its compiled forward runs, what ``profile``
and ``floor`` describe); ``floor_plan`` the floor of its partition, what the step plan
plans from. Thread-safety: the backend changes a region only between steps (before a
forward), never while its graphs run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import fx

from hyper_offload.passes import ActivationTrace, ResidencySchedule, check_schedule
from hyper_offload.passes.fx.sizes import unbounded_sizes
from hyper_offload.runtime import TransferRuntime

from .collectives import is_collective
from .recompute_search import Scorer
from .region_plan import GraphPlan, PlannedRegion
from .region_report import LOGGER
from .size_buckets import Bucket, bucket_of, size_inputs
from .step_plan import RegionProfile, held_inputs, region_profile
from .step_timeline import RegionFloor
from .step_trace import RegionTrace, kept_across, region_trace
from .tiling_report import TilingReport
from .tiling_source import TilingSource

__all__ = ["CompiledRegion", "Lowering", "activation_inputs"]


class Lowering(NamedTuple):
    """One compiled lowering of a region: what runs its forward, its plan, its graphs."""

    compiled: Callable[..., Any]
    planned: PlannedRegion
    graphs: tuple[fx.GraphModule, fx.GraphModule] | None


class CompiledRegion:
    """Per-region state (module docstring)."""

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
        self.floor_plan: GraphPlan | None = None
        """The floor of the region's partition (the step plan plans from it); None for a
        region served by a cache or never planned."""
        self.step_schedule: ResidencySchedule | None = None
        """The schedule of the lowering in force when it was made for the step (None:
        the floor, or the region scope's plan)."""
        self.variants: dict[ResidencySchedule | None, Lowering] = {}
        """Lowerings compiled so far, by ``step_schedule`` (None: the floor)."""
        self.attempted: GraphPlan | None = None
        """The plan last handed to the lowering, also when lowering it raised (which
        storages it meant to move: ``hyper_offload.check`` bisects them)."""
        self.dynamo_graph = (gm, _fake_example_inputs(gm, example_inputs))
        """What Dynamo handed over, its example inputs as Dynamo's fake values: the step
        scope may lower the region again from it. Never the real inputs: a region's input
        is often an activation (the logits a loss region takes), whose autograd graph
        holds the whole step's saved tensors and host copies, for as long as the region
        lives."""
        context = torch._guards.TracingContext.try_get()
        self.fake_mode = context.fake_mode if context is not None else None
        """Dynamo's fake mode of the compile (its ``ShapeEnv``, each input's symbolic
        sizes): a re-lowering runs in it, so it sees the region's sizes as the first
        lowering did (a region recompiled under automatic dynamic stays symbolic, a
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
        self.lowering_requested: tuple[ResidencySchedule | None, int] | None = None
        """The step asked for this region to run another lowering: ``(schedule, budget)``
        (None schedule: the floor); done before the next step's first forward."""
        self.scorer: Scorer | None = None
        """The re-lowering search's objective, while the re-lowering compiles."""
        self.lower_with: tuple[ResidencySchedule, int] | None = None
        """While a lowering for the step compiles: its schedule, and the budget it was
        checked under (:mod:`.step_planner`)."""
        self.relowered = False
        self.activation_inputs = activation_inputs(example_inputs)
        """AOTAutograd's names of the graph inputs that are activations (may move)."""
        self.from_cache = False
        """True when the compiled code came from AOTAutograd's cache (no partitioner ran)."""
        self.graphs: tuple[fx.GraphModule, fx.GraphModule] | None = None  # lowered fw, bw
        self.size_inputs = size_inputs(example_inputs)
        """``{graph input index: symbol}`` of the inputs that are sizes (:mod:`.size_buckets`)."""
        self.unbounded_sizes = unbounded_sizes(example_inputs)
        """Graph inputs that are sizes with no upper bound: ``{input index: (symbol,
        the size the plan assumes)}`` (:mod:`hyper_offload.passes.fx.sizes`)."""
        self.size_warned = False
        self.tiling: TilingReport | None = None
        """What sequence tiling did to the region's graph (``tile_sequence``,
        :mod:`.tiling`); every plan's report carries it."""
        self.untiled: TilingSource | None = None
        """What its tiling was chosen from (None: ``tile_sequence="off"``)."""
        self.retile_target: int | None = None
        """The floor the step asked tiling to reach, until it is tiled again
        (:mod:`.tiling_step`, before the next step's first forward)."""
        self.retiled = False
        """Whether the step had it tiled again (at most once)."""

    def set_planned(self, planned: PlannedRegion) -> None:
        """Adopt a (new) plan: the profile and trace are derived from it again."""
        if self.tiling is not None and planned.report.tiling is None:
            planned = dataclasses.replace(
                planned, report=dataclasses.replace(planned.report, tiling=self.tiling))
        self.planned = planned
        for derived in ("profile", "floor", "slot_names", "kept_across_bytes"):
            self.__dict__.pop(derived, None)

    def adopt(self, lowering: Lowering, schedule: ResidencySchedule | None) -> None:
        """Run ``lowering`` (made for ``schedule``; None: the floor) from now on."""
        self.variants[schedule] = lowering
        self.compiled = lowering.compiled
        self.graphs = lowering.graphs
        self.step_schedule = schedule
        self.set_planned(lowering.planned)

    def op_origin(self, op: str) -> str | None:
        """The aten op that trace op ``op`` (``"bw:mul_17"``) came from, where a
        decomposition made it (``"aten.nll_loss_backward"``); None when it is its own."""
        graph_name, _, node_name = op.partition(":")
        if self.graphs is None or graph_name not in ("fw", "bw"):
            return None
        graph = self.graphs[graph_name == "bw"].graph
        node = next((n for n in graph.nodes if n.name == node_name), None)
        origin = node.meta.get("original_aten") if node is not None else None
        packet = getattr(origin, "overloadpacket", None)
        if packet is None or packet is getattr(node.target, "overloadpacket", None):
            return None
        return f"aten.{packet.__name__}"

    @property
    def where(self) -> str:
        """The region in ``verify``'s errors."""
        return f"compile door, region {self.index}"

    @property
    def static_sizes(self) -> bool:
        """Whether every size of the region's graphs is a number (no symbolic size)."""
        return self.planned is not None and not self.planned.report.sizes

    def step_trace(
        self, lowerable: bool, sizes: Mapping[str, int] | None = None
    ) -> tuple[RegionTrace, tuple[int, ...]] | None:
        """What the step plan plans from, and its bytes curve: the floor of its partition
        when it may be lowered again (``lowerable``), else the lowering in force, its
        symbolic storages at ``sizes`` (:mod:`.size_buckets`; None: the sizes the plan
        assumes). None for a region never planned."""
        source = self.floor_plan if lowerable else self.planned
        if self.floor_plan is None or source is None:
            return None
        fx_trace, schedule = source.fx_trace, source.schedule
        if sizes and fx_trace.storage_exprs:
            trace = fx_trace.at_sizes(sizes).with_budget(fx_trace.trace.budget_bytes)
            resident = check_schedule(trace, schedule).resident_bytes
            return region_trace(dataclasses.replace(fx_trace, trace=trace), schedule), resident
        return region_trace(fx_trace, schedule), source.check.resident_bytes

    def bucket(self, args: Sequence[Any]) -> Bucket:
        """The sizes of a call of this region with ``args`` (empty for static sizes)."""
        return bucket_of(self.size_inputs, args) if self.size_inputs else ()

    @functools.cached_property
    def kept_across_bytes(self) -> int:
        """Bytes of movable storages the lowering in force keeps from forward to
        backward (0 at the floor): measured retained bytes less these are the floor's."""
        if self.step_schedule is None or self.floor_plan is None:
            return 0
        return kept_across(
            region_trace(self.floor_plan.fx_trace, self.floor_plan.schedule), self.step_schedule
        )

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
        """The profile of the lowering in force that the step plan lays out (no ops for a
        region never planned: an inference graph, or a cached one whose plan was not
        stored)."""
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
        """The trace and schedule of the lowering in force (empty for a region never
        planned): its floor unless the step plan lowered it again."""
        if self.planned is None:
            return RegionFloor(ActivationTrace((), {}, 0), ResidencySchedule((), ()), 0)
        trace = self.planned.fx_trace
        return RegionFloor(trace.trace, self.planned.schedule, trace.num_fw_ops)

    @contextlib.contextmanager
    def compiling_again(self) -> Iterator[None]:
        """The context every later lowering of :attr:`dynamo_graph` runs in: a tracing
        context with Dynamo's fake mode of the first compile (it owns the example inputs,
        so a fake mode active around the call, an estimate's fake step, does not clash),
        and no AOTAutograd cache (its key cannot tell lowerings or partitions apart, so it
        would serve the floor's graphs). A fresh context, not Dynamo's own: that one also
        counts DDPOptimizer's bucket compiles, which a lowering outside Dynamo's compile
        would throw off (its lazy backward then finds no bucket left)."""
        from torch._functorch import config as functorch_config

        tracing = (torch._guards.tracing(torch._guards.TracingContext(self.fake_mode))
                   if self.fake_mode is not None else contextlib.nullcontext())
        with functorch_config.patch(enable_autograd_cache=False), tracing:
            yield

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
