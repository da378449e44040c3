"""One sweep case through one door, without and with hyper_offload, judged bit for bit.

* ``compile``: ``torch.compile(module, backend="aot_eager")`` is the reference;
  ``backend="hyper_offload"`` with :data:`COMPILE_OPTIONS` (budget 0: everything
  movable moves) must give the same loss and gradients at every step. What moved is read
  from the backend (:func:`hyper_offload.compiler.registry.shared_backend`): the
  bytes its transfer runtime copied to the host and the saved tensors its region
  reports offload.
* ``eager``: plain eager is the reference; an ``OffloadSession`` at budget 0 runs the
  same steps (step 1 warms up with online eviction, later steps replay the plan).

A case is *skipped*, with a :class:`Skip` reason, when the reference itself cannot
judge it: the sample raises in plain eager, nothing requires grad, or two plain runs
differ (a nondeterministic op). Anything the library run does differently (another
bit, an exception) is *failed*. A pass where nothing moved exercised nothing of the
library: :attr:`CaseResult.moved` says so and the summary counts those apart.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .exact import StepResult, capture, first_mismatch, run_step
from .opdb import OpModule, SparseSample, SweepCase, dtype_name, op_key

__all__ = ["COMPILE_OPTIONS", "DOORS", "CaseResult", "Skip", "run_case", "skipped_op"]

COMPILE_OPTIONS: dict[str, Any] = {"inner_compiler": "aot_eager", "max_resident_activation_mb": 0}
EAGER_BUDGET_MB = 0
DOORS = ("compile", "eager")


class Skip(str, Enum):
    """Why a case was not judged; the value is the reason the summary counts."""

    NO_SAMPLES = "the OpInfo's sample generator raises"
    SAMPLE_ERROR = "the sample raises in plain eager"
    NO_GRAD_INPUT = "no tensor of the sample requires grad"
    NO_GRAD_OUTPUT = "no output of the op has a gradient"
    NONDETERMINISTIC = "two plain runs differ"
    PLAIN_COMPILE_ERROR = "plain torch.compile(backend='aot_eager') raises"
    NO_GRAPH = "Dynamo compiles no graph of the sample under plain aot_eager"
    SPARSE = "a sparse tensor among the sample's inputs or outputs (activations are strided)"


@dataclass
class CaseResult:
    """The verdict on one case in one door. ``status`` is "passed", "skipped" (``skip``
    says why, ``detail`` the exception) or "failed" (``detail``: the first mismatch or
    the exception, with its step). ``moved_bytes``: bytes copied to the host over all
    steps; ``transfers``: copies made (compile: host copies; eager: D2H + H2D);
    ``offloaded``: saved tensors the compile plan moves (compile only)."""

    op: str
    variant: str
    dtype: str
    sample: int
    door: str
    status: str = "passed"
    skip: str | None = None
    detail: str = ""
    mismatch: dict[str, Any] | None = None
    moved_bytes: int = 0
    transfers: int = 0
    offloaded: int = 0
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    cause: str = ""
    """For a failure whose cause the sweep measured: :data:`MODE_CAUSE` (else "")."""

    @property
    def moved(self) -> bool:
        return self.moved_bytes > 0

    def record(self) -> dict[str, Any]:
        return asdict(self)


class _Skipped(Exception):
    def __init__(self, reason: Skip, detail: str = "") -> None:
        super().__init__(reason.value)
        self.reason, self.detail = reason, detail


def _error(error: BaseException) -> str:
    """``Type: first line`` of an exception, at most 300 characters."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def skipped_op(op: Any, dtype: torch.dtype, variant: str, door: str, error: Exception) -> CaseResult:
    """The result for an (op, dtype) whose sample generator raised."""
    return CaseResult(op_key(op), variant, dtype_name(dtype), -1, door, "skipped",
                      Skip.NO_SAMPLES.name.lower(), _error(error))


def run_case(case: SweepCase, door: str, steps: int = 2) -> CaseResult:
    """Judge ``case`` in ``door`` over ``steps`` (>= 2) steps (module docstring)."""
    if door not in DOORS or steps < 2:
        raise ValueError(f"run_case: door must be one of {DOORS} and steps >= 2, got {door!r}, {steps}")
    result = CaseResult(op_key(case.op), case.variant, dtype_name(case.dtype), case.index, door)
    started = time.perf_counter()
    try:
        module, first = _prepare(case)
        if door == "compile":
            _run_compile(module, steps, result)
        else:
            _run_eager(module, first, steps, result)
    except _Skipped as skipped:
        result.status, result.skip, result.detail = "skipped", skipped.reason.name.lower(), skipped.detail
    finally:
        if door == "compile":
            torch._dynamo.reset()
    result.seconds = round(time.perf_counter() - started, 3)
    return result


def _prepare(case: SweepCase) -> tuple[OpModule, StepResult]:
    """The case's module and one plain eager step, or :class:`_Skipped`."""
    try:
        module = OpModule(case)
    except SparseSample as error:
        raise _Skipped(Skip.SPARSE, str(error)) from None
    except Exception as error:  # noqa: BLE001 - the sample itself is broken in plain eager
        raise _Skipped(Skip.SAMPLE_ERROR, _error(error)) from None
    if len(module.scales) == 0:
        raise _Skipped(Skip.NO_GRAD_INPUT)
    try:
        loss = run_step(module, module)
    except Exception as error:  # noqa: BLE001
        raise _Skipped(Skip.SAMPLE_ERROR, _error(error)) from None
    if not loss.requires_grad:
        raise _Skipped(Skip.NO_GRAD_OUTPUT)
    return module, capture(module, loss)


def _check_deterministic(reference: list[StepResult]) -> None:
    for step, got in enumerate(reference[1:], start=1):
        mismatch = first_mismatch(reference[0], got, step)
        if mismatch is not None:
            raise _Skipped(Skip.NONDETERMINISTIC, mismatch.describe())


def _judge(result: CaseResult, reference: list[StepResult], step: int, got: StepResult) -> bool:
    """Record the first mismatch of ``got`` against the reference's step; True if none."""
    mismatch = first_mismatch(reference[step], got, step)
    if mismatch is None:
        return True
    result.status, result.detail, result.mismatch = "failed", mismatch.describe(), asdict(mismatch)
    return False


def _fail(result: CaseResult, step: int, error: BaseException) -> None:
    """Record an exception of the library run at ``step``."""
    result.status, result.detail = "failed", f"step {step}: {_error(error)}"


def _run_eager(module: OpModule, first: StepResult, steps: int, result: CaseResult) -> None:
    from hyper_offload import OffloadConfig, OffloadSession

    reference = [first] + [capture(module, run_step(module, module)) for _ in range(steps - 1)]
    _check_deterministic(reference)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=EAGER_BUDGET_MB))
    per_step: list[dict[str, Any]] = []
    for step in range(steps):
        try:
            loss = run_step(module, module, session)
        except Exception as error:  # noqa: BLE001 - the library failed the case
            _fail(result, step, error)
            break
        stats = session.last_stats
        if stats is not None:
            result.moved_bytes += stats.bytes_d2h
            result.transfers += stats.transfers
            per_step.append({"phase": stats.phase, "bytes_d2h": stats.bytes_d2h,
                             "demand_loads": stats.demand_loads})
        if not _judge(result, reference, step, capture(module, loss)):
            break
    result.figures = {"steps": per_step}
    if result.mismatch is not None and _differs_under_any_mode(module, reference):
        result.cause = MODE_CAUSE


MODE_CAUSE = "torch_formula_under_any_dispatch_mode"
"""The cause of an eager failure that a no-op ``TorchDispatchMode`` reproduces without
the library: while any dispatch mode is active, torch treats every tensor as
subclass-like (ATen's ``TensorSubclassLikeUtils.h``) and some formulas take their other
branch (complex ``cumprod``'s backward, ``pinverse``, ``lstsq``, ``prod``). The eager
door runs every op under its mode; no offload is involved."""


class _NoopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _differs_under_any_mode(module: OpModule, reference: list[StepResult]) -> bool:
    """Whether plain eager under a no-op dispatch mode already differs from plain."""
    try:
        loss = run_step(module, module, _NoopMode())
    except Exception:  # noqa: BLE001 - then the mode alone does not explain the failure
        return False
    return first_mismatch(reference[0], capture(module, loss), 0) is not None


class _StepError(Exception):
    def __init__(self, step: int, error: BaseException) -> None:
        super().__init__(f"step {step}: {_error(error)}")
        self.step, self.error = step, error


def _compiled_steps(
    module: OpModule, steps: int, backend: str, options: dict[str, Any] | None = None
) -> tuple[list[StepResult], int, list[str]]:
    """``steps`` steps of ``torch.compile(module, backend=backend)``, the graphs Dynamo
    compiled, and the backend's errors Dynamo answered by running the region in Python
    (it does so for fake-tensor errors such as data-dependent outputs)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, backend=backend, options=options)
    results = []
    for step in range(steps):
        try:
            results.append(capture(module, run_step(module, compiled)))
        except Exception as error:  # noqa: BLE001 - the caller decides skip or failure
            raise _StepError(step, error) from error
    fallbacks = [
        reason.split("\n")[1].strip() for reason in counters["unimplemented"]
        if reason.startswith("Backend compiler exception") and f"`{backend}`" in reason
    ]
    return results, counters["stats"]["unique_graphs"], fallbacks


def _run_compile(module: OpModule, steps: int, result: CaseResult) -> None:
    from hyper_offload.compiler.registry import shared_backend

    try:
        reference, graphs, plain_fallbacks = _compiled_steps(module, steps, "aot_eager")
    except _StepError as error:  # Dynamo/AOTAutograd cannot take the sample
        raise _Skipped(Skip.PLAIN_COMPILE_ERROR, str(error)) from None
    if graphs == 0:
        raise _Skipped(Skip.NO_GRAPH, "; ".join(plain_fallbacks[:1]))
    _check_deterministic(reference)
    try:
        got, _, fallbacks = _compiled_steps(module, steps, "hyper_offload", COMPILE_OPTIONS)
    except _StepError as error:
        _fail(result, error.step, error.error)
        return
    finally:
        _compile_figures(shared_backend(COMPILE_OPTIONS), result)
    if len(fallbacks) > len(plain_fallbacks):
        result.status = "failed"
        result.detail = f"Dynamo ran a region in Python that plain aot_eager compiled: {fallbacks[0]}"
        return
    for step, step_result in enumerate(got):
        if not _judge(result, reference, step, step_result):
            return


def _compile_figures(backend: Any, result: CaseResult) -> None:
    """What the backend moved: measured bytes and host copies, planned saved tensors."""
    if backend is None:  # Dynamo compiled no region (the op ran in Python)
        return
    stats = backend.runtime.stats()
    result.moved_bytes = backend.runtime.bytes_d2h
    result.transfers = stats.pool.hits + stats.pool.misses
    reports = backend.reports
    result.offloaded = sum(len(r.offloaded) for r in reports)
    result.figures = {
        "regions": len(reports),
        "kept": sum(len(r.kept) for r in reports),
        "kept_reasons": sorted({k.reason for r in reports for k in r.kept}),
    }
