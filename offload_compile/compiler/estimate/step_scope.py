"""``hyper_offload.estimate`` under ``budget_scope="step"``: the backend's own step plan,
on fake tensors, for the model as compiled or with its identical blocks compiled per block.

A copy of the model whose parameters are fake twins (:func:`..fake_capture.fake_module`)
is compiled with ``torch.compile`` and a :class:`~..backend.HyperOffloadBackend`
in *fake-steps* mode, and runs one step on fake inputs: one forward (Dynamo splits it
into the regions a real compile makes: graph breaks, blocks compiled on their own,
one compiled block invoked once per layer) and the backward of its loss (a scalar output
that requires grad; without one, of every output that requires grad, seeded with ones),
and more steps while
the plan asks for regions to be lowered again (as a real run's next steps). Each region is
partitioned, planned at its floor and lowered by the backend's own code; its graphs run
as FX graphs on the fake tensors, so the backend's step recorder sees the step exactly
as it sees a real first step, measures the eager code between regions as in a real
step (:mod:`..step.meter`: an LM head and loss outside the compiled blocks), and the step
model plans it. Estimate and backend therefore agree by construction: same regions, same
floor plans, same eager bytes, same step plan (a test compares them).

What a fake step cannot do: eager code between regions that reads tensor *values*
(``if x.sum() > 0``, ``.item()``, ``.tolist()``) has no values to read; the error names
the op, and the fix is to estimate with ``budget_scope="region"`` (one region, no Dynamo)
or to hide that code behind a graph-break-free path. Inductor's code generation is
skipped; its decompositions, joint-graph passes and partition are not.

Dynamo caches: the copy is a new module, so its frames compile afresh and every cache
entry the estimate makes guards on objects that die with it; ``torch._dynamo`` is not
reset (the caller's compiled models keep their code).

**Identical blocks**: estimate one compiled block invoked once per layer, not one graph
of all. A 32-layer decoder compiled whole is one Dynamo graph of 32 copies of the same block:
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
Finding and compiling the blocks is pure module walking; no torch config is changed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hyper_offload import progress
from hyper_offload.errors import ConfigurationError, DynamicShapeError, HyperOffloadError
from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.passes.fx.fx_trace import FloorDetail, floor_detail
from hyper_offload.runtime.device import TransferBandwidth

from ..backend import HyperOffloadBackend
from ..fake_capture import estimate_fake_mode, fake_inputs, fake_module
from ..options import BackendOptions
from ..region_report import RegionReport
from ..step.controller import StepState
from ..step_report import StepReport

__all__ = [
    "AUTO_MIN_REPEATS", "LAYOUTS", "MAX_KINDS", "MIN_REPEATS", "BlockRun", "StepEstimate",
    "block_run_for", "compile_as_given", "compile_per_block", "estimate_step", "repeated_blocks",
]


class StepEstimate(NamedTuple):
    """The step plan of one fake step, the regions it ran, the seconds it took, and how
    the model was compiled for it (``"as given"``, or :meth:`.BlockRun.describe`)."""

    step: StepReport
    regions: tuple[RegionReport, ...]
    seconds: float
    layout: str = "as given"
    compute_s: float = 0.0
    """The step's predicted compute: every op of every invocation (recomputation
    included) as its region's lowering in force traced and priced it."""
    floor_detail: FloorDetail | None = None
    """What is on the device at the floor's op, where a region's op sets it."""


def estimate_step(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    device: torch.device,
    options: BackendOptions,
    link: TransferBandwidth,
    throughput: DeviceThroughput | None,
    layout: str = "auto",
) -> StepEstimate:
    """Run one step of ``model(*example_inputs)`` on fake tensors on ``device`` through
    the backend in fake-steps mode, and return its step plan (module docstring).
    ``layout``: :data:`LAYOUTS` (:func:`block_run_for`).

    Raises ``ConfigurationError`` when the step has no backward (nothing requires grad, or no
    compiled region's output reaches one)."""
    started = time.perf_counter()
    progress.note("capturing the step on fake tensors")
    mode = estimate_fake_mode()
    fake = fake_module(model, mode, device)
    inputs = fake_inputs(mode, example_inputs, device)
    backend = HyperOffloadBackend(options, link=link, throughput=throughput, fake_steps=True,
                                  fake_mode=mode)
    run = block_run_for(fake, layout)
    compiled = compile_as_given(fake, _refusing_data_dependent_inputs(backend), run)
    steps = _MAX_STEPS + _RETILING_STEPS * (options.tile_sequence == "auto")
    for number in range(1, steps + 1):
        progress.note("running one step on fake tensors" if number == 1 else
                      f"step {number}: regions lowered again for the step plan")
        with backend.measuring():
            _fake_step(compiled, inputs, mode, backend)
        fake.zero_grad(set_to_none=True)  # as a training loop does between steps
        if backend.controller.state not in (StepState.RELOWERING, StepState.RETILING):
            break
    report = backend.step_report
    if report is None and not backend.regions:
        raise ConfigurationError(
            f"hyper_offload.estimate: torch.compile compiled no region of "
            f"{type(model).__name__}'s step (Dynamo ran all of it eagerly: TORCH_LOGS="
            "graph_breaks says why; a data-dependent op such as nonzero inside a loop skips "
            "the whole frame), so the compile backend would move nothing either. Fix: "
            "torch._dynamo.config.capture_dynamic_output_shape_ops = True (data-dependent "
            "sizes are then planned at the bound torch derives), or estimate the model as "
            "one region with budget_scope='region'"
        )
    if report is None:
        raise ConfigurationError(
            f"hyper_offload.estimate: {type(model).__name__}'s step has no backward through "
            "a compiled region (no parameter or input requires grad), so there are no "
            "saved activations to plan. Fix: estimate a training step (parameters with "
            "requires_grad=True)"
        )
    progress.note("pricing the step")
    return StepEstimate(report, tuple(backend.reports), time.perf_counter() - started,
                        "as given" if run is None else run.describe(), _compute_s(backend),
                        _floor_detail(backend, report))


FLOOR_DETAIL_LEAST_BYTES = 1 << 20
"""Values smaller than this are left out of an estimate's floor detail."""


def _floor_detail(backend: HyperOffloadBackend, report: StepReport | None) -> FloorDetail | None:
    """:func:`~hyper_offload.passes.fx.fx_trace.floor_detail` at the step floor's
    op, on the lowering in force of its region (None: eager code, or no plan)."""
    floor_op = None if report is None else report.floor_op
    if floor_op is None or floor_op.region is None:
        return None
    region = backend.regions[floor_op.region]
    op = floor_op.op.split(" (of ", 1)[0]  # the report names a decomposed op's origin
    if region.planned is None or op not in region.planned.fx_trace.op_index():
        return None
    return floor_detail(region.planned.fx_trace, op, least_bytes=FLOOR_DETAIL_LEAST_BYTES,
                        graphs=region.graphs)


def _compute_s(backend: HyperOffloadBackend) -> float:
    """:attr:`StepEstimate.compute_s` of the plan in force (0 when there is none)."""
    from hyper_offload.passes.analysis.predicted_timeline import op_durations

    plan = backend.step_plan
    if plan is None:
        return 0.0
    regions = backend.lowerings.floors(plan.timeline)
    per_region = {r: sum(op_durations(t.trace)) for r, t in regions.items()}
    return sum(per_region.get(i.region, 0.0) for i in plan.timeline.invocations)


_MAX_STEPS = 3
"""Fake steps an estimate runs at most: the first at the floor, and more while the step
plan asks for regions to be lowered again (:mod:`..step.lowerings`: the recompute search,
each region at most once, and schedules made for the step), as a real run's next steps: a
lowering asked for at a step's end is made before the next step's first forward, and that
step is planned again at its end."""

_RETILING_STEPS = 2
"""Fake steps more with ``tile_sequence="auto"``, whose step may ask a region to be tiled
again (the controller's RETILING, once per region), planned again on the tiled graph and
searched again."""


def _fake_step(
    compiled: Any, inputs: Sequence[Any], mode: Any, backend: HyperOffloadBackend
) -> None:
    """One forward and the backward of its loss (or of every output that requires grad,
    seeded with ones), as a real step runs them (the backend measures the eager code
    between its regions). An error
    the backend raised on purpose comes out as itself, not wrapped in Dynamo's
    ``BackendCompilerFailed``: the caller of ``estimate`` compiled nothing."""
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        with mode, torch.enable_grad():
            outputs = compiled(*inputs)
            leaves = _backward_roots(outputs)
            if leaves:
                # A scalar (a loss) is seeded by autograd, as loss.backward() seeds it in a
                # real step (and measured alike); a seed of any other output is the
                # estimate's own, not the step's: not measured.
                meter = backend.controller.recorder.observer
                with meter.region() if meter is not None else contextlib.nullcontext():
                    seeds = [None if t.dim() == 0 else torch.ones_like(t) for t in leaves]
                torch.autograd.backward(leaves, seeds)
    except BackendCompilerFailed as error:
        if isinstance(error.inner_exception, HyperOffloadError):
            raise error.inner_exception from None
        raise


def _backward_roots(outputs: Any) -> list[torch.Tensor]:
    """What a training step calls backward on: its loss (a scalar that requires grad: an
    HF model's ``.loss`` beside its logits), else every output that requires grad."""
    leaves = [t for t in tree_flatten(outputs)[0]
              if isinstance(t, torch.Tensor) and t.requires_grad]
    losses = [t for t in leaves if t.dim() == 0]
    return losses or leaves


def _refusing_data_dependent_inputs(backend: HyperOffloadBackend) -> Any:
    """``backend``, refusing a region whose inputs have sizes that eager code before it
    computed from tensor values (``nonzero``, ``.item()`` between regions): a real step
    hands the region a concrete size, a fake step a symbol with no bound to plan at."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    def compile_region(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        symbols = set().union(*(free_unbacked_symbols(v) for v in example_inputs))
        if symbols:
            raise DynamicShapeError(
                f"hyper_offload.estimate: region {len(backend.regions)} gets size(s) "
                f"{', '.join(sorted(map(str, symbols)))} that eager code before it computed "
                "from tensor values (e.g. nonzero between compiled regions); a fake step "
                "has no values, so there is no size to plan at. Fix: torch._dynamo.config."
                "capture_dynamic_output_shape_ops = True (the op then runs inside a region "
                "and its size is planned at the bound torch derives), or estimate the model "
                "as one region with budget_scope='region'"
            )
        return backend(gm, example_inputs)

    return compile_region


def block_run_for(model: nn.Module, layout: str) -> BlockRun | None:
    """The run of identical blocks ``layout`` compiles per block in ``model``
    (:data:`LAYOUTS`), or None to compile it as given. A model its owner
    compiled (whole or per block) is always compiled as given."""
    from torch._dynamo.eval_frame import OptimizedModule

    if layout == "as_given" or any(
        isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    ):
        return None
    run = repeated_blocks(model)
    if run is None or (layout == "auto" and len(run.names) < AUTO_MIN_REPEATS):
        return None
    return run


def compile_as_given(model: nn.Module, backend: Any, per_block: BlockRun | None = None) -> Any:
    """``model`` compiled with ``backend`` the way its owner compiled it: each submodule
    the owner compiled (``torch.compile(block)`` in its parent's place, or
    ``block.compile()``) is compiled again with ``backend`` and the rest runs eagerly, as
    in per-block training; a model compiled whole, or not compiled at all, is compiled
    whole, or with ``per_block`` (a run of its identical blocks) each of those blocks on
    its own and the rest whole (:func:`compile_per_block`). ``model`` (a
    private copy) is changed in place.

    One Dynamo context serves every submodule, with its own recompile bucket
    (``isolate_recompiles``): blocks share compiled regions as they do under one
    backend, and the estimate's entries never count against the caller's recompile
    limit (each copy and backend is new, so they could never be reused anyway)."""
    from torch._dynamo.eval_frame import OptimizedModule

    # dynamic=False: sizes stay static however many estimates this process made before.
    # Dynamo keeps per-code-object state: a frame (a block's forward) estimated at another
    # sequence length earlier was compiled again with a symbolic length (automatic dynamic
    # shapes) and planned at its bound: measured, Llama-3-8B x 32K after a 16K estimate
    # reported a floor of 60.4 GiB instead of 7.6.
    optimize = torch._dynamo.optimize(backend=backend, isolate_recompiles=True, dynamic=False)
    if per_block is not None:
        return compile_per_block(model, per_block, optimize)
    if isinstance(model, OptimizedModule):
        return optimize(model._orig_mod)
    recompiled = False
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, OptimizedModule):
                setattr(parent, name, optimize(child._orig_mod))
                recompiled = True
        if getattr(parent, "_compiled_call_impl", None) is not None:  # block.compile()
            parent._compiled_call_impl = optimize(parent._call_impl)
            recompiled = True
    return model if recompiled else optimize(model)


# ---------------------------------------------------------------- identical blocks, compiled per block

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
