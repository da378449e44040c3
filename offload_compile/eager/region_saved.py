"""What an opaque region keeps for its backward, which the session cannot move.

A ``torch.compile``d module (or a ``skip_offload`` function) runs as one virtual op: the
activations its own ops save for the backward are created inside it, where nothing is
traced, and stay on the device until the region's backward. The session cannot plan
them, but it must count them: they share the device with what it plans (left
out, a plan reads feasible and is not). :func:`region_saved_bytes` reads them from
autograd's graph at the end of the region's forward (the nodes the region created: from its
outputs back to its start), the way :mod:`hyper_offload.compiler.saved_bytes` reads a
compiled step. The warmup records them as one *held* storage of that size, written by the
region's forward op, read by every op up to its backward op (so no plan has a gap to move it
in) and released after it; the replay counts the same bytes at the same ops.

Not counted: the region's inputs and the parameters whose gradients it accumulates
(they exist before the region), storages the session tracks (planned already), host
copies (a region compiled
with the ``hyper_offload`` backend offloads its own saved activations under its own
budget: what it keeps on the device is counted here, what it moved is not).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch

from hyper_offload.compiler.saved_bytes import any_node_saved_tensors, inner_tensors
from hyper_offload.runtime.memory_meter import is_host_labelled

__all__ = ["region_saved_bytes"]


def region_saved_bytes(
    outputs: Iterable[Any], start: Any, device: torch.device, inputs: Collection[int],
    tracked: Callable[[torch.Tensor], bool],
) -> int:
    """Device bytes of the distinct storages saved by the autograd nodes between a
    region's ``outputs`` and its ``start`` node (``OpaqueRegionStart``'s backward),
    leaving out the storages of its ``inputs`` (``_cdata`` keys), of the leaves whose
    gradients it accumulates (parameters: their ``AccumulateGrad`` nodes are in the
    same graph) and those ``tracked`` says the session plans."""
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    storages: dict[int, int] = {}
    existing = set(inputs)
    while stack:
        node = stack.pop()
        if node is None or node is start or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a parameter
        if isinstance(variable, torch.Tensor):
            existing.update(t.untyped_storage()._cdata for t in inner_tensors(variable))
        for saved in any_node_saved_tensors(node):
            for tensor in inner_tensors(saved):
                if tensor.device != device or tensor.layout is not torch.strided:
                    continue
                if is_host_labelled(tensor) or tracked(tensor):
                    continue
                storage = tensor.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(n for key, n in storages.items() if key not in existing)
