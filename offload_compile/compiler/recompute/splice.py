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
    "EXTERN_MATMULS", "SpliceOption", "held_options", "inductor_uses_templates",
    "recompute_order", "splice", "splice_options",
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


def rounded_for_forward_users(node: fx.Node, *, templates: bool = False) -> bool:
    """Whether Inductor rounds ``node`` to its dtype for its forward users because it is
    saved for backward (``emulate_precision_casts_on_saved_tensors``, on by default): a
    low-precision pointwise result that a forward op also reads. Not saving it would
    drop that rounding and change the forward, so such a value is no splice option.

    Not so when every forward reader is an op whose inputs Inductor stores before it
    runs (``needs_realized_inputs``: a matmul, an attention kernel): that reader gets the
    stored, rounded value whether or not the value is saved (a rotary-embedded query
    read by attention alone). Under max-autotune (``templates``) a matmul template may
    fuse its producer, so the rule stays whole there."""
    from torch._inductor import config as inductor_config

    value = node.meta.get("val")
    readers = [user for user in node.users if user.op != "output"]
    return (
        bool(inductor_config.emulate_precision_casts_on_saved_tensors)
        and isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16)
        and torch.Tag.pointwise in getattr(node.target, "tags", ())
        and bool(readers)
        and (templates or not all(_reads_stored(user) for user in readers))
    )


def _reads_stored(node: fx.Node) -> bool:
    """Whether Inductor stores every input of ``node`` before running it."""
    from torch._inductor.lowering import needs_realized_inputs

    target = node.target
    return node.op == "call_function" and (
        target in needs_realized_inputs
        or getattr(target, "overloadpacket", None) in needs_realized_inputs
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
        if rounded_for_forward_users(forward[activation.name], templates=templates):
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


def held_options(options: Iterable[SpliceOption], reload_gbps: float) -> frozenset[str]:
    """The options a chain holds from before their first reader rather than recompute a
    second time (:class:`_Recompute`): those whose chain takes longer than copying their
    bytes back from the host at ``reload_gbps`` (an attention's output: seconds for a few
    GB). The others are recomputed again where a chain needs them early: that is faster
    than any way of keeping them off the device."""
    return frozenset(o.name for o in options if o.seconds * reload_gbps * 1e9 > o.nbytes)


def recompute_order(options: Iterable[SpliceOption]) -> list[SpliceOption]:
    """Cheapest first: most bytes freed per second of recompute (ties: graph order)."""
    return sorted(options, key=lambda o: -o.nbytes / max(o.seconds, 1e-12))


def splice(
    default_fw: fx.GraphModule,
    default_bw: fx.GraphModule,
    zero_bw: fx.GraphModule,
    recompute: Sequence[SpliceOption],
    held: Set[str] = frozenset(),
    *,
    barriers: Set[str] | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The default partition with the ``recompute`` activations (from
    :func:`splice_options` on the same graphs) recomputed by the spliced backward
    (module docstring). Forward inputs the chains start from that the default partition
    does not save are saved first (a forward input costs no activation bytes).
    ``held``: recomputed values a chain may hold from before their first reader rather
    than recompute twice (:func:`held_options`; :class:`_Recompute`); ``barriers``:
    names of the default backward's ops that cut it into stages (None: every op)."""
    dropped = {o.name for o in recompute}
    zero = {n.name: n for n in zero_bw.graph.nodes}
    saved = {n.name for n in _saved_inputs(default_bw)}
    leaves = {leaf for o in recompute for leaf in _leaves([zero[n] for n in o.chain])}
    primals = sorted(leaf for leaf in leaves if leaf not in saved)
    fw = _forward(default_fw, dropped, primals, _saved_count(default_bw))
    return fw, _spliced_backward(default_bw, zero, recompute, primals, frozenset(held),
                                 None if barriers is None else frozenset(barriers))


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
    recompute: Sequence[SpliceOption],
    primals: list[str],
    held: Set[str],
    barriers: Set[str] | None,
) -> fx.GraphModule:
    dropped = {o.name for o in recompute}
    chain = {name for o in recompute for name in o.chain}
    graph = fx.Graph()
    inputs: dict[str, fx.Node] = {}  # placeholders: the default backward's kept, new primals
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
            inputs[node.name] = copied
    if first_tensor is None:
        for name in primals:
            inputs[name] = graph.node_copy(zero[name])
    positions = {n.name: i for i, n in enumerate(
        n for n in default_bw.graph.nodes if n.op != "placeholder")}
    recompute = _Recompute(
        graph, zero, dropped, chain, inputs, _uses(default_bw, dropped),
        _siblings(recompute, held),
        None if barriers is None else frozenset(positions[b] for b in barriers if b in positions),
    )
    values: dict[str, fx.Node] = dict(inputs)  # what the default backward's nodes read
    for position, node in enumerate(n for n in default_bw.graph.nodes if n.op != "placeholder"):
        recompute.at(position)
        for arg in node.all_input_nodes:
            if arg.name in dropped:
                values[arg.name] = recompute.value(arg.name)
        values[node.name] = graph.node_copy(node, lambda a: values[a.name])
    out = fx.GraphModule(default_bw, graph, class_name=type(default_bw).__name__)
    out.graph.lint()
    out.recompile()
    out.meta = dict(default_bw.meta)
    return out


def _siblings(recompute: Sequence[SpliceOption], held: Set[str]) -> dict[str, frozenset[str]]:
    """Each held value and the other held values whose chains share an op with its own."""
    chains = {o.name: set(o.chain) for o in recompute if o.name in held}
    return {
        name: frozenset(o for o in chains if o != name and chains[o] & chains[name])
        for name in chains
    }


def _uses(bw: fx.GraphModule, dropped: Set[str]) -> dict[str, tuple[int, int]]:
    """Each dropped value's first and last reader among ``bw``'s ops (positions counted
    without placeholders)."""
    uses: dict[str, tuple[int, int]] = {}
    for position, node in enumerate(n for n in bw.graph.nodes if n.op != "placeholder"):
        for arg in node.all_input_nodes:
            if arg.name in dropped:
                first = uses.get(arg.name, (position, position))[0]
                uses[arg.name] = (first, position)
    return uses


class _Recompute:
    """The recompute chains of one spliced backward, op by op (module docstring).

    Invariant (what makes the working set a single op's, not a layer's): every value a
    chain makes is made right before the backward op that first needs it, and no value
    lives past the last backward op that reads it. So chains are built afresh for each
    backward op that needs a dropped value (``at``): nothing built for one op is reused
    by a later one. A dropped value is materialized once, at its first reader, and that
    copy serves its own readers up to its last; a chain that needs a dropped value
    outside that range (before its first reader, or after its last) recomputes it
    privately, a copy that dies with the chain, rather than making it live longer.

    The exception is ``held``: dropped values whose recomputation costs more than keeping
    them (an attention output: recomputing it costs its attention again). A chain that
    needs one before its first reader materializes the shared copy there, which then
    lives on to its own readers; the held values whose chains share that op are
    materialized with it (an attention's output and its log-sum-exp: one attention).

    ``barriers`` (positions; None: every op) cut the backward into stages instead: a
    private copy serves every chain of its stage, and no chain value or private copy made
    before a barrier op is alive while it runs; a held value is held early only where no
    barrier lies before its first reader, else recomputed privately, once per stage (a
    value whose own readers lie on both sides of a barrier keeps its one copy). The
    search puts one at the op where a plan peaks."""

    def __init__(
        self, graph: fx.Graph, zero: Mapping[str, fx.Node], dropped: Set[str],
        chain: Set[str], inputs: Mapping[str, fx.Node], uses: Mapping[str, tuple[int, int]],
        held: Mapping[str, frozenset[str]], barriers: frozenset[int] | None = None,
    ) -> None:
        self.graph, self.zero, self.dropped, self.chain = graph, zero, dropped, chain
        self.inputs, self.uses, self.held, self.barriers = inputs, uses, held, barriers
        self.shared: dict[str, fx.Node] = {}  # dropped value -> its materialized copy
        self.making: set[str] = set()  # shared copies being built (their chains run)
        self.position = -1
        self.built: dict[str, fx.Node] = {}  # this op's chain nodes
        self.stage: dict[str, fx.Node] = {}  # this stage's private copies

    def at(self, position: int) -> None:
        """The backward op at ``position`` runs next: chains built before it are done."""
        if self.barriers is None or position - 1 in self.barriers:
            self.stage = {}
        self.position, self.built = position, {}

    def value(self, name: str) -> fx.Node:
        """The dropped value ``name`` for its own reader at the current op."""
        if name not in self.shared:
            self.making.add(name)
            self.shared[name] = self._materialize(name)
            self.making.discard(name)
        return self.shared[name]

    def _read(self, name: str) -> fx.Node:
        """What a chain node reads for its input ``name``."""
        if name in self.dropped:
            first, last = self.uses[name]
            if name in self.shared and first <= self.position <= last:
                return self.shared[name]  # alive for its own readers anyway
            if name in self.stage:
                return self.stage[name]
            if name in self.held and self.position < first and self._may_hold(first):
                early = self.value(name)
                for sibling in sorted(self.held[name] - self.making):
                    self.value(sibling)
                return early
            self.stage[name] = self._materialize(name)
            return self.stage[name]
        if name in self.chain:
            return self._build(name)
        return self.inputs[name]  # a leaf: a kept saved value or a forward input

    def _may_hold(self, first: int) -> bool:
        """Whether a copy made now may live to the op at ``first``: no barrier between."""
        return self.barriers is None or not any(
            self.position <= b < first for b in self.barriers)

    def _build(self, name: str) -> fx.Node:
        if name not in self.built:
            source = self.zero[name]
            args = fx.node.map_arg((source.args, source.kwargs), lambda a: self._read(a.name))
            # a name of its own: the default backward's nodes keep theirs (it may
            # recompute the same forward op under the same name for its own use)
            node = self.graph.create_node(source.op, source.target, *args,
                                          name=f"{name}_recomputed")
            node.meta = dict(source.meta)
            self.built[name] = node
        return self.built[name]

    def _materialize(self, name: str) -> fx.Node:
        """``name``'s chain, then the opaque copy that stores it rounded (module
        docstring); the chain's nodes die there."""
        barrier = self.graph.call_function(MATERIALIZE, (self._build(name),))
        barrier.meta = dict(self.zero[name].meta)
        return barrier
