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
   distinct partition is planned by :func:`~.region_plan.plan_graphs` under the *same*
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
recompute and the spliced backward (:mod:`.recompute_splice`) recomputes exactly.

Exactness (the result must equal plain compile bit for bit):

* **Random ops** are never recomputed: the partitioner bans them, and a partition whose
  backward re-runs a seeded random op that the default partition does not is rejected
  (its RNG state would not be replayed).
* **Collectives** (tensor parallel) are never recomputed: the search marks them
  ``MUST_SAVE`` and no spliced chain contains one (:mod:`.collectives`: each rank ranks
  partitions by its own measurements, and a recomputed all-reduce on one rank is a
  collective the others never run). A device mesh among the graph's inputs is sized
  0 bytes for the partitioner; another opaque input turns the search off for the region.
* **Low precision under Inductor.** Inductor keeps a fused intermediate in fp32 and
  rounds it to bf16/fp16 only where it is stored, so a value recomputed inside a
  backward kernel can differ from the stored one (``benchmarks/recompute_exactness.py``:
  16 of 17 values differ at budget 0). When the forward has low-precision values and the
  inner compiler is Inductor, the search only lets the partitioner recompute, beyond
  what the default partition recomputes, values whose arithmetic is the same wherever
  it runs: not low precision themselves, and reading low-precision values only from
  buffers every kernel reads from memory (graph inputs, extern matmul/convolution
  results). Every other forward op is marked ``MUST_SAVE`` on the copy the search
  partitions (``RecomputeReport.restriction`` says how many).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch import fx
from torch._functorch import config as functorch_config

from hyper_offload import progress
from hyper_offload.passes.fx.cost_model import DeviceThroughput, node_seconds, throughput_for
from hyper_offload.passes.ir.trace import DEFAULT_BANDWIDTH_GBPS
from hyper_offload.runtime.device import TransferBandwidth

from .collectives import is_collective, sizing_opaque_inputs, unsizable_inputs
from .options import BackendOptions
from .recompute_splice import (
    EXTERN_MATMULS,
    held_options,
    inductor_uses_templates,
    recompute_order,
    splice,
    splice_options,
)
from .region_plan import GraphPlan, plan_graphs
from .region_report import PartitionReport, RecomputeReport

__all__ = [
    "RECOMPUTE_GRID",
    "SPLICE_REFINEMENTS",
    "SPLICE_SHARES",
    "SEARCH_MIN_WORK",
    "SEARCH_WORK_SHARE",
    "STEP_SEARCH_MIN_WORK",
    "PartitionChoice",
    "PlanScore",
    "Scorer",
    "choose_partition",
    "copy_joint",
    "draws_random",
    "graph_planner",
    "plan_work",
    "low_precision_bans",
    "recomputed_nodes",
    "refine_count",
    "region_score",
    "search_region",
    "share_counts",
    "uses_low_precision",
]

RECOMPUTE_GRID = (0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
"""``activation_memory_budget`` values searched (those below the user's setting): the
grid ``benchmarks/recompute_mix.py`` prices torch's recompute-only partitions on, so the
search can always pick the one recompute alone would. Each value costs one partition and
one plan (the demo GPT: 0.4 s + 0.3 s on 2 cores). A coarser grid (0.8, 0.6, 0.5, 0.3,
0.0) was measured and rejected: on aot_eager's Llama-1B graphs at 50% on 16 GB/s the
best recompute-only partition is at 0.2 (145.72 ms) and the search then stopped at
145.78 ms."""

_LOW_PRECISION = (torch.bfloat16, torch.float16)

Partitioner = Callable[[fx.GraphModule], tuple[fx.GraphModule, fx.GraphModule]]
"""The stock partition of a joint graph (it may rewrite the graph it is given)."""


class PlanScore(NamedTuple):
    """How the search ranks one planned partition: predicted compute and stall
    (seconds), whether it meets the budget, and its predicted peak (bytes)."""

    compute_s: float
    stall_s: float
    feasible: bool
    peak_bytes: int


Scorer = Callable[[GraphPlan], PlanScore]
"""The search's objective for a planned partition (:func:`region_score` by default; the
step scope prices a region's partition on the whole step, :mod:`.step.lowerings`)."""


def region_score(plan: GraphPlan) -> PlanScore:
    """The region scope's objective: the region's own compute and its plan's stall, and
    whether its plan meets the region's budget."""
    return PlanScore(
        plan.compute_s, plan.predicted_stall_s, plan.feasible, plan.check.peak_resident_bytes
    )
Planner = Callable[[fx.GraphModule, fx.GraphModule, "int | None"], GraphPlan]
"""Plans a forward/backward pair under a byte budget (None: the options' budget)."""


SEARCH_WORK_SHARE = 1.0
"""The recompute search's work bound, as a share of the default partition's planning
work (:func:`plan_work`): with :data:`SEARCH_MIN_WORK`, and the rule that an attempt
starts only when the largest attempt so far would still fit, a region whose one plan is
costly (HF RWKV, 2 layers: 1.1 M accesses, ~40 s a plan) searches about one more
partition, as the earlier time bound let it, and a usual one its whole grid.
Measured: ``benchmarks/search_bound.py`` (docs/benchmarks.md)."""

SEARCH_MIN_WORK = 2_000_000
"""Planning work (trace accesses) the region scope's search may always spend. It runs at
every compile of every region, before anything is known of the step, so it stays close to
what the earlier time bound allowed: HF RWKV (1.1 M accesses a plan, ~40 s) searches about one
more partition. Work, not seconds: the same model gets the same search, and so the same
plan, on any machine under any load (a time bound stopped the step's search after one
partition on every 4- and 32-layer Llama case)."""

STEP_SEARCH_MIN_WORK = 8_000_000
"""The same for the default step scope's search, which runs once per region, after a
step was seen to stall or miss the budget  (:mod:`.step.lowerings`): enough for the whole
grid and splice search of a 32-layer Llama-3-8B region at 32 K tokens (13 plans, 2.8 M
accesses, one of them 2.0 M: ``benchmarks/peers.py --search``), so the default door
finds what the region scope's unbounded search finds."""


def plan_work(plan: GraphPlan) -> int:
    """The work of planning ``plan``'s partition: its trace's accesses (what the planning
    pipeline's passes walk; its time grows about linearly with them)."""
    return sum(len(op.accesses) for op in plan.fx_trace.trace.ops)


@dataclass(frozen=True)
class PartitionChoice:
    """The chosen partition, its plan, and the report of the search."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    plan: GraphPlan
    report: RecomputeReport


@dataclass(frozen=True)
class _Candidate:
    """One partition the search produced: its report, graphs and plan (None: rejected)."""

    report: PartitionReport
    fw: fx.GraphModule
    bw: fx.GraphModule
    plan: GraphPlan | None
    recomputed: tuple[str, ...] = ()


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
    low-precision values follow the exactness rule above, and the spliced backwards of
    :mod:`.recompute_splice` join the search. ``seconds`` prices one op for ranking
    splice options (default: the roofline at CPU figures). ``bounded``: the search's
    planning work is bounded (:data:`SEARCH_WORK_SHARE` of the default partition's
    :func:`plan_work`, at least ``min_work``), so a region whose one plan is costly
    compiles in about twice the time of an unsearched one (the issue-31 bound: HF RWKV at
    10% took 5.3x before it), and the same model gets the same plan on any machine.
    ``score`` is the objective every partition is ranked by (default: the region's own
    plan, :func:`region_score`). ``reload_gbps``: the link's host-to-device GB/s for a
    forward graph (default: the 16 GB/s default link), which decides what a spliced
    backward holds rather than recomputes twice (:func:`~.recompute_splice.held_options`)."""
    seconds = seconds or partial(node_seconds, throughput=throughput_for(torch.device("cpu")))
    user_budget = float(functorch_config.activation_memory_budget)
    pristine = copy_joint(joint) if mode == "auto" else None
    fw, bw = partition(joint)  # the original graph: exactly what plain compile partitions
    default_plan = plan(fw, bw, None)
    deadline = _WorkBound.after(default_plan, min_work) if bounded else None
    default = _Candidate(
        _partition_report(user_budget, default_plan, 0, score), fw, bw, default_plan
    )
    if pristine is None or (default.report.feasible and default.report.stall_s <= 0):
        return _unsearched(mode, user_budget, default)
    if unsizable := unsizable_inputs(pristine.graph):
        return _unsearched(mode, user_budget, default, restriction=(
            f"opaque graph input(s) {unsizable}: the partitioner cannot size them, so "
            "recompute is not searched (offload only)"
        ))

    default_recomputed = recomputed_nodes(fw, bw)
    banned, restriction = _bans(pristine, default_recomputed, restrict_low_precision)
    budgets = [b for b in grid if b < user_budget]
    with sizing_opaque_inputs(pristine.graph):  # a device mesh input: 0 bytes (.collectives)
        candidates = [
            default,
            *_search(pristine, partition, plan, default, default_recomputed, budgets, banned,
                     deadline, score),
        ]
        if restriction is not None and (deadline is None or deadline.affords()):
            candidates += _splice_search(
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


def _bans(
    pristine: fx.GraphModule, default_recomputed: set[str], restrict_low_precision: bool
) -> tuple[frozenset[str], str | None]:
    """Forward ops the search's partitions must save, and the exactness rule that limited
    it (None: none did). Collectives always (:mod:`.collectives`); under Inductor in low
    precision, what the rule in the module docstring bans."""
    banned = frozenset(n.name for n in pristine.graph.nodes if is_collective(n))
    if not (restrict_low_precision and uses_low_precision(pristine)):
        return banned, None
    low_precision = low_precision_bans(pristine, default_recomputed)
    return banned | low_precision, (
        f"low precision under Inductor: {len(low_precision)} forward op(s) kept from "
        "torch's recompute (a fused recomputation may round differently); the spliced "
        "backward recomputes exactly"
    )


def _unsearched(
    mode: str, user_budget: float, default: _Candidate, restriction: str | None = None
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


def _search(
    pristine: fx.GraphModule,
    partition: Partitioner,
    plan: Planner,
    default: _Candidate,
    default_recomputed: set[str],
    budgets: list[float],
    banned: frozenset[str],
    deadline: _WorkBound | None = None,
    score: Scorer = region_score,
) -> list[_Candidate]:
    """Torch's partition at each of ``budgets`` (``banned`` ops marked ``MUST_SAVE``),
    each distinct one planned under the default partition's byte budget, or rejected
    when its backward re-runs a random op the default partition (which recomputes
    ``default_recomputed``) does not."""
    assert default.plan is not None
    byte_budget = default.plan.budget_bytes
    default_random = _random_nodes(default_recomputed, default.fw)
    seen = {_saved_signature(default.fw)}
    found = []
    for number, memory_budget in enumerate(budgets, 1):
        progress.note(f"recompute search: partition {number}/{len(budgets)}")
        if deadline is not None and not deadline.affords():
            break  # the work bound (choose_partition): keep what was found so far
        graph = copy_joint(pristine)
        for node in graph.graph.nodes:
            if node.name in banned:
                node.meta["recompute"] = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
        with functorch_config.patch(activation_memory_budget=memory_budget):
            fw, bw = partition(graph)
        signature = _saved_signature(fw)
        if signature in seen:
            continue  # the same partition as a larger budget's: nothing new to plan
        seen.add(signature)
        extra = tuple(sorted(recomputed_nodes(fw, bw) - default_recomputed))
        random = sorted(_random_nodes(set(extra), fw) - default_random)
        if random:
            rejected = PartitionReport(
                memory_budget, 0.0, 0.0, False, 0, 0, 0, len(extra),
                rejected=f"recomputes random op(s) {', '.join(random)} without replaying "
                         "their RNG state",
            )
            found.append(_Candidate(rejected, fw, bw, None, extra))
            continue
        planned = plan(fw, bw, byte_budget)
        found.append(_Candidate(_partition_report(memory_budget, planned, len(extra), score),
                                fw, bw, planned, extra))
        if deadline is not None:
            deadline.record(plan_work(planned))
    return found


class _WorkBound:
    """The search's work bound (:func:`choose_partition`): the planning work it may still
    spend, and the largest attempt seen so far (the expected cost of the next one).
    ``hit`` says whether the bound stopped the search. Work, never seconds: the same
    search on any machine."""

    def __init__(self, allowance: int, attempt: int) -> None:
        self.allowance, self.attempt, self.spent, self.hit = allowance, attempt, 0, False

    @classmethod
    def after(cls, default: GraphPlan, min_work: int) -> _WorkBound:
        """The bound once the default partition is planned: :data:`SEARCH_WORK_SHARE` of
        its work, never under ``min_work``; one more partition costs about what the
        largest so far did, and starts only if it is expected to fit."""
        work = plan_work(default)
        return cls(max(int(SEARCH_WORK_SHARE * work), min_work), attempt=work)

    def affords(self) -> bool:
        """Whether one more attempt is expected to fit the bound."""
        if self.spent + self.attempt > self.allowance:
            self.hit = True
        return not self.hit

    def record(self, work: int) -> None:
        self.spent += work
        self.attempt = max(self.attempt, work)


SPLICE_SHARES = (0.125, 0.25, 0.5, 0.75, 1.0)
"""Shares of the splice options' bytes (cheapest recompute first) the search tries
first: one spliced backward and one plan each, the whole first: where even every option
does not fit the budget, no share does (recomputing more keeps fewer bytes, op by op),
and the search tries only the last resort (:func:`_splice_search`)."""

SPLICE_REFINEMENTS = 6
"""Further spliced backwards the search may plan, bisecting the option count between
the best share's neighbours (:func:`refine_count`). Measured
(``benchmarks/recompute_mix.py``, bf16 Inductor): the shares alone left the Llama-7B
row at 70% on 16 GB/s at 110.42 ms, above torch's (inexact) recompute only at
107.85 ms; the best count lies between two shares."""


def share_counts(sizes: Sequence[int], shares: Iterable[float] = SPLICE_SHARES) -> list[int]:
    """For each share, the fewest leading options (``sizes``: their bytes, in the
    order they would be recomputed) whose bytes cover it; each count once, ascending."""
    total, counts = sum(sizes), set()
    for share in shares:
        count, covered = 0, 0
        while count < len(sizes) and covered < share * total:
            covered += sizes[count]
            count += 1
        if count:
            counts.add(count)
    return sorted(counts)


def refine_count(
    scores: Mapping[int, float], price: Callable[[int], float], *, limit: int
) -> dict[int, float]:
    """``scores`` (option count -> predicted step; ``inf``: infeasible) with at most
    ``limit`` more counts priced: each round prices the midpoints between the best
    count and its nearest priced neighbours, so on a step time that falls and then
    rises with the count (less stall, more recompute) the bracket around the best
    halves every round. Nothing is priced while no count is feasible."""
    scores = dict(scores)
    priced = 0
    while priced < limit:
        best = min(scores, key=lambda c: (scores[c], c))
        if math.isinf(scores[best]):
            break
        below = max((c for c in scores if c < best), default=best)
        above = min((c for c in scores if c > best), default=best)
        probes = [m for m in ((below + best) // 2, (best + above + 1) // 2) if m not in scores]
        if not probes:
            break
        for count in probes[: limit - priced]:
            scores[count] = price(count)
            priced += 1
    return scores


def _splice_search(
    pristine: fx.GraphModule,
    partition: Partitioner,
    plan: Planner,
    default: _Candidate,
    user_budget: float,
    seconds: Callable[[fx.Node], float],
    deadline: _WorkBound | None = None,
    score: Scorer = region_score,
    reload_gbps: Callable[[fx.GraphModule], float] | None = None,
) -> list[_Candidate]:
    """The default partition with its cheapest saved activations recomputed by the
    spliced backward (:mod:`.recompute_splice`, exact in low precision under Inductor):
    the counts covering each of :data:`SPLICE_SHARES` (every option first: where that
    does not fit, only the last resort follows), then up to :data:`SPLICE_REFINEMENTS`
    counts around the best of them, each planned under the default partition's byte
    budget. Values that cost more to recompute than to reload are held
    (:func:`~.recompute_splice.held_options`); where no count fits, the last resort
    recomputes every option with a stage barrier at the op where that peaks (nothing
    recomputed before it alive there). The recompute chains come from torch's
    ``activation_memory_budget=0`` partition."""
    assert default.plan is not None
    byte_budget = default.plan.budget_bytes
    with functorch_config.patch(activation_memory_budget=0.0):
        _, zero_bw = partition(copy_joint(pristine))
    options = recompute_order(splice_options(
        default.fw, default.bw, zero_bw, unrepeatable=_unrepeatable, seconds=seconds,
        templates=inductor_uses_templates(),
    ))
    built: dict[tuple[int, str], _Candidate] = {}
    held = held_options(options, DEFAULT_BANDWIDTH_GBPS if reload_gbps is None
                        else reload_gbps(default.fw))

    def price(count: int, barrier: str | None = None) -> float:
        if deadline is not None and not deadline.affords():
            return math.inf  # past the work bound: not built, not a candidate
        chosen = options[:count]
        fw, bw = splice(default.fw, default.bw, zero_bw, chosen, held,
                        barriers=None if barrier is None else {barrier})
        planned = plan(fw, bw, byte_budget)
        ops = tuple(sorted({name for option in chosen for name in option.chain}))
        report = dataclasses.replace(
            _partition_report(user_budget, planned, len(ops), score), spliced=count,
        )
        built[count, barrier or ""] = _Candidate(report, fw, bw, planned, ops)
        if deadline is not None:
            deadline.record(plan_work(planned))
        return report.step_s if report.feasible else math.inf

    # count 0 is the default partition itself: priced already, a bound for the bisection
    scores = {0: default.report.step_s if default.report.feasible else math.inf}
    counts = share_counts([o.nbytes for o in options])
    if counts:  # every option first: where even that does not fit, no fewer will
        scores[counts[-1]] = price(counts[-1])
    if any(not math.isinf(v) for v in scores.values()):
        scores |= {count: price(count) for count in counts[:-1]}
        refine_count(scores, price, limit=SPLICE_REFINEMENTS)  # each priced lands in built
    elif (peak := _backward_peak(built.get((counts[-1], ""))) if counts else None):
        # Nothing fits. The last resort: no recomputed value alive where every option
        # recomputed peaks (a held attention output made early for the MLP's chains is
        # recomputed once more after it: compute for memory; 8B x 256K fits so)
        price(counts[-1], barrier=peak)
    return [built[key] for key in sorted(built)]


def _backward_peak(candidate: _Candidate | None) -> str | None:
    """The backward node at which ``candidate``'s plan peaks (None: none, or a forward
    op)."""
    if candidate is None or candidate.plan is None:
        return None
    resident = candidate.plan.check.resident_bytes
    op = candidate.plan.fx_trace.op_nodes[max(range(len(resident)), key=resident.__getitem__)]
    return op.removeprefix("bw:") if op.startswith("bw:") else None


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
    """The :data:`Planner` both doors search with: :func:`~.region_plan.plan_graphs`
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
    known, :mod:`.step.lowerings`) the ``recompute`` option's search, every partition
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


_LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def copy_joint(joint: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``joint`` the partitioner may rewrite: new graph, nodes and node meta
    dicts (names kept); the meta values (fake tensors) and the module's attributes
    (parameters, constants) are shared, as the partitioner only reads them. (A deep
    copy would clone real constant tensors, which fails under fake mode.)"""
    with warnings.catch_warnings():
        # torch's Graph.__deepcopy__ deep-copies the graph's pytree codegen, and copying its
        # LeafSpec calls LeafSpec.__new__, which torch 2.13 deprecated: a FutureWarning
        # "from copyreg" at every compile (issue 30). The copy itself is right (an equal
        # spec); only that one warning is silenced, and only here.
        warnings.filterwarnings("ignore", message=_LEAFSPEC_DEPRECATION, category=FutureWarning)
        graph = copy.deepcopy(joint.graph)
    duplicate = fx.GraphModule(joint, graph, class_name=type(joint).__name__)
    duplicate.meta = dict(joint.meta)
    return duplicate


def _partition_report(
    memory_budget: float, plan: GraphPlan, recomputed: int, score: Scorer = region_score
) -> PartitionReport:
    scored = score(plan)
    return PartitionReport(
        memory_budget=memory_budget,
        compute_s=scored.compute_s,
        stall_s=scored.stall_s,
        feasible=scored.feasible,
        peak_without_offload=plan.fx_trace.peak_without_offload,
        peak_with_plan=scored.peak_bytes,
        bytes_d2h=plan.check.bytes_d2h,
        recomputed=recomputed,
    )


def _saved_signature(fw: fx.GraphModule) -> tuple[str, ...]:
    """What a partition saves: the names of the forward graph's outputs."""
    (output,) = fw.graph.find_nodes(op="output")
    return tuple(str(a) for a in fx.node.map_arg(output.args[0], lambda n: n.name))


def recomputed_nodes(fw: fx.GraphModule, bw: fx.GraphModule) -> set[str]:
    """Forward ops the backward runs again: ``call_function`` nodes in both graphs (the
    partitioner copies nodes by name)."""
    forward = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    return {
        n.name for n in bw.graph.nodes if n.op == "call_function" and n.name in forward
    }


def _random_nodes(names: set[str], fw: fx.GraphModule) -> set[str]:
    """Those of ``names`` whose op draws random numbers: a seeded, nondeterministic op,
    except an attention kernel called with ``dropout_p == 0`` (it draws nothing)."""
    return {n.name for n in fw.graph.nodes if n.name in names and draws_random(n)}


def _unrepeatable(node: fx.Node) -> bool:
    """An op a recompute chain must not re-run: its result would differ (a random draw)
    or other ranks would not run it with this one (a collective)."""
    return draws_random(node) or is_collective(node)


def draws_random(node: fx.Node) -> bool:
    """Whether running ``node`` again would draw fresh random numbers."""
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    schema = getattr(target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" in names:
        index = names.index("dropout_p")
        value = node.kwargs.get("dropout_p", node.args[index] if index < len(node.args)
                                else schema.arguments[index].default_value)
        return value != 0
    return True


def _forward_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """The joint graph's forward ops: ``call_function`` nodes no tangent reaches."""
    backward: set[fx.Node] = set()
    forward = []
    for node in joint.graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            backward.add(node)
        elif node.op == "call_function":
            if any(i in backward for i in node.all_input_nodes):
                backward.add(node)
            else:
                forward.append(node)
    return forward


def _dtype(node: fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def uses_low_precision(joint: fx.GraphModule) -> bool:
    """Whether any forward op produces a bf16 or fp16 tensor."""
    return any(_dtype(n) in _LOW_PRECISION for n in _forward_nodes(joint))


def _stored(node: fx.Node, *, templates: bool) -> bool:
    """Whether every kernel reads ``node``'s value from memory, rounded to its dtype
    (``templates``: max-autotune's matmul templates, which may fuse their consumers)."""
    if node.op == "placeholder":
        return True
    return not templates and node.op == "call_function" and node.target in EXTERN_MATMULS


def low_precision_bans(joint: fx.GraphModule, default_recomputed: set[str]) -> frozenset[str]:
    """Forward ops (by name) whose recomputation under Inductor may not reproduce the
    value the forward used: a low-precision result, or arithmetic on a low-precision
    value that was not read from memory. Views and tuple items compute nothing and are
    not banned; nor is what the default partition already recomputes (plain compile
    does the same)."""
    templates = inductor_uses_templates()
    banned = set()
    for node in _forward_nodes(joint):
        if node.name in default_recomputed or node.target is operator.getitem:
            continue
        if _is_view(node):
            continue
        low_result = _dtype(node) in _LOW_PRECISION
        fused_low_input = any(
            _dtype(i) in _LOW_PRECISION and not _stored(i, templates=templates)
            for i in node.all_input_nodes
        )
        if low_result or fused_low_input:
            banned.add(node.name)
    return frozenset(banned)


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
