"""Warm-restart benchmark: a second process compiling the same model with the same
Inductor cache directory, plain ``torch.compile`` against ``backend="hyper_offload"``.

Per backend, two fresh processes share one empty cache directory (``cold``, then
``warm``); each compiles the 2-layer demo GPT (Inductor) and runs one training step.
Measured per process (CPU, this machine):

* ``compile_to_step_s``: from the ``torch.compile`` call to the end of the first
  backward (what a restarted job waits for). Plain ``torch.compile`` imports Inductor
  inside ``torch.compile``; our backend, named by a string, at the first call; this
  figure contains both.
* ``first_step_s``: the first forward + backward alone.
* ``process_s``: the whole process, interpreter start to exit.
* the AOTAutograd cache hits, and whether the region came from the cache and offloads.

One JSON line per (backend, cold/warm), then one ``warm_start_ratio`` line: ours over
plain for each figure (target: warm ``compile_to_step_s`` <= 1.3x plain's).

Run from the repository root: ``python benchmarks/warm_start.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import gpt_module


def _child(backend_name: str) -> None:
    """One process: compile, one training step, one JSON line on stdout."""
    import torch
    from torch._dynamo.utils import counters

    gpt = gpt_module()
    config = gpt.GPTConfig(layers=2, dim=64, heads=4, seq_len=64, vocab=128)
    torch.manual_seed(0)
    model = gpt.GPT(config)
    idx, targets = gpt.random_batch(config, batch=2)
    started = time.perf_counter()
    regions: list = []
    if backend_name == "plain":
        compiled = torch.compile(model)
    else:
        import hyper_offload

        # The object form, so that the regions can be inspected; it imports the backend
        # inside this timing, as the string form does at the first call.
        backend = hyper_offload.backend(max_resident_activation_fraction=0.5)
        compiled = torch.compile(model, backend=backend)
        regions = backend.regions
    step_started = time.perf_counter()
    loss = compiled(idx, targets)
    loss.backward()
    done = time.perf_counter()
    print(json.dumps({
        "compile_to_step_s": done - started,
        "first_step_s": done - step_started,
        "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "from_cache": [r.from_cache for r in regions],
        "offloaded": sum(len(r.planned.report.offloaded) for r in regions if r.planned),
        "loss": loss.item(),
    }))


def _run_child(backend_name: str, cache_dir: str) -> dict[str, object]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", backend_name],
        env=env, capture_output=True, text=True, timeout=1200, check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - started
    return result


FIGURES = ("compile_to_step_s", "first_step_s", "process_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="warm processes per backend")
    parser.add_argument("--child", choices=["plain", "hyper_offload"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    warm: dict[str, list[dict[str, object]]] = {}
    for backend_name in ("plain", "hyper_offload"):
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = _run_child(backend_name, cache_dir)
            print(json.dumps({"bench": "warm_start", "backend": backend_name, "run": "cold",
                              "measured": True, **cold}), flush=True)
            warm[backend_name] = [_run_child(backend_name, cache_dir) for _ in range(args.repeats)]
            for result in warm[backend_name]:
                print(json.dumps({"bench": "warm_start", "backend": backend_name, "run": "warm",
                                  "measured": True, **result}), flush=True)
    median = {b: {f: statistics.median(r[f] for r in runs) for f in FIGURES} for b, runs in warm.items()}
    print(json.dumps({
        "bench": "warm_start_ratio", "measured": True, "repeats": args.repeats,
        **{f"warm_{f}": {"plain": median["plain"][f], "hyper_offload": median["hyper_offload"][f],
                         "ratio": median["hyper_offload"][f] / median["plain"][f]} for f in FIGURES},
        "target_compile_to_step_ratio": 1.3,
    }))


if __name__ == "__main__":
    main()
