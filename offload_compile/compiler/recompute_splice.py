"""Exact recompute under Inductor in low precision: the spliced backward.

Inductor computes fused bf16/fp16 intermediates in fp32 and rounds them only where it
stores them, so a value's bits depend on where the kernels of its graph begin and end.
Torch's own recompute partitions move those boundaries (the recomputed ops fuse into
backward kernels, and the backward fuses differently around them), so they do not
reproduce plain compile's gradients in bf16 (``benchmarks/recompute_exactness.py``: 16
of 17 values differ at budget 0). The spliced backward recomputes a saved activation
without moving any boundary plain compile has:

1. **its chain**, the ops of torch's ``activation_memory_budget=0`` partition that
   compute it, started from values plain compile's kernels read from memory: the
   default partition's saved values (graph outputs are realized, and Inductor rounds a
   saved value for its forward users too) and forward inputs. So the chain reads the
   same rounded values the forward's kernels read, and a chain that needs another
   recomputed value reads that value's materialized copy;
2. ``hyper_offload::materialize`` (:data:`~hyper_offload.passes.ir.ops.MATERIALIZE`)
   right after the chain: an opaque op (an extern kernel), so the value is stored
   rounded to its dtype, as the forward stored it, and no backward kernel fuses into
   the chain;
3. the default partition's backward graph, node for node, reading the materialized
   value where it read the saved one.

The forward is the default partition's with a ``hyper_offload::discard`` stand-in
(:data:`~hyper_offload.passes.ir.ops.DISCARD`), right after the producer, in place of
each recomputed saved output: the extern op realizes the value where the graph output
did, before any consumer is lowered (a stand-in at the output lets Inductor inline the
value unrounded), and the output node keeps its AOTAutograd descriptors. Values Inductor
would round only because they are saved (:func:`rounded_for_forward_users`) are not
options: not saving them would change the forward. Measured
(``benchmarks/recompute_exactness.py``, row ``recompute_exactness.splice``): on the
2-layer GPT in bf16 under Inductor, all 29 loss and gradient values equal plain
compile's with any share of the 35 options recomputed.

Any subset of the options can be recomputed, so the decision is per saved activation:
:func:`splice_options` finds them, :func:`recompute_order` ranks them by bytes freed
per second of recompute, and :func:`splice` builds the graphs for one choice.

Invariants of :func:`splice`: the forward computes exactly the default forward's ops
and saves the same values, each recomputed one replaced by an empty stand-in, after the
forward inputs the chains need; the backward's placeholders are the default
backward's (recomputed ones now empty), after those inputs; every node of the default
backward appears once, in the same order, with the same name (chain nodes are named
``<forward name>_recomputed``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

import torch
import torch.fx as fx

from hyper_offload.passes.fx.cost_model import tensor_bytes
from hyper_offload.passes.ir.ops import DISCARD, MATERIALIZE

__all__ = [
    "EXTERN_MATMULS", "SpliceOption", "inductor_uses_templates", "recompute_order", "splice",
    "splice_options",
]


@dataclass(frozen=True)
class SpliceOption:
    """One saved activation the spliced backward can recompute.

    ``chain``: the budget-0 backward's nodes (names) that compute it, in graph order;
    ``nbytes``: its device bytes; ``seconds``: the chain's predicted run time."""

    name: str
    chain: tuple[str, ...]
    nbytes: int
    seconds: float


def _saved_inputs(bw: fx.GraphModule) -> list[fx.Node]:
    """The backward's saved-value placeholders (tangents and RNG seeds excluded)."""
    return [
        n for n in bw.graph.find_nodes(op="placeholder")
        if not n.name.startswith(("tangents", "bwd_seed", "bwd_base_offset"))
    ]


_aten = torch.ops.aten
EXTERN_MATMULS = frozenset({
    _aten.mm.default, _aten.bmm.default, _aten.addmm.default, _aten.baddbmm.default,
    _aten.convolution.default,
})
"""Ops Inductor runs as extern kernels unless max-autotune's templates are on: then
nothing fuses into them and their results are stored, rounded to their dtype, before
anyone reads them; under templates their kernel is chosen by benchmarking and may fuse
its consumers."""


def inductor_uses_templates() -> bool:
    """Whether Inductor may compile :data:`EXTERN_MATMULS` as templates (max-autotune)."""
    from torch._inductor import config as inductor_config

    return bool(inductor_config.max_autotune or inductor_config.max_autotune_gemm)


def is_primal(node: fx.Node) -> bool:
    """A forward input (parameter, buffer or user input) as a placeholder."""
    return node.op == "placeholder" and node.name.startswith("primals")


def _chain(zero: Mapping[str, fx.Node], name: str, cuts: Set[str]) -> list[fx.Node]:
    """``name``'s ancestors in the budget-0 backward (itself included) up to, not
    including, its placeholders and the ``cuts`` (read from memory instead), in graph
    order."""
    seen: dict[str, fx.Node] = {}
    stack = [zero[name]]
    while stack:
        node = stack.pop()
        if node.name in seen or node.op == "placeholder" or (node.name in cuts and node.name != name):
            continue
        seen[node.name] = node
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(zero)}
    return sorted(seen.values(), key=lambda n: order[n.name])


def _leaves(chain: Sequence[fx.Node]) -> set[str]:
    inside = {n.name for n in chain}
    return {i.name for n in chain for i in n.all_input_nodes if i.name not in inside}


def rounded_for_forward_users(node: fx.Node) -> bool:
    """Whether Inductor rounds ``node`` to its dtype for its forward users because it is
    saved for backward (``emulate_precision_casts_on_saved_tensors``, on by default): a
    low-precision pointwise result that a forward op also reads. Not saving it would
    drop that rounding and change the forward, so such a value is no splice option."""
    from torch._inductor import config as inductor_config

    value = node.meta.get("val")
    return (
        bool(inductor_config.emulate_precision_casts_on_saved_tensors)
        and isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16)
        and torch.Tag.pointwise in getattr(node.target, "tags", ())
        and any(user.op != "output" for user in node.users)
    )


def splice_options(
    default_fw: fx.GraphModule,
    default_bw: fx.GraphModule,
    zero_bw: fx.GraphModule,
    *,
    unrepeatable: Callable[[fx.Node], bool],
    seconds: Callable[[fx.Node], float],
    templates: bool = False,
) -> tuple[SpliceOption, ...]:
    """The saved activations of the default partition (``default_fw``/``default_bw``)
    that the budget-0 backward (``zero_bw``) recomputes, each with its chain: its
    budget-0 ancestors back to values plain compile's kernels read from memory, rounded
    to their dtype, namely the default partition's saved values (graph outputs, which
    Inductor realizes) and forward inputs (saved for the chain if the default partition
    does not save them).

    An activation is not an option when its chain needs a value the default partition
    does not save, when the chain re-runs an ``unrepeatable`` op (one that draws random
    numbers, whose RNG state would not be replayed, or a collective), when Inductor
    rounds it for its forward users because it is saved
    (:func:`rounded_for_forward_users`), or, under max-autotune (``templates``),
    when the chain runs a matmul or convolution (the kernel is chosen by benchmarking,
    so the recompute may not get the forward's). ``seconds`` prices one node."""
    zero = {n.name: n for n in zero_bw.graph.nodes}
    forward = {n.name: n for n in default_fw.graph.nodes}
    saved = _saved_inputs(default_bw)
    kept = {n.name for n in saved}
    options = []
    for activation in saved:
        node, value = zero.get(activation.name), activation.meta.get("val")
        if node is None or node.op != "call_function":
            continue  # saved at budget 0 too
        if not isinstance(value, torch.Tensor) or activation.name not in forward:
            continue
        if rounded_for_forward_users(forward[activation.name]):
            continue
        chain = _chain(zero, activation.name, kept)
        unsaved = {
            leaf for leaf in _leaves(chain) if leaf not in kept and not is_primal(zero[leaf])
        }
        if unsaved or any(unrepeatable(n) for n in chain):
            continue
        if templates and any(n.target in EXTERN_MATMULS for n in chain):
            continue
        options.append(SpliceOption(
            activation.name, tuple(n.name for n in chain), tensor_bytes(value, activation.name),
            sum(seconds(n) for n in chain),
        ))
    return tuple(options)


def recompute_order(options: Iterable[SpliceOption]) -> list[SpliceOption]:
    """Cheapest first: most bytes freed per second of recompute (ties: graph order)."""
    return sorted(options, key=lambda o: -o.nbytes / max(o.seconds, 1e-12))


def splice(
    default_fw: fx.GraphModule,
    default_bw: fx.GraphModule,
    zero_bw: fx.GraphModule,
    recompute: Sequence[SpliceOption],
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The default partition with the ``recompute`` activations (from
    :func:`splice_options` on the same graphs) recomputed by the spliced backward
    (module docstring). Forward inputs the chains start from that the default partition
    does not save are saved first (a forward input costs no activation bytes)."""
    dropped = {o.name for o in recompute}
    chain = {name for o in recompute for name in o.chain}
    zero = {n.name: n for n in zero_bw.graph.nodes}
    saved = {n.name for n in _saved_inputs(default_bw)}
    leaves = {leaf for o in recompute for leaf in _leaves([zero[n] for n in o.chain])}
    primals = sorted(leaf for leaf in leaves if leaf not in saved)
    fw = _forward(default_fw, dropped, primals, _saved_count(default_bw))
    return fw, _spliced_backward(default_bw, zero, dropped, chain, primals)


def _saved_count(bw: fx.GraphModule) -> int:
    """How many forward outputs AOTAutograd hands ``bw``: every placeholder but the
    tangents (saved SymInts, saved tensors, RNG seeds and offsets)."""
    return sum(
        not n.name.startswith("tangents") for n in bw.graph.find_nodes(op="placeholder")
    )


def _is_tensor(value: object) -> bool:
    return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor)


def _forward(
    fw: fx.GraphModule, dropped: set[str], primals: list[str], saved_count: int
) -> fx.GraphModule:
    """``fw`` saving ``primals`` first and a ``discard`` stand-in for each of
    ``dropped``. ``saved_count``: how many of ``fw``'s outputs are saved for backward
    (the last ones); the others are the user's and stay as they are, even where a user
    output is also saved (it then appears twice, once in each part)."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    stand_ins: dict[str, fx.Node] = {}
    for node in fw.graph.nodes:
        if node.op != "output":
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
            if node.name in dropped:
                # right after its producer: the extern op realizes the value before any
                # consumer is lowered, as the graph output does in plain compile (a stand-in
                # placed at the output lets Inductor inline it unrounded into consumers)
                stand_ins[node.name] = graph.call_function(
                    DISCARD, (env[node.name],))
                stand_ins[node.name].meta["val"] = node.meta["val"].new_empty(0)
            continue
        (outputs,) = node.args
        names = [o.name if isinstance(o, fx.Node) else None for o in outputs]
        # AOTAutograd's layout: user outputs, then saved tensors, then saved SymInts; a
        # saved name may be a user output too, so only the count tells where saving begins
        first_saved = len(outputs) - saved_count
        new = []
        for index, (output, name) in enumerate(zip(outputs, names)):
            value = fx.node.map_arg(output, lambda n: env[n.name])
            if name in dropped and index >= first_saved:  # a saved copy, not a user output
                value = stand_ins[name]
            new.append(value)
        new[first_saved:first_saved] = [env[p] for p in primals]
        out_node = graph.output(tuple(new))
        out_node.meta = _output_meta(node.meta, first_saved, len(primals))
    out = fx.GraphModule(fw, graph, class_name=type(fw).__name__)
    out.graph.eliminate_dead_code()
    out.recompile()
    out.meta = dict(fw.meta)
    return out


def _output_meta(meta: Mapping[str, object], first_saved: int, added: int) -> dict[str, object]:
    """The forward output node's meta with ``added`` saved forward inputs at
    ``first_saved``. Its ``desc`` (one AOTAutograd descriptor per output) must stay: it
    is how Inductor knows which outputs are saved for backward, and a low-precision
    pointwise value saved for backward is rounded for its forward users too
    (``emulate_precision_casts_on_saved_tensors``), as plain compile does."""
    from torch._functorch._aot_autograd import descriptors

    saved = (descriptors.SavedForBackwardsAOTOutput, descriptors.SavedForBackwardsNoVcCheckAOTOutput)
    out = dict(meta)
    descs = meta.get("desc")
    if isinstance(descs, list):
        start = min((d.idx for d in descs if isinstance(d, saved)), default=0)
        new = [descriptors.SavedForBackwardsAOTOutput(start + i) for i in range(added)]
        shifted = [type(d)(d.idx + added) if isinstance(d, saved) else d for d in descs]
        out["desc"] = shifted[:first_saved] + new + shifted[first_saved:]
    return out


def _spliced_backward(
    default_bw: fx.GraphModule,
    zero: Mapping[str, fx.Node],
    dropped: set[str],
    chain: set[str],
    primals: list[str],
) -> fx.GraphModule:
    graph = fx.Graph()
    inputs: dict[str, fx.Node] = {}  # placeholders: the default backward's kept, new primals
    built: dict[str, fx.Node] = {}  # recompute nodes, by name
    values: dict[str, fx.Node] = {}  # what the default backward's nodes read, by name

    def read(name: str) -> fx.Node:
        """What a chain node reads for its input ``name``."""
        if name in dropped:
            return materialized(name)  # another recomputed value, rounded as stored
        if name in chain:
            return build(name)
        return inputs[name]  # a leaf: a kept saved value or a forward input

    def build(name: str) -> fx.Node:
        if name not in built:
            for arg in zero[name].all_input_nodes:
                read(arg.name)
            source = zero[name]
            # a name of its own: the default backward's nodes keep theirs (it may
            # recompute the same forward op under the same name for its own use)
            built[name] = graph.create_node(
                source.op, source.target, *fx.node.map_arg((source.args, source.kwargs), lambda a: read(a.name)),
                name=f"{name}_recomputed",
            )
            built[name].meta = dict(source.meta)
        return built[name]

    def materialized(name: str) -> fx.Node:
        if name not in values:
            barrier = graph.call_function(MATERIALIZE, (build(name),))
            barrier.meta = dict(zero[name].meta)
            values[name] = barrier
        return values[name]

    placeholders = default_bw.graph.find_nodes(op="placeholder")
    # saved SymInts come first, then saved tensors: the new ones lead those, as in the forward
    first_tensor = next((p for p in placeholders if _is_tensor(p)), None)
    for node in placeholders:
        if node is first_tensor:
            for name in primals:
                inputs[name] = graph.node_copy(zero[name])
        copied = graph.node_copy(node)
        if node.name in dropped:
            copied.meta["val"] = node.meta["val"].new_empty(0)  # the discard's stand-in
        else:
            inputs[node.name] = values[node.name] = copied
    if first_tensor is None:
        for name in primals:
            inputs[name] = graph.node_copy(zero[name])
    for node in default_bw.graph.nodes:
        if node.op == "placeholder":
            continue
        for arg in node.all_input_nodes:
            if arg.name in dropped:
                materialized(arg.name)
        values[node.name] = graph.node_copy(node, lambda a: values[a.name])
    out = fx.GraphModule(default_bw, graph, class_name=type(default_bw).__name__)
    out.graph.lint()
    out.recompile()
    out.meta = dict(default_bw.meta)
    return out
