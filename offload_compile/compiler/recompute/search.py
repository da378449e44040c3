"""Offload and recompute planned together: keep, move or recompute each saved activation.

The search is an outer loop over torch's stock min-cut partitioner with the residency
pipeline inside it. For one region's joint graph:

1. torch's default partition (whatever ``activation_memory_budget`` the user set; plain
   compile runs exactly this) is planned under the budget. If its plan meets the budget
   and the timeline model predicts no stall, it is kept: recomputing only adds compute,
   so nothing can be faster. A budget at or above the peak therefore changes nothing,
   and ``recompute="off"`` always stops here.
2. Otherwise each ``activation_memory_budget`` of :data:`RECOMPUTE_GRID` below the
   user's partitions a fresh deep copy of the joint graph (the partitioner rewrites the
   graph it is given), the partitioner recomputing more the lower the value. Each
   distinct partition is planned by :func:`~..region_plan.plan_graphs` under the *same*
   byte budget (the fraction resolves against the default partition's peak), and priced
   as compute (every op, recomputation included, by the roofline) plus the plan's
   predicted stall.
3. The least predicted step time among the feasible plans wins (ties: the partition
   that recomputes less); with none feasible, the one closest to the budget.

So per saved activation the answer is one of three: kept on the device, offloaded by
the plan, or recomputed by the partition. Why an outer search rather than a trace with
recompute options: the partitioner already knows which ops can be recomputed and how
(views, RNG functionalization, effect tokens, collectives), so every partition it emits
is a graph torch itself would compile, and our planning core stays the one pure
pipeline. ``benchmarks/recompute_mix.py`` measures what the search buys (predicted, on
GPU-priced traces): never slower than either strategy alone and strictly faster on 13
of 24 rows in fp32, and on 12 of 24 in bf16 under Inductor (every row where a plan can
be faster), where the exactness rule below leaves torch's partitions almost nothing to
recompute and the spliced backward (:mod:`.splice`) recomputes exactly.

Exactness (the result must equal plain compile bit for bit: no random op, no collective
recomputed, and under Inductor in low precision only what rounds the same) is
:mod:`.rules`'s; the candidates are built, planned and priced by
:mod:`.candidates`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import fx
from torch._functorch import config as functorch_config

from hyper_offload.passes.fx.cost_model import DeviceThroughput, node_seconds, throughput_for
from hyper_offload.runtime.device import TransferBandwidth

from ..options import BackendOptions
from .candidates import (
    SEARCH_MIN_WORK,
    STEP_SEARCH_MIN_WORK,
    Candidate,
    Partitioner,
    Planner,
    Scorer,
    WorkBound,
    budget_candidates,
    copy_joint,
    partition_report,
    region_score,
    splice_candidates,
)
from .rules import (
    partition_bans, recomputed_nodes, sizing_opaque_inputs, unsizable_inputs,
)
from ..region_plan import GraphPlan, plan_graphs
from ..region_report import RecomputeReport

__all__ = [
    "RECOMPUTE_GRID",
    "PartitionChoice",
    "choose_partition",
    "graph_planner",
    "search_region",
]

RECOMPUTE_GRID = (0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
"""``activation_memory_budget`` values searched (those below the user's setting): the
grid ``benchmarks/recompute_mix.py`` prices torch's recompute-only partitions on, so the
search can always pick the one recompute alone would. Each value costs one partition and
one plan (the demo GPT: 0.4 s + 0.3 s on 2 cores). A coarser grid (0.8, 0.6, 0.5, 0.3,
0.0) was measured and rejected: on aot_eager's Llama-1B graphs at 50% on 16 GB/s the
best recompute-only partition is at 0.2 (145.72 ms) and the search then stopped at
145.78 ms."""


@dataclass(frozen=True)
class PartitionChoice:
    """The chosen partition, its plan, and the report of the search."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    plan: GraphPlan
    report: RecomputeReport


def choose_partition(
    joint: fx.GraphModule,
    partition: Partitioner,
    plan: Planner,
    *,
    mode: str,
    restrict_low_precision: bool,
    grid: Iterable[float] = RECOMPUTE_GRID,
    seconds: Callable[[fx.Node], float] | None = None,
    bounded: bool = True,
    min_work: int = SEARCH_MIN_WORK,
    score: Scorer = region_score,
    reload_gbps: Callable[[fx.GraphModule], float] | None = None,
) -> PartitionChoice:
    """Partition ``joint`` and plan it, searching recompute when it pays (module
    docstring). ``restrict_low_precision``: the inner compiler fuses (Inductor), so
    low-precision values follow the exactness rule (:mod:`.rules`), and
    the spliced backwards of :mod:`.splice` join the search. ``seconds``
    prices one op for ranking splice options (default: the roofline at CPU figures).
    ``bounded``: the search's planning work is bounded
    (:data:`~.candidates.SEARCH_WORK_SHARE` of the default partition's
    :func:`~.candidates.plan_work`, at least ``min_work``), so a region whose
    one plan is costly compiles in about twice the time of an unsearched one (the
    issue-31 bound: HF RWKV at 10% took 5.3x before it), and the same model gets the
    same plan on any machine. ``score`` is the objective every partition is ranked by
    (default: the region's own plan, :func:`~.candidates.region_score`).
    ``reload_gbps``: the link's host-to-device GB/s for a forward graph (default: the
    16 GB/s default link), which decides what a spliced backward holds rather than
    recomputes twice (:func:`~.splice.held_options`)."""
    seconds = seconds or partial(node_seconds, throughput=throughput_for(torch.device("cpu")))
    user_budget = float(functorch_config.activation_memory_budget)
    pristine = copy_joint(joint) if mode == "auto" else None
    fw, bw = partition(joint)  # the original graph: exactly what plain compile partitions
    default_plan = plan(fw, bw, None)
    deadline = WorkBound.after(default_plan, min_work) if bounded else None
    default = Candidate(
        partition_report(user_budget, default_plan, 0, score), fw, bw, default_plan
    )
    if pristine is None or (default.report.feasible and default.report.stall_s <= 0):
        return _unsearched(mode, user_budget, default)
    if unsizable := unsizable_inputs(pristine.graph):
        return _unsearched(mode, user_budget, default, restriction=(
            f"opaque graph input(s) {unsizable}: the partitioner cannot size them, so "
            "recompute is not searched (offload only)"
        ))

    default_recomputed = recomputed_nodes(fw, bw)
    banned, restriction = partition_bans(pristine, default_recomputed, restrict_low_precision)
    budgets = [b for b in grid if b < user_budget]
    with sizing_opaque_inputs(pristine.graph):  # a device mesh input: 0 bytes (.collectives)
        candidates = [
            default,
            *budget_candidates(pristine, partition, plan, default, default_recomputed,
                               budgets, banned, deadline, score),
        ]
        if restriction is not None and (deadline is None or deadline.affords()):
            candidates += splice_candidates(
                pristine, partition, plan, default, user_budget, seconds, deadline, score,
                reload_gbps,
            )
    offload_only_s = default.report.step_s if default.report.feasible else None
    usable = [c for c in candidates if c.plan is not None]
    feasible = [c for c in usable if c.report.feasible]
    if feasible:
        best = min(feasible, key=lambda c: c.report.step_s)  # first (least recompute) on ties
    else:
        best = min(usable, key=lambda c: (c.report.peak_with_plan, c.report.step_s))
    budget = default_plan.budget_bytes
    fits_alone = [c.report.compute_s for c in usable if c.report.peak_without_offload <= budget]
    report = RecomputeReport(
        mode=mode, searched=True, memory_budget=best.report.memory_budget,
        recomputed=best.recomputed, offload_only_s=offload_only_s,
        recompute_only_s=min(fits_alone, default=None), joint_s=best.report.step_s,
        partitions=tuple(c.report for c in candidates), restriction=restriction,
        spliced=best.report.spliced, work_bounded=deadline is not None and deadline.hit,
    )
    assert best.plan is not None
    return PartitionChoice(best.fw, best.bw, best.plan, report)


def _unsearched(
    mode: str, user_budget: float, default: Candidate, restriction: str | None = None
) -> PartitionChoice:
    """Torch's default partition, kept without a search (``restriction``: why not)."""
    assert default.plan is not None
    report = RecomputeReport(
        mode=mode, searched=False, memory_budget=user_budget, recomputed=(),
        offload_only_s=default.report.step_s if default.report.feasible else None,
        recompute_only_s=None, joint_s=default.report.step_s, partitions=(default.report,),
        restriction=restriction,
    )
    return PartitionChoice(default.fw, default.bw, default.plan, report)


def graph_planner(
    *,
    num_fwd_outputs: int,
    options: BackendOptions,
    bandwidth: Callable[[fx.GraphModule], TransferBandwidth],
    region: int,
    throughput: DeviceThroughput | None = None,
    floor: bool = False,
    activation_inputs: frozenset[str] = frozenset(),
) -> Planner:
    """The :data:`~.candidates.Planner` both doors search with: :func:`~..region_plan.plan_graphs`
    with the options, the link ``bandwidth(fw)`` and ``throughput``; with ``floor``,
    every movable saved activation offloaded (``plan_graphs(floor=True)``), graph inputs in
    ``activation_inputs`` included."""
    def plan(fw: fx.GraphModule, bw: fx.GraphModule, budget: int | None) -> GraphPlan:
        return plan_graphs(
            fw, bw, num_fwd_outputs=num_fwd_outputs, options=options,
            bandwidth=bandwidth(fw), region=region, throughput=throughput,
            budget_bytes=budget, floor=floor, activation_inputs=activation_inputs,
        )

    return plan


def search_region(
    joint: fx.GraphModule,
    partition: Partitioner,
    *,
    num_fwd_outputs: int,
    options: BackendOptions,
    bandwidth: Callable[[fx.GraphModule], TransferBandwidth],
    region: int,
    throughput: DeviceThroughput | None = None,
    floor: bool = False,
    activation_inputs: frozenset[str] = frozenset(),
    score: Scorer | None = None,
) -> PartitionChoice:
    """:func:`choose_partition` as both doors call it: partitions planned by
    :func:`graph_planner`, the low-precision rule on under Inductor. ``floor``: the
    step scope's plan, each partition at its floor; without ``score``, torch's partition
    alone (the first lowering: nothing is known of the step yet, and the step plan later
    keeps what fits); with ``score`` (the step scope's re-lowering once the step is
    known, :mod:`..step.lowerings`) the ``recompute`` option's search, every partition
    ranked on the whole step."""
    plan = graph_planner(
        num_fwd_outputs=num_fwd_outputs, options=options, bandwidth=bandwidth,
        region=region, throughput=throughput, floor=floor,
        activation_inputs=activation_inputs,
    )
    device = next(
        (n.meta["val"].device for n in joint.graph.find_nodes(op="placeholder")
         if isinstance(n.meta.get("val"), torch.Tensor)),
        torch.device("cpu"),
    )
    return choose_partition(
        joint, partition, plan, mode="off" if floor and score is None else options.recompute,
        restrict_low_precision=options.inner_compiler == "inductor",
        seconds=partial(node_seconds, throughput=throughput or throughput_for(device)),
        score=score or region_score,
        min_work=SEARCH_MIN_WORK if score is None else STEP_SEARCH_MIN_WORK,
        reload_gbps=lambda fw: bandwidth(fw).h2d_gbps,
    )


