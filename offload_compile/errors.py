"""Every exception and warning a user of hyper-offload can meet, in one place.

``except hyper_offload.HyperOffloadError`` catches every error the library raises on
purpose; each error also subclasses the builtin it always has (``ValueError`` for bad
input, ``RuntimeError`` for a state or run-time failure, ``ImportError`` for a missing
extra), so existing ``except ValueError`` code keeps working. Warnings derive from
:class:`HyperOffloadWarning` (and ``UserWarning`` or ``RuntimeWarning``), so
``warnings.filterwarnings("error", category=hyper_offload.HyperOffloadWarning)`` turns
them all into errors. The table in docs/errors.md says when each is raised and
what to do.

Messages name where it broke, which rule was violated and how to fix it; the classes
here only carry what a caller may want to inspect (``violations``, ``schedule``, ...).

Invariant: this is a leaf of the import graph (the standard library only, no torch), so
that every layer, the pure passes included, raises these classes and the root exports
them without loading anything else. Modules that used to define an error re-export it
from here, so ``hyper_offload.passes.PlanningError`` and the like keep working.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "CheckUsageError",
    "ConfigurationError",
    "ConfigurationTypeError",
    "DataLostError",
    "DynamicShapeError",
    "HostBudgetError",
    "HyperOffloadError",
    "HyperOffloadWarning",
    "LoweringError",
    "OffloadBudgetWarning",
    "OffloadRuntimeError",
    "OffloadSessionError",
    "OptimalPlannerError",
    "OptionalDependencyError",
    "OrderError",
    "PageableFallbackWarning",
    "PipelineCommError",
    "PipelineStateError",
    "PlanningError",
    "PlotDependencyError",
    "PoolMisuseError",
    "PrefetchError",
    "ReleaseDelayError",
    "ReplayMismatchError",
    "ReportScopeError",
    "ResidencyMisuseError",
    "ScheduleError",
    "StepFormatError",
    "SwapOutsideGroupWarning",
    "SwapStateError",
    "TilingError",
    "TimelineError",
    "TorchCompatibilityError",
    "TraceFormatError",
    "TransferFailedError",
    "TransferIntegrityError",
    "TransferMisuseError",
    "UnsupportedScheduleError",
]


class HyperOffloadError(Exception):
    """Base class of every error hyper-offload raises on purpose."""


class HyperOffloadWarning(Warning):
    """Base class of every warning hyper-offload issues."""


# ---------------------------------------------------------------- configuration and arguments


class ConfigurationError(HyperOffloadError, ValueError):
    """A knob has a value hyper-offload does not accept: an ``OffloadConfig`` field, a key
    or value of the compile ``options=``, an ``estimate`` or CLI argument, or an argument
    of a public function (a pipeline schedule name, a planner objective, ...). The message
    names the knob, what it accepts and the fix. Also a ``ValueError``, as these were."""


class ConfigurationTypeError(ConfigurationError, TypeError):
    """A knob has a value of the wrong type (``OffloadConfig(planner=3)``, a non-bool
    flag, ...). Also a ``TypeError``, as these were, and a :class:`ConfigurationError`."""


class OptionalDependencyError(HyperOffloadError, ImportError):
    """A feature needs a package the library itself does not depend on (scipy for the
    exact planner, matplotlib for plots); the message says what to install."""


class TorchCompatibilityError(HyperOffloadError, RuntimeError):
    """This torch build lacks or changed something hyper-offload relies on; the message
    names it and where the library must be adapted."""


# ---------------------------------------------------------------- planning (passes)


class TraceFormatError(HyperOffloadError, ValueError):
    """A trace or schedule (JSON or Python data) is malformed; the message names the field."""


class ScheduleError(HyperOffloadError, ValueError):
    """Raised by ``ScheduleReport.raise_if_invalid``; lists every violation of the schedule."""


class PlanningError(ScheduleError):
    """A stage of ``plan_residency`` produced a schedule ``check_schedule`` rejects (or one
    the placement pass cannot rewrite). Always a bug, never a budget problem: an
    infeasible budget is reported in ``ScheduleReport.infeasible_ops``, not raised.

    ``where`` names the door and region, ``stage`` the step (a ``PlanningStage``, a str
    Enum); ``schedule`` and ``report`` are the rejected ``ResidencySchedule`` and its
    ``ScheduleReport`` (``report`` is None when the placement pass refused its input), so
    a caller can still show what went wrong.
    """

    def __init__(
        self, message: str, *, where: str, stage: str, schedule: Any, report: Any | None
    ) -> None:
        super().__init__(message)
        self.where = where
        self.stage = stage
        self.schedule = schedule
        self.report = report


class OptimalPlannerError(HyperOffloadError, RuntimeError):
    """The exact planner's integer program could not be solved (solver status in the message)."""


class PrefetchError(HyperOffloadError, ValueError):
    """The prefetch placement pass was given a schedule it cannot rewrite (names the rule)."""


class ReleaseDelayError(HyperOffloadError, ValueError):
    """The release placement pass was given a schedule it cannot rewrite (names the rule)."""


class LoweringError(HyperOffloadError, ValueError):
    """The schedule asks for something the FX lowering cannot express (names the action,
    the op and the rule)."""


class TilingError(HyperOffloadError, ValueError):
    """Sequence tiling was asked to split ops it cannot split into tiles run one after
    another (names the ops and the rule; ``passes.fx.tiling_rewrite``)."""


class DynamicShapeError(HyperOffloadError, ValueError):
    """A symbolic size has no hint to plan with (the message names it and the fix)."""


# ---------------------------------------------------------------- pipeline orders (passes)


class StepFormatError(HyperOffloadError, ValueError):
    """A pipeline ``MetaStep`` (or its text form) breaks one of the order IR's invariants."""


class OrderError(HyperOffloadError, ValueError):
    """Raised by ``assert_valid_order``; ``violations`` holds every broken rule
    (``OrderViolation`` records)."""

    def __init__(self, message: str, violations: Sequence[Any]) -> None:
        super().__init__(message)
        self.violations = list(violations)


class TimelineError(HyperOffloadError, ValueError):
    """Pipeline orders cannot be placed on one timeline (they deadlock or are malformed)."""


# ---------------------------------------------------------------- runtime


class OffloadRuntimeError(HyperOffloadError, RuntimeError):
    """Base class of every error the runtime layer (what moves bytes) raises on purpose."""


class HostBudgetError(HyperOffloadError, MemoryError):
    """A host buffer was asked for past the host budget
    (``OffloadConfig.max_host_activation_mb``) with ``pageable_fallback=False``: the plan
    that asked was not made under this budget. The message names the budget, what the
    pool holds and the fixes. Also a ``MemoryError``."""


class PoolMisuseError(OffloadRuntimeError):
    """A ``PinnedMemoryPool`` rule was broken (double release, releasing a buffer the pool
    never handed out, ...)."""


class ResidencyMisuseError(OffloadRuntimeError):
    """A residency state-machine rule was broken (H2D without a host copy, releasing a
    storage twice, an unknown storage id, ...). Nothing was changed."""


class TransferFailedError(OffloadRuntimeError):
    """A copy between device and host failed. The message says which copy of the data is
    still valid; the state was rolled back so that no transfer is in flight and no buffer
    is leaked. The original exception is chained as ``__cause__``."""


class TransferIntegrityError(OffloadRuntimeError):
    """``verify`` found bytes that differ from what left the device: a reload whose bytes
    are not those the D2H read, or device bytes written after their D2H was issued (a
    copy-stream race). ``check`` names which check failed ("reload" or "write after
    copy"); the message names where, the storage and its size, and what to do."""

    def __init__(self, message: str, *, check: str = "", where: str = "") -> None:
        super().__init__(message)
        self.check = check
        self.where = where
        """Where the door found it ("eager op 12", "region 0, fw:mm"); empty below."""


class DataLostError(OffloadRuntimeError):
    """The bytes of a storage were requested but neither a device nor a host copy exists
    any more (both were released). Raised instead of handing out garbage."""


class TransferMisuseError(OffloadRuntimeError):
    """A transfer-op rule was broken (wait without a start, release of a copy still
    filling, a tensor that is not a host copy, no active runtime, ...). Nothing was
    changed."""


class PipelineStateError(OffloadRuntimeError):
    """The pipeline executor met a step its state forbids (an FSDP unshard twice, compute
    while sharded, a compute before its input was received, a loss that was never
    computed); the message names the step and the rule its order broke."""


class SwapStateError(PipelineStateError):
    """A pipeline swap step ran out of order, or a swapped-out activation was read before
    its wait-load step. Raised before any kernel touches the missing bytes."""


class PipelineCommError(HyperOffloadError, RuntimeError):
    """A P2P operation of the pipeline failed or timed out."""


class UnsupportedScheduleError(HyperOffloadError, ValueError):
    """``PipelineSwapSchedule`` cannot run this combination of options and stages (the
    message says why and what to change)."""


# ---------------------------------------------------------------- front doors


class ReplayMismatchError(HyperOffloadError, RuntimeError):
    """The eager step being replayed does not have the structure the warmup step recorded
    (another op, leaf count or size at an op index)."""


class OffloadSessionError(HyperOffloadError, RuntimeError):
    """Misuse of an ``OffloadSession``, or an unsafe access it refused to run."""


class CheckUsageError(HyperOffloadError, ValueError):
    """``hyper_offload.check`` was called with arguments it cannot run (an unknown door,
    no step, an output with nothing to differentiate)."""


class ReportScopeError(HyperOffloadError, AttributeError):
    """A report was asked for a figure its scope does not have: ``EstimateReport.region``
    (the single-region plan of ``budget_scope="region"``) of a step-scoped estimate. Also
    an ``AttributeError``, so ``getattr(report, "region", None)`` is None as it was; the
    message names what to read instead."""


class PlotDependencyError(OptionalDependencyError):
    """A plot was asked for but matplotlib (the ``plot`` extra) is not installed."""


# ---------------------------------------------------------------- warnings


class OffloadBudgetWarning(HyperOffloadWarning, UserWarning):
    """The eager warmup step's plan cannot meet the session's budget at some ops: later
    steps run exactly, at the plan's (higher) peak. Warned once, at the end of warmup."""


class PageableFallbackWarning(HyperOffloadWarning, RuntimeWarning):
    """A pinned pool served a request with pageable memory (cap reached or pinning
    refused): transfers through that buffer block the host. Warned once per pool."""


class SwapOutsideGroupWarning(HyperOffloadWarning, UserWarning):
    """``swap_tensor_wrapper`` ran outside a pipeline FWD leaf; nothing was registered."""
