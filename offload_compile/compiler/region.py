"""One compiled region of the ``hyper_offload`` backend: what Dynamo handed over, and its lowerings.

A region is what Dynamo hands the backend once (a graph and its example inputs). Under
``budget_scope="step"`` it may run several *lowerings* over its life, all exact, each a
:class:`Lowering` (compiled code, plan, graphs, and what it was made for):

* its **floor** (every movable saved activation copied out), the first one, made before
  anything was known of the step;
* a lowering with a **schedule made for the step** (:mod:`hyper_offload.passes.plan.step`),
  where the step plan asks for one: compiled when first asked for, kept by schedule, so a
  schedule seen before is never compiled again (``variants``);
* after the recompute search ranked on the step, the chosen partition's lowering, which
  replaces the others.

``lowering`` is the one in force: what the region's forward runs and every figure of it
derives from. The region changes only through :meth:`CompiledRegion.adopt`, called by the
backend between steps (before a forward), never while its graphs run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import fx

from hyper_offload.passes import ActionKind, ResidencySchedule
from hyper_offload.passes.fx.sizes import Bucket, bucket_of, size_inputs, unbounded_sizes
from hyper_offload.passes.plan.step import RegionFloor

from .recompute.rules import is_collective
from .region_plan import GraphPlan, PlannedRegion
from .region_report import LOGGER, TilingReport

__all__ = [
    "CompiledRegion", "Lowering", "TilingSource", "activation_inputs", "fake_example_inputs",
]


class TilingSource(NamedTuple):
    """A region's untiled Dynamo graph, its example inputs as Dynamo's fake values
    (never the real ones: an activation holds its whole autograd graph), the inputs that
    carry tokens (``{placeholder: token dim}``; None: the analysis' default) and the
    inputs that are activations (AOTAutograd's names), kept so that the step can choose
    again (:meth:`.step.lowerings.RegionLowerings.retile`)."""

    graph: fx.GraphModule
    inputs: list[Any]
    seeds: dict[str, int | None] | None
    moving: frozenset[str]


class Lowering(NamedTuple):
    """One compiled lowering of a region: what runs its forward, its plan, its graphs,
    the schedule it was made for (None: its partition's floor, or the region scope's
    plan) and the floor of its partition (None outside the step scope, or from a cache
    without one)."""

    compiled: Callable[..., Any]
    planned: PlannedRegion
    graphs: tuple[fx.GraphModule, fx.GraphModule] | None
    schedule: ResidencySchedule | None = None
    floor: GraphPlan | None = None

    @property
    def recomputes(self) -> bool:
        """Whether its partition recomputes more than torch's."""
        report = self.planned.report.recompute
        return report is not None and bool(report.recomputed or report.spliced)


class CompiledRegion:
    """Per-region state (module docstring)."""

    def __init__(self, index: int, gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                 tiling: TilingReport | None = None, untiled: TilingSource | None = None
                 ) -> None:
        self.index = index
        self.tiling = tiling
        """What sequence tiling did to ``gm`` (``tile_sequence``, :mod:`.tiling`; None:
        off); every lowering's report carries it. Changed only by the step's re-tiling
        (:meth:`.step.lowerings.RegionLowerings.retile`)."""
        self.untiled = untiled
        """What its tiling was chosen from (None: ``tile_sequence="off"``)."""
        self.lowering: Lowering | None = None
        """The lowering in force (None for a region never planned: an inference graph,
        or a cached one whose plan was not stored)."""
        self.variants: dict[ResidencySchedule | None, Lowering] = {}
        """Lowerings of the partition in force compiled so far, by ``schedule``."""
        self.compiled: Callable[..., Any] | None = None
        """What runs the region's forward: the lowering's, or the inner compiler's output
        for a region never planned."""
        self.attempted: GraphPlan | None = None
        """The plan last handed to the lowering, also when lowering it raised (which
        storages it meant to move: ``hyper_offload.check`` bisects them)."""
        self.relowered = False
        """Whether the recompute search ranked on the step ran for this region."""
        self.lowering_failed = False
        """Whether lowering it with a schedule made for the step failed (it is then never
        asked again: the lowering in force runs, exact)."""
        self.from_cache = False
        """True when the compiled code came from AOTAutograd's cache (no partitioner ran)."""
        self.dynamo_graph = (gm, fake_example_inputs(gm, example_inputs))
        """What Dynamo handed over, its example inputs as Dynamo's fake values: the step
        scope may lower the region again from it. Never the real inputs: a region's input
        is often an activation whose autograd graph holds the whole step's saved tensors."""
        context = torch._guards.TracingContext.try_get()
        self.fake_mode = context.fake_mode if context is not None else None
        """Dynamo's fake mode of the compile: a lowering made later runs in it, so it sees
        the region's sizes as the first lowering did."""
        self.collectives = any(is_collective(node) for node in gm.graph.nodes)
        """Whether the region runs collectives (its Dynamo graph, or its lowered graphs)."""
        self.activation_inputs = activation_inputs(example_inputs)
        """AOTAutograd's names of the graph inputs that are activations (may move)."""
        self.size_inputs = size_inputs(example_inputs)
        self.unbounded_sizes = unbounded_sizes(example_inputs)
        """Graph inputs that are sizes with no upper bound: ``{input index: (symbol,
        the size the plan assumes)}`` (:mod:`hyper_offload.passes.fx.sizes`)."""
        self._size_warned = False

    def __repr__(self) -> str:
        state = "unplanned" if self.lowering is None else (
            "floor" if self.lowering.schedule is None else "lowered for the step")
        return f"CompiledRegion({self.index}, {state}, {len(self.variants)} variant(s))"

    # ------------------------------------------------------------------ the lowering in force

    @property
    def planned(self) -> PlannedRegion | None:
        return None if self.lowering is None else self.lowering.planned

    @property
    def graphs(self) -> tuple[fx.GraphModule, fx.GraphModule] | None:
        return None if self.lowering is None else self.lowering.graphs

    @property
    def floor_plan(self) -> GraphPlan | None:
        return None if self.lowering is None else self.lowering.floor

    @property
    def step_schedule(self) -> ResidencySchedule | None:
        return None if self.lowering is None else self.lowering.schedule

    @property
    def recomputes(self) -> bool:
        return self.lowering is not None and self.lowering.recomputes

    def adopt(self, lowering: Lowering, *, new_partition: bool = False) -> None:
        """Run ``lowering`` from now on; ``new_partition``: it lowers another partition than
        the one in force (the variants of the old one are dropped)."""
        if new_partition:
            self.variants = {}
        if self.tiling is not None and lowering.planned.report.tiling is None:
            report = dataclasses.replace(lowering.planned.report, tiling=self.tiling)
            lowering = lowering._replace(planned=dataclasses.replace(lowering.planned,
                                                                     report=report))
        self.variants[lowering.schedule] = lowering
        self.lowering = lowering
        self.compiled = lowering.compiled
        self.collectives = self.collectives or any(
            is_collective(node) for graph in (lowering.graphs or ()) for node in graph.graph.nodes)
        for derived in ("slot_names", "kept_across_bytes"):
            self.__dict__.pop(derived, None)

    # ------------------------------------------------------------------ as the step sees it

    @property
    def where(self) -> str:
        """The region in ``verify``'s errors."""
        return f"compile door, region {self.index}"

    @property
    def static_sizes(self) -> bool:
        """Whether every size of the region's graphs is a number (no symbolic size)."""
        return self.planned is not None and not self.planned.report.sizes

    @property
    def lowerable(self) -> bool:
        """Whether the step plan may lower it again with a schedule of its own: its
        partition is torch's (compiling again reproduces it), its sizes are numbers, and
        no lowering for the step failed."""
        return (self.floor_plan is not None and self.static_sizes and not self.recomputes
                and not self.lowering_failed)

    def step_floor(
        self, sizes: Mapping[str, int] | None = None, *, in_force: bool = False
    ) -> RegionFloor | None:
        """The region as the step plan sees it: the floor of its partition when it may be
        lowered again (and not ``in_force``), else the lowering in force, symbolic
        storages at ``sizes`` (None: the sizes the plan assumes). None for a region never
        planned here."""
        if self.floor_plan is None or self.planned is None:
            return None
        lowerable = self.lowerable and not in_force
        source = self.floor_plan if lowerable else self.planned
        fx_trace = source.fx_trace
        trace = fx_trace.trace
        if sizes and fx_trace.storage_exprs:
            trace = fx_trace.at_sizes(sizes).with_budget(trace.budget_bytes)
        return fx_trace.region_floor(source.schedule, trace=trace, lowerable=lowerable)

    def bucket(self, args: Sequence[Any]) -> Bucket:
        """The sizes of a call of this region with ``args`` (empty for static sizes)."""
        return bucket_of(self.size_inputs, args) if self.size_inputs else ()

    @functools.cached_property
    def kept_across_bytes(self) -> int:
        """Bytes of movable storages the lowering in force keeps from forward to backward
        that its floor would move: measured retained bytes less these are the floor's."""
        floor, schedule = self.floor_plan, self.step_schedule
        if schedule is None or floor is None:
            return 0
        trace, num_fw = floor.fx_trace.trace, floor.fx_trace.num_fw_ops
        copied = {a.storage for _, _, a in schedule.actions() if a.kind is ActionKind.COPY_D2H}
        total = 0
        for storage in frozenset(floor.fx_trace.movable()) - copied:
            ops = [op for op, _ in trace.accesses_of(storage)]
            if ops and ops[0] < num_fw <= ops[-1]:
                total += trace.storage_sizes[storage]
        return total

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

    def op_operands(self, op: str) -> tuple[tuple[str, int], ...]:
        """What trace op ``op`` holds while it runs, by name and bytes (largest first),
        on the floor's plan (the one the step's floor is laid out from); () unknown."""
        plan = self.floor_plan or self.planned
        if plan is None or op not in plan.fx_trace.op_nodes:
            return ()
        return plan.fx_trace.operands(plan.fx_trace.op_nodes.index(op))

    @contextlib.contextmanager
    def compiling_again(self) -> Iterator[None]:
        """The context every later lowering of :attr:`dynamo_graph` runs in: a tracing
        context with Dynamo's fake mode of the first compile (it owns the example inputs,
        so a fake mode active around the call does not clash), no AOTAutograd cache (its
        key cannot tell lowerings or partitions apart, so it would serve the floor's
        graphs), and grad enabled (a training region is compiled as one, whatever mode the
        forward that triggered it ran in). A fresh context, not Dynamo's own: that one
        also counts DDPOptimizer's bucket compiles, which a lowering outside Dynamo's
        compile would throw off."""
        from torch._functorch import config as functorch_config

        tracing = (torch._guards.tracing(torch._guards.TracingContext(self.fake_mode))
                   if self.fake_mode is not None else contextlib.nullcontext())
        with functorch_config.patch(enable_autograd_cache=False), tracing, torch.enable_grad():
            yield

    def check_sizes(self, args: Sequence[Any]) -> None:
        """Warn once if a call's size exceeds what the plan assumed for an unbounded one
        (a smaller size needs fewer bytes under the same plan: no warning)."""
        if self._size_warned:
            return
        for index, (symbol, planned) in self.unbounded_sizes.items():
            if index < len(args) and isinstance(args[index], int) and args[index] > planned:
                self._size_warned = True
                LOGGER.warning(
                    "hyper_offload region %d: planned for %s <= %d (no bound was declared, so "
                    "the plan assumes the size at the compile) but runs with %s=%d; results "
                    "stay exact, resident bytes grow with the size and may exceed the "
                    "budget. Fix: declare the largest size, torch._dynamo.mark_dynamic(tensor, "
                    "dim, min=2, max=N) (a larger size then recompiles and is planned again)",
                    self.index, symbol, planned, symbol, args[index],
                )
                return


def fake_example_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
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
