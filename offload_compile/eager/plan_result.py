"""``WarmupResult``: an eager plan (trace, schedule, report, op callables) and the pure
helpers that make one: planning a warmup's trace (:func:`plan_step`), re-planning it for
other sizes (:func:`replan`), and the per-op tables the replay reads on its hot path.

Every eager plan's trace ends with the step-end op
(:func:`~hyper_offload.passes.ir.trace.with_step_end`): the replay runs its actions
after the model's last op, so a retained storage may leave the device in its last gap.

What an opaque region keeps for its backward, which the session cannot move.

A ``torch.compile``d module (or a ``skip_offload`` function) runs as one virtual op: the
activations its own ops save for the backward are created inside it, where nothing is
traced, and stay on the device until the region's backward. The session cannot plan
them, but it must count them: they share the device with what it plans (left
out, a plan reads feasible and is not). :func:`region_saved_bytes` reads them from
autograd's graph at the end of the region's forward (the nodes the region created: from its
outputs back to its start), the way :mod:`hyper_offload.runtime.saved_bytes` reads a
compiled step. The warmup records them as one *held* storage of that size, written by the
region's forward op, read by every op up to its backward op (so no plan has a gap to move it
in) and released after it; the replay counts the same bytes at the same ops.

Not counted: the region's inputs and the parameters whose gradients it accumulates
(they exist before the region), storages the session tracks (planned already), host
copies (a region compiled
with the ``hyper_offload`` backend offloads its own saved activations under its own
budget: what it keeps on the device is counted here, what it moved is not).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch

from hyper_offload.runtime.saved_bytes import any_node_saved_tensors, inner_tensors
from hyper_offload.config import MIB
from hyper_offload.passes.analysis.validator import ScheduleReport
from hyper_offload.passes.ir.schedule import ResidencySchedule
from hyper_offload.passes.ir.trace import (
    ActivationTrace, StorageId, TraceOp, has_step_end, with_step_end,
)
from hyper_offload.passes.plan.planning import PlannedSchedule, PlanningError, plan_residency
from hyper_offload.passes.plan.report import ResidencyPlanner
from hyper_offload.runtime.memory_meter import is_host_labelled

from .executor_base import ACCUMULATE_GRAD, OffloadBudgetWarning, OffloadSessionError

__all__ = [
    "WarmupResult",
    "first_outputs_only",
    "hand_back",
    "plan_step",
    "plan_warmup",
    "region_saved_bytes",
    "refuse_swap_step",
    "replan",
    "warmup_trace",
]


class WarmupResult:
    """What a warmup step produced: the trace, the plan, its report, and the callables
    of every op (identity-compared on replay's hot path).

    ``schedule`` is :func:`~hyper_offload.passes.plan_residency`'s (prefetches placed,
    earliest op 0) and ``report == check_schedule(trace, schedule)``, without violations.
    """

    def __init__(
        self,
        trace: ActivationTrace,
        schedule: ResidencySchedule,
        report: ScheduleReport,
        funcs: list[Any],
        comm_buffers: frozenset[StorageId] = frozenset(),
        pins: Mapping[int, tuple[StorageId, ...]] | None = None,
        foreign: frozenset[StorageId] = frozenset(),
        virtual: Mapping[StorageId, int] | None = None,
    ) -> None:
        self.trace = trace
        self.schedule = schedule
        self.report = report
        self.funcs = funcs
        self.comm_buffers = comm_buffers
        """Storages a functional collective read or wrote (tensor parallel)."""
        self.pins: Mapping[int, tuple[StorageId, ...]] = pins or {}
        """Op index -> the storages a ``Work``-returning op pinned there (from that op to
        the end of the step: :mod:`hyper_offload.passes.ir.trace_op`)."""
        self.foreign = foreign
        """FSDP's buffers (``fsdp::`` ops): 0 bytes in the trace, never bound."""
        self.virtual: Mapping[StorageId, int] = virtual or {}
        """What opaque regions keep for their backward (:mod:`.plan_result`): id ->
        bytes. No storage: the replay counts them and runs no action on them."""
        self.replay_pre, self.replay_post, self.virtual_delta = _virtual_replay(
            trace, schedule, self.virtual)
        ops = trace.ops[:-1] if has_step_end(trace) else trace.ops
        self.hand_back = hand_back(ops, set().union(*pins.values()) if pins else set())
        """``ACCUMULATE_GRAD`` op index -> the incoming gradients it read for the last
        time (retained: never released by the plan): the replay hands them back to
        autograd there (unbinds them: ``.grad`` keeps one, or it dies)."""


def plan_step(
    trace: ActivationTrace,
    planner: ResidencyPlanner,
    *,
    where: str,
    host_budget_bytes: int | None = None,
    measured_peak: int | None = None,
) -> PlannedSchedule:
    """Plan an eager step's trace through the shared pipeline (reloads may start at op
    0: the step is one timeline). ``measured_peak``: the most resident bytes the warmup
    step itself reached; where the plan would peak above it (the warmup met a budget the
    plan only just keeps, or stayed below it), the trace is planned again under that
    peak, so a replay never runs above its warmup (no op needs more than the warmup
    held: it read its operands there). Raises ``PlanningError`` as ``plan_residency``."""
    planned = plan_residency(trace, planner, earliest_prefetch_op=0, where=where,
                             host_budget_bytes=host_budget_bytes)
    if measured_peak is None or planned.check.peak_resident_bytes <= measured_peak:
        return planned
    if planned.trace.budget_bytes > trace.budget_bytes:
        return planned  # the host budget binds: the plan already keeps what it must
    within = plan_residency(trace.with_budget(min(measured_peak, trace.budget_bytes)), planner,
                            earliest_prefetch_op=0, where=where,
                            host_budget_bytes=host_budget_bytes)
    if within.check.peak_resident_bytes < planned.check.peak_resident_bytes:
        return within
    return planned


def replan(
    plan: WarmupResult, sizes: Mapping[StorageId, int], planner: ResidencyPlanner
) -> WarmupResult:
    """``plan``'s trace with other storage sizes, planned again (same ops and accesses:
    no re-trace). The replay's answer to a step that ran the same ops with larger
    sizes (:mod:`.replay_checks`)."""
    trace = dataclasses.replace(plan.trace, storage_sizes=dict(sizes))
    try:
        planned = plan_step(trace, planner, where="eager re-plan")
    except PlanningError as error:
        raise OffloadSessionError(f"{error}\nThe session keeps its previous plan.") from error
    virtual = {sid: trace.storage_sizes[sid] for sid in plan.virtual}  # regions grow too
    return WarmupResult(trace, planned.schedule, planned.check, plan.funcs, plan.comm_buffers,
                        plan.pins, plan.foreign, virtual)


def _virtual_replay(
    trace: ActivationTrace, schedule: ResidencySchedule, virtual: Mapping[StorageId, int]
) -> tuple[Sequence[tuple[Any, ...]], Sequence[tuple[Any, ...]], dict[int, tuple[int, int]]]:
    """The schedule the replay runs (``pre``, ``post`` without actions on virtual
    storages) and, per op, the virtual bytes it creates and releases (for the count)."""
    if not virtual:
        return schedule.pre, schedule.post, {}
    delta: dict[int, list[int]] = {}
    for sid, nbytes in virtual.items():
        delta.setdefault(trace.accesses_of(sid)[0][0], [0, 0])[0] += nbytes
    post = []
    for index, actions in enumerate(schedule.post):
        for action in actions:
            if action.storage in virtual:
                delta.setdefault(index, [0, 0])[1] += virtual[action.storage]
        post.append(tuple(a for a in actions if a.storage not in virtual))
    pre = [tuple(a for a in actions if a.storage not in virtual) for actions in schedule.pre]
    return pre, post, {op: (made, freed) for op, (made, freed) in delta.items()}


def first_outputs_only(
    ops: Sequence[TraceOp], foreign: Collection[StorageId]
) -> tuple[TraceOp, ...]:
    """``ops`` with each foreign storage an output of its creating op only: the replay
    skips a foreign storage's views as it skips views of parameters."""
    seen: set[StorageId] = set()
    out = []
    for op in ops:
        outputs = []
        for sid in op.outputs:
            if sid in foreign:
                if sid in seen:
                    continue
                seen.add(sid)
            outputs.append(sid)
        out.append(op if len(outputs) == len(op.outputs)
                   else dataclasses.replace(op, outputs=tuple(outputs)))
    return tuple(out)


def hand_back(
    ops: Sequence[TraceOp], pinned: Collection[StorageId]
) -> dict[int, tuple[StorageId, ...]]:
    """``ACCUMULATE_GRAD`` op index -> the storages it reads for the last time (the
    incoming gradients; pinned ones stay the communication's). Creating a ``.grad``
    keeps such a storage, accumulating into one frees it: the trace retains it either
    way (counted to the end of the step, never released by the plan)."""
    last: dict[StorageId, int] = {}
    for index, op in enumerate(ops):
        for access in op.accesses:
            last[access.storage] = index
    handed: dict[int, tuple[StorageId, ...]] = {}
    for index, op in enumerate(ops):
        if op.name == ACCUMULATE_GRAD:
            sids = tuple(s for s in op.storages if last[s] == index and s not in pinned)
            if sids:
                handed[index] = sids
    return handed


def region_saved_bytes(
    outputs: Iterable[Any], start: Any, device: torch.device, inputs: Collection[int],
    tracked: Callable[[torch.Tensor], bool],
) -> int:
    """Device bytes of the distinct storages saved by the autograd nodes between a
    region's ``outputs`` and its ``start`` node (``OpaqueRegionStart``'s backward),
    leaving out the storages of its ``inputs`` (``_cdata`` keys), of the leaves whose
    gradients it accumulates (parameters: their ``AccumulateGrad`` nodes are in the
    same graph) and those ``tracked`` says the session plans."""
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    storages: dict[int, int] = {}
    existing = set(inputs)
    while stack:
        node = stack.pop()
        if node is None or node is start or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a parameter
        if isinstance(variable, torch.Tensor):
            existing.update(t.untyped_storage()._cdata for t in inner_tensors(variable))
        for saved in any_node_saved_tensors(node):
            for tensor in inner_tensors(saved):
                if tensor.device != device or tensor.layout is not torch.strided:
                    continue
                if is_host_labelled(tensor) or tracked(tensor):
                    continue
                storage = tensor.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(n for key, n in storages.items() if key not in existing)


def step_holds(
    ops: tuple[TraceOp, ...], ends: dict[StorageId, int], retained: frozenset[StorageId]
) -> dict[StorageId, int]:
    """``held_until`` of the step: storages that died ops after their last access (and
    did not outlive the step)."""
    last: dict[StorageId, int] = {}
    for index, op in enumerate(ops):
        for sid in op.storages:
            last[sid] = index
    return {sid: end for sid, end in ends.items()
            if sid in last and sid not in retained and last[sid] < end < len(ops)}


def host_budget_message(planned: PlannedSchedule, refused: int) -> str:
    """The host budget binds: what it kept on the device, and the fixes."""
    requested = planned.requested_budget_bytes or planned.trace.budget_bytes
    return (
        f"OffloadSession warmup: the host budget of {planned.host_budget_bytes} B "
        "(OffloadConfig.max_host_activation_mb, per rank; counted in host pool buckets) "
        "cannot hold what the device budget of "
        f"{requested} B would move: the plan keeps {planned.peak_host_bytes} B on the host "
        f"and peaks at {planned.trace.budget_bytes} B on the device"
        + (f" (the warmup step itself kept {refused} storage(s) on the device for want of "
           "host room)" if refused else "")
        + ". Every step stays exact. Raise max_host_activation_mb (or lower "
        "local_world_size if fewer ranks share this machine), raise "
        "max_resident_activation_mb, or recompute instead: the compile door "
        "(torch.compile(backend=\"hyper_offload\"), recompute=\"auto\") recomputes what "
        "neither budget holds"
    )


def infeasible_message(trace: ActivationTrace, check: ScheduleReport, measured_peak: int) -> str:
    """Why the budget cannot be met, with the figures a user needs to fix it."""
    worst = max(check.infeasible_ops, key=lambda op: op.required_bytes)
    message = (
        f"OffloadSession warmup: no schedule meets the budget of {trace.budget_bytes} B at "
        f"{len(check.infeasible_ops)} op(s) (the most: op {worst.op_index}, "
        f"{trace.ops[worst.op_index].name}, needs {worst.required_bytes} B on the device). "
        f"Later steps run exactly, at the plan's peak of {check.peak_resident_bytes} B; "
        f"the warmup step itself reached {measured_peak} B, counting the end of the step."
    )
    if trace.retained_bytes > trace.budget_bytes:
        message += (
            f" At the end of the step every tensor that outlives it is on the device: "
            f"{trace.retained_bytes} B here (gradients, outputs, anything still referenced), "
            "above the budget by itself. Free what the next step does not need before leaving the "
            "session (e.g. optimizer.zero_grad(set_to_none=True) after optimizer.step()), or"
        )
    else:
        message += " Split the op's inputs (e.g. a smaller micro-batch), or"
    return message + (
        f" raise max_resident_activation_mb to at least {check.peak_resident_bytes / MIB:.4g}"
    )


def warmup_trace(
    ops: tuple[TraceOp, ...], sizes: dict[StorageId, int], *, retained: frozenset[StorageId],
    foreign: Collection[StorageId], ends: dict[StorageId, int], budget_bytes: int,
    bandwidth: Any, disk: tuple[int, float] | None,
) -> ActivationTrace:
    """A warmup step's trace, ending in :data:`~hyper_offload.passes.ir.trace.STEP_END`:
    FSDP's ``foreign`` storages at 0 bytes and outputs of their creating op only, holds from
    ``ends`` (:func:`step_holds`), the measured ``bandwidth`` if any, the ``disk`` tier
    (budget bytes, GB/s) if any."""
    if foreign:
        sizes.update(dict.fromkeys(foreign, 0))
        ops = first_outputs_only(ops, foreign)
    trace = with_step_end(ActivationTrace(
        ops=ops,
        storage_sizes=sizes,
        budget_bytes=budget_bytes,
        retained=retained,
        held_until=step_holds(ops, ends, retained),
        **(
            {}
            if bandwidth is None
            else {"d2h_bandwidth_gbps": bandwidth.d2h_gbps,
                  "h2d_bandwidth_gbps": bandwidth.h2d_gbps}
        ),
    ))
    return trace if disk is None else trace.with_disk(*disk)


def plan_warmup(
    trace: ActivationTrace, planner: ResidencyPlanner, *, host_budget_bytes: int | None,
    measured_peak: int, host_limited: int,
) -> PlannedSchedule:
    """:func:`plan_step` for the eager warmup: a failure is an :class:`OffloadSessionError`
    (the session stays in warmup); a binding host budget and ops over the device budget
    are :class:`OffloadBudgetWarning` s, attributed to the user's ``with session:``."""
    try:
        planned = plan_step(trace, planner, where="eager warmup",
                            host_budget_bytes=host_budget_bytes, measured_peak=measured_peak)
    except PlanningError as error:
        raise OffloadSessionError(f"{error}\nThe session stays in warmup.") from error
    if planned.binding == "host" or host_limited:
        warnings.warn(OffloadBudgetWarning(host_budget_message(planned, host_limited)),
                      stacklevel=4)
    if planned.check.infeasible_ops:
        warnings.warn(
            OffloadBudgetWarning(infeasible_message(trace, planned.check, measured_peak)),
            stacklevel=4,  # the user's `with session:` (through OffloadSession.__exit__)
        )
    return planned


def refuse_swap_step(name: str, index: int) -> None:
    """Fail at the first op of a swapping ``PipelineSwapSchedule.step()``: its swap groups
    resize the chunks' saved storages themselves, the session would move the same ones."""
    raise OffloadSessionError(
        f"OffloadSession warmup, op {index} ({name}): runs inside PipelineSwapSchedule(swap=True)."
        "step(), whose swap groups offload each chunk's saved activations themselves; the "
        "session would plan and move the same storages. Fix: build the schedule with "
        "swap=False inside the session (the session then plans every activation of the "
        "rank, the chunks across micro-batches included, under its one budget), or run the "
        "swap schedule outside `with session:`"
    )
