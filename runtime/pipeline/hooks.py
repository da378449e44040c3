"""The current swap group (a ``ContextVar``) and the saved-tensor hooks that use it.

Three situations, told apart by the context variable:

* inside an eligible FWD leaf: the chunk's :class:`SwapGroup` is current; wrapped code
  adds its saved tensors to it (``swap_wrapper``) or registers tensors explicitly
  (``swap_tensor_wrapper``);
* inside a FWD leaf that has no swap window (or a schedule without ``swap=True``):
  :data:`NO_WINDOW` is current; wrappers pass everything through silently;
* anywhere else (no pipeline step running): nothing is current; ``swap_tensor_wrapper``
  warns once per call site, ``swap_wrapper`` simply runs the wrapped code.

Every saved tensor packed while a group is current is packed as a :class:`SavedRef`
holding the tensor and the group; unpacking checks the group's residency first, so a
swapped-out activation read before its ``SWAP_WAIT_LOAD`` raises
:class:`~.swap_group.SwapStateError` instead of reading a 0-byte storage (which crashes
the process, TORCH_NOTES). ``ContextVar`` gives each thread its own value and restores
the outer value when a nested context exits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Final

import torch

from .swap_group import SwapGroup

__all__ = [
    "NO_WINDOW",
    "SavedRef",
    "current_group",
    "group_scope",
    "in_pipeline_forward",
    "saved_tensor_hooks",
    "swap_step_running",
    "swap_step_scope",
]


class _NoWindow:
    """Marker: a pipeline FWD leaf runs, but its chunk is not swapped."""

    def __repr__(self) -> str:
        return "NO_WINDOW"


NO_WINDOW: Final = _NoWindow()
_CURRENT: ContextVar[SwapGroup | _NoWindow | None] = ContextVar("hyper_offload_swap_group", default=None)


_SWAP_STEP: ContextVar[bool] = ContextVar("hyper_offload_swap_step", default=False)


def swap_step_running() -> bool:
    """True inside a ``PipelineSwapSchedule.step()`` that swaps (``swap=True``): its
    swap groups resize the chunks' storages themselves (the eager door refuses to plan
    the same storages)."""
    return _SWAP_STEP.get()


@contextmanager
def swap_step_scope(swapping: bool) -> Iterator[None]:
    """Mark the ``step()`` running in this context as swapping (or not)."""
    token = _SWAP_STEP.set(swapping)
    try:
        yield
    finally:
        _SWAP_STEP.reset(token)


def current_group() -> SwapGroup | None:
    """The swap group of the FWD leaf running in this context, if it is swapped."""
    value = _CURRENT.get()
    return value if isinstance(value, SwapGroup) else None


def in_pipeline_forward() -> bool:
    """True inside any pipeline FWD leaf (swapped or not)."""
    return _CURRENT.get() is not None


@contextmanager
def group_scope(group: SwapGroup | None) -> Iterator[None]:
    """Make ``group`` current (``None``: a FWD leaf without a swap window); nesting restores
    the outer value. Saved tensors packed inside are guarded by :func:`saved_tensor_hooks`."""
    token = _CURRENT.set(NO_WINDOW if group is None else group)
    try:
        if group is None:
            yield
        else:
            with saved_tensor_hooks(collect=False):
                yield
    finally:
        _CURRENT.reset(token)


class SavedRef:
    """What a pack hook returns: the saved tensor and the group that may own its storage."""

    __slots__ = ("tensor", "group")

    def __init__(self, tensor: torch.Tensor, group: SwapGroup) -> None:
        self.tensor = tensor
        self.group = group


def _unpack(saved: object) -> torch.Tensor:
    if isinstance(saved, SavedRef):
        saved.group.check_readable(saved.tensor, "backward (unpacking a saved tensor)")
        return saved.tensor
    assert isinstance(saved, torch.Tensor)
    return saved


def saved_tensor_hooks(
    *, collect: bool, policy_fn: Callable[[torch.Tensor], bool] | None = None, packed: bool = False
) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks for code running in the current group: every saved tensor is guarded on
    unpack; with ``collect`` the ones ``policy_fn`` accepts (all by default) join the group
    (parameters and protected storages never do, see ``SwapGroup.add``), in its packed
    buffer with ``packed`` (``group_swap=True``)."""

    def pack(tensor: torch.Tensor) -> object:
        group = current_group()
        if group is None:
            return tensor
        if collect and (policy_fn is None or policy_fn(tensor)):
            group.add(tensor, packed=packed)
        # Detached: an op's *output* arrives here with its grad_fn, which owns this saved
        # value; keeping the grad_fn would form a reference cycle (node → SavedRef →
        # tensor → node) that only the cyclic GC frees, so a chunk's activations would
        # outlive its backward. Autograd re-attaches the graph edge on unpack.
        return SavedRef(tensor.detach(), group)

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
