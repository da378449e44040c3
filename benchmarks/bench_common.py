"""Helpers shared by the benchmark scripts (not part of the library).

* :func:`gpt_module` imports ``examples/gpt_model.py`` (the one GPT the examples and every
  benchmark use), so that the benchmarks measure the model the README and docs show.
* :func:`mark_all_partitioner` / :func:`torch_offload_backend`: torch's own AOTAutograd
  activation offloading (``torch._functorch.config.enable_activation_offloading``) with
  every joint node marked ``should_offload`` by a partitioner pass: what torch offers
  without a budget or a planner. Inductor only (torch applies it in its partitioner).
* :func:`digest`: a bit-exact fingerprint of tensors, to compare across processes.
* :func:`run_isolated`: run a benchmark worker in a fresh process with an empty Inductor
  cache, so that no method profits from (or is served by) another method's compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def gpt_module() -> ModuleType:
    """``examples/gpt_model.py`` as a module (``GPT``, ``GPTConfig``, ``random_batch``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import gpt_model

    return gpt_model


def mark_all_partitioner() -> Any:
    """A partitioner that marks every joint node ``should_offload`` and runs the stock
    min-cut partition with torch's activation offloading on (scoped to the compile).

    The returned object's class attribute ``moved`` accumulates the bytes its offload
    nodes move per step (each offloaded value once to the host and once back)."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class MarkAll(CustomPartitionerFn):
        moved = 0

        def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> Any:
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
            return self  # Inductor snapshots its config by deep copy

    return MarkAll()


def torch_offload_backend(partitioner: Any, inner: str = "inductor") -> Callable[..., Any]:
    """A ``torch.compile`` backend with ``partitioner`` as its partitioner: Inductor, or
    (``inner="aot_eager"``) AOTAutograd with no-op compilers, which runs the partitioned
    graphs as they are (torch's offloading is a partitioner rewrite, so it applies too)."""

    def compile_fn(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        if inner == "aot_eager":
            from torch._dynamo.backends.common import aot_autograd
            from torch._dynamo.backends.debugging import boxed_nop

            return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partitioner,
                                keep_inference_input_mutations=True)(gm, example_inputs)
        if inner != "inductor":
            raise ValueError(f"torch_offload_backend: inner must be 'inductor' or 'aot_eager', got {inner!r}")
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        with inductor_config.patch(custom_partitioner_fn=partitioner):
            return compile_fx(gm, example_inputs)

    return compile_fn


def min_cut_partitioner() -> Any:
    """torch's stock min-cut partitioner (the one ``activation_memory_budget`` steers)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """Bit-exact fingerprint of tensors (compared across worker processes)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_isolated(script: str, argv: Sequence[str], timeout_s: float | None = None,
                 cache_dir: str | None = None) -> dict[str, Any]:
    """Run ``python script *argv`` in a fresh process with an empty Inductor cache (or
    ``cache_dir`` when given: a cache shared across calls) and return the last JSON line
    it printed; on failure ``{"error": [last stderr line]}``."""
    with tempfile.TemporaryDirectory() as fresh:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir or fresh}
        try:
            done = subprocess.run([sys.executable, script, *argv], env=env, capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": [f"timed out after {timeout_s} s"]}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["no output"]}
    return json.loads(lines[-1])
