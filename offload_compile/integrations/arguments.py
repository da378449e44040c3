"""What an integration needs before torch: its settings, and the trainer packages.

``OffloadArguments``: the settings a trainer integration reads, in one small dataclass.
It reads like ``TrainingArguments`` and ``HfArgumentParser`` parses it beside them
(``--offload_door eager --max_resident_activation_mb 512``); the names are those of
:class:`~hyper_offload.OffloadConfig` and the compile ``options=``, so a setting means the
same thing in every door. Options beyond these (``recompute``, ``verify``, a planner)
are the backend's and the session's own: build an :class:`~.door.OffloadDoor` from a
``hyper_offload.backend(...)`` or an ``OffloadSession(...)`` for those.

:func:`require`: the trainer packages, imported where an integration needs them: the one
place a missing optional dependency becomes an error that names the extra to install.

Imports neither torch nor a trainer package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from types import ModuleType
from typing import Any

from hyper_offload.errors import ConfigurationError, OptionalDependencyError

__all__ = ["DOORS", "OffloadArguments", "require"]

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
