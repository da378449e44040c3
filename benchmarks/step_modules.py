"""How many library modules the compile door runs code in, per training step: the step
that compiles (``torch.compile`` down to the lowering), the step after it (planned,
re-lowered), and a step that runs the plan in force (the runtime path a saved
activation takes). A Python profile hook records every library file a call enters.

Model: a tiny MLP (Linear-GELU-Linear-GELU-Linear, batch 64), ``inner_compiler=
"aot_eager"``, half its peak. One JSON line, ``"measured": true``; the modules of the
planned step are listed. Compare two commits by running it in each checkout.

Run from the repository root: ``python benchmarks/step_modules.py``.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hyper_offload

ROOT = Path(hyper_offload.__file__).resolve().parents[1]
LIBRARY = tuple(str(ROOT / folder) + "/" for folder in ("offload_compile", "passes", "runtime"))


def modules_run(step: Callable[[], None]) -> set[str]:
    """The library files (relative to the repository) whose functions ``step`` calls, on
    any thread (autograd's included)."""
    seen: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(LIBRARY):
            seen.add(str(Path(frame.f_code.co_filename).relative_to(ROOT)))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return seen


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                          nn.Linear(128, 1))
    x = torch.randn(64, 32)
    compiled = torch.compile(model, backend="hyper_offload", options={
        "inner_compiler": "aot_eager", "max_resident_activation_fraction": 0.5})

    def step() -> None:
        compiled(x).pow(2).mean().backward()

    compiling, second, planned = (modules_run(step) for _ in range(3))
    print(json.dumps({
        "bench": "step_modules", "measured": True,
        "compiling_step": len(compiling), "second_step": len(second),
        "planned_step": len(planned), "all_steps": len(compiling | second | planned),
        "planned_step_modules": sorted(planned),
    }))


if __name__ == "__main__":
    main()
