"""``HyperOffloadBackend.step_report``: the step plan in force, readable.

One row per invocation (region, ordinal): the bytes its slots keep on the device, the
bytes they move (to the host in the forward, back in the backward), and the bytes it
retains that no plan moves (activations a region keeps, a block's saved input); then
the step's predicted peak against the budget, the floor (everything movable moved) and
the peak without offload. Every re-plan logs one line on ``hyper_offload`` (INFO), a
step plan that cannot fit (the floor is over the budget) a WARNING.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hyper_offload.passes.plan.step import FloorOp, InvocationPlan, StepPlan

from .region_report import LOGGER, NOT_BIT_EXACT, UNDER_FLOOR

__all__ = ["StepReport", "build_step_report", "explain_floor", "log_step_plan"]

_MIB = 1 << 20


@dataclass(frozen=True)
class StepReport:
    """The step plan's figures (bytes; all *predicted* except ``retained_bytes``, which
    were measured on the autograd graph of the step the plan was made from)."""

    budget_bytes: int
    peak_bytes: int
    floor_peak_bytes: int
    peak_without_offload_bytes: int
    invocations: tuple[InvocationPlan, ...]
    replans: int
    steps_seen: int
    predicted_stall_s: float = 0.0
    """Seconds the step waits for copies (*predicted*: the timeline model at the prices
    the regions were traced with)."""
    relowered: tuple[int, ...] = ()
    """Regions lowered again with the recompute search ranked on the step, because an
    earlier plan did not fit or stalled (:mod:`.step.lowerings`); their region reports
    say what they recompute."""
    lowered_for_step: tuple[int, ...] = ()
    """Regions the plan runs with a schedule made for the step
    (:mod:`~hyper_offload.passes.plan.step.planner`):
    what they move, and where, was planned on the whole step; the others run their floor
    and keep slots at run time (``kept_bytes``)."""
    floor_op: FloorOp | None = None
    """The op at which the floor peaks: what sets ``floor_peak_bytes``."""
    eager_measured: bool = False
    """Whether the eager code between regions was measured and counted (a step of this
    shape ran inside ``HyperOffloadBackend.measuring()``, as ``hyper_offload.estimate``'s
    fake step does)."""
    regions_floor_bytes: int | None = None
    """Where the eager code was measured: the floor with it left out (what the regions
    alone need)."""
    host_budget_bytes: int | None = None
    """The host budget the plan keeps (per rank, pool buckets; None: none)."""
    peak_host_bytes: int = 0
    """The most host bytes the plan's moved slots hold at once (*predicted*)."""
    binding: str = "none"
    """Which budget limits the step
    (:attr:`~hyper_offload.passes.plan.step.plan.StepPlan.binding`): ``"device"``,
    ``"host"``, ``"both"`` or ``"none"``."""
    tiled: tuple[int, ...] = ()
    """Regions whose graphs sequence tiling split into tiles (``tile_sequence``): the
    step is then *not bit-exact* (their region reports say what was tiled)."""

    @property
    def floor_explained(self) -> str:
        """What sets the floor and what lowers it (one line; empty without a step)."""
        return explain_floor(self.floor_op, self.floor_peak_bytes)

    @property
    def moved_bytes(self) -> int:
        """Bytes copied to the host per step (each also comes back once)."""
        return sum(p.moved_bytes for p in self.invocations)

    @property
    def kept_bytes(self) -> int:
        return sum(p.kept_bytes for p in self.invocations)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    def summary(self) -> dict[str, object]:
        """Flat, JSON-friendly figures."""
        return {
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.peak_bytes,
            "floor_peak_bytes": self.floor_peak_bytes,
            "peak_without_offload_bytes": self.peak_without_offload_bytes,
            "moved_bytes": self.moved_bytes,
            "kept_bytes": self.kept_bytes,
            "invocations": len(self.invocations),
            "replans": self.replans,
            "steps_seen": self.steps_seen,
            "predicted_stall_s": self.predicted_stall_s,
            "relowered": list(self.relowered),
            "lowered_for_step": list(self.lowered_for_step),
            "floor_op": None if self.floor_op is None else self.floor_op.op,
            "floor_op_region": None if self.floor_op is None else self.floor_op.region,
            "floor_op_bytes": None if self.floor_op is None else self.floor_op.op_bytes,
            "eager_between_regions_counted": self.eager_measured,
            "regions_floor_bytes": self.regions_floor_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "peak_host_bytes": self.peak_host_bytes,
            "binding": self.binding,
            "tiled_regions": list(self.tiled),
            "bit_exact": not self.tiled,
        }

    def __str__(self) -> str:
        lines = [
            f"hyper_offload step: {len(self.invocations)} invocation(s), predicted peak "
            f"{self.peak_bytes / _MIB:.2f} MiB for a budget of {self.budget_bytes / _MIB:.2f} "
            f"MiB (floor {self.floor_peak_bytes / _MIB:.2f}, without offload "
            f"{self.peak_without_offload_bytes / _MIB:.2f}), predicted stall "
            f"{self.predicted_stall_s * 1e3:.3f} ms; {self.replans} plan(s) in "
            f"{self.steps_seen} step(s)"
            + (f"; region(s) {', '.join(map(str, self.relowered))} re-lowered with "
               "recompute" if self.relowered else "")
            + (f"; region(s) {', '.join(map(str, self.lowered_for_step))} lowered with the "
               "step's schedule" if self.lowered_for_step else "")
            + (f"; host {self.peak_host_bytes / _MIB:.2f} MiB of a host budget of "
               f"{self.host_budget_bytes / _MIB:.2f} MiB" if self.host_budget_bytes is not None
               else "")
            + f"; binding: {self.binding}",
            f"floor set by {self.floor_explained}",
            *([f"sequence tiling in region(s) {', '.join(map(str, self.tiled))}: "
               f"{NOT_BIT_EXACT}"] if self.tiled else []),
            "eager code between compiled regions: " + (
                "counted (measured in the step the plan was made from)" if self.eager_measured
                else "not counted (run a training step inside `with backend.measuring():`, "
                "or hyper_offload.estimate, to measure it)"),
            f"{'invocation':>10} {'kept MiB':>9} {'moved MiB':>9} {'retained MiB':>12}",
        ]
        lines += [
            f"{p.invocation!r:>10} {p.kept_bytes / _MIB:9.2f} {p.moved_bytes / _MIB:9.2f} "
            f"{p.retained_bytes / _MIB:12.2f}"
            for p in self.invocations
        ]
        return "\n".join(lines)


def build_step_report(
    plan: StepPlan, replans: int, steps_seen: int, predicted_stall_s: float = 0.0,
    relowered: tuple[int, ...] = (), *, plain_peak: int | None = None,
    op_origin: Callable[[int, str], str | None] | None = None,
    op_operands: Callable[[int, str], tuple[tuple[str, int], ...]] | None = None,
    tiled: tuple[int, ...] = (),
) -> StepReport:
    """The report of ``plan``. ``plain_peak``: the step's peak without offload on torch's
    partitions, where the plan's regions were re-lowered since; ``op_origin(region,
    op)``: the aten op a decomposed node came from (named beside the floor's op);
    ``op_operands(region, op)``: what that op holds, by name (listed with it);
    ``tiled``: the regions sequence tiling split (the report says it is not bit-exact)."""
    floor_op = plan.floor_op
    if floor_op is not None and floor_op.region is not None:
        operands = op_operands(floor_op.region, floor_op.op) if op_operands else ()
        origin = op_origin(floor_op.region, floor_op.op) if op_origin else None
        floor_op = floor_op._replace(
            op=floor_op.op if origin is None else f"{floor_op.op} (of {origin})",
            operands=operands)
    return StepReport(
        budget_bytes=plan.budget_bytes, peak_bytes=plan.peak_bytes,
        floor_peak_bytes=plan.floor_peak_bytes,
        peak_without_offload_bytes=plain_peak or plan.peak_without_offload_bytes,
        invocations=plan.invocations, replans=replans, steps_seen=steps_seen,
        predicted_stall_s=predicted_stall_s, relowered=relowered,
        lowered_for_step=tuple(sorted(plan.schedules)), floor_op=floor_op,
        eager_measured=plan.timeline.between is not None,
        regions_floor_bytes=plan.regions_floor_bytes,
        host_budget_bytes=plan.host_budget_bytes, peak_host_bytes=plan.peak_host_bytes,
        binding=plan.binding, tiled=tiled,
    )


_LOSS_OPS = ("nll_loss", "log_softmax", "cross_entropy", "softmax_backward")
_ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "flex_attention")


def explain_floor(floor_op: FloorOp | None, floor_bytes: int) -> str:
    """``floor_op`` in words, and what lowers the floor there: its own operands no plan
    moves; what else the step holds there is movable only as far as the floor moved it."""
    if floor_op is None:
        return f"no op ({floor_bytes / _MIB:,.1f} MiB)"
    name = floor_op.op.lower()
    if any(k in name for k in _LOSS_OPS):
        lower = ("the loss over the vocabulary: compute the LM head and the loss in sequence "
                 "chunks, each checkpointed (examples/llama_model.py: LlamaConfig.loss_chunks), "
                 "or split the sequence across ranks (context parallel)")
    elif any(k in name for k in _ATTENTION_OPS):
        lower = "attention over the whole sequence: split it across ranks (context parallel)"
    else:
        lower = ("this op's own inputs and outputs, which no offload or recompute plan moves: "
                 "a shorter sequence or batch per rank (context parallel) or a chunked op")
    if floor_op.region is None:
        lower += "; it runs eagerly, outside every compiled region"
    return f"{floor_op.describe()}; lowered by {lower}"


def log_step_plan(plan: StepPlan, number: int, predicted_stall_s: float = 0.0) -> None:
    """One log line per step plan (module docstring)."""
    regions = len({p.invocation.region for p in plan.invocations})
    figures = (
        number, len(plan.invocations), regions, plan.peak_bytes / _MIB,
        plan.budget_bytes / _MIB, plan.floor_peak_bytes / _MIB, plan.moved_bytes / _MIB,
        plan.kept_bytes / _MIB, predicted_stall_s * 1e3,
    )
    message = (
        "hyper_offload step plan %d: %d invocation(s) of %d region(s), predicted peak "
        "%.2f MiB for a budget of %.2f MiB (floor %.2f MiB); moves %.2f MiB, keeps %.2f "
        "MiB, predicted stall %.3f ms"
    )
    if plan.floor_peak_bytes > plan.budget_bytes:
        over = (
            f"; the floor is over the budget (set by {explain_floor(plan.floor_op, 0)})"
            .replace("%", "%%") +
            ": no plan meets it, and the plan reaches the "
            "floor's peak moving only what lowers it. Fix: raise the budget; with recompute='auto' (the default) the "
            "step's regions are lowered again once with the recompute search, which may "
            "bring the floor down (a region's own working memory it cannot)"
        )
        LOGGER.warning(message + over, *figures, extra={UNDER_FLOOR: True})
    elif plan.binding == "host":
        LOGGER.warning(message + _host_binds(plan), *figures)
    else:
        LOGGER.info(message, *figures)


def _host_binds(plan: StepPlan) -> str:
    """Why a plan the host budget held over the device budget is there, and the fixes."""
    host = plan.host_budget_bytes or 0
    return (
        f"; the host budget ({host / _MIB:.2f} MiB per rank, "
        "OffloadConfig.max_host_activation_mb) cannot take what the device budget would "
        f"move: {plan.kept_for_host} slot(s) stay on the device, so the step peaks over its "
        "device budget (exact). Fix: with recompute='auto' (the default) the step's regions "
        "are lowered again once with the recompute search, which recomputes what neither "
        "budget holds; or raise max_host_activation_mb (fewer ranks on the node: "
        "local_world_size) or the device budget"
    ).replace("%", "%%")
