"""Small models with the knobs the lifecycle events turn: a branch that re-reads an early
activation, a probe that raises inside an op (the model catches it), layers to freeze,
unfreeze and add. Every knob is plain state, set identically on a model and its twin.

Each forward takes ``x`` of shape ``(batch, WIDTH)`` and returns a scalar loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.debugging import aot_eager, boxed_nop

WIDTH = 32
"""Features of every model's input."""


class Knobbed(nn.Module):
    """The knobs shared by every model here (module docstring)."""

    EVAL_CHANGES_OPS = False
    """Whether ``eval()`` changes the ops a training step runs (dropout in eager code)."""
    OPAQUE_PREFIX = "\0"
    """Parameters under this prefix live in compiled blocks: freezing one changes what
    the block runs, not the ops a session sees (one opaque op, whose backward
    accumulates the block's gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = False
        self.probe = False
        self.extra = nn.ModuleList()
        self.register_buffer("wrong", torch.zeros(3, 3), persistent=False)

    def grow(self, seed: int) -> None:
        """Append one layer (the same on a model and its twin: seeded)."""
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.extra.append(nn.Linear(WIDTH, WIDTH))

    def around(self, h: torch.Tensor) -> torch.Tensor:
        """The probe (an op that raises, caught: code probing a fast path) and the added
        layers, applied to a ``(batch, WIDTH)`` activation."""
        if self.probe:
            h = _probe(h, self.wrong)
        for layer in self.extra:
            h = torch.tanh(layer(h))
        return h


@torch.compiler.disable
def _probe(h: torch.Tensor, wrong: torch.Tensor) -> torch.Tensor:
    """Try a fast path that fails (a shape error inside the kernel) and fall back.

    Runs eagerly under ``torch.compile`` (a graph break), as such code must: Dynamo runs
    the op on fake tensors while tracing and raises its own error at compile time,
    outside the ``try``, so plain ``torch.compile`` of a model that probes inline fails
    (``TorchRuntimeError``); an eager door sees the op fail either way."""
    try:
        return h @ wrong
    except RuntimeError:
        return h


class MLP(Knobbed):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = h = F.gelu(self.layers[0](x))
        for layer in self.layers[1:]:
            h = F.gelu(layer(h))
        h = self.around(h)
        if self.branch:  # re-reads the first activation, used long ago
            h = h + first
        return self.head(h).pow(2).mean()


class Attention(Knobbed):
    """Pre-norm attention + MLP block with dropout (seeded per step in both runs)."""

    EVAL_CHANGES_OPS = True

    def __init__(self, heads: int = 4, tokens: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads, self.tokens = heads, tokens
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, d = x.shape[0], WIDTH
        t, heads = self.tokens, self.heads
        x = x.unsqueeze(1).expand(b, t, d) * torch.arange(1, t + 1, dtype=x.dtype).view(1, t, 1)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
        att = self.drop(((q @ k.transpose(-2, -1)) * (d // heads) ** -0.5).softmax(-1))
        h = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, d)))
        out = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        pooled = self.around(out.mean(dim=1))
        if self.branch:
            pooled = pooled + x.sum(dim=1)
        return pooled.pow(2).mean()


class Branchy(Knobbed):
    """Two paths; the branch re-reads ``h0``, which the plain path last uses at once."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(WIDTH, 64), nn.Linear(64, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.l0(x)
        h = torch.tanh(self.l1(h0 * 0.5 + 1.0))
        h = self.around(h)
        if self.branch:
            h = h * h0.mean(dim=-1, keepdim=True)
        return self.l2(h).pow(2).mean()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(WIDTH, WIDTH), nn.Dropout(0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(F.gelu(self.fc(h)))


def _users_own_nop(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """``aot_eager``'s no-op compiler, its result tagged: see :func:`compiled_by_the_user`."""
    run = boxed_nop(gm, example_inputs)
    run.compiled_by_the_user = True  # type: ignore[attr-defined]
    return run


users_aot_eager = functools.partial(aot_eager, fw_compiler=_users_own_nop)
"""``aot_eager`` exactly, for the blocks a user compiles inside the model: regions it
compiles can be told apart in the autograd graph."""


def compiled_by_the_user(node: Any) -> bool:
    """Whether an autograd node is the backward of a region the model's own
    ``torch.compile`` (:data:`users_aot_eager`) compiled, not a door's backend.

    Under an outer ``torch.compile`` the blocks' own compile is inlined into the outer
    frame's graph. When Dynamo gives the outer frame up ("graph break in a for/while loop ...
    Skipping the frame and falling back to eager", after a hook inside the loop raised),
    the blocks run their own compiled code, as under plain ``torch.compile``: regions no
    door's backend sees, like eager code between regions (found by make fuzz, 12-07)."""
    forward = getattr(type(node), "_forward_cls", None)
    return bool(getattr(getattr(forward, "compiled_fw", None), "compiled_by_the_user", False))


class CompiledStack(Knobbed):
    """Blocks that are ``torch.compile``d (``aot_eager``, as :data:`users_aot_eager`):
    inside a session each runs as one opaque op with its compiled forward and backward."""

    OPAQUE_PREFIX = "blocks."

    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            torch.compile(Block(), backend=users_aot_eager, dynamic=False) for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = h = torch.tanh(x * 1.5)
        for block in self.blocks:
            h = block(h)
        h = self.around(h)
        if self.branch:
            h = h + first
        return self.head(h).pow(2).mean()


MODELS: dict[str, Callable[[], Knobbed]] = {
    "mlp": MLP, "attention": Attention, "branchy": Branchy, "compiled": CompiledStack,
}
