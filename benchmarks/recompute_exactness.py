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

Measured on this machine (CPU). Run: ``.venv/bin/python benchmarks/recompute_exactness.py``
(~2 min on 2 cores).
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


def step(backend: Any, dtype: torch.dtype, memory_budget: float, emulate: bool) -> list[torch.Tensor]:
    """Loss and every gradient of one compiled step (fresh model, fixed seed and batch)."""
    torch.manual_seed(0)
    model = GPT(CONFIG).to(dtype)
    tokens = torch.randint(0, CONFIG.vocab, (4, CONFIG.seq_len), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, CONFIG.vocab, (4, CONFIG.seq_len), generator=torch.Generator().manual_seed(2))
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
    return out


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

        from hyper_offload.compiler.recompute_search import copy_joint, recomputed_nodes

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

    count = 0
    for node in list(graph.graph.nodes):
        value = node.meta.get("val")
        if node.name not in names or not isinstance(value, torch.Tensor):
            continue
        users = [user for user in node.users if user.op != "output"]
        if value.dtype not in (torch.bfloat16, torch.float16) or not users:
            continue
        with graph.graph.inserting_after(node):
            realized = graph.graph.call_function(torch.ops._inductor_test.realize.default, (node,))
        realized.meta = dict(node.meta)
        for user in users:
            user.replace_input_with(node, realized)
        count += 1
    graph.recompile()
    return count


def main() -> None:
    torch.use_deterministic_algorithms(True)
    for row in rows():
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
