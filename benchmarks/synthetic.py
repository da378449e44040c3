"""Synthetic activation traces for the planner benchmark (and the bundled quality set).

Three families (and a timed compile-path variant of the first,
:func:`timed_transformer_trace`, for the planning-time figure):

* :func:`transformer_trace` — a training step of a stack of transformer-like blocks:
  each forward block reads its weights and the previous hidden state and writes a few
  saved activations; the backward pass walks the blocks in reverse, reads the saved
  activations and the weights, and writes gradients (retained). Regular, with long
  forward-to-backward gaps: this is what the speed benchmark scales up.
* :func:`saved_stack_trace` — a deep stack whose forward saves four storages per layer
  (1, 4, 4 and 1 x 64 KiB: the shape of a transformer block's saved input, MLP
  up-projection, activation and output) and whose backward reads them in reverse, each
  backward op turning one gradient into the next: the planning-time figure of issue 30
  (12,500 layers: 100,002 ops, 250,003 accesses).
* :func:`irregular_trace` — random lifetimes, random sizes, random re-reads and the odd
  in-place re-write (several write epochs per storage). Greedy does not trivially tie the
  optimum here, so the quality benchmark uses these.

``python benchmarks/synthetic.py --write-bundled benchmarks/data`` regenerates the
bundled quality set (fixed seed, deterministic).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace
from pathlib import Path

from hyper_offload.passes.analysis.liveness import required_bytes, resident_bytes_without_offload
from hyper_offload.passes.ir.trace import BACKWARD_GRAPH, FORWARD_GRAPH, ActivationTrace

BUNDLED_SEED = 20260511
BUNDLED_COUNT = 30
KIB = 1024


def transformer_trace(
    num_layers: int, *, activations_per_layer: int = 4, budget_fraction: float = 0.5
) -> ActivationTrace:
    """A forward + backward step of ``num_layers`` blocks; about 12 accesses per layer
    per saved activation pair, so accesses grow linearly with ``num_layers``."""
    ops: list[dict[int, str]] = []
    sizes: dict[int, int] = {}
    retained: list[int] = []
    next_id = 0

    def new(size: int) -> int:
        nonlocal next_id
        sizes[next_id] = size
        next_id += 1
        return next_id - 1

    weights = [new(64 * KIB) for _ in range(num_layers)]
    hidden = new(16 * KIB)
    ops.append({hidden: "W"})
    saved: list[list[int]] = []
    for layer in range(num_layers):
        acts = []
        previous = hidden
        for k in range(activations_per_layer):
            act = new((8 + 8 * (k % 3)) * KIB)
            ops.append({weights[layer]: "R", previous: "R", act: "W"})
            acts.append(act)
            previous = act
        saved.append(acts)
        hidden = acts[-1]
    grad = new(16 * KIB)
    ops.append({hidden: "R", grad: "W"})
    for layer in reversed(range(num_layers)):
        weight_grad = new(64 * KIB)
        retained.append(weight_grad)
        for act in reversed(saved[layer]):
            ops.append({act: "R", weights[layer]: "R", grad: "W"})
        ops.append({grad: "R", weight_grad: "W"})
    retained.extend(weights)
    retained.append(grad)
    trace = ActivationTrace.from_accesses(ops, sizes, budget_bytes=0, retained=retained)
    peak = max(resident_bytes_without_offload(trace))
    return trace.with_budget(int(peak * budget_fraction))


def timed_transformer_trace(num_layers: int, *, seed: int = 0) -> ActivationTrace:
    """:func:`transformer_trace` at 70% of its peak as a compile-path trace: ops named
    ``fw:``/``bw:`` (the backward begins at the loss), each with a seeded duration of
    1-100 µs, links at 0.5 GB/s, so copies matter. ~9 ops per layer."""
    activations_per_layer = 4
    trace = transformer_trace(num_layers, activations_per_layer=activations_per_layer,
                              budget_fraction=0.7)
    num_fw = 1 + num_layers * activations_per_layer
    durations = random.Random(seed)
    ops = tuple(
        replace(op, name=f"{FORWARD_GRAPH if i < num_fw else BACKWARD_GRAPH}:{op.name}",
                duration_s=durations.uniform(1e-6, 1e-4))
        for i, op in enumerate(trace.ops)
    )
    return replace(trace, ops=ops, d2h_bandwidth_gbps=0.5, h2d_bandwidth_gbps=0.5)


SAVED_PER_LAYER = (1, 4, 4, 1)  # x 64 KiB


def saved_stack_trace(num_layers: int, *, budget_divisor: int = 3) -> ActivationTrace:
    """A forward + backward over ``num_layers`` blocks that each save
    :data:`SAVED_PER_LAYER` x 64 KiB, under ``max(floor, peak // budget_divisor)``
    (``floor``: the largest bytes one op needs resident). ``8 * num_layers + 2`` ops,
    ``20 * num_layers + 3`` accesses."""
    ops: list[dict[int, str]] = []
    sizes: dict[int, int] = {}

    def new(size: int) -> int:
        sizes[len(sizes)] = size
        return len(sizes) - 1

    hidden = new(64 * KIB)
    ops.append({hidden: "W"})
    saved: list[list[int]] = []
    for _ in range(num_layers):
        layer = []
        for multiple in SAVED_PER_LAYER:
            activation = new(multiple * 64 * KIB)
            ops.append({hidden: "R", activation: "W"})
            layer.append(activation)
            hidden = activation
        saved.append(layer)
    grad = new(64 * KIB)
    ops.append({hidden: "R", grad: "W"})
    for layer in reversed(saved):
        for activation in reversed(layer):
            next_grad = new(64 * KIB)
            ops.append({activation: "R", grad: "R", next_grad: "W"})
            grad = next_grad
    trace = ActivationTrace.from_accesses(ops, sizes, budget_bytes=0)
    peak = max(resident_bytes_without_offload(trace))
    return trace.with_budget(max(max(required_bytes(trace)), peak // budget_divisor))


def irregular_trace(rng: random.Random, *, num_ops: int, num_storages: int) -> ActivationTrace:
    """Random lifetimes and sizes; budget a random 45-80% of the no-offload peak."""
    ops: list[dict[int, str]] = [{} for _ in range(num_ops)]
    sizes: dict[int, int] = {}
    retained = []
    for storage in range(num_storages):
        sizes[storage] = rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 32]) * KIB
        birth = rng.randrange(num_ops)
        lifetime = int(rng.expovariate(1 / (num_ops / 3))) + 1
        death = min(num_ops - 1, birth + lifetime)
        touched = {birth: "W"}
        for _ in range(rng.randint(0, 4)):
            op = rng.randint(birth, death)
            if op != birth:
                touched[op] = "W" if rng.random() < 0.15 else "R"
        touched[death] = touched.get(death, "R")
        for op, kind in touched.items():
            ops[op][storage] = kind
        if rng.random() < 0.08:
            retained.append(storage)
    trace = ActivationTrace.from_accesses(ops, sizes, budget_bytes=0, retained=retained)
    peak = max(resident_bytes_without_offload(trace))
    return trace.with_budget(int(peak * rng.uniform(0.45, 0.8)))


def bundled_traces(seed: int = BUNDLED_SEED, count: int = BUNDLED_COUNT) -> list[ActivationTrace]:
    """The quality set: ``count`` irregular traces of 20-60 ops."""
    rng = random.Random(seed)
    traces = []
    for _ in range(count):
        num_ops = rng.randint(20, 60)
        traces.append(
            irregular_trace(rng, num_ops=num_ops, num_storages=rng.randint(num_ops // 2, num_ops))
        )
    return traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-bundled", type=Path, required=True, metavar="DIR")
    args = parser.parse_args()
    args.write_bundled.mkdir(parents=True, exist_ok=True)
    for index, trace in enumerate(bundled_traces()):
        path = args.write_bundled / f"irregular_{index:02d}.json"
        path.write_text(trace.to_json(indent=None) + "\n")
    print(f"wrote {BUNDLED_COUNT} traces to {args.write_bundled}")


if __name__ == "__main__":
    main()
