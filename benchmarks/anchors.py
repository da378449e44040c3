"""Anchor benchmark: hyper-offload against what users would otherwise pick.

Same model (``examples/gpt_model.py``), same batch, same budget fraction, one JSON line per
method; each method runs in a fresh process with an empty Inductor cache, and in that
process its step is timed in alternation with the no-offload eager step (and, for compile
methods, with plain ``torch.compile`` using the same inner compiler). Methods:

* ``no_offload`` — plain eager (the baseline of every ratio).
* ``save_on_cpu`` — ``torch.autograd.graph.save_on_cpu`` (pinned on CUDA; on CPU torch
  does no copy at all: ``tensor.cpu()`` of a CPU tensor is the tensor itself).
* ``hook_offload`` — a saved-tensor-hooks offloader in the style of torchtune's
  ``OffloadActivations``: every saved tensor >= 1 KiB that is not a parameter goes to
  the host at pack time (side stream on CUDA), and comes back at unpack time.
* ``checkpoint`` — ``torch.utils.checkpoint`` (non-reentrant) on the fewest leading blocks
  whose measured peak meets the budget (``checkpoint_blocks`` says how many).

  (These two baselines, which torch ships no method for, are in ``anchor_baselines.py``.)
* ``hyper_offload_eager`` — ``OffloadSession`` at the budget (timed steps are replays).
* ``compile`` — plain ``torch.compile`` (the numerics reference of the compile methods).
* ``torch_aot_offload`` — AOTAutograd's ``enable_activation_offloading`` with every node
  marked by a partitioner pass (``bench_common.mark_all_partitioner``); Inductor only.
* ``compile_memory_budget`` — ``torch._functorch.config.activation_memory_budget`` set to
  the budget fraction (torch's own recompute-to-a-budget under compile).
* ``hyper_offload_compile`` — ``backend=hyper_offload.backend(inner_compiler=...,
  max_resident_activation_fraction=...)``.

Figures per line:

* ``peak_step_bytes`` — device bytes the step adds at its peak: activations, temporaries
  and gradients; parameters and inputs excluded. CUDA: ``max_memory_allocated`` minus
  ``memory_allocated`` before the step (``peak_reserved_bytes`` beside it). CPU, eager
  methods: ``DeviceMemoryMeter`` (host-labelled copies excluded). CPU, compiled methods:
  ``null`` — no meter can see inside compiled code on CPU and the CPU allocator keeps no
  counters (docs/architecture.md, "Memory measurement").
* ``saved_bytes`` — device bytes alive at the end of the forward (what the backward
  holds). CUDA: allocator; CPU eager: the meter; CPU compiled: the tensors AOTAutograd
  saved (``hyper_offload.compiler.saved_device_bytes``).
* ``budget_bytes`` — ``--budget`` times the no-offload ``peak_step_bytes`` (eager) or
  the fraction given to the compile methods (``budget_fraction``).
* ``bytes_moved`` — bytes the method copies per step (device to host plus back).
* ``step_s`` / ``step_ratio`` — median step, and its ratio to the no-offload eager
  median timed in alternation in the same process; compile methods also give
  ``step_ratio_vs_compile``.
* ``numerics_equal`` — loss and every gradient ``torch.equal`` to the reference (no-offload
  eager; plain compile for compile methods), under ``torch.use_deterministic_algorithms``.
  ``null`` for the two references themselves.

    python benchmarks/anchors.py                      # CPU default, ~3 minutes on 2 cores
    python benchmarks/anchors.py --tiny               # smoke sizes
    python benchmarks/anchors.py --device cuda --dtype bfloat16 --layers 12 --dim 768 \\
        --heads 12 --seq 2048 --batch 4 --vocab 50304
    python benchmarks/anchors_table.py anchors.jsonl  # the Markdown table
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from anchor_baselines import HookOffloader, checkpointed_model
from bench_common import gpt_module, mark_all_partitioner, min_cut_partitioner, run_isolated, torch_offload_backend

EAGER_METHODS = ("no_offload", "save_on_cpu", "hook_offload", "checkpoint", "hyper_offload_eager")
COMPILE_METHODS = ("compile", "torch_aot_offload", "compile_memory_budget", "hyper_offload_compile")
METHODS = EAGER_METHODS + COMPILE_METHODS
Step = Callable[[], torch.Tensor]


# -- measuring ------------------------------------------------------------------------


@dataclass
class Setup:
    """One method ready to run: ``run()`` does forward + backward and returns the loss."""

    model: nn.Module
    forward: Callable[[], torch.Tensor]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    compiled: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def run(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        with self.context():
            loss = self.forward()
            loss.backward()
        return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memory(setup: Setup, device: torch.device, exclude: list[torch.Tensor]) -> dict[str, Any]:
    """``peak_step_bytes`` and ``saved_bytes`` of one step (module docstring)."""
    from hyper_offload.compiler import saved_device_bytes
    from hyper_offload.runtime import DeviceMemoryMeter

    setup.model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with setup.context():
            loss = setup.forward()
            _sync(device)
            saved = torch.cuda.memory_allocated(device) - base
            loss.backward()
        _sync(device)
        return {"peak_step_bytes": torch.cuda.max_memory_allocated(device) - base,
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device), "saved_bytes": saved}
    if setup.compiled:
        with setup.context():
            loss = setup.forward()
            saved = saved_device_bytes(loss, exclude=exclude)
            loss.backward()
        return {"peak_step_bytes": None, "saved_bytes": saved}
    meter = DeviceMemoryMeter("cpu")  # counts only storages the step creates
    with meter, setup.context():
        loss = setup.forward()
        saved = meter.live_bytes
        loss.backward()
    return {"peak_step_bytes": meter.peak_bytes, "saved_bytes": saved}


def _timed(step: Step, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def time_alternating(steps: dict[str, Step], rounds: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each step, timed in alternation so load changes hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(_timed(step, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def equal_numerics(ref: Setup, other: Setup) -> bool:
    """Loss and every gradient bit for bit equal (parameters in the same order)."""
    ref_loss = ref.run()
    ref_grads = [None if p.grad is None else p.grad.clone() for p in ref.model.parameters()]
    loss = other.run()
    grads = [p.grad for p in other.model.parameters()]
    if len(grads) != len(ref_grads) or not torch.equal(ref_loss, loss):
        return False
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(ref_grads, grads))


# -- the methods ----------------------------------------------------------------------


@dataclass
class Bench:
    """The model, batch and options shared by every method of one worker."""

    args: argparse.Namespace
    model: nn.Module
    batch: tuple[torch.Tensor, torch.Tensor]
    device: torch.device

    def eager(self, model: nn.Module | None = None, **kw: Any) -> Setup:
        model = model if model is not None else copy.deepcopy(self.model)
        return Setup(model, lambda: model(*self.batch), **kw)

    def compiled(self, backend: Any, config: dict[str, Any] | None = None, **kw: Any) -> Setup:
        """``torch.compile`` of a fresh copy; ``config`` patches ``torch._functorch.config``
        around every call (a recompile then sees it too)."""
        from torch._functorch import config as functorch_config

        model = copy.deepcopy(self.model)
        fn = torch.compile(model, backend=backend)
        context = (lambda: functorch_config.patch(**config)) if config else contextlib.nullcontext
        return Setup(model, lambda: fn(*self.batch), context=context, compiled=True, **kw)

    def exclude(self, setup: Setup) -> list[torch.Tensor]:
        return [*setup.model.parameters(), *self.batch]


def eager_setup(bench: Bench, method: str, budget_bytes: int) -> Setup:
    """The eager methods (budget in bytes of the no-offload peak)."""
    from hyper_offload import OffloadConfig, OffloadSession
    from hyper_offload.config import MIB

    if method == "no_offload":
        return bench.eager()
    if method == "save_on_cpu":
        pin = bench.device.type == "cuda"
        setup = bench.eager(context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin))
        setup.info["bytes_moved"] = 2 * saved_tensor_bytes(bench.eager(setup.model)) if pin else 0
        return setup
    if method == "hook_offload":
        setup = bench.eager()
        offloader = HookOffloader(setup.model.parameters())
        setup.context = lambda: offloader
        setup.info["offloader"] = offloader
        return setup
    if method == "checkpoint":
        layers = len(bench.model.blocks)
        for blocks in range(1, layers + 1):  # the fewest blocks that meet the budget
            setup = bench.eager(checkpointed_model(bench.model, blocks))
            peak = measure_memory(setup, bench.device, bench.exclude(setup))["peak_step_bytes"]
            if peak <= budget_bytes:
                break
        setup.info.update(checkpoint_blocks=blocks, bytes_moved=0)
        return setup
    if method == "hyper_offload_eager":
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_bytes / MIB),
                                 device=bench.device)
        setup = bench.eager(context=lambda: session)
        setup.run()  # warmup: trace, evict online, plan; every later step replays
        setup.info["session"] = session
        return setup
    raise ValueError(f"anchors: unknown eager method {method!r}; expected one of {EAGER_METHODS}")


def saved_tensor_bytes(setup: Setup) -> int:
    """Bytes of every tensor autograd saves in one step (what ``save_on_cpu`` copies)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        setup.run()
    return total


def compile_setup(bench: Bench, method: str) -> Setup:
    import hyper_offload

    inner, fraction = bench.args.inner, bench.args.budget
    if method == "compile":
        return bench.compiled(inner, info={"bytes_moved": 0})
    if method == "torch_aot_offload":
        partitioner = mark_all_partitioner()
        return bench.compiled(torch_offload_backend(partitioner, inner), info={"partitioner": partitioner})
    if method == "compile_memory_budget":
        # aot_eager's default partitioner ignores the budget; give it torch's min-cut one
        backend = inner if inner == "inductor" else torch_offload_backend(min_cut_partitioner(), inner)
        return bench.compiled(backend, config={"activation_memory_budget": fraction}, info={"bytes_moved": 0})
    if method == "hyper_offload_compile":
        backend = hyper_offload.backend(inner_compiler=inner, max_resident_activation_fraction=fraction)
        return bench.compiled(backend, info={"backend": backend})
    raise ValueError(f"anchors: unknown compile method {method!r}; expected one of {COMPILE_METHODS}")


def _method_figures(setup: Setup) -> dict[str, Any]:
    """Bytes moved and plan figures, read after the measured steps."""
    info = setup.info
    out = {k: v for k, v in info.items() if k in ("bytes_moved", "checkpoint_blocks")}
    if "offloader" in info:
        offloader = info["offloader"]
        offloader.moved = 0
        setup.run()
        out["bytes_moved"] = offloader.moved
    if "partitioner" in info:
        out["bytes_moved"] = type(info["partitioner"]).moved
    if "session" in info:
        stats = info["session"].last_stats
        report = info["session"].report
        out.update(bytes_moved=stats.bytes_d2h + stats.bytes_h2d,
                   session_peak_resident_bytes=stats.peak_resident_bytes,
                   planned_peak_bytes=report.peak_resident_bytes, feasible=report.feasible)
    if "backend" in info:
        reports = info["backend"].reports
        step = info["backend"].step_report
        out.update(bytes_moved=sum(r.bytes_d2h + r.bytes_h2d for r in reports),
                   predicted_peak_before=sum(r.predicted_peak_before for r in reports),
                   predicted_peak_after=sum(r.predicted_peak_after for r in reports),
                   feasible=all(r.feasible for r in reports),
                   # the budget the step scope resolved the fraction to (of the step's peak)
                   step_budget_bytes=step.budget_bytes if step is not None else None)
    return out


def measure(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """One method, in this (fresh) process: memory, bytes moved, times, numerics."""
    # warn_only, as in the GPU tests: an op without a deterministic kernel (some SDPA
    # backward kernels) warns instead of stopping the run; a mismatch it caused would show
    # as numerics_equal false, never be hidden.
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    gm = gpt_module()
    config = gm.GPTConfig(vocab=args.vocab, seq_len=args.seq, layers=args.layers, dim=args.dim,
                          heads=args.heads)
    torch.manual_seed(0)
    model = gm.GPT(config).to(device=device, dtype=getattr(torch, args.dtype))
    bench = Bench(args, model, gm.random_batch(config, args.batch, device=device), device)

    plain = bench.eager()
    plain.run()  # warm the allocator and kernels
    base_memory = measure_memory(plain, device, bench.exclude(plain))
    budget_bytes = int(args.budget * base_memory["peak_step_bytes"])
    result: dict[str, Any] = {"bench": "anchors", "method": method, "device": device.type,
                              "dtype": args.dtype, "layers": args.layers, "dim": args.dim,
                              "seq": args.seq, "batch": args.batch, "inner": None,
                              "budget_fraction": args.budget, "budget_bytes": budget_bytes,
                              "no_offload_peak_step_bytes": base_memory["peak_step_bytes"]}
    steps: dict[str, Step] = {"no_offload": plain.run}
    if method in EAGER_METHODS:
        setup = plain if method == "no_offload" else eager_setup(bench, method, budget_bytes)
        reference = None if method == "no_offload" else bench.eager()
    else:
        result["inner"] = args.inner
        reference = None if method == "compile" else compile_setup(bench, "compile")
        started = time.perf_counter()
        setup = compile_setup(bench, method)
        setup.run()
        result["first_call_s"] = time.perf_counter() - started
        if reference is not None:
            reference.run()
            steps["compile"] = reference.run
    setup.run()  # one more warm step (first replay / allocator warm-up)
    result.update(measure_memory(setup, device, bench.exclude(setup)))
    if reference is not None and setup.compiled:
        result["compile_saved_bytes"] = measure_memory(reference, device, bench.exclude(reference))["saved_bytes"]
    if method != "no_offload":
        steps[method] = setup.run
    medians = time_alternating(steps, args.steps, device)
    result["step_s"] = medians[method]
    result["no_offload_step_s"] = medians["no_offload"]
    result["step_ratio"] = medians[method] / medians["no_offload"]
    if "compile" in medians:
        result["step_ratio_vs_compile"] = medians[method] / medians["compile"]
    result.update(_method_figures(setup))
    result["numerics_equal"] = None if reference is None else equal_numerics(reference, setup)
    return result


def _worker_argv(args: argparse.Namespace, method: str) -> list[str]:
    argv = ["--worker", method]
    for name in ("device", "dtype", "layers", "dim", "heads", "seq", "batch", "vocab", "steps",
                 "budget", "inner", "threads"):
        argv += [f"--{name}", str(getattr(args, name))]
    return argv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=7, help="timed rounds (medians)")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="budget as a fraction of the no-offload peak (default 0.5)")
    parser.add_argument("--inner", default=None, choices=("inductor", "aot_eager"),
                        help="inner compiler of the compile methods (default: inductor on CUDA, "
                             "aot_eager on CPU, where Inductor's C++ compiles take minutes)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (1: OpenMP spin-waits swamp timing on a shared CPU)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tiny", action="store_true", help="smoke sizes: 2 layers, dim 64, seq 32")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per method")
    parser.add_argument("--shared-cache", default=None, metavar="DIR",
                        help="one Inductor cache for every method (faster; first_call_s is then not cold)")
    parser.add_argument("--out", default=None, help="also write the JSON lines to this file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner is None:
        args.inner = "aot_eager" if args.device == "cpu" else "inductor"
    if args.tiny:
        args.layers, args.dim, args.heads, args.seq, args.batch, args.vocab = 2, 64, 2, 32, 2, 128
        args.steps = min(args.steps, 3)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args, args.worker)), flush=True)
        return
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        raise SystemExit(f"anchors: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if args.out:  # one run per file: start it empty
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("")
    for method in args.methods.split(","):
        result = run_isolated(__file__, _worker_argv(args, method), timeout_s=args.timeout,
                              cache_dir=args.shared_cache)
        if "error" in result:
            result = {"bench": "anchors", "method": method, "device": args.device, **result}
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
