"""Communication in a region's graphs: what the backend must not move, re-run or size.

Tensor parallel puts collectives in a region's graphs (DTensor's redistributions lower
to ``_c10d_functional`` ops and their ``wait_tensor``) and passes the device mesh or
process group in as an opaque graph input (a ``FakeScriptObject`` while tracing). Three
rules follow:

* a functional collective's inputs live until its wait (the trace's rule:
  :mod:`hyper_offload.passes.fx.collectives`);
* a collective is never recomputed (the partition search marks it ``MUST_SAVE`` and no
  spliced chain may contain one): ranks rank partitions by their own measurements, and
  a recomputed all-reduce in one rank's backward is a collective the others never run;
* torch's min-cut partitioner cannot size an opaque input and refuses to guess
  (``unsafe_treat_script_objects_as_zero_size``). A device mesh or process group holds
  no activation memory, so for graphs whose only opaque inputs are those the search
  partitions with that switch on; any other opaque object turns the search off for the
  region, with the reason in its report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config

from hyper_offload.errors import ConfigurationError
from hyper_offload.passes.fx.collectives import is_collective_op

__all__ = [
    "is_collective",
    "opaque_inputs",
    "sizing_opaque_inputs",
    "unsizable_inputs",
]

_COMMUNICATION_CLASSES = ("DeviceMesh", "ProcessGroup")
"""Opaque classes that only name ranks (no tensor memory of their own)."""


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` calls an op of a communication namespace."""
    return node.op == "call_function" and is_collective_op(node.target)


def opaque_inputs(graph: fx.Graph) -> dict[str, str]:
    """Placeholder name -> class name, for every opaque-object input of ``graph``."""
    found = {}
    for node in graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        name = getattr(value, "script_class_name", None)
        if name is None and isinstance(value, torch.ScriptObject):
            name = str(value._type().qualified_name())
        if name is not None:
            found[node.name] = name
    return found


def unsizable_inputs(graph: fx.Graph) -> dict[str, str]:
    """The opaque inputs that are not a device mesh or process group (their memory is
    unknown: the recompute search cannot run on the graph)."""
    return {
        node: cls for node, cls in opaque_inputs(graph).items()
        if not cls.endswith(_COMMUNICATION_CLASSES)
    }


@contextlib.contextmanager
def sizing_opaque_inputs(graph: fx.Graph) -> Iterator[None]:
    """Let the min-cut partitioner size ``graph``'s communication objects as 0 bytes.

    Raises ``ConfigurationError`` naming the input when another opaque object is present
    (callers check :func:`unsizable_inputs` first)."""
    unknown = unsizable_inputs(graph)
    if unknown:
        raise ConfigurationError(
            f"sizing_opaque_inputs: opaque input(s) {unknown} may hold tensors; only a "
            "DeviceMesh or ProcessGroup is known to hold no activation memory"
        )
    if not opaque_inputs(graph):
        yield
        return
    with functorch_config.patch(unsafe_treat_script_objects_as_zero_size=True):
        yield
