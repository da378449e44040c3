"""Choosing activations for pipeline swap: ``swap_wrapper`` and ``swap_tensor_wrapper``.

Selection and timing are separate. These wrappers say *which* activations of a stage
may be swapped; a ``PipelineSwapSchedule(..., swap=True)`` decides *when* (its four swap
steps). ``swap=True`` never wraps a model or picks tensors by itself, and the wrappers do
nothing outside such a schedule's FWD leaves of eligible chunks.

* ``swap_wrapper(module_or_callable, policy_fn=None, group_swap=False)``: the tensors that
  autograd saves while the wrapped forward runs join the current chunk's swap group
  (``torch.autograd.graph.saved_tensors_hooks``), filtered by ``policy_fn(tensor) -> bool``.
  Parameters (also FSDP-unsharded ones, by storage), the stage's inputs, its output and
  the loss never join; tensors sharing a storage join once.
* ``swap_tensor_wrapper(tensor_or_nested, tag=None, group_swap=False)``: registers the
  tensors of a nested structure with the current group and returns the input unchanged.
  Outside any pipeline FWD it warns (once per call site) and does nothing.

``group_swap=True`` (the design's "group / bulk copy"): the tensors it selects move in
their chunk's one packed host buffer, with a single copy each way for all of them
(:class:`~hyper_offload.runtime.pipeline.packed_copy.PackedCopy`), instead of one copy
per storage. The cost is a device staging buffer of the packed size while each copy is
issued (the members and the pack coexist for that moment); the gain is one large copy
instead of many small ones, which matters when a chunk saves many small tensors.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_leaves

from hyper_offload.errors import ConfigurationTypeError, SwapOutsideGroupWarning
from hyper_offload.runtime.pipeline.session import (
    current_group,
    in_pipeline_forward,
    saved_tensor_hooks,
)

__all__ = ["SwapOutsideGroupWarning", "SwapWrapped", "swap_tensor_wrapper", "swap_wrapper"]

T = TypeVar("T")
Policy = Callable[[torch.Tensor], bool]


def swap_wrapper(
    module_or_callable: T, policy_fn: Policy | None = None, group_swap: bool = False
) -> T:
    """Make the saved activations of ``module_or_callable``'s forward swappable.

    A module is wrapped in place, the way ``fully_shard`` does it: its class becomes a
    subclass whose ``forward`` runs the original one under the collecting hooks. The
    module keeps its parameters and names (``layers[i] = swap_wrapper(layers[i])``), and a
    ``copy.deepcopy`` of it stays wrapped and runs *its own* parameters. A plain callable
    is returned wrapped. ``policy_fn(tensor)`` returning False keeps that tensor on the
    device.
    """
    _check_flag("swap_wrapper", "group_swap", group_swap)
    if policy_fn is not None and not callable(policy_fn):
        raise ConfigurationTypeError(f"swap_wrapper: policy_fn must be callable (tensor -> bool) or None, got {policy_fn!r}")
    if isinstance(module_or_callable, torch.nn.Module):
        module = module_or_callable
        if not isinstance(module, SwapWrapped):
            cls = type(module)
            module.__class__ = type(f"Swap{cls.__name__}", (SwapWrapped, cls), {})
        module._swap_policy_fn = policy_fn  # type: ignore[attr-defined]
        module._swap_group_swap = group_swap  # type: ignore[attr-defined]
        return module  # type: ignore[return-value]
    if not callable(module_or_callable):
        raise ConfigurationTypeError(
            f"swap_wrapper: expected an nn.Module or a callable, got {type(module_or_callable).__name__}"
        )
    fn = module_or_callable

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _run_collecting(policy_fn, group_swap, fn, *args, **kwargs)

    return wrapped  # type: ignore[return-value]


class SwapWrapped:
    """Mixin put in front of a wrapped module's class by :func:`swap_wrapper`."""

    _swap_policy_fn: Policy | None = None
    _swap_group_swap: bool = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _run_collecting(
            self._swap_policy_fn, self._swap_group_swap, super().forward, *args, **kwargs  # type: ignore[misc]
        )


def _run_collecting(
    policy_fn: Policy | None, group_swap: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    if current_group() is None:
        return fn(*args, **kwargs)
    with saved_tensor_hooks(collect=True, policy_fn=policy_fn, packed=group_swap):
        return fn(*args, **kwargs)


def swap_tensor_wrapper(tensor_or_nested: T, tag: str | None = None, group_swap: bool = False) -> T:
    """Register every tensor in ``tensor_or_nested`` with the current swap group; returns
    the input unchanged. Outside a pipeline FWD leaf: warns once per call site."""
    _check_flag("swap_tensor_wrapper", "group_swap", group_swap)
    if tag is not None and not isinstance(tag, str):
        raise ConfigurationTypeError(f"swap_tensor_wrapper: tag must be a str or None, got {tag!r}")
    group = current_group()
    if group is None:
        if not in_pipeline_forward():
            warnings.warn(
                f"swap_tensor_wrapper(tag={tag!r}) called outside a pipeline FWD leaf: nothing is "
                "registered. Call it inside a stage's forward run by PipelineSwapSchedule(swap=True)",
                SwapOutsideGroupWarning,
                stacklevel=2,
            )
        return tensor_or_nested
    for leaf in tree_leaves(tensor_or_nested):
        if isinstance(leaf, torch.Tensor):
            group.add(leaf, tag, packed=group_swap)
    return tensor_or_nested


def _check_flag(where: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigurationTypeError(f"{where}: {name} must be a bool, got {value!r}")
