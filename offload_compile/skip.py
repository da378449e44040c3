"""``@hyper_offload.skip_offload``: keep a function out of offloading.

Under ``torch.compile`` the decorated function is a forced graph break
(``torch.compiler.disable``): it runs eagerly between two compiled regions, nothing
inside it is offloaded, and each compiled region is planned under the budget on its
own; ``torch._dynamo.explain`` lists the break. Outside compile it simply calls the
function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["skip_offload"]

F = TypeVar("F", bound=Callable[..., Any])


def skip_offload(fn: F) -> F:
    """Run ``fn`` without offloading (see the module docstring)."""
    if not callable(fn):
        raise TypeError(
            f"skip_offload: expected a function or method to decorate, got "
            f"{type(fn).__name__}; use it as @hyper_offload.skip_offload"
        )

    @functools.wraps(fn)
    def call_unchanged(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return torch.compiler.disable(call_unchanged, recursive=True)  # type: ignore[return-value]
