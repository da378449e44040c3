"""Compile benchmark: ``backend="hyper_offload"`` against plain ``torch.compile`` and against
torch's own ``enable_activation_offloading`` with every saved activation marked.

One JSON object per line, all measured in the same run on the same small GPT:

* ``compile_step`` — per inner compiler and variant, each in its own process with an
  empty Inductor cache: first-call seconds (compile +
  one step), the fastest and the median step over ``--steps`` steps, ratios to plain
  ``torch.compile`` with the same inner compiler, device bytes of saved activations the
  compiled backward holds (``hyper_offload.compiler.saved_device_bytes``; on CUDA also
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

``--verify`` passes ``verify=True`` to every hyper_offload backend (issue 34: every
transfer checked; a copy race raises ``TransferIntegrityError``, which a worker reports
in its line's ``error``): each line then says ``"verify": true`` and hyper_offload lines
give ``verify_checks`` (comparisons that passed) and ``verified_steps``. Verify costs
time: its step ratios are not the overhead figures (``benchmarks/verify_cost.py``).

Run from the repository root: ``python benchmarks/compile_step.py [--quick] [--verify]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch import nn

import hyper_offload
import hyper_offload.compiler
from bench_common import digest, gpt_module, mark_all_partitioner, run_isolated, torch_offload_backend
from hyper_offload.compiler import saved_device_bytes


def _model_and_batch(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The GPT of ``examples/gpt_model.py`` (seed 0) and a seeded batch."""
    gm = gpt_module()
    config = gm.GPTConfig(vocab=args.vocab, seq_len=args.seq, layers=args.layers, dim=args.d, heads=args.heads)
    torch.manual_seed(0)
    return gm.GPT(config).to(device=device, dtype=getattr(torch, args.dtype)), gm.random_batch(config, args.batch, device=device)


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    """What ``--verify`` adds to every line (nothing without it)."""
    return {"verify": True} if args.verify else {}


def _backend(inner: str, variant: str, verify: bool = False) -> tuple[Any, Any]:
    if variant == "plain":
        return inner, None
    if variant.startswith("hyper_offload@"):
        fraction = float(variant.split("@", 1)[1])
        extra = {"verify": True} if verify else {}
        return hyper_offload.backend(inner_compiler=inner, max_resident_activation_fraction=fraction,
                                     **extra), None
    partitioner = mark_all_partitioner()
    return torch_offload_backend(partitioner), partitioner


def measure(args: argparse.Namespace, inner: str, variant: str) -> dict[str, Any]:
    """One variant, in this (fresh) process."""
    torch.use_deterministic_algorithms(True)
    backend, partitioner = _backend(inner, variant, args.verify)
    device = torch.device(args.device)
    model, (idx, target) = _model_and_batch(args, device)
    compiled = torch.compile(model, backend=backend)

    def step() -> tuple[torch.Tensor, int]:
        model.zero_grad(set_to_none=False)
        loss = compiled(idx, target)
        saved = saved_device_bytes(loss, exclude=[*model.parameters(), idx, target])
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
        "layers": args.layers, "dtype": args.dtype, "seq": args.seq, "batch": args.batch,
        "first_call_s": first,
        # the fastest step: on a shared machine the median mostly measures other load
        "step_s": min(times), "step_median_s": statistics.median(times),
        "saved_device_bytes": saved, "loss": loss.item(),
        "digest": digest([loss, *(p.grad for p in model.parameters())]), **_flags(args),
    }
    if device.type == "cuda":
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    if isinstance(backend, hyper_offload.compiler.HyperOffloadBackend):
        reports = backend.reports
        result["bytes_moved"] = sum(r.bytes_d2h + r.bytes_h2d for r in reports)
        result["predicted_peak_before"] = sum(r.predicted_peak_before for r in reports)
        result["predicted_peak_after"] = sum(r.predicted_peak_after for r in reports)
        result["predicted_exposed_transfer_s"] = sum(r.exposed_transfer_s for r in reports)
        result["feasible"] = all(r.feasible for r in reports)
        if args.verify:
            result["verify_checks"] = getattr(backend.runtime, "checks", None)
            result["verified_steps"] = getattr(backend, "verified_steps", None)
    if partitioner is not None:
        result["bytes_moved"] = type(partitioner).moved
    return result


def memory_curve(args: argparse.Namespace, inner: str) -> None:
    """``compile_memory_curve`` lines: saved device bytes and the plan at several budgets."""
    torch.use_deterministic_algorithms(True)
    for fraction in (1.0, 0.75, 0.5, 0.25, 0.0):
        torch._dynamo.reset()
        model, (idx, target) = _model_and_batch(args, torch.device(args.device))
        options: dict[str, Any] = (
            {"max_resident_activation_mb": 0} if fraction == 0.0
            else {"max_resident_activation_fraction": fraction}
        )
        if args.verify:
            options["verify"] = True
        backend = hyper_offload.backend(inner_compiler=inner, **options)
        loss = torch.compile(model, backend=backend)(idx, target)
        saved = saved_device_bytes(loss, exclude=[*model.parameters(), idx, target])
        loss.backward()
        reports = backend.reports
        print(json.dumps({
            "bench": "compile_memory_curve", "inner": inner, "layers": args.layers,
            "budget_fraction": fraction, "saved_device_bytes": saved,
            "predicted_peak_before": sum(r.predicted_peak_before for r in reports),
            "predicted_peak_after": sum(r.predicted_peak_after for r in reports),
            "bytes_moved": sum(r.bytes_d2h + r.bytes_h2d for r in reports),
            "feasible": all(r.feasible for r in reports), **_flags(args),
        }), flush=True)


def _run_worker(args: argparse.Namespace, inner: str, variant: str) -> dict[str, Any]:
    """Each variant in its own process with an empty Inductor cache, so that no variant's
    compile time profits from kernels another one compiled."""
    argv = ["--worker", inner, variant, "--device", args.device,
            "--layers", str(args.layers), "--d", str(args.d), "--heads", str(args.heads),
            "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
            "--steps", str(args.steps), "--dtype", args.dtype, *(["--verify"] if args.verify else [])]
    result = run_isolated(__file__, argv)
    if "error" in result:
        return {"bench": "compile_step", "inner": inner, "variant": variant, **_flags(args), **result}
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
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--variants", default="plain,hyper_offload@1.0,hyper_offload@0.5,torch_offload_all",
                        help="comma-separated; torch_offload_all runs under inductor only")
    parser.add_argument("--no-curve", action="store_true", help="skip the compile_memory_curve lines")
    parser.add_argument("--quick", action="store_true", help="2 layers, 4 steps")
    parser.add_argument("--verify", action="store_true",
                        help="verify=True for the hyper_offload backends: every transfer checked (issue 34)")
    parser.add_argument("--worker", nargs=2, metavar=("INNER", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.steps = 2, 4
    if args.worker:
        print(json.dumps(measure(args, *args.worker)), flush=True)
        return
    if not args.no_curve:
        memory_curve(args, "aot_eager")
    for inner in args.inner.split(","):
        variants = [v for v in args.variants.split(",") if inner == "inductor" or v != "torch_offload_all"]
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
