"""Is recomputation bitwise exact? (issue 17's exactness rule, measured.)

A tiny GPT (``examples/gpt_model.py``) takes one training step under ``torch.compile``
with torch's stock min-cut partitioner at several ``activation_memory_budget`` values
(lower: more ops recomputed in the backward), each compared with the default partition
(``1.0``) by ``torch.equal`` on the loss and every gradient. Deterministic algorithms on.
One JSON line per (backend, dtype, budget, ``emulate_precision_casts``):

* ``aot_eager_decomp_partition`` runs the min-cut partition on eager kernels;
* ``inductor`` with ``emulate_precision_casts`` off (torch's default) and on (Inductor
  rounds fused intermediates to their dtype as eager would), and a line comparing
  the default partition with the flag on against the flag off;
* ``recompute_exactness.realized``: Inductor bf16 at budget 0 with forced realization
  (Inductor's own ``_inductor_test.realize`` op: the value is stored, rounded to its
  dtype, and its users read it back) after the recomputed low-precision values, in the
  backward and, for the same nodes, in the forward. ``saved``: only the values the
  default partition saves (what plain compile's backward reads from memory); ``every``:
  every recomputed low-precision value. Does rounding where plain compile stores make
  recompute exact?
* ``recompute_exactness.values``: the same budget-0 partition with a tap (an opaque
  custom op, so an extern kernel: its input is stored and read back) after each
  recomputed value the default partition saves, compared with the value plain compile's
  forward stores (tapped after each saved output): are the recomputed values themselves
  equal, and are the gradients then?
* ``recompute_exactness.splice``: what the backend searches in bf16 under Inductor,
  the product's spliced backward (``compiler/recompute/splice.py``) on a 2-layer GPT with the
  cheapest 25 / 50 / 100 % of its options recomputed;
* ``recompute_exactness.spliced``: the first prototype of that, the backward built as a recompute prologue (the
  partition's own recompute nodes, up to each value the default partition saves), an
  opaque barrier after each of those values, then the default partition's backward
  graph verbatim. Also listed: what the partition's forward saves beyond the default
  partition's saves and the graph inputs (``saved_outside_plain``).

Measured on this machine (CPU). Run: ``.venv/bin/python benchmarks/recompute_exactness.py``
(~5 min on 2 cores; ``--splice-only``: the ``splice`` rows alone).
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from gpt_model import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab=64, seq_len=32, layers=1, dim=32, heads=2)
MEMORY_BUDGETS = (0.5, 0.0)


def step(backend: Any, dtype: torch.dtype, memory_budget: float, emulate: bool,
         config: GPTConfig = CONFIG) -> list[torch.Tensor]:
    """Loss and every gradient of one compiled step (fresh model, fixed seed and batch)."""
    torch.manual_seed(0)
    model = GPT(config).to(dtype)
    tokens = torch.randint(0, config.vocab, (4, config.seq_len), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, config.vocab, (4, config.seq_len), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=memory_budget), \
            torch._inductor.config.patch(emulate_precision_casts=emulate):
        loss = torch.compile(model, backend=backend)(tokens, targets)
        loss = loss if loss.dim() == 0 else loss.mean()
        loss.backward()
    return [loss.detach(), *(p.grad.clone() for p in model.parameters())]


def differing(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(not torch.equal(x, y) for x, y in zip(a, b))


def rows() -> list[dict[str, Any]]:
    out = []
    for backend in ("aot_eager_decomp_partition", "inductor"):
        for dtype in (torch.float32, torch.bfloat16):
            for emulate in ((False, True) if backend == "inductor" else (False,)):
                baseline = step(backend, dtype, 1.0, emulate)
                for memory_budget in MEMORY_BUDGETS:
                    recomputed = step(backend, dtype, memory_budget, emulate)
                    out.append({
                        "bench": "recompute_exactness", "backend": backend, "dtype": str(dtype),
                        "activation_memory_budget": memory_budget,
                        "emulate_precision_casts": emulate,
                        "values": len(baseline), "differing": differing(baseline, recomputed),
                        "measured": True,
                    })
            if backend == "inductor":
                plain = step(backend, dtype, 1.0, False)
                out.append({
                    "bench": "recompute_exactness.emulate_vs_default", "backend": backend,
                    "dtype": str(dtype), "activation_memory_budget": 1.0,
                    "values": len(plain), "differing": differing(plain, step(backend, dtype, 1.0, True)),
                    "measured": True,
                })
    out.extend(realized_rows())
    out.append(values_row())
    out.extend(spliced_rows())
    out.extend(splice_rows())
    return out


SPLICE_CONFIG = GPTConfig(vocab=64, seq_len=32, layers=2, dim=32, heads=2)
SPLICE_SHARES = (0.25, 0.5, 1.0)


def splice_rows() -> list[dict[str, Any]]:
    """The product's spliced backward (``hyper_offload.compiler.recompute.splice``) on
    the 2-layer GPT in bf16 under Inductor: the cheapest ``share`` of its options
    recomputed, against plain Inductor."""
    plain = step("inductor", torch.bfloat16, 1.0, False, SPLICE_CONFIG)
    out = []
    for share in SPLICE_SHARES:
        partitioner = _ProductSplice(share)
        got = step(partial(_inductor_with, partitioner), torch.bfloat16, 1.0, False, SPLICE_CONFIG)
        out.append({
            "bench": "recompute_exactness.splice", "backend": "inductor", "dtype": str(torch.bfloat16),
            "layers": SPLICE_CONFIG.layers, "share": share, **partitioner.counts,
            "values": len(plain), "differing": differing(plain, got), "measured": True,
        })
    return out


class _ProductSplice(CustomPartitionerFn):
    """The default partition with the first ``share`` of ``recompute_order``'s options
    recomputed by ``splice``."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.counts: dict[str, int] = {}

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, ...]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from hyper_offload.compiler.recompute import splice as rs
        from hyper_offload.compiler.recompute.candidates import copy_joint
        from hyper_offload.compiler.recompute.rules import draws_random
        from hyper_offload.passes.fx.cost_model import node_seconds, throughput_for

        graphs = {}
        for memory_budget in (1.0, 0.0):
            with torch._functorch.config.patch(activation_memory_budget=memory_budget):
                graphs[memory_budget] = min_cut_rematerialization_partition(
                    copy_joint(gm), joint_inputs, **kwargs)
        (fw, bw), (_, zero_bw) = graphs[1.0], graphs[0.0]
        price = partial(node_seconds, throughput=throughput_for(torch.device("cpu")))
        options = rs.recompute_order(rs.splice_options(fw, bw, zero_bw, unrepeatable=draws_random, seconds=price))
        chosen = options[: round(len(options) * self.share)]
        self.counts = {"options": len(options), "recomputed_saved_values": len(chosen),
                       "recompute_ops": sum(len(o.chain) for o in chosen)}
        return rs.splice(fw, bw, zero_bw, chosen)

    def uuid(self) -> Any:
        return ("recompute_exactness.splice", self.share)


@torch.library.custom_op("recompute_exactness::barrier", mutates_args=())
def _barrier(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_barrier.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def spliced_rows() -> list[dict[str, Any]]:
    """Recompute prologue | barrier | the default partition's backward (module docstring)."""
    plain = step("inductor", torch.bfloat16, 1.0, False)
    out = []
    for memory_budget in MEMORY_BUDGETS:
        partitioner = _SplicingPartitioner()
        got = step(partial(_inductor_with, partitioner), torch.bfloat16, memory_budget, False)
        out.append({
            "bench": "recompute_exactness.spliced", "backend": "inductor", "dtype": str(torch.bfloat16),
            "activation_memory_budget": memory_budget, **partitioner.counts,
            "values": len(plain), "differing": differing(plain, got), "measured": True,
        })
    return out


class _SplicingPartitioner(CustomPartitionerFn):
    def __init__(self) -> None:
        self.counts: dict[str, Any] = {}

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, ...]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from hyper_offload.compiler.recompute.candidates import copy_joint

        with torch._functorch.config.patch(activation_memory_budget=1.0):
            default_fw, default_bw = min_cut_rematerialization_partition(copy_joint(gm), joint_inputs, **kwargs)
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        inputs = {node.name for node in fw.graph.nodes if node.op == "placeholder"}
        spliced, recomputed = _splice(default_bw, bw)
        self.counts = {
            "recomputed_saved_values": recomputed,
            "saved_outside_plain": sorted(_outputs(fw) - _outputs(default_fw) - inputs),
        }
        return fw, spliced

    def uuid(self) -> Any:
        return "recompute_exactness.spliced"


def _splice(plain_bw: fx.GraphModule, bw: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """``bw``'s placeholders, then for each input of ``plain_bw`` that ``bw`` recomputes
    its recompute chain (copied from ``bw``) and a barrier, then ``plain_bw``'s nodes."""
    graph = fx.Graph()
    ours = {node.name: node for node in bw.graph.nodes}
    env: dict[str, fx.Node] = {}

    def copy(node: fx.Node, lookup: dict[str, fx.Node]) -> fx.Node:
        new = graph.node_copy(node, lambda arg: lookup[arg.name])
        new.meta = dict(node.meta)
        return new

    def build(name: str) -> fx.Node:
        if name not in env:
            for arg in ours[name].all_input_nodes:
                build(arg.name)
            env[name] = copy(ours[name], env)
        return env[name]

    for node in bw.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = copy(node, env)
    plain: dict[str, fx.Node] = {}
    recomputed = 0

    def value(name: str) -> fx.Node:  # an input of plain_bw, recomputed right before first use
        nonlocal recomputed
        if name not in plain:
            if ours[name].op == "placeholder":
                plain[name] = env[name]
            else:
                plain[name] = graph.call_function(torch.ops.recompute_exactness.barrier.default, (build(name),))
                plain[name].meta = dict(ours[name].meta)
                recomputed += 1
        return plain[name]

    for node in plain_bw.graph.nodes:
        if node.op != "placeholder":
            for arg in node.all_input_nodes:
                if arg.op == "placeholder":
                    value(arg.name)
            plain[node.name] = copy(node, plain)
    spliced = fx.GraphModule(bw, graph)
    spliced.graph.eliminate_dead_code()
    spliced.recompile()
    return spliced, recomputed


_TAPPED: dict[str, torch.Tensor] = {}


@torch.library.custom_op("recompute_exactness::tap", mutates_args=())
def _tap(x: torch.Tensor, key: str) -> torch.Tensor:
    _TAPPED[key] = x.detach().clone()
    return x.clone()


@_tap.register_fake
def _(x: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(x)


def values_row() -> dict[str, Any]:
    """Recomputed values against the stored ones, and the gradients (module docstring)."""
    plain = step("inductor", torch.bfloat16, 1.0, False)
    _TAPPED.clear()
    stored = step(partial(_inductor_with, _TappingPartitioner("stored")), torch.bfloat16, 1.0, False)
    recomputing = _TappingPartitioner("recomputed")
    got = step(partial(_inductor_with, recomputing), torch.bfloat16, 0.0, False)
    pairs = [(key, value) for key, value in _TAPPED.items() if key.startswith("recomputed:")]
    equal = sum(torch.equal(value, _TAPPED["stored:" + key.split(":", 1)[1]]) for key, value in pairs)
    return {
        "bench": "recompute_exactness.values", "backend": "inductor", "dtype": str(torch.bfloat16),
        "activation_memory_budget": 0.0, "recomputed_saved_values": len(pairs),
        "equal_to_stored": equal, "taps_change_plain": differing(plain, stored),
        "values": len(plain), "differing": differing(plain, got), "measured": True,
    }


class _TappingPartitioner(CustomPartitionerFn):
    """``stored``: tap the forward's saved outputs; ``recomputed``: tap the recomputed
    values the default partition saves, where the backward computes them."""

    def __init__(self, which: str) -> None:
        self.which = which

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, ...]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from hyper_offload.compiler.recompute.candidates import copy_joint
        from hyper_offload.compiler.recompute.rules import recomputed_nodes

        with torch._functorch.config.patch(activation_memory_budget=1.0):
            default_fw, default_bw = min_cut_rematerialization_partition(copy_joint(gm), joint_inputs, **kwargs)
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        if self.which == "stored":
            _insert_after(fw, _outputs(fw), lambda node: (torch.ops.recompute_exactness.tap.default,
                                                         (node, "stored:" + node.name)))
        else:
            extra = recomputed_nodes(fw, bw) - recomputed_nodes(default_fw, default_bw)
            _insert_after(bw, extra & _outputs(default_fw), lambda node: (
                torch.ops.recompute_exactness.tap.default, (node, "recomputed:" + node.name)))
        return fw, bw

    def uuid(self) -> Any:
        return ("recompute_exactness.values", self.which)


def realized_rows() -> list[dict[str, Any]]:
    """Inductor bf16 at budget 0, recomputed values force-realized (module docstring)."""
    plain = step("inductor", torch.bfloat16, 1.0, False)
    out = []
    for which in ("saved", "every"):
        partitioner = _RealizingPartitioner(which)
        got = step(partial(_inductor_with, partitioner), torch.bfloat16, 0.0, False)
        out.append({
            "bench": "recompute_exactness.realized", "backend": "inductor", "dtype": str(torch.bfloat16),
            "activation_memory_budget": 0.0, "realized": which, **partitioner.counts,
            "values": len(plain), "differing": differing(plain, got), "measured": True,
        })
    return out


def _inductor_with(partitioner: Any, gm: fx.GraphModule, inputs: list[Any]) -> Any:
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    with inductor_config.patch(custom_partitioner_fn=partitioner, force_disable_caches=True):
        return compile_fx(gm, inputs)


class _RealizingPartitioner(CustomPartitionerFn):
    """Stock partition at the ambient budget, then ``realize`` after recomputed values."""

    def __init__(self, which: str) -> None:
        self.which = which
        self.counts: dict[str, int] = {}

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, ...]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from hyper_offload.compiler.recompute.candidates import copy_joint
        from hyper_offload.compiler.recompute.rules import recomputed_nodes

        with torch._functorch.config.patch(activation_memory_budget=1.0):
            default_fw, default_bw = min_cut_rematerialization_partition(copy_joint(gm), joint_inputs, **kwargs)
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        extra = recomputed_nodes(fw, bw) - recomputed_nodes(default_fw, default_bw)
        chosen = extra & _outputs(default_fw) if self.which == "saved" else extra
        self.counts = {"recomputed": len(extra), "realized_bw": _realize_after(bw, chosen),
                       "realized_fw": _realize_after(fw, chosen)}
        return fw, bw

    def uuid(self) -> Any:
        return ("recompute_exactness.realized", self.which)


def _outputs(graph: fx.GraphModule) -> set[str]:
    (output,) = graph.graph.find_nodes(op="output")
    return {arg.name for arg in output.args[0] if isinstance(arg, fx.Node)}


def _realize_after(graph: fx.GraphModule, names: set[str]) -> int:
    """Route every non-output user of the low-precision nodes ``names`` through ``realize``."""
    import torch._inductor.test_operators  # noqa: F401  (defines _inductor_test.realize)

    low = {
        node.name for node in graph.graph.nodes
        if isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dtype in (torch.bfloat16, torch.float16)
    }
    return _insert_after(graph, names & low, lambda node: (torch.ops._inductor_test.realize.default, (node,)))


def _insert_after(graph: fx.GraphModule, names: set[str], make: Any) -> int:
    """After each tensor node in ``names`` with a non-output user, insert ``make(node)``
    (``(target, args)``) and route those users through it; the output keeps the node."""
    count = 0
    for node in list(graph.graph.nodes):
        users = [user for user in node.users if user.op != "output"]
        if node.name not in names or not isinstance(node.meta.get("val"), torch.Tensor) or not users:
            continue
        target, args = make(node)
        with graph.graph.inserting_after(node):
            inserted = graph.graph.call_function(target, args)
        inserted.meta = dict(node.meta)
        for user in users:
            user.replace_input_with(node, inserted)
        count += 1
    graph.recompile()
    return count


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splice-only", action="store_true",
                        help="only the recompute_exactness.splice rows (~1 min)")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    for row in (splice_rows() if args.splice_only else rows()):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
