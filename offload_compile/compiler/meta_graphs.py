"""Graphs on the meta device: compiled as plain ``torch.compile``, nothing planned.

A meta tensor has no bytes, so a region computing on the meta device has nothing to move
(and no host copy a backward could reach). The backend compiles such a graph with its
inner compiler alone: no region, report or step. ``hyper_offload.estimate`` gives what a
real step would keep and move (its fake tensors are on the device they model, never
meta).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from .options import BackendOptions
from .region_report import LOGGER

__all__ = ["compile_on_meta", "on_meta"]


def on_meta(example_inputs: Sequence[Any]) -> bool:
    """Whether a graph computes on the meta device."""
    return any(isinstance(value, torch.Tensor) and value.device.type == "meta"
               for value in example_inputs)


def compile_on_meta(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions, *, warn: bool
) -> Callable[..., Any]:
    """``gm`` compiled with ``options``' inner compiler alone; ``warn``: say once (the
    caller keeps the flag) why nothing is planned and what to use instead."""
    if warn:
        LOGGER.warning(
            "hyper_offload: a region computes on the meta device, whose tensors hold no "
            "bytes: nothing to move, so it is compiled as plain torch.compile with %s (no "
            "region report). For what a real step would keep and move, use "
            "hyper_offload.estimate(model, example_inputs, budget=...); to train, "
            "materialize the model first (model.to_empty(device=...))",
            options.inner_compiler,
        )
    if options.inner_compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=options.inductor_patches() or None)
    from torch._dynamo.backends.debugging import aot_eager

    return aot_eager(gm, example_inputs)
