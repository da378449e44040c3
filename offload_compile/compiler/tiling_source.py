"""What a region's sequence tiling is chosen from (a leaf: the region keeps it, and
:mod:`.tiling` and :mod:`.tiling_step` choose from it)."""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import fx

__all__ = ["TilingSource"]


class TilingSource(NamedTuple):
    """A region's untiled Dynamo graph, its example inputs as Dynamo's fake values
    (never the real ones: an activation holds its whole autograd graph), the inputs that
    carry tokens (``{placeholder: token dim}``; None: the analysis' default) and the
    inputs that are activations (AOTAutograd's names), kept so that the step can choose
    again (:mod:`.tiling_step`)."""

    graph: fx.GraphModule
    inputs: list[Any]
    seeds: dict[str, int | None] | None
    moving: frozenset[str]
