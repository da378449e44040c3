"""``@hyper_offload.skip_offload``: keep a function out of offloading.

Under ``torch.compile`` the decorated function is a forced graph break
(``torch.compiler.disable``): it runs eagerly between two compiled regions, nothing
inside it is offloaded, and each compiled region is planned under the budget on its
own; ``torch._dynamo.explain`` lists the break. Eagerly, inside an active
``OffloadSession``, it runs as one virtual op (see :mod:`hyper_offload.eager.opaque`);
outside any session it is a plain call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hyper_offload.errors import ConfigurationTypeError

from .opaque import call_opaque

__all__ = ["skip_offload"]

F = TypeVar("F", bound=Callable[..., Any])


def skip_offload(fn: F) -> F:
    """Run ``fn`` without offloading, as one opaque op (see the module docstring).

    Also the way to keep a ``torch.compile``d function or module compiled inside an
    eager ``OffloadSession``: ``block = skip_offload(torch.compile(block))``.
    """
    if not callable(fn):
        raise ConfigurationTypeError(
            f"skip_offload: expected a function or method to decorate, got "
            f"{type(fn).__name__}; use it as @hyper_offload.skip_offload"
        )

    @functools.wraps(fn)
    def call_as_opaque_region(*args: Any, **kwargs: Any) -> Any:
        return call_opaque(fn, args, kwargs)

    return torch.compiler.disable(call_as_opaque_region, recursive=True)  # type: ignore[return-value]
