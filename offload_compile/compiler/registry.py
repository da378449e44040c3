"""How backends are found: ``backend="hyper_offload"``, ``hyper_offload.backend(...)``, names.

* ``torch.compile(model, backend="hyper_offload", options={...})``: Dynamo calls
  :func:`hyper_offload_backend` once per region, with the options of the ``torch.compile``
  call that made the region. Regions compiled with the same options (across separate
  ``torch.compile`` calls on different blocks, too) must share one
  :class:`~.backend.HyperOffloadBackend`: one bandwidth probe per device, region numbers
  that count, one host pool, one step under one budget. :class:`BackendRegistry` is how:
  a cache keyed by :meth:`~.options.BackendOptions.cache_key`, like Inductor's caches,
  not configuration. It holds its backends *weakly* (Dynamo's compiled code holds each
  region's forward, which holds its backend); ``torch._dynamo.reset()`` calls
  :func:`hyper_offload_backend`'s ``reset``, so the next compile starts a fresh step.
  :func:`shared_backend` finds the backend of an option set (to read its reports).
* ``hyper_offload.backend(config, **options)``: a backend object of one's own (two models
  that must not share a budget pass two); it never enters the registry.
* ``hyper_offload.register_backend(name, **options)``: trainers that take the compile
  backend as a string (torchtitan's ``--compile.backend``, a YAML file) get a name in
  torch's own registry (``torch._dynamo.register_backend``) whose :class:`NamedBackend`
  compiles every region as ``backend="hyper_offload", options=...`` does;
  :func:`step_report` reads the step plan back by that name. Registering a name twice
  with the same options returns the same object; with other options, or a name torch
  already uses for another backend, it is a :class:`~hyper_offload.ConfigurationError`.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch import fx

from hyper_offload.config import OffloadConfig
from hyper_offload.errors import ConfigurationError, ConfigurationTypeError

from .backend import HyperOffloadBackend
from .options import EAGER_ONLY, BackendOptions, parse_backend_options
from .region_report import RegionReport
from .step_report import StepReport

__all__ = [
    "BackendRegistry", "NamedBackend", "backend", "hyper_offload_backend", "register_backend",
    "shared_backend", "step_report",
]

_Backend = TypeVar("_Backend")


class BackendRegistry(Generic[_Backend]):
    """Backends by option key, held weakly (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backends: weakref.WeakValueDictionary[str, _Backend] = weakref.WeakValueDictionary()

    def __len__(self) -> int:
        with self._lock:
            return len(self._backends)

    def __repr__(self) -> str:
        return f"BackendRegistry({len(self)} backend(s))"

    def get(self, key: str, make: Callable[[], _Backend]) -> _Backend:
        """The backend for ``key``, made by ``make()`` if none is alive."""
        with self._lock:
            backend = self._backends.get(key)
            if backend is None:
                backend = make()
                self._backends[key] = backend
            return backend

    def peek(self, key: str) -> _Backend | None:
        """The live backend for ``key``, or None (never makes one)."""
        with self._lock:
            return self._backends.get(key)

    def clear(self) -> None:
        """Forget every backend (``torch._dynamo.reset()`` calls this)."""
        with self._lock:
            self._backends.clear()


def backend(config: OffloadConfig | None = None, **options: Any) -> HyperOffloadBackend:
    """A configured backend object: ``torch.compile(model, backend=hyper_offload.backend(
    OffloadConfig(max_resident_activation_mb=512), inner_compiler="aot_eager"))``.

    ``options`` are the keys ``options=`` accepts besides the ``OffloadConfig`` fields
    (``inner_compiler``, ``max_resident_activation_fraction``, ...), or those fields
    themselves. With ``config`` given, every one of its fields the compile door reads
    applies (an option passed beside it wins); its ``max_resident_activation_mb`` is
    replaced by the fraction when one is passed."""
    if config is not None:
        if not isinstance(config, OffloadConfig):
            raise ConfigurationTypeError(
                f"hyper_offload.backend: config must be an OffloadConfig, got "
                f"{type(config).__name__}; pass options as keywords instead"
            )
        fields = {
            f.name: getattr(config, f.name) for f in dataclasses.fields(OffloadConfig)
            if f.name not in EAGER_ONLY and f.name != "max_offload_activation_mb"
        }
        if "max_resident_activation_fraction" in options:
            del fields["max_resident_activation_mb"]
        options = {**fields, **options}
    return HyperOffloadBackend(parse_backend_options(options))


def hyper_offload_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The function Dynamo calls for ``backend="hyper_offload"`` (entry point);
    ``torch.compile``'s ``mode=`` arrives as ``mode``."""
    options = dict(options or {})
    if mode is not None:
        if options.get("mode", mode) != mode:
            raise ConfigurationError(
                f"hyper_offload: torch.compile(mode={mode!r}) and options['mode']="
                f"{options['mode']!r} disagree; pass the mode once"
            )
        options["mode"] = mode
    parsed = parse_backend_options(options)
    shared = _SHARED_BACKENDS.get(parsed.cache_key(), lambda: HyperOffloadBackend(parsed))
    return shared(gm, example_inputs)


# The backends of backend="hyper_offload", one per option set: a cache, not
# configuration. torch._dynamo.reset() calls this function's ``reset``.
_SHARED_BACKENDS: BackendRegistry[HyperOffloadBackend] = BackendRegistry()
hyper_offload_backend.reset = _SHARED_BACKENDS.clear  # type: ignore[attr-defined]


def shared_backend(options: dict[str, Any] | None = None) -> HyperOffloadBackend | None:
    """The backend ``backend="hyper_offload"`` with these ``options`` uses now, if any:
    how to read its ``step_report`` and ``reports`` after ``torch.compile(model,
    backend="hyper_offload", options=...)``."""
    parsed = parse_backend_options(options)
    return _SHARED_BACKENDS.peek(parsed.cache_key())


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
