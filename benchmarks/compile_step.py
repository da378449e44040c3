"""Compile benchmark: ``backend="hyper_offload"`` against plain ``torch.compile`` and against
torch's own ``enable_activation_offloading`` with every saved activation marked.

One JSON object per line, all measured in the same run on the same small GPT:

* ``compile_step`` — per inner compiler and variant, each in its own process with an
  empty Inductor cache: first-call seconds (compile +
  one step), the fastest and the median step over ``--steps`` steps, ratios to plain
  ``torch.compile`` with the same inner compiler, device bytes of saved activations the
  compiled backward holds (``compiled_memory.saved_device_bytes``; on CUDA also
  ``torch.cuda.max_memory_allocated``), bytes moved, and whether loss and every
  gradient equal plain compile bit for bit. On CPU, torch's offloading copies to the
  same device, so its ``saved_device_bytes`` cannot drop there; compare it on CUDA.

* ``compile_memory_curve`` — aot_eager, budgets 1.0 / 0.75 / 0.5 / 0.25 of the peak
  and 0 MiB: saved device bytes, predicted peak before/after, bytes moved.

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


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    """Bit-exact fingerprint of tensors (compared across worker processes)."""
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _backend(inner: str, variant: str) -> tuple[Any, Any]:
    if variant == "plain":
        return inner, None
    if variant.startswith("hyper_offload@"):
        fraction = float(variant.split("@", 1)[1])
        return hyper_offload.backend(inner_compiler=inner, max_resident_activation_fraction=fraction), None
    partitioner = _mark_all_partitioner()
    return _torch_offload_backend(partitioner), partitioner


def measure(args: argparse.Namespace, inner: str, variant: str) -> dict[str, Any]:
    """One variant, in this (fresh) process."""
    torch.use_deterministic_algorithms(True)
    backend, partitioner = _backend(inner, variant)
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
        "layers": args.layers, "first_call_s": first,
        # the fastest step: on a shared machine the median mostly measures other load
        "step_s": min(times), "step_median_s": statistics.median(times),
        "saved_device_bytes": saved, "loss": loss.item(),
        "digest": _digest([loss, *(p.grad for p in model.parameters())]),
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
    if partitioner is not None:
        result["bytes_moved"] = type(partitioner).moved
    return result


def memory_curve(args: argparse.Namespace, inner: str) -> None:
    """``compile_memory_curve`` lines: saved device bytes and the plan at several budgets."""
    torch.use_deterministic_algorithms(True)
    for fraction in (1.0, 0.75, 0.5, 0.25, 0.0):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyGPT(args.vocab, args.d, args.layers, args.heads, args.seq)
        idx = torch.randint(0, args.vocab, (args.batch, args.seq))
        options: dict[str, Any] = (
            {"max_resident_activation_mb": 0} if fraction == 0.0
            else {"max_resident_activation_fraction": fraction}
        )
        backend = hyper_offload.backend(inner_compiler=inner, **options)
        loss = torch.compile(model, backend=backend)(idx).float().pow(2).mean()
        saved = saved_device_bytes(loss, exclude=[*model.parameters(), idx])
        loss.backward()
        reports = backend.reports
        print(json.dumps({
            "bench": "compile_memory_curve", "inner": inner, "layers": args.layers,
            "budget_fraction": fraction, "saved_device_bytes": saved,
            "predicted_peak_before": sum(r.predicted_peak_before for r in reports),
            "predicted_peak_after": sum(r.predicted_peak_after for r in reports),
            "bytes_moved": sum(r.bytes_d2h + r.bytes_h2d for r in reports),
            "feasible": all(r.feasible for r in reports),
        }), flush=True)


def _run_worker(args: argparse.Namespace, inner: str, variant: str) -> dict[str, Any]:
    """Each variant in its own process with an empty Inductor cache, so that no variant's
    compile time profits from kernels another one compiled."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        argv = [sys.executable, __file__, "--worker", inner, variant, "--device", args.device,
                "--layers", str(args.layers), "--d", str(args.d), "--heads", str(args.heads),
                "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
                "--steps", str(args.steps)]
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"bench": "compile_step", "inner": inner, "variant": variant,
                "error": done.stderr.strip().splitlines()[-1:] or ["no output"]}
    return json.loads(lines[-1])


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
    parser.add_argument("--worker", nargs=2, metavar=("INNER", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.steps = 2, 4
    if args.worker:
        print(json.dumps(measure(args, *args.worker)), flush=True)
        return
    memory_curve(args, "aot_eager")
    for inner in args.inner.split(","):
        variants = ["plain", "hyper_offload@1.0", "hyper_offload@0.5"]
        if inner == "inductor":
            variants.append("torch_offload_all")
        base = None
        for variant in variants:
            result = _run_worker(args, inner, variant)
            if "error" not in result:
                base = base or result
                result["step_ratio"] = result["step_s"] / base["step_s"]
                result["first_call_ratio"] = result["first_call_s"] / base["first_call_s"]
                result["exact"] = result["digest"] == base["digest"]
            print(json.dumps({k: v for k, v in result.items() if k != "digest"}), flush=True)


if __name__ == "__main__":
    main()
