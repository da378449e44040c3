"""The recompute search's candidates: partitions of one joint graph, each planned and
priced under a work bound.

:func:`~.search.choose_partition` ranks what this module produces, beside
torch's default partition:

* :func:`budget_candidates`: torch's own partition at each ``activation_memory_budget``
  of the grid, each distinct one planned (or rejected by :mod:`.rules`);
* :func:`splice_candidates`: the default partition with its cheapest saved activations
  recomputed by the spliced backward (:mod:`.splice`), the option count
  bisected around the best of a few byte shares (:func:`share_counts`,
  :func:`refine_count`).

Every candidate is planned by a :data:`Planner` under the default partition's byte
budget, scored by a :data:`Scorer` (:func:`region_score` by default) into its
:class:`~..region_report.PartitionReport`, and counted against a :class:`WorkBound`:
planning work (trace accesses, :func:`plan_work`), never seconds, so the same model gets
the same search on any machine.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import fx
from torch._functorch import config as functorch_config

from hyper_offload import progress
from hyper_offload.passes.ir.trace import DEFAULT_BANDWIDTH_GBPS

from .rules import random_nodes, recomputed_nodes, unrepeatable
from .splice import (
    held_options,
    inductor_uses_templates,
    recompute_order,
    splice,
    splice_options,
)
from ..region_plan import GraphPlan
from ..region_report import PartitionReport

__all__ = [
    "SEARCH_MIN_WORK",
    "SEARCH_WORK_SHARE",
    "SPLICE_REFINEMENTS",
    "SPLICE_SHARES",
    "STEP_SEARCH_MIN_WORK",
    "Candidate",
    "Partitioner",
    "PlanScore",
    "Planner",
    "Scorer",
    "WorkBound",
    "budget_candidates",
    "copy_joint",
    "partition_report",
    "plan_work",
    "refine_count",
    "region_score",
    "share_counts",
    "splice_candidates",
]

Partitioner = Callable[[fx.GraphModule], tuple[fx.GraphModule, fx.GraphModule]]
"""The stock partition of a joint graph (it may rewrite the graph it is given)."""

Planner = Callable[[fx.GraphModule, fx.GraphModule, "int | None"], GraphPlan]
"""Plans a forward/backward pair under a byte budget (None: the options' budget)."""


class PlanScore(NamedTuple):
    """How the search ranks one planned partition: predicted compute and stall
    (seconds), whether it meets the budget, and its predicted peak (bytes)."""

    compute_s: float
    stall_s: float
    feasible: bool
    peak_bytes: int


Scorer = Callable[[GraphPlan], PlanScore]
"""The search's objective for a planned partition (:func:`region_score` by default; the
step scope prices a region's partition on the whole step, :mod:`..step.lowerings`)."""


def region_score(plan: GraphPlan) -> PlanScore:
    """The region scope's objective: the region's own compute and its plan's stall, and
    whether its plan meets the region's budget."""
    return PlanScore(
        plan.compute_s, plan.predicted_stall_s, plan.feasible, plan.check.peak_resident_bytes
    )


@dataclass(frozen=True)
class Candidate:
    """One partition the search produced: its report, graphs and plan (None: rejected)."""

    report: PartitionReport
    fw: fx.GraphModule
    bw: fx.GraphModule
    plan: GraphPlan | None
    recomputed: tuple[str, ...] = ()


def partition_report(
    memory_budget: float, plan: GraphPlan, recomputed: int, score: Scorer = region_score
) -> PartitionReport:
    """The report of a partition planned as ``plan`` at ``memory_budget`` that recomputes
    ``recomputed`` forward ops, ranked as ``score`` says."""
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
step was seen to stall or miss the budget  (:mod:`..step.lowerings`): enough for the whole
grid and splice search of a 32-layer Llama-3-8B region at 32 K tokens (13 plans, 2.8 M
accesses, one of them 2.0 M: ``benchmarks/peers.py --search``), so the default door
finds what the region scope's unbounded search finds."""


def plan_work(plan: GraphPlan) -> int:
    """The work of planning ``plan``'s partition: its trace's accesses (what the planning
    pipeline's passes walk; its time grows about linearly with them)."""
    return sum(len(op.accesses) for op in plan.fx_trace.trace.ops)


class WorkBound:
    """The search's work bound (:func:`~.search.choose_partition`): the planning work it may still
    spend, and the largest attempt seen so far (the expected cost of the next one).
    ``hit`` says whether the bound stopped the search. Work, never seconds: the same
    search on any machine."""

    def __init__(self, allowance: int, attempt: int) -> None:
        self.allowance, self.attempt, self.spent, self.hit = allowance, attempt, 0, False

    @classmethod
    def after(cls, default: GraphPlan, min_work: int) -> WorkBound:
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
        """Count one attempt's planning work (:func:`plan_work`)."""
        self.spent += work
        self.attempt = max(self.attempt, work)


def _saved_signature(fw: fx.GraphModule) -> tuple[str, ...]:
    """What a partition saves: the names of the forward graph's outputs."""
    (output,) = fw.graph.find_nodes(op="output")
    return tuple(str(a) for a in fx.node.map_arg(output.args[0], lambda n: n.name))


def budget_candidates(
    pristine: fx.GraphModule,
    partition: Partitioner,
    plan: Planner,
    default: Candidate,
    default_recomputed: set[str],
    budgets: list[float],
    banned: frozenset[str],
    deadline: WorkBound | None = None,
    score: Scorer = region_score,
) -> list[Candidate]:
    """Torch's partition at each of ``budgets`` (``banned`` ops marked ``MUST_SAVE``),
    each distinct one planned under the default partition's byte budget, or rejected
    when its backward re-runs a random op the default partition (which recomputes
    ``default_recomputed``) does not."""
    assert default.plan is not None
    byte_budget = default.plan.budget_bytes
    default_random = random_nodes(default_recomputed, default.fw)
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
        random = sorted(random_nodes(set(extra), fw) - default_random)
        if random:
            rejected = PartitionReport(
                memory_budget, 0.0, 0.0, False, 0, 0, 0, len(extra),
                rejected=f"recomputes random op(s) {', '.join(random)} without replaying "
                         "their RNG state",
            )
            found.append(Candidate(rejected, fw, bw, None, extra))
            continue
        planned = plan(fw, bw, byte_budget)
        found.append(Candidate(partition_report(memory_budget, planned, len(extra), score),
                               fw, bw, planned, extra))
        if deadline is not None:
            deadline.record(plan_work(planned))
    return found


SPLICE_SHARES = (0.125, 0.25, 0.5, 0.75, 1.0)
"""Shares of the splice options' bytes (cheapest recompute first) the search tries
first: one spliced backward and one plan each, the whole first: where even every option
does not fit the budget, no share does (recomputing more keeps fewer bytes, op by op),
and the search tries only the last resort (:func:`splice_candidates`)."""

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


def splice_candidates(
    pristine: fx.GraphModule,
    partition: Partitioner,
    plan: Planner,
    default: Candidate,
    user_budget: float,
    seconds: Callable[[fx.Node], float],
    deadline: WorkBound | None = None,
    score: Scorer = region_score,
    reload_gbps: Callable[[fx.GraphModule], float] | None = None,
) -> list[Candidate]:
    """The default partition with its cheapest saved activations recomputed by the
    spliced backward (:mod:`.splice`, exact in low precision under Inductor):
    the counts covering each of :data:`SPLICE_SHARES` (every option first: where that
    does not fit, only the last resort follows), then up to :data:`SPLICE_REFINEMENTS`
    counts around the best of them, each planned under the default partition's byte
    budget. Values that cost more to recompute than to reload are held
    (:func:`~.splice.held_options`); where no count fits, the last resort
    recomputes every option with a stage barrier at the op where that peaks (nothing
    recomputed before it alive there). The recompute chains come from torch's
    ``activation_memory_budget=0`` partition."""
    assert default.plan is not None
    byte_budget = default.plan.budget_bytes
    with functorch_config.patch(activation_memory_budget=0.0):
        _, zero_bw = partition(copy_joint(pristine))
    options = recompute_order(splice_options(
        default.fw, default.bw, zero_bw, unrepeatable=unrepeatable, seconds=seconds,
        templates=inductor_uses_templates(),
    ))
    built: dict[tuple[int, str], Candidate] = {}
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
            partition_report(user_budget, planned, len(ops), score), spliced=count,
        )
        built[count, barrier or ""] = Candidate(report, fw, bw, planned, ops)
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


def _backward_peak(candidate: Candidate | None) -> str | None:
    """The backward node at which ``candidate``'s plan peaks (None: none, or a forward
    op)."""
    if candidate is None or candidate.plan is None:
        return None
    resident = candidate.plan.check.resident_bytes
    op = candidate.plan.fx_trace.op_nodes[max(range(len(resident)), key=resident.__getitem__)]
    return op.removeprefix("bw:") if op.startswith("bw:") else None
