"""The backends ``backend="hyper_offload"`` hands out: one per option set.

Dynamo calls the string backend once per region, with the options of the
``torch.compile`` call that made the region. Regions compiled with the same options
(across separate ``torch.compile`` calls on different blocks, too) must share one
:class:`~.dynamo_backend.HyperOffloadBackend`: one bandwidth probe per device, region
numbers that count, one host pool, one step under one budget. This registry is how: a
cache keyed by :meth:`~.options.BackendOptions.cache_key`, like Inductor's caches, not
configuration.

Lifetime: the registry holds its backends *weakly*. A backend lives as long as
something uses it (Dynamo's compiled code holds each region's forward, which holds its
backend), so a backend nobody uses any more is dropped; ``torch._dynamo.reset()``, which
drops Dynamo's compiled code, also calls :meth:`BackendRegistry.clear` (Dynamo calls the
``reset`` of every backend it cached), so the next compile starts a fresh step. Two
models that must not share a budget pass separate ``hyper_offload.backend(...)``
objects, which never enter the registry.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["BackendRegistry"]

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
