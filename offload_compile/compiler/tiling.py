"""The compile door's sequence tiling (option ``tile_sequence``).

Before a region is compiled, when ``tile_sequence`` is ``"auto"`` or a tile count:

1. the region's Dynamo graph is analysed (:mod:`hyper_offload.passes.fx.tiling`): which
   ops are token-wise along which dim, and the spans of them that may be tiled;
2. the region as it is is *probed* (:func:`probe_floor`: its graphs compiled without
   code and traced at its floor, everything movable moved): the op with the most bytes
   that no plan can move sets the floor. When that op belongs to a span, the spans with
   the same ops (that span in every layer) are tiled
   (:mod:`~hyper_offload.passes.fx.tiling_rewrite`: each tile recomputed in its backward,
   one tile's intermediates alive at a time). ``"auto"`` doubles the tiles of the spans
   that set the floor (2, 4, 8, ...: whichever spans set it after the last doubling)
   until the floor fits the budget,
   is set by an op no tiling lowers (attention, an embedding's gradient), or a doubling
   lowers it by less than :data:`MIN_GAIN`; when it fits, each count is then bisected
   down to the **fewest tiles that still fit**. A tile count (``tile_sequence=8``) tiles
   the spans that set the untiled floor with that count whatever the budget, then, while
   the floor is over it, the spans that set it next; ``"off"`` (the default) analyses
   nothing and changes nothing;
3. the region is compiled from the tiled graph as from any Dynamo graph (the recompute
   search, the step plan, the lowerings all see the tiled graphs); its region report says
   what was tiled (:class:`~.region_report.TilingReport`), and that the plan is *not
   bit-exact* (sums over tokens are reassociated: weight gradients, a loss mean).

Every candidate is priced on the one timeline model: its floor from its own trace, its
compute (the tiles' recomputation included) by the roofline cost model. The budget a
floor must fit is ``max_resident_activation_mb``, or with a fraction that fraction of
the region's own peak without offload (the step's peak is only known after a step).
Every later lowering of the region starts from the tiled graph. Under the step scope the
step plan may then find the step's floor over the budget at a token-wise op of a region
whose own floor was under it (what the rest of the step holds there; the working set of
a partition the recompute search chose): the step controller tiles that region again,
once, for the floor the step needs there (:meth:`.step.lowerings.RegionLowerings.retile`).

A probe is the backend's own compile of the region minus code generation
(:func:`~.fake_capture.compile_graphs_only`: AOTAutograd with the inner compiler's
decompositions and partition pipeline, torch's min-cut partition), traced as the step
scope traces a region at its floor
(:func:`~hyper_offload.passes.fx.graph_trace.build_fx_trace`, everything movable moved),
so the floor it reads is the one the region would be lowered at. It runs in a fresh
tracing context on the region's fake mode (as a re-lowering does,
:meth:`.region.CompiledRegion.compiling_again`), so Dynamo's own
compile of the region is untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from hyper_offload.passes import required_bytes
from hyper_offload.passes.analysis.predicted_timeline import op_durations
from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.passes.fx.graph_trace import build_fx_trace
from hyper_offload.passes.fx.tiling import Span, sequence_length, tile_spans, token_axes
from hyper_offload.passes.fx.tiling_rewrite import TileUnit, tile_graph

from .fake_capture import compile_graphs_only
from .options import BackendOptions
from .region import TilingSource, activation_inputs, fake_example_inputs
from .region_report import LOGGER, TiledSpanReport, TilingReport

__all__ = ["MAX_TILES", "MIN_GAIN", "SPAN_KEY", "Probe", "TilingSource", "choose_tiling",
           "probe_floor", "tile_region", "tiling_source"]

MAX_TILES = 128
"""At most this many tiles per span (and never more than the sequence's tokens)."""

MIN_GAIN = 0.05
"""``"auto"`` doubles a span's tiles only while that lowers the floor by this share."""

SPAN_KEY = "hyper_offload_span"
"""``node.meta["custom"][SPAN_KEY]``: the span a Dynamo node belongs to. AOTAutograd
copies ``custom`` onto every aten node it traces from the node, backward nodes included,
so the floor's op names its span."""


class Probe(NamedTuple):
    """A candidate's predicted floor (bytes), the op that sets it (``"bw:mm_4"``) and
    its span (None: not a token-wise op), the compute of both graphs (seconds, the
    roofline), and the peak with nothing moved (bytes)."""

    floor_bytes: int
    floor_op: str
    floor_span: int | None
    compute_s: float
    peak_without_offload: int


Prober = Callable[[fx.GraphModule], Probe]


def tiling_source(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> TilingSource:
    """``gm``'s :class:`TilingSource` (read once, at the region's first compile)."""
    return TilingSource(gm, fake_example_inputs(gm, example_inputs), _seeds(gm, example_inputs),
                        activation_inputs(example_inputs))


def tile_region(
    source: TilingSource, options: BackendOptions, *, throughput: DeviceThroughput | None = None,
    target: int | None = None,
) -> tuple[fx.GraphModule, TilingReport]:
    """``source``'s graph tiled as ``options.tile_sequence`` says (module docstring), and
    the report; the graph itself when nothing is tiled (never modified). ``target``: the
    floor the step asks for (:meth:`.step.lowerings.RegionLowerings.retile`), instead of
    the options' budget; the spans that set the floor are then tiled even where it already fits it."""
    def probe(graph: fx.GraphModule) -> Probe:
        return probe_floor(graph, source.inputs, options, activation_inputs=source.moving,
                           throughput=throughput)

    started = time.perf_counter()
    try:
        return choose_tiling(source.graph, options.tile_sequence, probe,
                             _budget(options) if target is None else target,
                             seeds=source.seeds, force=target is not None)
    except Exception as error:  # an optimisation failed: the region compiles untiled, exact
        LOGGER.warning(
            "hyper_offload: sequence tiling of a region failed (%s: %s); it compiles "
            "untiled (exact). Fix: report it, or pass tile_sequence='off'",
            type(error).__name__, error)
        return source.graph, _untiled(options.tile_sequence, None,
                                      f"tiling failed ({type(error).__name__})", started)


def _budget(options: BackendOptions) -> Callable[[Probe], int] | int:
    if options.budget_fraction is not None:
        fraction = options.budget_fraction
        return lambda untiled: int(fraction * untiled.peak_without_offload)
    return options.config.budget_bytes


def choose_tiling(
    gm: fx.GraphModule, mode: str | int, probe: Prober, budget: Callable[[Probe], int] | int,
    *, seeds: Mapping[str, int | None] | None = None, force: bool = False,
) -> tuple[fx.GraphModule, TilingReport]:
    """The search of the module docstring, with ``probe`` giving a candidate's floor and
    ``budget`` (bytes, or a function of the untiled probe) the floor to reach; ``force``:
    tile the spans that set the floor even where the untiled floor fits."""
    started = time.perf_counter()
    seq_len = sequence_length(gm.graph)
    if seq_len is None or seq_len < 2:
        return gm, _untiled(mode, seq_len, "no sequence length found", started)
    axes = token_axes(gm.graph, seq_len, seeds)
    spans = tile_spans(gm.graph, axes)
    if not spans:
        return gm, _untiled(mode, seq_len, "no token-wise op to tile", started)
    search = _Search(gm, axes, spans, probe, min(seq_len, MAX_TILES))
    limit = budget(search.untiled) if callable(budget) else budget
    stopped = search.run(mode, limit, force)
    chosen, after = search.best
    report = TilingReport(
        mode=str(mode), seq_len=seq_len,
        spans=search.reports(), floor_before_bytes=search.untiled.floor_bytes,
        floor_after_bytes=after.floor_bytes, floor_op_before=search.untiled.floor_op,
        floor_op_after=after.floor_op, compute_before_s=search.untiled.compute_s,
        compute_after_s=after.compute_s, probes=search.probes,
        seconds=time.perf_counter() - started, stopped=stopped,
    )
    return (search.graph(chosen) if chosen else gm), report


def _untiled(mode: str | int, seq_len: int | None, why: str, started: float) -> TilingReport:
    return TilingReport(str(mode), seq_len, (), 0, 0, "", "", 0.0, 0.0, 0,
                        time.perf_counter() - started, why)


class _Search:
    """The tile counts chosen so far (by span signature) and what each was probed at."""

    def __init__(self, gm: fx.GraphModule, axes: Mapping[str, Any], spans: tuple[Span, ...],
                 probe: Prober, max_tiles: int) -> None:
        self.axes, self.spans, self.max_tiles = axes, spans, max_tiles
        self.base = tile_graph(gm, axes, ())  # a copy, each span's nodes tagged
        by_name = {node.name: node for node in self.base.graph.nodes}
        for span in spans:
            for name in span.nodes:
                meta = by_name[name].meta  # the copy's own dict; "custom" may be shared
                meta["custom"] = {**(meta.get("custom") or {}), SPAN_KEY: span.index}
        self._probe, self.probes = probe, 0
        self._seen: dict[tuple[tuple[str, int], ...], Probe] = {}
        self.untiled = self.floor({})
        self.best: tuple[dict[str, int], Probe] = ({}, self.untiled)

    def floor(self, counts: Mapping[str, int]) -> Probe:
        key = tuple(sorted(counts.items()))
        if key not in self._seen:
            self.probes += 1
            self._seen[key] = self._probe(self.graph(counts) if counts else self.base)
        return self._seen[key]

    def graph(self, counts: Mapping[str, int]) -> fx.GraphModule:
        """The base graph with every span of each signature in ``counts`` tiled."""
        chosen = [s for s in self.spans if counts.get(s.signature, 1) > 1]
        return tile_graph(self.base, self.axes, _units(chosen, counts))

    def run(self, mode: str | int, limit: int, force: bool = False) -> str:
        """Tile the spans that set the floor, doubling their tiles, while the floor is
        over ``limit`` (``force``: at least once; a tile count: whatever the limit);
        then, when it fits, the fewest tiles that still fit. Why it stopped."""
        counts: dict[str, int] = {}
        current, stopped = self.untiled, "the floor fits the budget untiled"
        counted = isinstance(mode, int)
        while current.floor_bytes > limit or ((force or counted) and not counts):
            if current.floor_span is None:
                stopped = f"the floor is set by {current.floor_op}, not a token-wise op"
                break
            signature = self.spans[current.floor_span].signature
            if counted:
                if signature in counts:
                    stopped = f"the floor is set by {current.floor_op}, in spans tiled {mode}-fold"
                    break
                tiles = min(int(mode), self.max_tiles)
            else:
                tiles = 2 * counts.get(signature, 1)
                if tiles > self.max_tiles:
                    stopped = (f"the floor is set by {current.floor_op}, in spans at the most "
                               f"tiles ({self.max_tiles})")
                    break
            trial = {**counts, signature: tiles}
            probed = self.floor(trial)
            if not counted and probed.floor_bytes > (1 - MIN_GAIN) * current.floor_bytes:
                stopped = (f"more tiles lower the floor set by {current.floor_op} by less than "
                           f"{MIN_GAIN:.0%}")
                break
            counts, current = trial, probed
            stopped = "the floor fits the budget"
        if counts and current.floor_bytes <= limit and not counted:
            counts = self._fewest(counts, limit)
        self.best = (counts, self.floor(counts))
        return stopped

    def _fewest(self, counts: dict[str, int], limit: int) -> dict[str, int]:
        """``counts`` (whose floor fits ``limit``) with each signature's tiles bisected
        down to the fewest that still fit, the others as they are (last tiled first)."""
        counts = dict(counts)
        for signature in reversed(list(counts)):
            low, high = 1, counts[signature]
            while high - low > 1:
                middle = (low + high) // 2
                fits = self.floor({**counts, signature: middle}).floor_bytes <= limit
                low, high = (low, middle) if fits else (middle, high)
            counts[signature] = high
        return counts

    def reports(self) -> tuple[TiledSpanReport, ...]:
        counts, _ = self.best
        found: dict[str, TiledSpanReport] = {}
        for span in self.spans:
            tiles = counts.get(span.signature, 1)
            if tiles < 2:
                continue
            first = found.get(span.signature)
            found[span.signature] = (
                dataclasses.replace(first, copies=first.copies + 1) if first
                else TiledSpanReport(span.nodes[0], span.nodes[-1], span.ops, tiles))
        return tuple(found.values())


def _units(spans: Sequence[Span], counts: Mapping[str, int]) -> list[TileUnit]:
    """One unit per run of adjacent spans of one segment with the same count (tiled as
    one block: no concatenation and split between them)."""
    units: list[TileUnit] = []
    for span in spans:
        tiles = counts[span.signature]
        last = units[-1] if units else None
        if (last is not None and last.tiles == tiles and _adjacent(last, span)):
            units[-1] = TileUnit(last.nodes + span.nodes, tiles)
        else:
            units.append(TileUnit(span.nodes, tiles))
    return units


def _adjacent(unit: TileUnit, span: Span) -> bool:
    """Whether ``span`` reads a value of the unit (the two are cut there)."""
    return not set(unit.nodes).isdisjoint(span.inputs)


def _seeds(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, int | None] | None:
    """The graph inputs that carry tokens: every input but the parameters, at its one dim
    of the sequence's extent (None: the analysis' default)."""
    seq_len = sequence_length(gm.graph)
    placeholders = gm.graph.find_nodes(op="placeholder")
    if seq_len is None or len(placeholders) != len(example_inputs):
        return None
    seeds: dict[str, int | None] = {}
    for node, value in zip(placeholders, example_inputs):
        dims = [d for d, extent in enumerate(getattr(value, "shape", ())) if extent == seq_len]
        token = isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
        seeds[node.name] = dims[0] if token and len(dims) == 1 else None
    return seeds


# ------------------------------------------------------------------ probes


class _Capture(CustomPartitionerFn):
    """Torch's min-cut partition, kept (the backend's partitioner without the plan)."""

    def __init__(self) -> None:
        self.graphs: tuple[fx.GraphModule, fx.GraphModule, int] | None = None

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.graphs = (fw, bw, kwargs["num_fwd_outputs"])
        return fw, bw

    def __deepcopy__(self, memo: dict[int, Any]) -> _Capture:
        return self  # Inductor snapshots its config; the capture is kept by reference

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, ("hyper_offload tiling probe",))

    def uuid(self) -> Any:
        return "hyper_offload tiling probe"


def probe_floor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions, *,
    activation_inputs: frozenset[str], throughput: DeviceThroughput | None,
) -> Probe:
    """The floor of ``gm`` compiled as the backend compiles it (module docstring)."""
    from torch._functorch import config as functorch_config

    capture = _Capture()
    context = torch._guards.TracingContext.try_get()
    fake_mode = context.fake_mode if context is not None else None
    tracing = (torch._guards.tracing(torch._guards.TracingContext(fake_mode))
               if fake_mode is not None else contextlib.nullcontext())
    with functorch_config.patch(enable_autograd_cache=False), tracing:
        compile_graphs_only(gm, example_inputs, capture, options.inner_compiler,
                            options.inductor_patches())
    assert capture.graphs is not None, "the region has a backward (it was compiled for one)"
    fw, bw, num_fwd_outputs = capture.graphs
    fx_trace = build_fx_trace(fw, bw, num_fwd_outputs=num_fwd_outputs, throughput=throughput,
                              activation_inputs=activation_inputs,
                              outputs_move=options.step_scoped)
    need = required_bytes(fx_trace.trace)
    at = max(range(len(need)), key=need.__getitem__)
    name = fx_trace.op_nodes[at]
    return Probe(need[at], name, _span_of(name, fw, bw), sum(op_durations(fx_trace.trace)),
                 fx_trace.peak_without_offload)


def _span_of(op: str, fw: fx.GraphModule, bw: fx.GraphModule) -> int | None:
    """The span of trace op ``op`` (``"bw:mm_4"``): its node's tag, else for an
    addition the tag its inputs share (autograd's accumulation of two gradients is
    traced untagged; any other untagged op is no span's)."""
    graph_name, _, node_name = op.partition(":")
    graph = (bw if graph_name == "bw" else fw).graph
    node = next((n for n in graph.nodes if n.name == node_name), None)
    if node is None:
        return None
    own = _tag(node)
    if own is not None or node.target is not torch.ops.aten.add.Tensor:
        return own
    tags = {_tag(arg) for arg in node.all_input_nodes} - {None}
    return tags.pop() if len(tags) == 1 else None


def _tag(node: fx.Node) -> int | None:
    custom = node.meta.get("custom")
    return custom.get(SPAN_KEY) if isinstance(custom, dict) else None
