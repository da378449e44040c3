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

Each region owns a :class:`TransferRuntime` and pinned pool. The callable returned to
Dynamo makes the runtime current around the forward; the backward needs nothing around
it (its transfer ops reach the runtime through the host copies they read), so the
compiled graphs carry no per-process state and AOTAutograd's and Inductor's caches may
serve them to another region or process: a warm restart runs the partitioner for no
region. The partitioner's ``uuid()`` (a hash of the planning sources and the options)
keeps a plain ``torch.compile``, or other options, from sharing those entries, and
:mod:`.region_cache` stores each region's plan so that a cached region still reports it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

# The compiled graphs call the transfer ops: importing .ops registers their real kernels
# (the package itself loads lazily and registers nothing).
import hyper_offload.runtime.ops  # noqa: F401
from hyper_offload import passes
from hyper_offload.config import OffloadConfig
from hyper_offload.runtime import PinnedMemoryPool, TransferRuntime
from hyper_offload.runtime.bandwidth import TransferBandwidth, profile_transfer_bandwidth

from . import region_cache
from .options import BackendOptions, parse_backend_options
from .recompute_search import search_region
from .region_plan import PlannedRegion, lower_region
from .region_report import LOGGER, RegionReport, log_region_report

__all__ = ["HyperOffloadBackend", "backend", "hyper_offload_backend"]

# The code that decides a region's rewritten graphs: every planning pass (the op
# declarations included, in passes/ir/) and this package. Its hash is in the
# partitioner's cache key, so an edited planner or lowering never reuses a stale cached
# graph (paths read from the imported modules, so they hold in the repository and when
# installed).
_PLANNING_CODE = (Path(passes.__file__).parent, Path(__file__).parent)


class _Region:
    """Per-region state: the runtime made current around its forward, and the plan."""

    def __init__(self, index: int, options: BackendOptions, example_inputs: Sequence[Any]) -> None:
        self.index = index
        self.runtime = TransferRuntime(pool=PinnedMemoryPool(options.config.max_host_bytes))
        self.planned: PlannedRegion | None = None
        self.from_cache = False
        """True when the compiled code came from AOTAutograd's cache (no partitioner ran)."""
        self.graphs: tuple[fx.GraphModule, fx.GraphModule] | None = None  # lowered fw, bw
        self.symbol_hints = {
            i: (str(v), int(v.node.hint)) for i, v in enumerate(example_inputs)
            if isinstance(v, torch.SymInt) and v.node.hint is not None
        }
        self.hint_warned = False

    def check_hints(self, args: Sequence[Any]) -> None:
        """Warn once if a dynamic size differs from the hint the plan was made for."""
        if self.hint_warned:
            return
        for index, (symbol, hint) in self.symbol_hints.items():
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


class _RegionForward:
    """What Dynamo calls for a region: its compiled forward, with the runtime current."""

    def __init__(
        self, compiled: Callable[..., Any], region: _Region, backend: HyperOffloadBackend
    ) -> None:
        self._compiled = compiled
        self._region = region
        self._backend = backend

    def __call__(self, *args: Any) -> Any:
        self._region.check_hints(args)
        # Copies seen complete drop their hold on host copies whose graph died (a step
        # that raised, a forward without backward), in every region: buffers come back
        # whichever region runs next.
        self._backend.collect()
        with self._region.runtime:
            return self._compiled(*args)


class _OffloadPartitioner(CustomPartitionerFn):
    """Stock min-cut partition (searched with recompute), then :func:`lower_region`."""

    def __init__(
        self, backend: HyperOffloadBackend, region: _Region, plan_key: str | None
    ) -> None:
        self._backend = backend
        self._region = region
        self._plan_key = plan_key

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
        region.planned = lower_region(
            fw, bw, choice.plan, num_fwd_outputs=num_fwd_outputs, options=options,
            region=region.index, recompute=choice.report,
            search_seconds=time.perf_counter() - started,
        )
        region.graphs = (fw, bw)
        if self._plan_key is not None:  # an inner compiler with a cache (Inductor)
            region_cache.store_plan(self._plan_key, region.planned)
        log_region_report(region.planned.report)
        return fw, bw

    def __deepcopy__(self, memo: dict[int, Any]) -> _OffloadPartitioner:
        # Inductor deep-copies config values when it snapshots its config; this object
        # carries its region (runtime, locks) by reference on purpose.
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Inductor pickles its config into cache keys: stand for this object by its
        # uuid (its region's runtime and locks neither pickle nor belong in a key).
        return (str, (repr(self.uuid()),))

    def uuid(self) -> Any:
        return (self._backend.planning_code, self._backend.options.cache_key())


class HyperOffloadBackend:
    """A configured ``hyper_offload`` backend: pass it as ``torch.compile(backend=...)``.

    ``reports`` lists one :class:`RegionReport` per compiled region, in compile order
    (a recompilation adds one). ``regions`` keeps the plans for inspection.
    """

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.regions: list[_Region] = []
        self.planning_code = region_cache.source_digest(_PLANNING_CODE)
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
        from hyper_offload.passes.fx.graph_trace import device_of, fw_outputs

        if self.options.transfer_bandwidth_gbps is not None:
            gbps = self.options.transfer_bandwidth_gbps
            return TransferBandwidth(gbps, gbps, measured=False)
        device = device_of(fw_outputs(fw))
        if device not in self._bandwidth:
            self._bandwidth[device] = profile_transfer_bandwidth(device)
        return self._bandwidth[device]

    def collect(self) -> None:
        """Let every region's runtime observe finished copies (see ``TransferRuntime.collect``)."""
        for region in self.regions:
            region.runtime.collect()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        region = _Region(next(self._counter), self.options, example_inputs)
        self.regions.append(region)
        if self.options.inner_compiler != "inductor":  # aot_eager: no cache, always planned
            partitioner = _OffloadPartitioner(self, region, plan_key=None)
            return _RegionForward(_compile_aot_eager(gm, example_inputs, partitioner), region, self)
        plan_key = region_cache.cache_key(
            gm, example_inputs, self.options.cache_key(), self.planning_code
        )
        partitioner = _OffloadPartitioner(self, region, plan_key)
        if self.options.drops_cudagraphs and region.index == 0:
            LOGGER.warning(
                "hyper_offload: mode=%r asks for CUDA graphs; hyper_offload regions run "
                "without them (their transfers keep host-side state a graph replay would "
                "skip); the mode's other Inductor settings apply", self.options.mode,
            )
        compiled = _compile_inductor(gm, example_inputs, partitioner, self.options)
        if region.planned is None:  # served by AOTAutograd's cache (or inference)
            region.planned = region_cache.load_plan(plan_key)
            region.from_cache = region.planned is not None
            if region.planned is not None:
                LOGGER.info("hyper_offload region %d: compiled code and plan served "
                            "from the cache", region.index)
                log_region_report(region.planned.report)
        return _RegionForward(compiled, region, self)


def _compile_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: Any, options: BackendOptions,
) -> Callable[..., Any]:
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # The mode's settings go through compile_fx's config_patches, which also wraps the
    # inner compile: the backward is compiled lazily, at the first backward, outside
    # this ``with`` (the partitioner runs inside it, at the forward's compile).
    with inductor_config.patch(custom_partitioner_fn=partitioner):
        return compile_fx(gm, example_inputs, config_patches=options.inductor_patches() or None)


def _compile_aot_eager(
    gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: Any
) -> Callable[..., Any]:
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    return aot_autograd(
        fw_compiler=boxed_nop,
        bw_compiler=boxed_nop,
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
