"""Hand-built graphs for sequence tiling's tests: small functions traced with
``torch.fx.symbolic_trace`` (the same torch functions and methods a Dynamo graph holds),
each node's value recorded as Dynamo records it (``meta["example_value"]``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

T, D, H, V = 8, 6, 12, 20
"""Tokens, model width, MLP width, vocabulary: all distinct, so a token dim is never
ambiguous, and wider in that order, as in a language model."""


def traced(fn: Callable[..., Any], *inputs: Any) -> fx.GraphModule:
    """``fn`` as a graph whose every node records the value it computed on ``inputs``."""
    gm = fx.symbolic_trace(fn)

    class Record(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            value = super().run_node(node)
            node.meta["example_value"] = value
            return value

    Record(gm).run(*inputs)
    return gm


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"w1": (H, D), "w3": (H, D), "w2": (D, H), "norm": (D,), "head": (V, D)}
    return {name: torch.randn(shape, generator=generator) * 0.3
            for name, shape in shapes.items()}


def mlp_block(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
              norm: torch.Tensor) -> torch.Tensor:
    """RMSNorm, SwiGLU and the residual: Llama's MLP half of a block."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
    return x + F.linear(F.silu(F.linear(h, w1)) * F.linear(h, w3), w2)


def head_and_loss(x: torch.Tensor, head: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The LM head and the mean cross-entropy over the tokens (ignore_index targets skip)."""
    logits = F.linear(x, head).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
