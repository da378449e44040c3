"""What every trainer integration shares: its settings, its door, and the trainer packages.

``OffloadArguments``: the settings a trainer integration reads, in one small dataclass.
It reads like ``TrainingArguments`` and ``HfArgumentParser`` parses it beside them
(``--offload_door eager --max_resident_activation_mb 512``); the names are those of
:class:`~hyper_offload.OffloadConfig` and the compile ``options=``, so a setting means the
same thing in every door. Options beyond these (``recompute``, ``verify``, a planner)
are the backend's and the session's own: build an :class:`OffloadDoor` from a
``hyper_offload.backend(...)`` or an ``OffloadSession(...)`` for those.

:func:`require`: the trainer packages, imported where an integration needs them: the one
place a missing optional dependency becomes an error that names the extra to install.

``OffloadDoor``: one trainer's offload, whichever door, behind the few calls a trainer
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

Importing it imports neither torch nor a trainer package (the doors load when an
:class:`OffloadDoor` is made).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import import_module
from types import ModuleType
from typing import Any, TYPE_CHECKING

from hyper_offload.errors import (
    ConfigurationError, ConfigurationTypeError, OptionalDependencyError,
)

if TYPE_CHECKING:
    import torch

    from hyper_offload.compiler.backend import HyperOffloadBackend
    from hyper_offload.compiler.step_report import StepReport
    from hyper_offload.eager.executor_base import StepStats
    from hyper_offload.eager.session import OffloadSession

__all__ = ["DOORS", "OffloadArguments", "OffloadDoor", "require"]

DOORS = ("compile", "eager")


@dataclass(frozen=True, kw_only=True)
class OffloadArguments:
    """Which door and what budget; validated on construction (``ConfigurationError``).

    Invariants: ``offload_door`` is one of :data:`DOORS`; at most one device budget is
    set; the fraction is the compile door's only (the eager door plans the step it
    traced, in MiB). Unset budgets keep the library's defaults.
    """

    offload_door: str = field(default="compile", metadata={
        "help": "hyper-offload door: 'compile' (torch.compile with backend hyper_offload, the "
                "model compiled in place) or 'eager' (an OffloadSession around each "
                "training step's forward and backward)"})
    max_resident_activation_mb: float | None = field(default=None, metadata={
        "help": "device budget for saved activations, in MiB (default 1024)"})
    max_resident_activation_fraction: float | None = field(default=None, metadata={
        "help": "compile door: the budget as a fraction in (0, 1] of the step's activation "
                "peak without offload, instead of max_resident_activation_mb"})
    max_host_activation_mb: float | None = field(default=None, metadata={
        "help": "host budget for offloaded activations per rank, in MiB (default: this "
                "machine's available memory over the ranks sharing it)"})
    inner_compiler: str = field(default="inductor", metadata={
        "help": "compile door: 'inductor' or 'aot_eager', what compiles the planned graphs"})

    def __post_init__(self) -> None:
        if self.offload_door not in DOORS:
            raise ConfigurationError(
                f"OffloadArguments.offload_door: expected one of {DOORS}, got "
                f"{self.offload_door!r}"
            )
        if None not in (self.max_resident_activation_mb, self.max_resident_activation_fraction):
            raise ConfigurationError(
                "OffloadArguments: max_resident_activation_mb and "
                "max_resident_activation_fraction both set the device budget; keep one"
            )
        if self.offload_door == "eager" and self.max_resident_activation_fraction is not None:
            raise ConfigurationError(
                "OffloadArguments.max_resident_activation_fraction: the eager door takes its "
                "budget in MiB (max_resident_activation_mb); the fraction is the compile "
                "door's"
            )
        # The door's own validation, where the user wrote the arguments.
        if self.offload_door == "compile":
            from hyper_offload.compiler.options import parse_backend_options

            parse_backend_options(self.backend_options())
        else:
            self.offload_config()

    def backend_options(self) -> dict[str, Any]:
        """The compile door's ``options=`` (only the settings given)."""
        names = ("max_resident_activation_mb", "max_resident_activation_fraction",
                 "max_host_activation_mb")
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return {"inner_compiler": self.inner_compiler, **given}

    def offload_config(self) -> Any:
        """The eager door's :class:`~hyper_offload.OffloadConfig`."""
        from hyper_offload.config import OffloadConfig

        names = ("max_resident_activation_mb", "max_host_activation_mb")
        return OffloadConfig(**{name: getattr(self, name) for name in names
                                if getattr(self, name) is not None})


def require(package: str, *, extra: str, feature: str) -> ModuleType:
    """The module ``package``, imported for ``feature``.

    Raises :class:`OptionalDependencyError` (an ``ImportError``) naming ``extra`` when it
    is not installed.
    """
    try:
        return import_module(package)
    except ImportError as error:
        raise OptionalDependencyError(
            f"{feature} needs the {package!r} package, which is not installed; install it "
            f'with `pip install "hyper-offload[{extra}]"`'
        ) from error


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


