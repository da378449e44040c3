"""What long work is doing now, for whoever listens (an estimate of an 8B model takes
about 40 s: capturing, partitioning region k, planning the step, pricing ...).

Library code calls :func:`note` when a stage begins. Nothing is printed or logged: a
note reaches only a listener installed with :func:`listening` around the work (the
command line installs one that rewrites one line in place on a terminal). The listener
lives in a :class:`~contextvars.ContextVar`, so there is no global state, and a thread
or task that did not install one hears nothing.

Invariant: imports the standard library only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

__all__ = ["Listener", "listening", "note"]

Listener = Callable[[str], None]
"""Called with a short description of the stage that begins (lower case, no period)."""

_LISTENER: ContextVar[Listener | None] = ContextVar("hyper_offload_progress", default=None)


def note(stage: str) -> None:
    """Tell the listener, if any, that ``stage`` begins (cheap when nobody listens)."""
    listener = _LISTENER.get()
    if listener is not None:
        listener(stage)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Send every :func:`note` made inside the block (in this context) to ``listener``."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)
