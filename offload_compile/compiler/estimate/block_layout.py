"""Identical blocks: estimate one compiled block invoked once per layer, not one graph of all.

A 32-layer decoder compiled whole is one Dynamo graph of 32 copies of the same block:
tracing, partitioning and planning it costs 32 times one block's work (Llama-3-8B at
32K: 89 s on 2 cores with CPU prices, 258 s and 1.56 GiB with GPU prices and the
recompute search).
Compiled *per block* (``torch.compile(block)`` for each layer, the usual FSDP2 layout),
the same step is one block region invoked once per layer plus the code around it:
captured, partitioned and searched once, and priced on the step for every layer by the
step plan (:mod:`~hyper_offload.passes.plan.step.plan`), which is what "capture and plan
one, price all" means.

:func:`repeated_blocks` finds the run of identical blocks of a model (in a
``ModuleList`` / ``Sequential``, at least :data:`MIN_REPEATS` children with the same
structure: module types, parameter and buffer names, shapes, strides, dtypes,
``requires_grad``, the same plain attributes and the same other attribute objects, so
that Dynamo has nothing to tell them apart by and compiles one region per kind). :func:`compile_per_block` compiles each block on its own
and the rest of the model as a whole. The outer frame breaks at each block call, and a
graph break inside the loop over the blocks makes Dynamo run that frame eagerly: the
functions and modules it calls (``self._head_and_loss(x)``, a norm, an embedding
method) are still compiled as regions the step plan counts, but code written inline in
that frame (an ``F.cross_entropy`` on the logits) runs uncompiled and, until the
estimate counts eager code between regions, uncounted. ``examples/llama_model.py`` keeps
its embedding and its head and loss in methods for this reason.

What differs from the plan of the model compiled whole (measured in
docs/architecture.md, "Identical blocks"): the block region's partition and its floor
lowering serve every layer (one compiled graph), so the step plan keeps slots per
layer on the floor instead of scheduling each layer's copies on the whole step, and the
recompute search picks one partition for all layers; a block's input and output are
region boundaries (its caller holds them) where the whole graph's min-cut could save
something else. Everything else (the fake step, the backend's own regions, floors, step
plan and timeline model) is the backend's: the estimate of a model with this layout
*is* the backend's step plan for that model compiled per block (a test compares them).
Pure module walking; no torch config is changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "AUTO_MIN_REPEATS", "LAYOUTS", "MAX_KINDS", "MIN_REPEATS", "BlockRun", "compile_per_block",
    "repeated_blocks",
]

LAYOUTS = ("auto", "as_given", "per_block")
"""``estimate(..., layout=)``: ``"as_given"`` compiles the model as its owner did (whole,
or the blocks it compiled on their own); ``"per_block"`` compiles each block of its run
of identical blocks on its own (:func:`compile_per_block`; as given when there is no
run); ``"auto"`` (default) is ``"per_block"`` for a model compiled whole whose run has
at least :data:`AUTO_MIN_REPEATS` blocks, else ``"as_given"``."""

MIN_REPEATS = 2
"""Blocks of one kind a run needs at least (one block is nothing to share)."""

MAX_KINDS = 4
"""Kinds of identical blocks one run may mix (each is one compiled region; Dynamo's
recompile limit, 8 by default, must not be reached, or blocks would run uncompiled)."""

AUTO_MIN_REPEATS = 8
"""Blocks from which ``layout="auto"`` estimates per block: where the whole graph's
capture and planning (linear in the blocks) dominate (a 32-layer Llama-3-8B takes
89-254 s whole, 34 s per block at 128K), and small models keep the estimate of exactly
the graph ``torch.compile(model)`` compiles. A structural count, not a time: the same
model always gets the same layout."""

_PLAIN = (bool, int, float, str, type(None))


class BlockRun(NamedTuple):
    """A run of identical blocks: the container, the names of its children in it, and
    how many kinds of identical blocks they are."""

    container: nn.Module
    path: str
    names: tuple[str, ...]
    block_type: str
    kinds: int = 1

    def describe(self) -> str:
        where = self.path or type(self.container).__name__
        kinds = "identical" if self.kinds == 1 else f"identical (in {self.kinds} kinds)"
        return f"{len(self.names)} {kinds} {self.block_type} in {where}, compiled per block"


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _signature(module: nn.Module) -> tuple[Any, ...]:
    """What a block is made of, without its tensors' values: module types, plain
    attributes by value, any other attribute (a shared config object) by identity, so
    two blocks with equal signatures give Dynamo nothing to tell them apart by."""
    parts: list[Any] = []
    for name, sub in module.named_modules():
        attributes = []
        for key, value in sorted(vars(sub).items()):
            if key.startswith("_") or isinstance(value, (nn.Module, torch.Tensor)):
                continue
            attributes.append((key, value if _plain(value) else ("object", id(value))))
        parts.append((name, type(sub), tuple(attributes)))
    tensors = [*module.named_parameters(remove_duplicate=False),
               *module.named_buffers(remove_duplicate=False)]
    parts.extend(
        (name, tuple(t.shape), t.stride(), t.dtype, t.requires_grad, isinstance(t, nn.Parameter))
        for name, t in tensors
    )
    return tuple(parts)


def repeated_blocks(model: nn.Module) -> BlockRun | None:
    """The run of identical blocks in ``model`` (module docstring): the children of one
    ``ModuleList`` or ``Sequential`` that share their signature with at least one other
    child (:data:`MIN_REPEATS`), in at most :data:`MAX_KINDS` kinds (a model that
    checkpoints its first layers has two: Dynamo compiles one region per kind), with no
    parameter shared between two of them. The container with the most such blocks wins
    (the first in ``named_modules`` order on ties); None when there is none."""
    best: BlockRun | None = None
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        kinds: dict[tuple[Any, ...], list[tuple[str, nn.Module]]] = {}
        for name, child in container.named_children():
            kinds.setdefault(_signature(child), []).append((name, child))
        runs = [members for members in kinds.values() if len(members) >= MIN_REPEATS]
        blocks = [member for members in runs for member in members]
        if not runs or len(runs) > MAX_KINDS or (best and len(blocks) <= len(best.names)):
            continue
        ids = [id(p) for _, c in blocks for p in c.parameters()]
        if len(ids) != len(set(ids)):
            continue
        order = {name: i for i, (name, _) in enumerate(container.named_children())}
        best = BlockRun(container, path, tuple(sorted((n for n, _ in blocks), key=order.get)),
                        type(blocks[0][1]).__name__, len(runs))
    return best


class _OwnRegion(nn.Module):
    """A block compiled on its own inside a model compiled whole: the outer frame breaks
    at the call (``torch._dynamo.disable``), so the block runs as its own compiled
    region, not inlined into the caller's graph."""

    def __init__(self, compiled: nn.Module) -> None:
        super().__init__()
        self.block = compiled

    @torch._dynamo.disable
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.block(*args, **kwargs)


def compile_per_block(
    model: nn.Module, run: BlockRun, optimize: Callable[[nn.Module], Any]
) -> Any:
    """``model`` (a private copy, changed in place) with each block of ``run`` compiled
    on its own by ``optimize`` and the rest compiled whole by it (module docstring)."""
    for name in run.names:
        block = getattr(run.container, name)
        setattr(run.container, name, _OwnRegion(optimize(block)))
    return optimize(model)
