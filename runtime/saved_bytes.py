"""Measure the device bytes a step keeps for its backward, read from autograd's graph.

A dispatch-mode meter cannot see compiled code (while a ``TorchDispatchMode`` is active
``torch.compile`` runs the original Python instead), and the CPU allocator keeps no
counters the profiler reports for Inductor's allocations. What the compiled autograd
graph keeps alive between forward and backward can be read exactly, though: AOTAutograd
stores the forward's saved values on the ``CompiledFunctionBackward`` node
(``saved_tensors`` and ``_tensors_no_vc_check``). :func:`saved_device_bytes` sums the
distinct storages among them that are on the device (host copies made by the transfer
ops carry the runtime's host label and are not counted), which is the part of
activation memory offloading changes. On an accelerator,
``torch.cuda.max_memory_allocated`` measures the whole step as well.

:func:`autograd_saved_device_bytes` reads every node of the graph, not only the compiled
ones: eager autograd nodes expose what they saved as ``_saved_<name>`` attributes (the
eager session's offloaded storages read 0 bytes there), custom Functions as
``saved_tensors``. Wrapper subclasses (DTensor under tensor parallel) are counted by
their inner tensors, which hold the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .memory_meter import is_host_labelled

__all__ = [
    "any_node_saved_tensors", "autograd_nodes", "autograd_saved_device_bytes", "inner_tensors",
    "is_compiled_region", "node_saved_tensors", "saved_device_bytes", "saved_tensors_of",
]


def autograd_nodes(roots: Iterable[torch.Tensor]) -> Iterator[Any]:
    """Every autograd node reachable from ``roots``, each once."""
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)


def node_saved_tensors(node: Any) -> list[torch.Tensor]:
    """Tensors one ``CompiledFunctionBackward`` node holds for its backward."""
    saved = [t for t in node.saved_tensors if isinstance(t, torch.Tensor)]
    saved.extend(
        t for t in getattr(node, "_tensors_no_vc_check", ()) if isinstance(t, torch.Tensor)
    )
    return saved


def is_compiled_region(node: Any) -> bool:
    """Whether an autograd node is the backward of a compiled region (AOTAutograd's)."""
    return "CompiledFunction" in type(node).__name__


def saved_tensors_of(
    *outputs: torch.Tensor, regions: Callable[[Any], bool] = is_compiled_region
) -> list[torch.Tensor]:
    """Tensors saved for backward by the compiled regions reachable from ``outputs``
    (``regions``: which of their autograd nodes count; every compiled region by default)."""
    saved: list[torch.Tensor] = []
    for node in autograd_nodes(outputs):
        if is_compiled_region(node) and regions(node):
            saved.extend(node_saved_tensors(node))
    return saved


def saved_device_bytes(
    *outputs: torch.Tensor, exclude: Iterable[torch.Tensor] = (),
    regions: Callable[[Any], bool] = is_compiled_region,
) -> int:
    """Bytes of distinct device storages the compiled backward of ``outputs`` holds
    (``regions`` as in :func:`saved_tensors_of`).

    ``exclude`` (parameters, inputs) are not activations and are not counted; host
    copies (host-labelled storages) are not device bytes.
    """
    skip = {id(t.untyped_storage()) for t in exclude}
    storages = {}
    for tensor in saved_tensors_of(*outputs, regions=regions):
        storage = tensor.untyped_storage()
        if id(storage) in skip or is_host_labelled(tensor):
            continue
        storages[id(storage)] = storage.nbytes()
    return sum(storages.values())


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``tensor``'s bytes: itself, or a wrapper subclass's inner
    tensors (``__tensor_flatten__``), recursively."""
    if not hasattr(tensor, "__tensor_flatten__") or type(tensor) is torch.Tensor:
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = (getattr(tensor, name) for name in names)
    return [t for value in inner if isinstance(value, torch.Tensor) for t in inner_tensors(value)]


def any_node_saved_tensors(node: Any) -> list[torch.Tensor]:
    """What one autograd node, compiled or eager, holds for its backward."""
    if is_compiled_region(node):
        return node_saved_tensors(node)
    values: list[Any] = []
    for name in dir(node):
        if name.startswith("_saved_") or name == "saved_tensors":
            try:
                values.append(getattr(node, name))
            except RuntimeError:  # freed by an earlier backward
                continue
    tensors: list[torch.Tensor] = []
    for value in values:
        items = value if isinstance(value, (tuple, list)) else (value,)
        tensors.extend(t for t in items if isinstance(t, torch.Tensor))
    return tensors


def autograd_saved_device_bytes(
    *outputs: torch.Tensor, exclude: Iterable[torch.Tensor] = ()
) -> int:
    """Bytes of distinct device storages every autograd node reachable from ``outputs``
    holds for the backward, compiled or eager (see the module docstring); ``exclude``
    and host copies as in :func:`saved_device_bytes`."""
    # ``_cdata`` (the storage's address) is stable while a tensor holds it, as each
    # saved tensor does until this returns.
    skip = {t.untyped_storage()._cdata for e in exclude for t in inner_tensors(e)}
    storages = {}
    for node in autograd_nodes(outputs):
        for saved in any_node_saved_tensors(node):
            for tensor in inner_tensors(saved):
                storage = tensor.untyped_storage()
                if storage._cdata in skip or is_host_labelled(tensor):
                    continue
                storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())
