"""Is recomputation bitwise exact? (issue 17's exactness rule, measured.)

A tiny GPT (``examples/gpt_model.py``) takes one training step under ``torch.compile``
with torch's stock min-cut partitioner at several ``activation_memory_budget`` values
(lower: more ops recomputed in the backward), each compared with the default partition
(``1.0``) by ``torch.equal`` on the loss and every gradient. Deterministic algorithms on.
One JSON line per (backend, dtype, budget, ``emulate_precision_casts``):

* ``aot_eager_decomp_partition`` runs the min-cut partition on eager kernels;
* ``inductor`` with ``emulate_precision_casts`` off (torch's default) and on (Inductor
  rounds fused intermediates to their dtype as eager would), and a last line comparing
  the default partition with the flag on against the flag off.

Measured on this machine (CPU). Run: ``.venv/bin/python benchmarks/recompute_exactness.py``
(~2 min on 2 cores).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from gpt_model import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab=64, seq_len=32, layers=1, dim=32, heads=2)
MEMORY_BUDGETS = (0.5, 0.0)


def step(backend: str, dtype: torch.dtype, memory_budget: float, emulate: bool) -> list[torch.Tensor]:
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
    return out


def main() -> None:
    torch.use_deterministic_algorithms(True)
    for row in rows():
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
