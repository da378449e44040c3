"""Tiny models and helpers shared by the compile-backend tests (kept small: CI runs on
2 cores and every Inductor compile costs seconds)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import hyper_offload
import hyper_offload.compiler

#: Both inner compilers; Inductor's C++ kernel builds take tens of seconds on two cores, so
#: its cases are ``slow`` (deselect with ``-m "not slow"`` while developing).
INDUCTOR = pytest.param("inductor", marks=pytest.mark.slow, id="inductor")
INNER_COMPILERS = ("aot_eager", INDUCTOR)

HIDDEN, SEQ, BATCH = 32, 8, 4


@pytest.fixture(scope="module", autouse=True)
def deterministic():
    """Deterministic algorithms for every test of a module that imports this fixture
    (autouse applies where the name is imported): plain Inductor on CPU is not
    run-to-run deterministic without them."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def moved_storages(planned: Any) -> set[int]:
    """Storages a region's plan moved (one copy each way each: several saved views may
    share one)."""
    offloaded = set(planned.report.offloaded)
    return {s.storage for s in planned.fx_trace.saved if s.name in offloaded}


def moved_views(backend: Any) -> int:
    """Saved views (tensors whose storage's base is another node) the backend's plans moved."""
    return sum(
        1 for region in backend.regions for s in region.planned.fx_trace.saved
        if s.name in region.planned.report.offloaded and s.base != s.name
    )


class Block(nn.Module):
    """Attention (views, softmax), LayerNorm, GELU, dropout, an in-place op; the MLP
    optionally under ``torch.utils.checkpoint``."""

    def __init__(self, d: int = HIDDEN, heads: int = 2, ckpt: bool = False) -> None:
        super().__init__()
        self.heads, self.ckpt = heads, ckpt
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        y = att.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.gelu(self.fc1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        h = checkpoint(self.mlp, h, use_reentrant=False) if self.ckpt else self.mlp(h)
        y = x + h
        y.mul_(0.5)  # in place
        return y


class TwoRegions(nn.Module):
    """Two blocks with a graph break between them: two compiled regions."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Block(ckpt=False), Block(ckpt=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def mlp(layers: int = 3, d: int = 64) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(layers)])


def compile_step(
    model_fn: Any, backend: Any, dtype: torch.dtype, *, steps: int = 1, x: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """Fresh model (seed 0), compiled with ``backend``; ``steps`` SGD steps. Returns the
    losses, the final parameters' gradients (and parameters when steps > 1), and the
    compiled model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model_fn().to(dtype)
    if x is None:
        x = torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        torch.manual_seed(1)  # dropout
        loss = compiled(x).float().pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        if steps > 1:
            opt.step()
            opt.zero_grad(set_to_none=False)
    grads = [p.grad.clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    return losses, grads + (params if steps > 1 else []), compiled


def offload_backend(inner: str, budget: str) -> hyper_offload.compiler.HyperOffloadBackend:
    """``budget``: "fits" (fraction 1.0), "half" (0.5) or "tight" (0 MiB: as tight as
    feasible, everything offloadable is offloaded). These tests are about one region's
    plan and lowering, so the budget is the region's (``budget_scope="region"``); the
    step scope is tested in ``test_step_budget.py``."""
    if budget == "tight":
        return hyper_offload.backend(
            inner_compiler=inner, max_resident_activation_mb=0, budget_scope="region"
        )
    fraction = {"fits": 1.0, "half": 0.5}[budget]
    return hyper_offload.backend(
        inner_compiler=inner, max_resident_activation_fraction=fraction, budget_scope="region"
    )


def transfer_ops_in(module: torch.fx.GraphModule) -> list[str]:
    return [
        str(n.target) for n in module.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("hyper_offload.")
    ]
