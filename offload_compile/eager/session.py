"""``OffloadSession``: the eager front door (warmup trace -> plan -> replay).

Usage (design section 3)::

    session = OffloadSession(OffloadConfig(max_resident_activation_mb=512))
    with session:            # step 1: warmup (trace + online eviction)
        loss = model(x); loss.backward()
    with session:            # later steps: replay the planned schedule
        loss = model(x); loss.backward()

Lifecycle. ``__enter__`` picks the executor for the phase (``"warmup"`` until a plan
exists, then ``"replay"``), makes the session current (a ``ContextVar``, read by
``skip_offload``) and enters :class:`ActivationDispatchMode`. ``__exit__`` leaves the
mode first (so cleanup is never traced), then

* on success: warmup builds and checks the plan (the session switches to replay);
  replay verifies the step ran every recorded op and restores what must survive;
* on an exception: every transfer is synchronised, offloaded storages still in use are
  paged back, every host buffer returns to the pool (``pool.stats()`` in-use bytes are
  0 again), and the exception propagates unchanged. The plan is kept; ``reset()``
  drops it to re-warm.

Who holds what. The session owns one ``TransferEngine``, one ``PinnedMemoryPool`` and
one ``ResidencyManager`` for its lifetime. During a step the manager holds the storage
*objects* it manages (not extra copies of their bytes) and the host buffers; the
executor holds only storage ids; autograd and the user hold ordinary tensors whose
storages the manager shrinks and grows in place. Nothing is held across steps except
the plan (trace, schedule, report, op callables).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from contextvars import Token
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
from hyper_offload.runtime.verify import VerifySteps

from .active import activate, current_session, deactivate
from .compiled_modules import install_compiled_module_hooks
from .dispatch_mode import ActivationDispatchMode
from .executor_base import BaseExecutor, OffloadSessionError, StepStats
from .op_guide import OpGuide
from .replay import ReplayExecutor
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
        self.manager = ResidencyManager(self.engine, self.pool)
        self._plan: WarmupResult | None = None
        self._executor: BaseExecutor | None = None
        self._mode: ActivationDispatchMode | None = None
        self._token: Token[OffloadSession | None] | None = None
        self._hooks: tuple[Any, ...] = ()
        self._started = 0.0
        self.last_stats: StepStats | None = None
        """Stats of the most recent step (also after a failed one)."""
        self.steps = 0
        """Completed steps (warmup and replay) since construction or ``reset()``."""
        self.rewarms = 0
        """Automatic re-warms after a structural mismatch (settling, or
        ``rewarm_on_mismatch``)."""
        self.warmups = 0
        """Warmup steps since construction or ``reset()`` (the first step and each
        re-warm)."""
        self.settled = False
        """Whether a replayed step ran the ops its warmup recorded (two consecutive steps
        agreed): from then on a mismatch raises, unless ``rewarm_on_mismatch``."""
        self._rewarm_reason: str | None = None
        self.replans = 0
        """Plans remade after a replayed step ran the same ops with larger sizes (no
        re-trace: :mod:`.size_drift`)."""
        self._verify = VerifySteps(self.config.verify)

    # ------------------------------------------------------------------ public state

    @property
    def phase(self) -> str:
        """``"warmup"`` until a plan exists, then ``"replay"``."""
        return "warmup" if self._plan is None else "replay"

    @property
    def verifying(self) -> bool:
        """Whether the next step checks its transfers (``OffloadConfig.verify``)."""
        return self._verify.next_step

    @property
    def verified_steps(self) -> int:
        """Steps whose transfers were checked (``OffloadConfig.verify``)."""
        return self._verify.verified

    @property
    def active(self) -> bool:
        return self._executor is not None

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
        """The executor of the step in progress (None between steps)."""
        return self._executor

    def reset(self) -> None:
        """Drop the plan: the next step warms up again."""
        if self.active:
            raise OffloadSessionError(
                "OffloadSession.reset(): called inside the session's own `with` block; "
                "call it between steps"
            )
        self._plan = None
        self.steps = 0
        self.warmups = 0
        self.settled = False

    def __repr__(self) -> str:
        return (
            f"OffloadSession(phase={self.phase}, device={self.device}, "
            f"budget_bytes={self.config.budget_bytes}, steps={self.steps})"
        )

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> OffloadSession:
        other = current_session()
        if self.active or other is not None:
            which = "this session is" if other is self or self.active else f"another session ({other!r}) is"
            raise OffloadSessionError(
                f"OffloadSession.__enter__: {which} already active; sessions do not nest. "
                "Finish the current `with` block first"
            )
        self.manager.verify = self.verifying
        self._executor = self._new_executor()
        self._mode = ActivationDispatchMode(self._executor)
        self._token = activate(self)
        self._started = time.perf_counter()
        try:
            self._hooks = install_compiled_module_hooks()
            self._mode.__enter__()
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._mode is not None and self._executor is not None
        executor = self._executor
        try:
            self._mode.__exit__(exc_type, exc, tb)
        finally:
            self._leave()
        if exc_type is not None:
            if isinstance(exc, ReplayMismatchError) and not self.settled:
                exc.add_note(
                    f"hyper_offload: the session ran {self.warmups} warmup step(s) and no two "
                    f"consecutive steps ran the same ops (OffloadConfig.max_warmups="
                    f"{self.config.max_warmups}); it stays strict from here"
                )
            self._abort(executor, exc)
            return None  # propagate unchanged
        try:
            result = executor.finish()
        except BaseException as error:
            self._abort(executor, error)
            raise
        if isinstance(result, WarmupResult):
            self._plan = result
            if isinstance(executor, ReplayExecutor) and executor.successor is None:
                self.replans += 1  # same ops, larger sizes: planned again (.size_drift)
        if isinstance(executor, ReplayExecutor) and executor.successor is None and not self.settled:
            self.settled = True
            LOGGER.info("OffloadSession: settled after %d warmup step(s): step %d ran the ops "
                        "the last warmup recorded; replaying its plan from here",
                        self.warmups, self.steps)
        if isinstance(executor, ReplayExecutor) and executor.successor is not None:
            executor = executor.successor  # re-warmed: report the warmup's figures
        self._close_stats(executor)
        self._verify.step_done(self.manager.verify)
        self.steps += 1
        return None

    # ------------------------------------------------------------------ internals

    def _new_executor(self) -> BaseExecutor:
        self._rewarm_reason = None
        if self._plan is None:
            return self._new_warmup()
        settling = not self.settled and self.warmups < self.config.max_warmups
        rewarm = self._take_over if self.config.rewarm_on_mismatch or settling else None
        return ReplayExecutor(self.manager, self.device, self._plan, rewarm=rewarm,
                              planner=self.config.resolved_planner(self.host_budget_bytes))

    def _new_warmup(self) -> WarmupExecutor:
        self.warmups += 1
        return WarmupExecutor(
            self.manager,
            self.device,
            budget_bytes=self.config.budget_bytes,
            planner=self.config.resolved_planner(self.host_budget_bytes),
            host_budget_bytes=self.host_budget_bytes,
        )

    def _take_over(self, reason: str) -> WarmupExecutor:
        """A warmup executor takes the mismatched step over (settling, or
        ``rewarm_on_mismatch``); ``reason`` is the mismatch."""
        self._rewarm_reason = reason
        LOGGER.info("OffloadSession: step %d ran other ops than the plan's warmup (%s); "
                    "re-warming (warmup %d, settling: at most %d)", self.steps, reason,
                    self.warmups + 1, self.config.max_warmups)
        warm = self._new_warmup()
        if self._mode is not None:
            self._mode.executor = warm
            self._executor = warm
        self.rewarms += 1
        return warm

    def _leave(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = ()
        if self._token is not None:
            deactivate(self._token)
        self._token = None
        self._mode = None
        self._executor = None

    def _abort(self, executor: BaseExecutor, error: BaseException | None) -> None:
        """Clean up after ``error``; a failure of the cleanup itself (e.g. a storage that
        cannot be paged back: ``DataLostError``) never replaces ``error``, it is attached
        to it as a note."""
        try:
            executor.abort()
        except Exception as cleanup_error:
            if error is None:
                raise
            if hasattr(error, "add_note"):
                error.add_note(
                    f"hyper_offload: cleaning up the session after this error also failed: "
                    f"{type(cleanup_error).__name__}: {cleanup_error}"
                )
        finally:
            self._close_stats(executor)

    def _close_stats(self, executor: BaseExecutor) -> None:
        stats = executor.close_stats(self.pool)
        stats.step_seconds = time.perf_counter() - self._started
        stats.warmups, stats.settled = self.warmups, self.settled
        stats.rewarm_reason = self._rewarm_reason
        self.last_stats = stats


def _normalise(device: torch.device) -> torch.device:
    if device.type != "cpu" and device.index is None:
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device


# Re-exported for callers that catch it from the session module.
__all__ += ["OffloadSessionError", "ReplayMismatchError"]
