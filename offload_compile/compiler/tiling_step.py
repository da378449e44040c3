"""Sequence tiling chosen on the step (``tile_sequence="auto"``, ``budget_scope="step"``).

A region's tiling is first chosen at its compile, from its own floor (:mod:`.tiling`).
The step's floor at an op of the region is that op's bytes plus what the rest of the step
holds there, and a region the step's recompute search lowered again recomputes in its
backward (a larger working set): the step plan can be over the budget at a token-wise op
of a region whose own floor was under it (Llama-3-8B at 224K tokens per rank: 70.9 GiB
at the MLP's ``silu`` backward after the search, for a 63.3 GiB budget). Then the step
asks that region to be tiled again (:func:`request_retiling`), once, from its untiled
Dynamo graph, for the floor the step needs there: its own floor less the step's excess,
the spans that set it tiled even where torch's partition alone would fit it (the step
asked because the lowering it wants does not). Before the next step's first forward the
region is compiled from the tiled graph at its floor, with torch's partition
(:func:`retile`), then the recompute search, asked at the same step's end, may search the
tiled graph (the region counts as not searched yet), and the step is planned again. A
failure keeps the lowering in force (exact, untiled or as first tiled).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from hyper_offload.passes import required_bytes
from hyper_offload.passes.fx.cost_model import DeviceThroughput

from .options import BackendOptions
from .region_report import LOGGER
from .region_state import CompiledRegion, Lowering
from .step_plan import StepPlan
from .tiling import tile_region

__all__ = ["request_retiling", "retile"]

Compile = Callable[[fx.GraphModule, Sequence[Any], Any], Callable[..., Any]]
"""The backend's compile of a region's Dynamo graph: ``(gm, example_inputs, plan_key)``."""


def request_retiling(plan: StepPlan, regions: Sequence[CompiledRegion],
                     options: BackendOptions) -> bool:
    """Ask the region whose op sets ``plan``'s floor over its budget to be tiled again
    (module docstring); whether one was asked. Called at a step's end with the plan in
    force (made when the last lowerings were) and with the plan made for that step."""
    op = plan.floor_op
    if (options.tile_sequence != "auto" or op is None or op.region is None
            or plan.floor_peak_bytes <= plan.budget_bytes):
        return False
    region = regions[op.region]
    if (region.untiled is None or region.retiled or region.retile_target is not None
            or region.planned is None):
        return False
    own = max(required_bytes(region.planned.fx_trace.trace), default=0)
    region.retile_target = max(own - (plan.floor_peak_bytes - plan.budget_bytes), 0)
    region.relowered = False  # the recompute search may search the tiled graph
    LOGGER.info("hyper_offload region %d: the step's floor is over its budget at %s; tiling "
                "the region again for a floor of %d B", region.index, op.op,
                region.retile_target)
    return True


def retile(region: CompiledRegion, compile: Compile, options: BackendOptions,
           throughput: DeviceThroughput | None) -> bool:
    """Tile ``region`` for the floor the step asked for and compile it (module
    docstring). Whether the region changed."""
    target, region.retile_target, region.retiled = region.retile_target, None, True
    assert region.untiled is not None and target is not None
    before = (Lowering(region.compiled, region.planned, region.graphs), region.step_schedule,
              region.floor_plan, region.dynamo_graph, region.tiling, region.variants)
    try:
        with region.compiling_again():
            gm, report = tile_region(region.untiled, options, throughput=throughput,
                                     target=target)
            if not report.tiled:
                LOGGER.info("hyper_offload region %d: not tiled again (%s)", region.index,
                            report.stopped)
                return False
            region.tiling, region.dynamo_graph = report, (gm, region.untiled.inputs)
            region.planned = None  # the lowering about to be compiled reports the new tiling
            compiled = compile(gm, region.untiled.inputs, None)
        assert region.planned is not None
        region.variants = {}  # another graph: the earlier lowerings are not its
        region.adopt(Lowering(compiled, region.planned, region.graphs), None)
        region.lowering_requested = None  # a schedule made for the graphs before
        LOGGER.info("hyper_offload region %d tiled again for the step: %s", region.index, report)
        return True
    except Exception as error:  # an optimisation failed: the lowering in force runs
        LOGGER.warning(
            "hyper_offload region %d: tiling it again for the step failed (%s: %s); it keeps "
            "the lowering it runs. Fix: report it, or pass tile_sequence=N or 'off'",
            region.index, type(error).__name__, error)
        lowering, schedule, region.floor_plan, region.dynamo_graph, region.tiling, variants = before
        region.adopt(lowering, schedule)
        region.variants = variants
        return False
