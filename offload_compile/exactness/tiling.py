"""How far sequence tiling moves training from plain training on the user's model.

Sequence tiling (``tile_sequence``, :mod:`hyper_offload.compiler.tiling`) is the one
option that is not bit-exact: each tile's forward is the untiled rows of token-wise
ops, but sums over tokens (weight gradients, a loss mean, an embedding's gradient) are
added tile by tile, in another order. So :func:`~.check.check` does not judge it with
``torch.equal``; it trains once more with tiling (everything movable moved, as the
exact run) and reports, for the loss and every gradient, the largest absolute and
relative difference from the plain run over the steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .report import Deviation, TilingDeviation
from .runs import Problem, RunResult, StepValues, offload_compile, train

__all__ = ["deviations", "measure_tiling"]


def measure_tiling(
    problem: Problem, want: RunResult, inner_compiler: str, options: dict[str, Any]
) -> TilingDeviation:
    """Train ``problem`` through the compile door with ``options`` (their
    ``tile_sequence``) and compare with the plain run ``want`` (module docstring)."""
    mode = str(options["tile_sequence"])
    door = offload_compile(inner_compiler, options)
    try:
        got = train(problem, door)
    except Exception as error:  # reported, never swallowed: it is the check's finding
        return TilingDeviation(mode, (), (), error=f"{type(error).__name__}: {error}")
    tiled = tuple(
        f"region {region.index}: {region.tiling}" for region in door.state.regions
        if region.tiling is not None and region.tiling.tiled
    )
    return TilingDeviation(mode, tiled, deviations(want.steps, got.steps))


def deviations(want: Sequence[StepValues], got: Sequence[StepValues]) -> tuple[Deviation, ...]:
    """The loss's and each gradient's deviation of ``got`` from ``want``, the largest
    over the steps, in the model's parameter order."""
    worst: dict[str, tuple[float, float]] = {}
    for a, b in zip(want, got):
        pairs = [("loss", a.loss, b.loss)]
        pairs += [(f"gradient of {name}", grad, b.grads.get(name)) for name, grad in a.grads.items()]
        for what, x, y in pairs:
            found = _deviation(x, y)
            old = worst.get(what, (0.0, 0.0))
            worst[what] = (max(old[0], found[0]), max(old[1], found[1]))
    return tuple(Deviation(what, *found) for what, found in worst.items())


def _deviation(x: torch.Tensor, y: torch.Tensor | None) -> tuple[float, float]:
    """(max abs difference, that over max |x|) of two values of one step."""
    if y is None or x.shape != y.shape:
        return float("inf"), float("inf")
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    x, y = x.double(), y.double()
    if not x.numel():
        return 0.0, 0.0
    diff = float((x - y).abs().max())
    if diff != diff:  # NaN
        return float("inf"), float("inf")
    scale = float(x.abs().max())
    return diff, (diff / scale if scale else (0.0 if diff == 0 else float("inf")))
