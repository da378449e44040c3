"""How low the compile door goes now that saved views leave the device (issue 15).

One JSON line per result, each against a baseline measured in the same run:

* ``floor``: the demo GPT (examples/gpt_model.py, 4x128, T=128, B=8): the compile door's
  smallest feasible budget (both inner compilers) against the eager door's on the same
  model, then a compile step *at* that floor: measured activation peak (the profiler's
  allocation events, parameter gradients left out as in the budget), saved device bytes
  (read from autograd's graph), and ``torch.equal`` of loss and gradients with plain
  compile.
* ``gpt2``: Hugging Face GPT-2 with 4 layers (built from a config, no weights), saved
  device bytes after forward with plain compile and with hyper_offload at 25% of the
  region's peak, both inner compilers (measured: ``saved_device_bytes``).
* ``compile_time``: cold-cache compile + first step of the same GPT-2, plain Inductor
  against hyper_offload at 50%, each in a fresh process with an empty Inductor cache.
* ``llama_7b``: ``hyper_offload.estimate`` of Llama-7B at seq 4096 (bf16, meta device):
  the smallest feasible budget (predicted: graphs on fake tensors).

    .venv/bin/python benchmarks/saved_views.py                 # everything (~5 min)
    .venv/bin/python benchmarks/saved_views.py --only floor gpt2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import hyper_offload  # noqa: E402
from bench_common import gpt_module, run_isolated  # noqa: E402
from hyper_offload.compiler import saved_device_bytes  # noqa: E402
from hyper_offload.passes import required_bytes  # noqa: E402

MIB = 1 << 20


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _gpt(seed: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    gpt = gpt_module()
    config = gpt.GPTConfig()
    torch.manual_seed(seed)
    return gpt.GPT(config), gpt.random_batch(config, 8)


def _compile_step(model: torch.nn.Module, batch: tuple, backend: Any) -> tuple[torch.Tensor, list, int]:
    loss = torch.compile(model, backend=backend)(*batch)
    saved = saved_device_bytes(loss, exclude=[*model.parameters(), *batch])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], saved


def _eager_floor() -> int:
    model, batch = _gpt()
    session = hyper_offload.OffloadSession(hyper_offload.OffloadConfig(max_resident_activation_mb=1e6))
    with session:
        model(*batch).backward()
    return max(required_bytes(session.trace))


def floor() -> None:
    from step_memory import profiled_step

    torch.use_deterministic_algorithms(True)
    eager = _eager_floor()
    for inner in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        model, batch = _gpt()
        probe = hyper_offload.backend(inner_compiler=inner, max_resident_activation_fraction=1.0)
        _compile_step(model, batch, probe)
        compile_floor = max(required_bytes(probe.regions[0].planned.fx_trace.trace))
        torch._dynamo.reset()
        want = _compile_step(*_gpt(), inner)
        torch._dynamo.reset()
        model, batch = _gpt()
        backend = hyper_offload.backend(inner_compiler=inner, max_resident_activation_mb=compile_floor / MIB)
        compiled = torch.compile(model, backend=backend)
        params = list(model.parameters())

        def step() -> tuple[torch.Tensor, int]:
            loss = compiled(*batch)
            saved = saved_device_bytes(loss, exclude=[*params, *batch])
            loss.backward()
            return loss.detach(), saved

        step()  # compile
        model.zero_grad(set_to_none=True)
        (loss, saved), memory = profiled_step(step, torch.device("cpu"), params)
        equal = torch.equal(loss, want[0]) and all(
            torch.equal(p.grad, g) for p, g in zip(params, want[1])
        )
        report = backend.reports[0]
        _emit(bench="floor", model="demo GPT 4x128 T=128 B=8", inner_compiler=inner,
              compile_floor_mib=round(compile_floor / MIB, 3), eager_floor_mib=round(eager / MIB, 3),
              floor_ratio=round(compile_floor / eager, 4), feasible_at_floor=report.feasible,
              measured_peak_at_floor_mib=round(memory.peak_bytes / MIB, 3),
              predicted_peak_at_floor_mib=round(report.predicted_peak_after / MIB, 3),
              saved_device_mib=round(saved / MIB, 3), equal=equal)


def _gpt2(layers: int = 4) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=128, n_head=4, n_positions=128, vocab_size=512,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    ids = torch.randint(512, (8, 128), generator=torch.Generator().manual_seed(1))
    return GPT2LMHeadModel(config), ids


def _gpt2_saved(backend: Any) -> tuple[int, Any]:
    model, ids = _gpt2()
    out = torch.compile(model, backend=backend)(input_ids=ids, labels=ids)
    saved = saved_device_bytes(out.loss, exclude=[*model.parameters(), ids])
    out.loss.backward()
    return saved, backend


def gpt2() -> None:
    for inner in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        plain, _ = _gpt2_saved(inner)
        torch._dynamo.reset()
        backend = hyper_offload.backend(inner_compiler=inner, max_resident_activation_fraction=0.25)
        got, _ = _gpt2_saved(backend)
        budget = sum(r.budget_bytes for r in backend.reports)
        _emit(bench="gpt2", model="HF GPT-2 4 layers, n_embd 128, T=128, B=8", inner_compiler=inner,
              saved_plain_mb=round(plain / 1e6, 3), saved_offload_mb=round(got / 1e6, 3),
              budget_mb=round(budget / 1e6, 3), regions=len(backend.reports),
              within_budget_plus_2mib=got <= budget + 2 * MIB)


def _compile_worker(method: str) -> None:
    """One cold compile + first step (run in a fresh process by :func:`compile_time`)."""
    backend: Any = "inductor"
    if method == "hyper_offload":
        backend = hyper_offload.backend(inner_compiler="inductor", max_resident_activation_fraction=0.5)
    started = time.perf_counter()
    _gpt2_saved(backend)
    print(json.dumps({"seconds": time.perf_counter() - started}))


def compile_time() -> None:
    seconds = {m: run_isolated(__file__, ["--worker", m]).get("seconds") for m in ("plain", "hyper_offload")}
    ratio = seconds["hyper_offload"] / seconds["plain"] if all(seconds.values()) else None
    _emit(bench="compile_time", model="HF GPT-2 4 layers (Inductor, cold cache, fresh process)",
          plain_s=seconds["plain"], hyper_offload_50pct_s=seconds["hyper_offload"],
          ratio=round(ratio, 3) if ratio else None)


def llama_7b() -> None:
    from llama_model import llama_7b as build

    tokens = torch.empty(1, 4096, dtype=torch.int64, device="meta")
    report = hyper_offload.estimate(build(), (tokens, tokens), budget=16384, budget_scope="region")
    _emit(bench="llama_7b", model="Llama-7B seq 4096 bf16 (estimate: predicted)",
          min_feasible_budget_mib=round(report.min_feasible_budget_bytes / MIB, 1),
          peak_without_offload_mib=round(report.region.predicted_peak_before / MIB, 1),
          saved_for_backward_mib=round(report.region.saved_activation_bytes / MIB, 1))


BENCHES = {"floor": floor, "gpt2": gpt2, "compile_time": compile_time, "llama_7b": llama_7b}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHES), default=list(BENCHES))
    parser.add_argument("--worker", choices=("plain", "hyper_offload"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _compile_worker(args.worker)
        return
    for name in args.only:
        BENCHES[name]()


if __name__ == "__main__":
    main()
