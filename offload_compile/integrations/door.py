"""``OffloadDoor``: one trainer's offload, whichever door, behind the few calls a trainer
integration makes.

* compile door: a :class:`~hyper_offload.compiler.HyperOffloadBackend`;
  :meth:`~OffloadDoor.compile` compiles a module *in place* (``nn.Module.compile``: the
  module keeps its class, its ``forward`` signature and its ``state_dict`` keys, which
  trainers inspect and save);
  the step report is the backend's ``step_report`` (*predicted* figures, planned from
  the step the backend saw);
* eager door: an :class:`~hyper_offload.OffloadSession`, made for the trainer's device at
  :meth:`~OffloadDoor.start`; each training step's forward and backward run inside it, either as a
  ``with`` block (:meth:`~OffloadDoor.step`) or between two trainer hooks
  (:meth:`~OffloadDoor.enter_step`, :meth:`~OffloadDoor.exit_step`); the step report is the
  session's ``last_stats`` (*measured*).

:meth:`~OffloadDoor.metrics` flattens the report into the figures trainers log, each name saying
whether it is predicted or measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TYPE_CHECKING

import torch

from hyper_offload.errors import ConfigurationError, ConfigurationTypeError

from .arguments import OffloadArguments

if TYPE_CHECKING:
    from hyper_offload.compiler.backend import HyperOffloadBackend
    from hyper_offload.compiler.step_report import StepReport
    from hyper_offload.eager.executor_base import StepStats
    from hyper_offload.eager.session import OffloadSession

__all__ = [
    "OffloadDoor",
]


_MIB = float(1 << 20)


class OffloadDoor:
    """The compile door's backend or the eager door's session, for one trainer.

    ``offload``: :class:`OffloadArguments` (default ``OffloadArguments()``), or a backend
    or session built with options of its own. Invariant: exactly one of ``backend`` and
    ``session`` is used; ``session`` is None until :meth:`~OffloadDoor.start` (eager door).
    """

    def __init__(self, offload: Any = None) -> None:
        # Here, not at import: the trainers' modules import this one, and a door's
        # machinery (Inductor's for the compile door) loads only when a door is made.
        from hyper_offload.compiler.backend import HyperOffloadBackend
        from hyper_offload.compiler.registry import backend
        from hyper_offload.eager.session import OffloadSession

        self.arguments: OffloadArguments | None = None
        self.backend: HyperOffloadBackend | None = None
        self.session: OffloadSession | None = None
        if offload is None or isinstance(offload, OffloadArguments):
            self.arguments = offload if offload is not None else OffloadArguments()
            if self.arguments.offload_door == "compile":
                self.backend = backend(**self.arguments.backend_options())
        elif isinstance(offload, HyperOffloadBackend):
            self.backend = offload
        elif isinstance(offload, OffloadSession):
            self.session = offload
        else:
            raise ConfigurationTypeError(
                f"OffloadDoor: expected OffloadArguments, a hyper_offload.backend(...) or an "
                f"OffloadSession, got {type(offload).__name__}"
            )

    @property
    def door(self) -> str:
        """``"compile"`` or ``"eager"``."""
        return "compile" if self.backend is not None else "eager"

    def __repr__(self) -> str:
        return f"OffloadDoor({self.backend if self.backend is not None else self.session!r})"

    def compile(self, module: torch.nn.Module) -> None:
        """Compile ``module`` in place with the backend (compile door only)."""
        if self.backend is None:
            raise ConfigurationError(
                "OffloadDoor.compile: this is the eager door, which compiles nothing; use "
                "OffloadArguments(offload_door='compile') to compile"
            )
        module.compile(backend=self.backend)

    def start(self, device: torch.device | str) -> None:
        """Make the eager door's session for ``device`` (once; nothing in the compile door)."""
        if self.backend is None and self.session is None:
            from hyper_offload.eager.session import OffloadSession

            assert self.arguments is not None
            self.session = OffloadSession(self.arguments.offload_config(), device=device)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A training step's forward and backward: inside the session (eager door)."""
        self.enter_step()
        try:
            yield
        except BaseException as error:
            self.exit_step(error)
            raise
        self.exit_step()

    def enter_step(self) -> None:
        """Start a step (eager door; the session must exist: :meth:`~OffloadDoor.start`)."""
        if self.backend is not None:
            return
        if self.session is None:
            raise ConfigurationError(
                "OffloadDoor.enter_step: the eager door has no session yet; call "
                "start(device) first (the trainer integrations do, at the start of training)"
            )
        self.session.__enter__()

    def exit_step(self, error: BaseException | None = None) -> None:
        """End the step in progress, if one is: accepted, or aborted by ``error`` (the
        session returns every host buffer; the error is not swallowed here)."""
        if self.session is None or not self.session.active:
            return
        if error is None:
            self.session.__exit__(None, None, None)
        else:
            self.session.__exit__(type(error), error, error.__traceback__)

    @property
    def report(self) -> StepReport | StepStats | None:
        """The compile door's ``step_report`` (predicted) or the eager door's last step's
        ``StepStats`` (measured); None before a step ended."""
        if self.backend is not None:
            return self.backend.step_report
        return None if self.session is None else self.session.last_stats

    def metrics(self) -> dict[str, float]:
        """The report as figures to log, in MiB; empty before a step ended."""
        report = self.report
        if report is None:
            return {}
        if self.backend is not None:
            return {
                "offload_budget_mb": report.budget_bytes / _MIB,
                "offload_predicted_peak_mb": report.peak_bytes / _MIB,
                "offload_predicted_moved_mb": report.moved_bytes / _MIB,
            }
        assert self.session is not None
        return {
            "offload_budget_mb": self.session.config.budget_bytes / _MIB,
            "offload_measured_peak_mb": report.peak_resident_bytes / _MIB,
            "offload_measured_moved_mb": report.bytes_d2h / _MIB,
        }


