"""Compile benchmark: ``backend="hyper_offload"`` against plain ``torch.compile`` and against
torch's own ``enable_activation_offloading`` with every saved activation marked.

One JSON object per line, all measured in the same run on the same small GPT:

* ``compile_step`` — per inner compiler and variant: first-call seconds (compile +
  one step), median step seconds over ``--steps`` steps, their ratios to plain
  ``torch.compile`` with the same inner compiler, device bytes of saved activations the
  compiled backward holds (``compiled_memory.saved_device_bytes``; on CUDA also
  ``torch.cuda.max_memory_allocated``), bytes moved, and whether loss and every
  gradient equal plain compile bit for bit.

Variants: ``plain``; ``hyper_offload@1.0`` (budget >= peak: nothing moves; targets: step
ratio <= 1.03, compile ratio <= 1.5); ``hyper_offload@0.5`` (half the region's
activation peak); ``torch_offload_all`` (AOTAutograd's ``enable_activation_offloading``
with ``should_offload`` set on every node: what torch offers without a budget or a
planner; Inductor only, since torch applies it in its partitioner).

Run from the repository root: ``python benchmarks/compile_step.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hyper_offload
from hyper_offload.compiled_memory import saved_device_bytes


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _mark_all_partitioner() -> Any:
    """A partitioner that marks every joint node ``should_offload`` and runs the stock
    min-cut partition with torch's activation offloading on (scoped to the compile)."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class MarkAll(CustomPartitionerFn):
        moved = 0

        def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    node.meta["should_offload"] = True
            with functorch_config.patch(enable_activation_offloading=True):
                fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
            for node in fw.graph.nodes:
                if node.name.startswith("cpu_offload_") and isinstance(node.meta.get("val"), torch.Tensor):
                    val = node.meta["val"]
                    MarkAll.moved += 2 * val.numel() * val.element_size()
            return fw, bw

        def uuid(self) -> Any:
            return "benchmark-mark-all"

        def __deepcopy__(self, memo: dict[int, Any]) -> Any:
            return self

    return MarkAll()


def _torch_offload_backend(partitioner: Any) -> Callable[..., Any]:
    def compile_fn(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        with inductor_config.patch(custom_partitioner_fn=partitioner):
            return compile_fx(gm, example_inputs)

    return compile_fn


def measure(args: argparse.Namespace, inner: str, variant: str, backend: Any) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = TinyGPT(args.vocab, args.d, args.layers, args.heads, args.seq).to(device)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    target = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    compiled = torch.compile(model, backend=backend)

    def step() -> tuple[torch.Tensor, int]:
        model.zero_grad(set_to_none=False)
        loss = F.cross_entropy(compiled(idx).flatten(0, 1), target.flatten())
        saved = saved_device_bytes(loss, exclude=[*model.parameters(), idx])
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return loss.detach(), saved

    started = time.perf_counter()
    loss, saved = step()
    first = time.perf_counter() - started
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        loss, saved = step()
        times.append(time.perf_counter() - started)
    result: dict[str, Any] = {
        "bench": "compile_step", "inner": inner, "variant": variant, "device": device.type,
        "first_call_s": first, "step_s": statistics.median(times),
        "saved_device_bytes": saved, "loss": loss.item(),
        "_grads": [p.grad.clone() for p in model.parameters()], "_loss": loss,
    }
    if device.type == "cuda":
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    if isinstance(backend, hyper_offload.HyperOffloadBackend):
        reports = backend.reports
        result["bytes_moved"] = sum(r.bytes_d2h + r.bytes_h2d for r in reports)
        result["predicted_peak_before"] = sum(r.predicted_peak_before for r in reports)
        result["predicted_peak_after"] = sum(r.predicted_peak_after for r in reports)
        result["predicted_exposed_transfer_s"] = sum(r.exposed_transfer_s for r in reports)
        result["feasible"] = all(r.feasible for r in reports)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="inductor,aot_eager")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="2 layers, 4 steps")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.steps = 2, 4
    torch.use_deterministic_algorithms(True)
    for inner in args.inner.split(","):
        variants: list[tuple[str, Any]] = [
            ("plain", inner),
            ("hyper_offload@1.0", hyper_offload.backend(inner_compiler=inner, max_resident_activation_fraction=1.0)),
            ("hyper_offload@0.5", hyper_offload.backend(inner_compiler=inner, max_resident_activation_fraction=0.5)),
        ]
        partitioner = None
        if inner == "inductor":
            partitioner = _mark_all_partitioner()
            variants.append(("torch_offload_all", _torch_offload_backend(partitioner)))
        base = None
        for variant, backend in variants:
            try:
                result = measure(args, inner, variant, backend)
            except Exception as error:  # report, keep measuring the others
                print(json.dumps({"bench": "compile_step", "inner": inner, "variant": variant,
                                  "error": f"{type(error).__name__}: {str(error)[:300]}"}), flush=True)
                continue
            if variant == "torch_offload_all" and partitioner is not None:
                result["bytes_moved"] = type(partitioner).moved
            if base is None:
                base = result
            result["step_ratio"] = result["step_s"] / base["step_s"]
            result["first_call_ratio"] = result["first_call_s"] / base["first_call_s"]
            result["exact"] = bool(torch.equal(result["_loss"], base["_loss"]) and all(
                torch.equal(a, b) for a, b in zip(result["_grads"], base["_grads"])
            ))
            print(json.dumps({k: v for k, v in result.items() if not k.startswith("_")}), flush=True)


if __name__ == "__main__":
    main()
