"""One training step of an :class:`~.opdb.OpModule`, captured, and compared bit for bit.

Equality is ``torch.equal`` with one extension: NaN equals NaN at the same positions
(``torch.equal`` is False for any NaN, and some samples produce NaN or inf on purpose,
e.g. ``log`` at 0). Anything else (another value, dtype, shape, a gradient that exists
on one side only) is a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from .opdb import OpModule

__all__ = ["Mismatch", "StepResult", "capture", "first_mismatch", "run_step", "same"]

SEED = 0
"""Seed of the global RNG at the start of every step (random ops draw the same values)."""


@dataclass(frozen=True)
class StepResult:
    """The loss and each parameter's gradient after one step (clones)."""

    loss: torch.Tensor
    grads: tuple[tuple[str, torch.Tensor | None], ...]

    def tensors(self) -> list[tuple[str, torch.Tensor | None]]:
        return [("loss", self.loss), *self.grads]


@dataclass(frozen=True)
class Mismatch:
    """The first tensor of a step that differs; ``max_abs_diff`` is over the finite
    elements both sides have (NaN when shapes or dtypes differ or a side is None)."""

    step: int
    tensor: str
    max_abs_diff: float
    detail: str

    def describe(self) -> str:
        return f"step {self.step}: {self.tensor} differs ({self.detail})"


def run_step(
    module: OpModule,
    call: Callable[..., torch.Tensor],
    session: AbstractContextManager[object] | None = None,
) -> torch.Tensor:
    """One step: fresh gradients and the case's input bytes restored (outside
    ``session``), then, inside ``session`` when given, the RNG seeded, ``call(*inputs)``
    and its backward. Returns the loss."""
    for p in module.parameters():
        p.grad = None
    module.inputs.restore()
    if session is None:
        return _forward_backward(call, module)
    with session:
        return _forward_backward(call, module)


def _forward_backward(call: Callable[..., torch.Tensor], module: OpModule) -> torch.Tensor:
    torch.manual_seed(SEED)
    loss = call(*module.inputs.tensors)
    if loss.requires_grad:  # else the caller skips the case (no output has a gradient)
        loss.backward()
    return loss


def capture(module: OpModule, loss: torch.Tensor) -> StepResult:
    """The step's loss and gradients, cloned (the next step overwrites them)."""
    grads = tuple(
        (f"grad[{name}]", None if p.grad is None else p.grad.detach().clone())
        for name, p in module.graded()
    )
    return StepResult(loss.detach().clone(), grads)


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit-for-bit equal, NaN equal to NaN (module docstring)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


def _max_abs_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
        return float("nan")
    both = torch.isfinite(a) & torch.isfinite(b)
    if not bool(both.any()):
        return float("nan")
    diff = (a[both].to(torch.complex128 if a.is_complex() else torch.float64)
            - b[both].to(torch.complex128 if b.is_complex() else torch.float64))
    return float(diff.abs().max())


def _describe(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return f"reference {'None' if a is None else 'a tensor'}, got {'None' if b is None else 'a tensor'}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"reference {a.dtype}{list(a.shape)}, got {b.dtype}{list(b.shape)}"
    differ = int((~((a == b) | (torch.isnan(a) & torch.isnan(b)))).sum())
    return f"{differ} of {a.numel()} elements, max abs diff {_max_abs_diff(a, b):.6g}"


def first_mismatch(reference: StepResult, got: StepResult, step: int) -> Mismatch | None:
    """The first of loss, then gradients in parameter order, that is not :func:`same`."""
    for (name, a), (_, b) in zip(reference.tensors(), got.tensors()):
        if not same(a, b):
            return Mismatch(step, name, _max_abs_diff(a, b), _describe(a, b))
    return None
