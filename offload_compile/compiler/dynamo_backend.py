"""The ``hyper_offload`` torch.compile backend.

``torch.compile(model, backend="hyper_offload", options={...})`` (registered through the
``torch_dynamo_backends`` entry point) or ``torch.compile(model,
backend=hyper_offload.backend(config))``. For every region Dynamo hands over:

1. AOTAutograd captures the joint graph; :func:`~.recompute_search.choose_partition`
   partitions it with the stock min-cut partitioner (the user's
   ``activation_memory_budget`` applies) and plans it under the budget, and with
   ``recompute="auto"`` (the default), where that plan stalls or cannot meet the budget,
   also tries partitions that recompute more and keeps the fastest predicted step;
2. :func:`~.region_plan.lower_region` lowers the chosen plan onto the
   ``hyper_offload::`` transfer ops and checks the lowered graphs again;
3. the inner compiler (Inductor, or aot_eager's nop compiler) compiles both graphs.

Each region owns a :class:`TransferRuntime` and pinned pool; the compiled forward and
the compiled backward (which runs inside ``loss.backward()``) are wrapped so that the
runtime is current while they run, and an exception leaves nothing in flight.

Inductor is configured for this compilation only: ``custom_partitioner_fn`` is set
with ``torch._inductor.config.patch`` around the compile. Its ``uuid()`` carries a
per-region nonce, so Inductor's and AOTAutograd's caches never hand this region's
compiled code to another compilation (a plain ``torch.compile`` has no partitioner in
its key) nor serve a cached region without running the partitioner, which is what
installs the runtime wrappers.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

# The compiled graphs call the transfer ops: importing .ops registers their real kernels
# (the package itself loads lazily and registers nothing).
import hyper_offload.runtime.ops  # noqa: F401
from hyper_offload.config import OffloadConfig
from hyper_offload.passes import (
    fx_lowering,
    fx_saved,
    fx_trace,
    greedy_planner,
    planning,
    refine_prefetch,
    release_delay,
)
from hyper_offload.runtime import PinnedMemoryPool, TransferRuntime, op_declarations
from hyper_offload.runtime.bandwidth import TransferBandwidth, profile_transfer_bandwidth

from . import recompute_search, region_plan
from .options import BackendOptions, parse_backend_options
from .recompute_search import search_region
from .region_plan import PlannedRegion, lower_region
from .region_report import LOGGER, RegionReport, log_region_report

__all__ = ["HyperOffloadBackend", "backend", "hyper_offload_backend"]

# The sources whose code decides a region's rewritten graphs: the partitioner's cache
# key hashes them, so an edited planner or lowering never reuses a stale cached graph.
# Read from the imported modules, so the paths hold in the repository and when installed.
_SOURCES = tuple(
    str(module.__file__)
    for module in (region_plan, recompute_search, planning, greedy_planner, refine_prefetch, release_delay,
                   fx_trace, fx_saved, fx_lowering, op_declarations)
)


class _Region:
    """Per-region state: the runtime made current around its compiled code, the plan."""

    def __init__(self, index: int, options: BackendOptions) -> None:
        self.index = index
        self.runtime = TransferRuntime(pool=PinnedMemoryPool(options.config.max_host_bytes))
        self.planned: PlannedRegion | None = None
        self.graphs: tuple[fx.GraphModule, fx.GraphModule] | None = None  # lowered fw, bw
        self.fw_symbol_hints: dict[int, tuple[str, int]] = {}
        self.hint_warned = False

    def check_hints(self, args: Sequence[Any]) -> None:
        """Warn once if a dynamic size differs from the hint the plan was made for."""
        if self.hint_warned:
            return
        for index, (symbol, hint) in self.fw_symbol_hints.items():
            if index < len(args) and isinstance(args[index], int) and args[index] != hint:
                self.hint_warned = True
                LOGGER.warning(
                    "hyper_offload region %d: planned for %s=%d (a size hint of a dynamic "
                    "shape) but runs with %s=%d; results stay exact, resident bytes scale "
                    "with the size and may exceed the budget. Fix: compile with "
                    "dynamic=False to plan each shape", self.index, symbol, hint, symbol,
                    args[index],
                )
                return


class _WithRuntime:
    """A compiled forward or backward that runs with its region's runtime current."""

    def __init__(self, compiled: Callable[..., Any], region: _Region, *, forward: bool) -> None:
        self._compiled = compiled
        self._region = region
        self._forward = forward
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__, not class attrs

    def __call__(self, args: list[Any]) -> Any:
        if self._forward:
            self._region.check_hints(args)
            # Host copies of a step whose backward never ran (no backward, or a backward
            # that raised elsewhere) are unreachable now: give their buffers back.
            self._region.runtime.release_orphans()
        with self._region.runtime:
            if getattr(self._compiled, "_boxed_call", False):
                return self._compiled(args)
            return self._compiled(*args)


class _OffloadPartitioner(CustomPartitionerFn):
    """Stock min-cut partition (searched with recompute), then :func:`lower_region`."""

    def __init__(self, backend: HyperOffloadBackend, region: _Region) -> None:
        self._backend = backend
        self._region = region
        self._nonce = uuid.uuid4().hex

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        region, options = self._region, self._backend.options
        num_fwd_outputs = kwargs["num_fwd_outputs"]

        def partition(joint: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        started = time.perf_counter()
        choice = search_region(
            gm, partition, num_fwd_outputs=num_fwd_outputs, options=options,
            bandwidth=self._backend.bandwidth, region=region.index,
        )
        fw, bw = choice.fw, choice.bw
        for index, node in enumerate(fw.graph.find_nodes(op="placeholder")):
            value = node.meta.get("val")
            if isinstance(value, torch.SymInt) and value.node.hint is not None:
                region.fw_symbol_hints[index] = (str(value), int(value.node.hint))
        region.planned = lower_region(
            fw, bw, choice.plan, num_fwd_outputs=num_fwd_outputs, options=options,
            region=region.index, recompute=choice.report,
            search_seconds=time.perf_counter() - started,
        )
        region.graphs = (fw, bw)
        log_region_report(region.planned.report)
        return fw, bw

    def __deepcopy__(self, memo: dict[int, Any]) -> _OffloadPartitioner:
        # Inductor deep-copies config values when it snapshots its config; this object
        # carries its region (runtime, locks) by reference on purpose.
        return self

    def uuid(self) -> Any:
        from torch._inductor.custom_graph_pass import get_hash_for_files

        return (get_hash_for_files(_SOURCES).hex(), self._backend.options.cache_key(), self._nonce)


class HyperOffloadBackend:
    """A configured ``hyper_offload`` backend: pass it as ``torch.compile(backend=...)``.

    ``reports`` lists one :class:`RegionReport` per compiled region, in compile order
    (a recompilation adds one). ``regions`` keeps the plans for inspection.
    """

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.regions: list[_Region] = []
        self._bandwidth: dict[torch.device, TransferBandwidth] = {}
        self._counter = itertools.count()

    def __repr__(self) -> str:
        return f"HyperOffloadBackend({self.options})"

    @property
    def reports(self) -> list[RegionReport]:
        return [r.planned.report for r in self.regions if r.planned is not None]

    def bandwidth(self, fw: fx.GraphModule) -> TransferBandwidth:
        """The copy bandwidth plans are priced with: ``transfer_bandwidth_gbps`` when
        given, else the region's device's, measured once per device."""
        from hyper_offload.passes.fx_trace import device_of, fw_outputs

        if self.options.transfer_bandwidth_gbps is not None:
            gbps = self.options.transfer_bandwidth_gbps
            return TransferBandwidth(gbps, gbps, measured=False)
        device = device_of(fw_outputs(fw))
        if device not in self._bandwidth:
            self._bandwidth[device] = profile_transfer_bandwidth(device)
        return self._bandwidth[device]

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        region = _Region(next(self._counter), self.options)
        self.regions.append(region)
        partitioner = _OffloadPartitioner(self, region)
        if self.options.inner_compiler == "inductor":
            if self.options.drops_cudagraphs and region.index == 0:
                LOGGER.warning(
                    "hyper_offload: mode=%r asks for CUDA graphs; hyper_offload regions run "
                    "without them (their transfers keep host-side state a graph replay would "
                    "skip); the mode's other Inductor settings apply", self.options.mode,
                )
            return _compile_inductor(gm, example_inputs, partitioner, region, self.options)
        return _compile_aot_eager(gm, example_inputs, partitioner, region)


def _compile_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: Any, region: _Region,
    options: BackendOptions,
) -> Callable[..., Any]:
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        compiled = compile_fx_inner(graph, inputs, **kwargs)
        return _WithRuntime(compiled, region, forward=not kwargs.get("is_backward", False))

    # The mode's settings go through compile_fx's config_patches, which also wraps the
    # inner compile: the backward is compiled lazily, at the first backward, outside
    # this ``with`` (the partitioner runs inside it, at the forward's compile).
    with inductor_config.patch(custom_partitioner_fn=partitioner):
        return compile_fx(
            gm, example_inputs, inner_compile=inner_compile,
            config_patches=options.inductor_patches() or None,
        )


def _compile_aot_eager(
    gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: Any, region: _Region
) -> Callable[..., Any]:
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def compiler(forward: bool) -> Callable[..., Any]:
        def compile_graph(graph: fx.GraphModule, inputs: Sequence[Any]) -> Any:
            return _WithRuntime(boxed_nop(graph, inputs), region, forward=forward)

        return compile_graph

    return aot_autograd(
        fw_compiler=compiler(True),
        bw_compiler=compiler(False),
        partition_fn=partitioner,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def backend(config: OffloadConfig | None = None, **options: Any) -> HyperOffloadBackend:
    """A configured backend object: ``torch.compile(model, backend=hyper_offload.backend(
    OffloadConfig(max_resident_activation_mb=512), inner_compiler="aot_eager"))``.

    ``options`` are the keys ``options=`` accepts besides the ``OffloadConfig`` fields
    (``inner_compiler``, ``max_resident_activation_fraction``); with ``config`` given,
    its ``max_resident_activation_mb`` is replaced by the fraction when one is passed.
    """
    if config is not None:
        if not isinstance(config, OffloadConfig):
            raise TypeError(
                f"hyper_offload.backend: config must be an OffloadConfig, got "
                f"{type(config).__name__}; pass options as keywords instead"
            )
        fields = {
            "max_offload_activation_mb": config.max_offload_activation_mb,
            "planner": config.planner,
        }
        if "max_resident_activation_fraction" not in options:
            fields["max_resident_activation_mb"] = config.max_resident_activation_mb
        options = {**fields, **options}
    return HyperOffloadBackend(parse_backend_options(options))


def hyper_offload_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The function Dynamo calls for ``backend="hyper_offload"`` (entry point);
    ``torch.compile``'s ``mode=`` arrives as ``mode``."""
    options = dict(options or {})
    if mode is not None:
        if options.get("mode", mode) != mode:
            raise ValueError(
                f"hyper_offload: torch.compile(mode={mode!r}) and options['mode']="
                f"{options['mode']!r} disagree; pass the mode once"
            )
        options["mode"] = mode
    return HyperOffloadBackend(parse_backend_options(options))(gm, example_inputs)
