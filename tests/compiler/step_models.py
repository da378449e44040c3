"""Small models in the layouts users compile them (issue 31), shared by the step tests.

An MLP-transformer block (LayerNorm, Linear 4x, GELU, Linear, residual) stacked
``layers`` times: compiled whole, block by block (torchtitan's way: one compiled graph
serves every layer), or whole with a graph break after the first half.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from torch import nn

from hyper_offload.runtime.saved_bytes import saved_device_bytes

D, BATCH, SEQ, LAYERS = 64, 4, 128, 4
SLACK = 256 * 1024
"""Bytes a measured step may exceed the budget by (issue 31: buffers the plan does not see)."""


class Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, layers: int = LAYERS, d: int = D, graph_break: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if self.graph_break and i == len(self.layers) // 2:
                torch._dynamo.graph_break()
            x = layer(x)
        return self.head(x).float().pow(2).mean()


LAYOUTS = ("whole", "per_block", "graph_break")


def build(layout: str, backend: Any, options: dict[str, Any] | None = None,
          dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """A fresh model (seeded: every call has the same weights) and its compiled step."""
    torch.manual_seed(0)
    model = Stack(graph_break=layout == "graph_break").to(dtype)
    kwargs = {"backend": backend} if options is None else {"backend": backend, "options": options}
    if layout == "per_block":
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, **kwargs)
        return model, model
    return model, torch.compile(model, **kwargs)


def batch(dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, SEQ, D, generator=generator).to(dtype)


class StepResult(NamedTuple):
    saved_bytes: int
    """Device bytes the compiled backward holds after the forward (measured)."""
    loss: torch.Tensor
    grads: tuple[torch.Tensor, ...]


def train(model: nn.Module, step: Callable[..., torch.Tensor], steps: int,
          dtype: torch.dtype = torch.float32, measure: Any = None) -> list[StepResult]:
    """``steps`` training steps on the same batch; what each saved, its loss and grads.
    ``measure``: a backend whose ``measuring()`` the first step runs in (the eager code
    between its regions measured, as ``hyper_offload.estimate`` measures it)."""
    x = batch(dtype)
    results = []
    for number in range(steps):
        with measure.measuring() if measure is not None and number == 0 else nullcontext():
            loss = step(x)
            saved = saved_device_bytes(loss, exclude=[*model.parameters(), x])
            loss.backward()
        grads = tuple(p.grad.clone() for p in model.parameters())
        results.append(StepResult(saved, loss.detach().clone(), grads))
        model.zero_grad(set_to_none=True)
    return results


def exact(a: StepResult, b: StepResult) -> bool:
    return torch.equal(a.loss, b.loss) and all(torch.equal(x, y) for x, y in zip(a.grads, b.grads))


def assert_estimate_is_the_step_plan(
    model: nn.Module, inputs: tuple[Any, ...], backend: Any, compile_step_bytes: int = 0,
    **options: Any,
) -> None:
    """``hyper_offload.estimate``'s fake step of ``model`` (uncompiled, or with the blocks
    it compiled on their own; fresh weights are fine), measuring the eager code between
    regions as a real step does, gives ``backend``'s
    step plan after a real step: the same invocations with the same kept / moved /
    retained bytes, the same peaks and predicted stall, and the same regions (issue 31,
    item 6; ``test_estimate_between.py`` tests what counting the eager code adds).
    ``compile_step_bytes``: what torch itself holds to the end of the real step that
    compiled the regions and of no later step (the floor and peak of a plan made from
    that step carry it; the fake step of ``estimate`` does not)."""
    from hyper_offload.compiler.fake_capture import resolve_trace_device
    from hyper_offload.compiler.options import parse_backend_options
    from hyper_offload.compiler.estimate.step_scope import estimate_step

    real = backend.step_report
    link = backend.bandwidth(backend.regions[0].graphs[0])  # what the backend priced with
    layout = options.pop("layout", "auto")  # estimate's, not a backend option
    estimate = estimate_step(
        model, inputs, device=resolve_trace_device(model, None),
        options=parse_backend_options(options), link=link, throughput=None,
        layout=layout,
    )
    assert real is not None
    for field in ("peak_bytes", "floor_peak_bytes"):
        assert getattr(estimate.step, field) + compile_step_bytes == getattr(real, field), (
            f"{field}: estimate {getattr(estimate.step, field)!r} + {compile_step_bytes} B, "
            f"real step {getattr(real, field)!r}"
        )
    for field in ("budget_bytes", "peak_without_offload_bytes", "invocations",
                  "predicted_stall_s"):
        assert getattr(estimate.step, field) == getattr(real, field), (
            f"{field}: estimate {getattr(estimate.step, field)!r}, real step {getattr(real, field)!r}"
        )
    assert estimate.step.fits == real.fits and estimate.step.moved_bytes == real.moved_bytes
    compiled = [(r.fw_nodes, r.bw_nodes, r.saved_activation_bytes, r.bytes_d2h)
                for r in backend.reports]
    assert [(r.fw_nodes, r.bw_nodes, r.saved_activation_bytes, r.bytes_d2h)
            for r in estimate.regions] == compiled
