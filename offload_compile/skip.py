"""``skip_offload``: mark a function as an opaque region.

Under ``torch.compile`` the function is not traced (``torch.compiler.disable``), so it
runs eagerly as a graph break. Eagerly, inside an active ``OffloadSession``, it runs as
one virtual op (see :mod:`hyper_offload.opaque`); outside any session it is a plain
call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .opaque import call_opaque

__all__ = ["skip_offload"]

F = TypeVar("F", bound=Callable[..., Any])


def skip_offload(fn: F) -> F:
    """Decorator: run ``fn`` as one opaque op (no per-op tracing or offloading inside).

    Also the way to keep a ``torch.compile``d function or module compiled inside an
    eager ``OffloadSession``: ``block = skip_offload(torch.compile(block))``.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return call_opaque(fn, args, kwargs)

    return torch.compiler.disable(wrapper)  # type: ignore[return-value]
