"""``ActivationDispatchMode`` and the small, allocation-light helpers of the op hot path.

The mode is deliberately thin: every aten op that runs while an ``OffloadSession`` is
active goes to the current executor's :meth:`dispatch`, which decides what to record or
which residency actions to run around the op. Inside ``__torch_dispatch__`` the mode is
already popped from the mode stack, so the executor's ``func(*args)`` runs the real
kernel (and any mode entered *before* the session, such as a ``DeviceMemoryMeter``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from .executor_base import BaseExecutor

__all__ = ["ActivationDispatchMode", "tensor_leaves", "written_arguments"]

_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


class ActivationDispatchMode(TorchDispatchMode):
    """Forwards every op to ``executor.dispatch`` (design section 5.1)."""

    def __init__(self, executor: BaseExecutor) -> None:
        super().__init__()
        self.executor = executor

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for tensor_type in types:
            if tensor_type.__torch_dispatch__ is not _PLAIN_DISPATCH:
                # A tensor subclass (e.g. ShadowTensor) unwraps itself first; its inner
                # ops come back here with plain tensors.
                return NotImplemented
        return self.executor.dispatch(func, args, kwargs or {})


def tensor_leaves(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's arguments or result, in pytree leaf order.

    Aten arguments nest at most lists/tuples of tensors (``cat``, ``_foreach_*``) and
    results are a tensor, a tuple or a list, so a short recursion beats ``tree_flatten``
    on the hot path and allocates nothing but the generator.
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list, dict)):
                yield from tensor_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensor_leaves(item)


def written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of every argument the op's schema marks as mutated
    (``Tensor(a!)``): the op WRITEs their storages. Non-aten callables write nothing."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        (position, argument.name)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )
