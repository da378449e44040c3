"""Recompute rules: which forward ops a partition may re-run, so that the step equals
plain compile bit for bit (and every rank runs the same collectives), what a partition
recomputes, and how the partitioner may size a graph's communication objects.

The recompute search (:mod:`.search`) lets torch's partitioner recompute only
what these rules allow:

* **Random ops** are never recomputed: the partitioner bans them, and a partition whose
  backward re-runs a seeded random op that the default partition does not is rejected
  (its RNG state would not be replayed; :func:`draws_random`).
* **Collectives** (tensor parallel: DTensor's redistributions lower to
  ``_c10d_functional`` ops and their ``wait_tensor``) are never recomputed: the search
  marks them ``MUST_SAVE`` and no spliced chain contains one (:func:`is_collective`):
  ranks rank partitions by their own measurements, and a recomputed all-reduce in one
  rank's backward is a collective the others never run. (That a functional collective's
  inputs live until its wait is the trace's rule: :mod:`hyper_offload.passes.ir.trace_op`.)
* **Communication objects.** Tensor parallel passes the device mesh or process group in
  as an opaque graph input (a ``FakeScriptObject`` while tracing). Torch's min-cut
  partitioner cannot size an opaque input and refuses to guess
  (``unsafe_treat_script_objects_as_zero_size``). A device mesh or process group holds
  no activation memory, so for graphs whose only opaque inputs are those the search
  partitions with that switch on (:func:`sizing_opaque_inputs`); any other opaque object
  turns the search off for the region, with the reason in its report
  (:func:`unsizable_inputs`).
* **Low precision under Inductor.** Inductor keeps a fused intermediate in fp32 and
  rounds it to bf16/fp16 only where it is stored, so a value recomputed inside a
  backward kernel can differ from the stored one (``benchmarks/recompute_exactness.py``:
  16 of 17 values differ at budget 0). When the forward has low-precision values and the
  inner compiler is Inductor, the search only lets the partitioner recompute, beyond
  what the default partition recomputes, values whose arithmetic is the same wherever
  it runs: not low precision themselves, and reading low-precision values only from
  buffers every kernel reads from memory (graph inputs, extern matmul/convolution
  results). Every other forward op is marked ``MUST_SAVE`` on the copy the search
  partitions (``RecomputeReport.restriction`` says how many; :func:`partition_bans`).
  The spliced backward (:mod:`.splice`) recomputes those exactly.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator

import torch
from torch import fx
from torch._functorch import config as functorch_config

from hyper_offload.errors import ConfigurationError
from hyper_offload.passes.ir.trace_op import is_collective_op

from .splice import EXTERN_MATMULS, inductor_uses_templates

__all__ = [
    "draws_random",
    "is_collective",
    "low_precision_bans",
    "opaque_inputs",
    "partition_bans",
    "random_nodes",
    "recomputed_nodes",
    "sizing_opaque_inputs",
    "unrepeatable",
    "unsizable_inputs",
    "uses_low_precision",
]

_LOW_PRECISION = (torch.bfloat16, torch.float16)

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


def partition_bans(
    pristine: fx.GraphModule, default_recomputed: set[str], restrict_low_precision: bool
) -> tuple[frozenset[str], str | None]:
    """Forward ops the search's partitions must save, and the exactness rule that limited
    it (None: none did). Collectives always (:func:`is_collective`); under Inductor in low
    precision, what the rule in the module docstring bans (:func:`low_precision_bans`)."""
    banned = frozenset(n.name for n in pristine.graph.nodes if is_collective(n))
    if not (restrict_low_precision and uses_low_precision(pristine)):
        return banned, None
    low_precision = low_precision_bans(pristine, default_recomputed)
    return banned | low_precision, (
        f"low precision under Inductor: {len(low_precision)} forward op(s) kept from "
        "torch's recompute (a fused recomputation may round differently); the spliced "
        "backward recomputes exactly"
    )


def recomputed_nodes(fw: fx.GraphModule, bw: fx.GraphModule) -> set[str]:
    """Forward ops the backward runs again: ``call_function`` nodes in both graphs (the
    partitioner copies nodes by name)."""
    forward = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    return {
        n.name for n in bw.graph.nodes if n.op == "call_function" and n.name in forward
    }


def random_nodes(names: set[str], fw: fx.GraphModule) -> set[str]:
    """Those of ``names`` whose op draws random numbers: a seeded, nondeterministic op,
    except an attention kernel called with ``dropout_p == 0`` (it draws nothing)."""
    return {n.name for n in fw.graph.nodes if n.name in names and draws_random(n)}


def unrepeatable(node: fx.Node) -> bool:
    """An op a recompute chain must not re-run: its result would differ (a random draw)
    or other ranks would not run it with this one (a collective)."""
    return draws_random(node) or is_collective(node)


def draws_random(node: fx.Node) -> bool:
    """Whether running ``node`` again would draw fresh random numbers."""
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    schema = getattr(target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" in names:
        index = names.index("dropout_p")
        value = node.kwargs.get("dropout_p", node.args[index] if index < len(node.args)
                                else schema.arguments[index].default_value)
        return value != 0
    return True


def _forward_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """The joint graph's forward ops: ``call_function`` nodes no tangent reaches."""
    backward: set[fx.Node] = set()
    forward = []
    for node in joint.graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            backward.add(node)
        elif node.op == "call_function":
            if any(i in backward for i in node.all_input_nodes):
                backward.add(node)
            else:
                forward.append(node)
    return forward


def _dtype(node: fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def uses_low_precision(joint: fx.GraphModule) -> bool:
    """Whether any forward op produces a bf16 or fp16 tensor."""
    return any(_dtype(n) in _LOW_PRECISION for n in _forward_nodes(joint))


def _stored(node: fx.Node, *, templates: bool) -> bool:
    """Whether every kernel reads ``node``'s value from memory, rounded to its dtype
    (``templates``: max-autotune's matmul templates, which may fuse their consumers)."""
    if node.op == "placeholder":
        return True
    return not templates and node.op == "call_function" and node.target in EXTERN_MATMULS


def low_precision_bans(joint: fx.GraphModule, default_recomputed: set[str]) -> frozenset[str]:
    """Forward ops (by name) whose recomputation under Inductor may not reproduce the
    value the forward used: a low-precision result, or arithmetic on a low-precision
    value that was not read from memory. Views and tuple items compute nothing and are
    not banned; nor is what the default partition already recomputes (plain compile
    does the same)."""
    templates = inductor_uses_templates()
    banned = set()
    for node in _forward_nodes(joint):
        if node.name in default_recomputed or node.target is operator.getitem:
            continue
        if _is_view(node):
            continue
        low_result = _dtype(node) in _LOW_PRECISION
        fused_low_input = any(
            _dtype(i) in _LOW_PRECISION and not _stored(i, templates=templates)
            for i in node.all_input_nodes
        )
        if low_result or fused_low_input:
            banned.add(node.name)
    return frozenset(banned)


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
