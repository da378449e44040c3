"""Configured backends under a name: ``hyper_offload.register_backend(name, **options)``.

Trainers that take the compile backend as a string from their configuration (torchtitan's
``--compile.backend``, a YAML file) cannot be handed a ``hyper_offload.backend(...)``
object, and ``backend="hyper_offload"`` alone cannot carry a budget. So::

    hyper_offload.register_backend("hyper_offload_16g", max_resident_activation_mb=16384)
    torch.compile(block, backend="hyper_offload_16g")      # or --compile.backend hyper_offload_16g
    hyper_offload.step_report("hyper_offload_16g")         # the step plan in force

The name goes into torch's own registry (``torch._dynamo.register_backend``), with a
:class:`NamedBackend` that carries the validated options and compiles every region as
``backend="hyper_offload", options=...`` with those options does: regions share one
:class:`~.dynamo_backend.HyperOffloadBackend` per option set (one step, one budget, one
host pool; :mod:`.backend_registry`), ``torch._dynamo.reset()`` forgets it, and
:func:`step_report` finds it again by the name. Nothing is kept here: the library adds a
name to torch's registry only when asked to, and reads it back from there.

Registering a name twice with the same options returns the same object (a configuration
module imported twice, one function called per rank); with other options, or a name torch
already uses for another backend, it is a :class:`~hyper_offload.ConfigurationError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from hyper_offload.errors import ConfigurationError, ConfigurationTypeError

from .dynamo_backend import HyperOffloadBackend, hyper_offload_backend, shared_backend
from .options import BackendOptions, parse_backend_options
from .region_report import RegionReport
from .step_report import StepReport

__all__ = ["NamedBackend", "register_backend", "step_report"]


class NamedBackend:
    """What :func:`register_backend` puts in torch's registry under ``name``: the Dynamo
    backend function of ``backend="hyper_offload"`` bound to ``options``."""

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        self.name = name
        self.options = dict(options)
        """The keyword options it was registered with (as given)."""
        self.parsed: BackendOptions = parse_backend_options(options)  # validated at once

    def __repr__(self) -> str:
        return f"NamedBackend({self.name!r}, {self.options})"

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any],
        options: dict[str, Any] | None = None, mode: str | None = None,
    ) -> Any:
        # torch.compile(backend=name, options=...) may add options: another option set,
        # so another shared backend (step_report(name) reads the registered one).
        merged = {**self.options, **(options or {})}
        return hyper_offload_backend(gm, example_inputs, options=merged, mode=mode)

    def reset(self) -> None:
        """``torch._dynamo.reset()`` calls this: forget the shared backends, as for
        ``backend="hyper_offload"``."""
        hyper_offload_backend.reset()  # type: ignore[attr-defined]

    @property
    def backend(self) -> HyperOffloadBackend | None:
        """The backend its regions share now (None before the first compile)."""
        return shared_backend(self.options)

    @property
    def step_report(self) -> StepReport | None:
        backend = self.backend
        return None if backend is None else backend.step_report

    @property
    def reports(self) -> list[RegionReport]:
        backend = self.backend
        return [] if backend is None else backend.reports


def register_backend(name: str, **options: Any) -> NamedBackend:
    """Register ``backend="hyper_offload"`` with ``options`` under ``name`` with
    ``torch._dynamo`` (module docstring); returns the registered :class:`NamedBackend`.
    ``options`` are validated here, as ``hyper_offload.backend(**options)`` validates
    them: a bad key or value raises :class:`~hyper_offload.ConfigurationError` at once,
    not at the first compile."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigurationTypeError(
            f"hyper_offload.register_backend: name must be a Python identifier (torch "
            f"looks backends up by it, config files spell it), got {name!r}"
        )
    wanted = NamedBackend(name, options)
    existing = _registered(name)
    if existing is None:
        torch._dynamo.register_backend(wanted, name=name)
        return wanted
    if isinstance(existing, NamedBackend) and (
            existing.parsed.cache_key() == wanted.parsed.cache_key()):
        return existing
    taken = (f"registered with other options, {existing.options}"
             if isinstance(existing, NamedBackend) else f"torch's backend {existing!r}")
    raise ConfigurationError(
        f"hyper_offload.register_backend: the name {name!r} is taken ({taken}); torch "
        "keeps one backend per name for the life of the process. Fix: register these "
        "options under another name"
    )


def step_report(name_or_backend: str | NamedBackend | HyperOffloadBackend) -> StepReport | None:
    """The step plan in force for the regions a backend compiled (None before a step
    ended): ``name_or_backend`` is a name given to :func:`register_backend`,
    ``"hyper_offload"`` (the default options), or a backend object. A trainer that knows
    its backend only by name reads the report with the same name."""
    if isinstance(name_or_backend, (NamedBackend, HyperOffloadBackend)):
        return name_or_backend.step_report
    if name_or_backend == "hyper_offload":
        backend = shared_backend(None)
        return None if backend is None else backend.step_report
    found = _registered(name_or_backend) if isinstance(name_or_backend, str) else None
    if not isinstance(found, NamedBackend):
        raise ConfigurationError(
            f"hyper_offload.step_report: {name_or_backend!r} is no hyper_offload backend: "
            "pass a name given to hyper_offload.register_backend, 'hyper_offload', or the "
            "backend object itself"
        )
    return found.step_report


def _registered(name: str) -> Any | None:
    """What torch's backend registry holds under ``name``, or None."""
    from torch._dynamo.exc import InvalidBackend

    try:
        return torch._dynamo.lookup_backend(name)
    except InvalidBackend:
        return None
