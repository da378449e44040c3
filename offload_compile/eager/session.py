"""``OffloadSession``: the eager front door (warmup trace -> plan -> replay).

Usage (design section 3)::

    session = OffloadSession(OffloadConfig(max_resident_activation_mb=512))
    with session:            # step 1: warmup (trace + online eviction)
        loss = model(x); loss.backward()
    with session:            # later steps: replay the planned schedule
        loss = model(x); loss.backward()

Lifecycle. Every transition belongs to one :class:`~.lifecycle.StepLifecycle` (states,
events, the plan, the counts; its module docstring draws the machine). The session asks
it what runs each step and tells it what happened:

* ``__enter__``: with grad enabled, a warmup (no plan yet) or a replay of the plan runs
  the step through :class:`ActivationDispatchMode`; under ``no_grad`` /
  ``inference_mode`` nothing is traced and the plan is left as it was. The session is
  made current (a ``ContextVar``, read by ``skip_offload``) either way.
* during the step: an op that raises taints it (the mode reports it); a replay whose ops
  change hands the step to a warmup when a re-warm is allowed.
* ``__exit__`` leaves the mode first (so cleanup is never traced), then on success the
  warmup's trace becomes the plan, a replay settles (or re-plans for larger sizes), and a
  tainted step is discarded after its cleanup; on an exception every transfer is
  synchronised, offloaded storages still in use are paged back (from disk too), every
  host buffer returns to the pool (``pool.stats()`` in-use bytes are 0 again), every
  file of the disk tier is removed, the plan is kept, and the exception propagates
  unchanged (a ``KeyboardInterrupt`` included).

Who holds what. The session owns one ``TransferEngine``, one ``PinnedMemoryPool``, one
``ResidencyManager``, with a disk tier one ``DiskStore``, for its lifetime, and its
lifecycle. During a step the manager
holds the storage *objects* it manages (not extra copies of their bytes) and the host
buffers; the executor holds only storage ids; autograd and the user hold ordinary
tensors whose storages the manager shrinks and grows in place. Nothing is held across
steps except the plan (trace, schedule, report, op callables).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch

from hyper_offload.config import OffloadConfig
from hyper_offload.errors import ConfigurationError, ConfigurationTypeError, ReplayMismatchError
from hyper_offload.passes.analysis.validator import ScheduleReport
from hyper_offload.passes.ir.schedule import ResidencySchedule
from hyper_offload.passes.ir.trace import ActivationTrace
from hyper_offload.runtime import PinnedMemoryPool, ResidencyManager, TransferEngine
from hyper_offload.runtime.device import require_usable
from hyper_offload.runtime.disk_store import DiskStore
from hyper_offload.runtime.verify import VerifySteps

from .dispatch_mode import ActivationDispatchMode
from .executor_base import (
    BaseExecutor, OffloadSessionError, StepStats, activate, current_session, deactivate,
)
from .lifecycle import StepKind, StepLifecycle, StepRecord, StepState
from .opaque import close_open_regions, install_compiled_module_hooks
from .replay import ReplayExecutor
from .replay_checks import OpGuide
from .warmup import WarmupExecutor, WarmupResult

__all__ = ["OffloadSession"]

LOGGER = logging.getLogger("hyper_offload")


class OffloadSession:
    """Eager activation offloading for one model's training steps (module docstring).

    ``device``: the device whose activations are managed (default: the current
    accelerator, else CPU). ``engine``: the ``TransferEngine`` that moves the bytes
    (default: one for ``device``; tests pass a scripted engine). One session per
    training loop; steps must not overlap.
    """

    def __init__(
        self,
        config: OffloadConfig | None = None,
        *,
        device: Any = None,
        engine: TransferEngine | None = None,
    ) -> None:
        self.config = config if config is not None else OffloadConfig()
        if not isinstance(self.config, OffloadConfig):
            raise ConfigurationTypeError(
                f"OffloadSession: expected an OffloadConfig, got {type(self.config).__name__}; "
                "pass OffloadConfig(max_resident_activation_mb=...)"
            )
        self.device = _normalise(require_usable(
            device if engine is None else engine.device, "OffloadSession"))
        if engine is not None and _normalise(engine.device) != self.device:
            raise ConfigurationError(
                f"OffloadSession: engine moves bytes of {engine.device}, but the session manages "
                f"{self.device}; pass an engine for the session's device"
            )
        self.engine = engine if engine is not None else TransferEngine(self.device)
        self.host_budget_bytes = self.config.host_budget_bytes()
        """The host budget every plan of this session keeps, resolved once here
        (``OffloadConfig.max_host_activation_mb``, or the node view when it is None)."""
        self.pool = PinnedMemoryPool(self.host_budget_bytes,
                                     pageable_fallback=self.config.pageable_fallback)
        self.disk: DiskStore | None = None
        """The disk tier's files (``OffloadConfig.max_disk_activation_mb``; None: none):
        each step removes its own, and the session's directory goes when the session is
        garbage collected or the process exits."""
        self.disk_bandwidth_gbps: float | None = None
        """What plans price the disk tier at (given, or measured once here)."""
        if self.config.disk_budget_bytes:
            self.disk = DiskStore(self.config.disk_dir,  # type: ignore[arg-type]
                                  budget_bytes=self.config.disk_budget_bytes)
            self.disk_bandwidth_gbps = self.config.disk_bandwidth()
        self.manager = ResidencyManager(self.engine, self.pool, disk=self.disk)
        self.lifecycle = StepLifecycle(max_warmups=self.config.max_warmups,
                                       rewarm_on_mismatch=self.config.rewarm_on_mismatch,
                                       verify=VerifySteps(self.config.verify))
        """Every state the session keeps across and during steps (:mod:`.lifecycle`)."""

    # ------------------------------------------------------------------ public state

    @property
    def state(self) -> StepState:
        """The lifecycle's state (:class:`~.lifecycle.StepState`)."""
        return self.lifecycle.state

    @property
    def phase(self) -> str:
        """``"warmup"`` until a plan exists, then ``"replay"``."""
        return "warmup" if self._plan is None else "replay"

    @property
    def steps(self) -> int:
        """Steps that ended without an exception since construction or ``reset()``."""
        return self.lifecycle.steps

    @property
    def warmups(self) -> int:
        """Warmup steps whose trace became the plan (the first and each re-warm)."""
        return self.lifecycle.warmups

    @property
    def rewarms(self) -> int:
        """Replayed steps a warmup took over because their ops changed (settling, or
        ``rewarm_on_mismatch``)."""
        return self.lifecycle.rewarms

    @property
    def replans(self) -> int:
        """Plans remade after a replayed step ran the same ops with larger sizes (no
        re-trace: :mod:`.replay_checks`)."""
        return self.lifecycle.replans

    @property
    def settled(self) -> bool:
        """Whether a replayed step ran the ops its warmup recorded: from then on a step
        with other ops raises, unless ``rewarm_on_mismatch``."""
        return self.lifecycle.settled

    @property
    def last_stats(self) -> StepStats | None:
        """Stats of the most recent step (also after a failed one)."""
        return self.lifecycle.last_stats

    @property
    def verifying(self) -> bool:
        """Whether the next step checks its transfers (``OffloadConfig.verify``)."""
        return self.lifecycle.verify.next_step

    @property
    def verified_steps(self) -> int:
        """Steps whose transfers were checked (``OffloadConfig.verify``)."""
        return self.lifecycle.verify.verified

    @property
    def active(self) -> bool:
        return self.lifecycle.step is not None

    @property
    def _plan(self) -> WarmupResult | None:
        return self.lifecycle.plan

    @property
    def trace(self) -> ActivationTrace | None:
        return None if self._plan is None else self._plan.trace

    @property
    def schedule(self) -> ResidencySchedule | None:
        return None if self._plan is None else self._plan.schedule

    @property
    def report(self) -> ScheduleReport | None:
        """``check_schedule(trace, schedule)`` of the plan."""
        return None if self._plan is None else self._plan.report

    @property
    def pins(self) -> Mapping[int, tuple[int, ...]]:
        """Op index -> the storages a ``Work``-returning op (``dist.send``, an
        ``async_op`` collective, ...) touched there: they stay on the device, unmoved, to
        the end of every step (their communication ends at a ``Work.wait()`` no op shows)."""
        return {} if self._plan is None else self._plan.pins

    @property
    def foreign(self) -> frozenset[int]:
        """Storages ``fsdp::`` ops made or filled (FSDP's all-gather and reduce-scatter
        buffers): parameters' memory, 0 bytes in the trace, never moved or bound."""
        return frozenset() if self._plan is None else self._plan.foreign

    @property
    def region_holds(self) -> Mapping[int, int]:
        """Virtual storage id -> bytes an opaque region's own ops saved for its backward
        (a compiled module, a ``skip_offload`` function): counted from its forward op to
        its backward op, never moved."""
        return {} if self._plan is None else self._plan.virtual

    @property
    def op_guide(self) -> OpGuide | None:
        return None if self._plan is None else OpGuide.from_trace(self._plan.trace)

    @property
    def executor(self) -> BaseExecutor | None:
        """The executor of the step in progress (None between steps and in a step
        without grad)."""
        step = self.lifecycle.step
        return None if step is None else step.executor

    def reset(self) -> None:
        """Drop the plan: the next step warms up again."""
        self.lifecycle.reset()

    def __repr__(self) -> str:
        return (
            f"OffloadSession(state={self.state.value}, device={self.device}, "
            f"budget_bytes={self.config.budget_bytes}, steps={self.steps})"
        )

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> OffloadSession:
        other = current_session()
        if other is not None and other is not self:
            raise OffloadSessionError(
                f"OffloadSession.__enter__: another session ({other!r}) is already active; "
                "sessions do not nest. Finish the current `with` block first"
            )
        kind = self.lifecycle.enter(torch.is_grad_enabled())
        step = self.lifecycle.step
        assert step is not None
        step.started = time.perf_counter()
        step.token = activate(self)
        if kind is StepKind.PASS:
            return self  # untraced: the plan stays exactly as it was
        self.manager.verify = self.verifying
        step.executor = self._new_executor(kind)
        step.mode = ActivationDispatchMode(step.executor, on_error=self._op_raised)
        try:
            step.hooks = install_compiled_module_hooks()
            step.mode.__enter__()
        except BaseException:
            self._leave(step)
            self.lifecycle.raised()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        step = self.lifecycle.step
        if step is None:
            self.lifecycle.exit()  # refuses: names the state and the fix
        assert step is not None
        executor = step.executor
        try:
            if executor is not None and exc is not None:
                close_open_regions(executor)  # a BaseException skips their exit hooks
            if step.mode is not None:
                step.mode.__exit__(exc_type, exc, tb)
        finally:
            self._leave(step)
        if executor is None:  # a step without grad
            self._finish(self.lifecycle.raised() if exc is not None else self.lifecycle.exit())
            return None
        if exc is not None:
            self._fail(step, executor, exc)
            return None  # propagate unchanged
        if step.tainted is not None and not step.executor.failed:
            self._discard(step, executor)  # (a step that went on after the session's own
            return None                    # error is refused by finish() below)
        try:
            result = executor.finish()
        except BaseException as error:
            self._fail(step, executor, error)
            raise
        executor = step.executor  # the warmup that took the step over, if one did
        replanned = isinstance(result, WarmupResult) and step.kind is StepKind.REPLAY and (
            step.rewarm_reason is None)
        settling = self.lifecycle.state is StepState.REPLAYING and not self.settled
        self._finish(self.lifecycle.exit(result, replanned=replanned), executor)
        if settling and self.settled:
            LOGGER.info("OffloadSession: settled after %d warmup step(s): step %d ran the ops "
                        "the last warmup recorded; replaying its plan from here",
                        self.warmups, self.steps - 1)
        self.lifecycle.verify.step_done(self.manager.verify)
        return None

    # ------------------------------------------------------------------ internals

    def _new_executor(self, kind: StepKind) -> BaseExecutor:
        planner = self.config.resolved_planner(self.host_budget_bytes)
        if kind is StepKind.WARMUP:
            return self._new_warmup()
        return ReplayExecutor(self.manager, self.device, self._plan, planner=planner,
                              take_over=self._take_over,
                              rewarm_allowed=self.lifecycle.rewarm_allowed)

    def _new_warmup(self) -> WarmupExecutor:
        return WarmupExecutor(
            self.manager,
            self.device,
            budget_bytes=self.config.budget_bytes,
            planner=self.config.resolved_planner(self.host_budget_bytes),
            host_budget_bytes=self.host_budget_bytes,
            disk=None if self.disk is None else (
                self.config.disk_budget_bytes, self.disk_bandwidth_gbps),
        )

    def _take_over(self, reason: str, ops_changed: bool) -> WarmupExecutor:
        """A warmup executor takes the replayed step over: its ops changed (``reason`` is
        the mismatch; a re-warm), or an op raised inside it (the step is tainted and
        finishes as a warmup that never becomes a plan)."""
        step = self.lifecycle.step
        assert step is not None
        if ops_changed:
            self.lifecycle.ops_changed(reason)
            LOGGER.info("OffloadSession: step %d ran other ops than the plan's warmup (%s); "
                        "re-warming (warmup %d, settling: at most %d)", self.steps, reason,
                        self.warmups + 1, self.config.max_warmups)
        warm = self._new_warmup()
        if step.mode is not None:  # None at finish(): the mode has exited, no op is left
            step.mode.executor = warm
        step.executor = warm
        return warm

    def _op_raised(self, error: BaseException, where: str) -> None:
        """The dispatch mode saw an op raise: the step is tainted (never a plan), and a
        replay hands the rest of it to a warmup if the user catches the error."""
        reason = f"{where} raised {type(error).__name__}: {error}"
        self.lifecycle.op_raised(reason)
        step = self.lifecycle.step
        if step is not None and step.executor is not None:
            step.executor.taint(reason)

    def _leave(self, step: StepRecord) -> None:
        for handle in step.hooks:
            handle.remove()
        step.hooks = ()
        if step.token is not None:
            deactivate(step.token)
        step.token = None
        step.mode = None

    def _fail(self, step: StepRecord, executor: BaseExecutor, error: BaseException) -> None:
        """Clean up after ``error`` (the plan stays); a failure of the cleanup itself (e.g.
        a storage that cannot be paged back: ``DataLostError``) never replaces ``error``,
        it is attached to it as a note."""
        if isinstance(error, ReplayMismatchError) and not self.settled:
            error.add_note(
                f"hyper_offload: the session ran {self.warmups} warmup step(s) and no two "
                f"consecutive steps ran the same ops (OffloadConfig.max_warmups="
                f"{self.config.max_warmups}); it stays strict from here"
            )
        executor = step.executor or executor
        try:
            executor.abort()
        except Exception as cleanup_error:
            error.add_note(
                f"hyper_offload: cleaning up the session after this error also failed: "
                f"{type(cleanup_error).__name__}: {cleanup_error}"
            )
        finally:
            self._finish(self.lifecycle.raised(), executor)

    def _discard(self, step: StepRecord, executor: BaseExecutor) -> None:
        """A step in which an op raised and the user went on: it ran exactly; clean up
        and keep the plan (a step that raised is never planned)."""
        executor = step.executor or executor
        try:
            executor.abort()
        finally:
            self._finish(self.lifecycle.exit(), executor)
        # Once per session as a warning (a loop that probes a fast path every step would
        # repeat it), then at INFO.
        level = logging.WARNING if self.lifecycle.discarded == 1 else logging.INFO
        LOGGER.log(level, "OffloadSession: %s inside `with session:` and the step went on; it "
                   "ran exactly, and is not used as a plan (the session stays %s)",
                   step.tainted, self.state.value)

    def _finish(self, step: StepRecord, executor: BaseExecutor | None = None) -> None:
        """Close the step's stats (``last_stats``)."""
        executor = executor if executor is not None else step.executor
        stats = (executor.close_stats(self.pool) if executor is not None
                 else StepStats("pass", pool=self.pool.stats()))
        stats.step_seconds = time.perf_counter() - step.started
        stats.warmups, stats.settled = self.warmups, self.settled
        stats.rewarm_reason = step.rewarm_reason
        stats.discarded = step.tainted
        self.lifecycle.last_stats = stats


def _normalise(device: torch.device) -> torch.device:
    if device.type != "cpu" and device.index is None:
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device


# Re-exported for callers that catch it from the session module.
__all__ += ["OffloadSessionError", "ReplayMismatchError"]
