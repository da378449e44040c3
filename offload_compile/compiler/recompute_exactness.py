"""Exactness of recomputation: which forward ops a partition may re-run, so that the step
equals plain compile bit for bit, and what a partition recomputes.

The recompute search (:mod:`.recompute_search`) lets torch's partitioner recompute only
what these rules allow:

* **Random ops** are never recomputed: the partitioner bans them, and a partition whose
  backward re-runs a seeded random op that the default partition does not is rejected
  (its RNG state would not be replayed; :func:`draws_random`).
* **Collectives** (tensor parallel) are never recomputed: the search marks them
  ``MUST_SAVE`` and no spliced chain contains one (:mod:`.collectives`: each rank ranks
  partitions by its own measurements, and a recomputed all-reduce on one rank is a
  collective the others never run). A device mesh among the graph's inputs is sized
  0 bytes for the partitioner; another opaque input turns the search off for the region.
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
  The spliced backward (:mod:`.recompute_splice`) recomputes those exactly.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from .collectives import is_collective
from .recompute_splice import EXTERN_MATMULS, inductor_uses_templates

__all__ = [
    "draws_random",
    "low_precision_bans",
    "partition_bans",
    "random_nodes",
    "recomputed_nodes",
    "unrepeatable",
    "uses_low_precision",
]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def partition_bans(
    pristine: fx.GraphModule, default_recomputed: set[str], restrict_low_precision: bool
) -> tuple[frozenset[str], str | None]:
    """Forward ops the search's partitions must save, and the exactness rule that limited
    it (None: none did). Collectives always (:mod:`.collectives`); under Inductor in low
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
