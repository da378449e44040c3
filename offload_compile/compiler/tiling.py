"""The compile door's sequence tiling (option ``tile_sequence``; issue 50, item 2).

Before a region is compiled, when ``tile_sequence`` is ``"auto"`` or a tile count:

1. the region's Dynamo graph is analysed (:mod:`hyper_offload.passes.fx.tiling`): which
   ops are token-wise along which dim, and the spans of them that may be tiled;
2. the region as it is is *probed* (:mod:`.tiling_probe`: its graphs compiled without
   code and traced at its floor, everything movable moved): the op with the most bytes
   that no plan can move sets the floor. When that op belongs to a span, the spans with
   the same ops (that span in every layer) are tiled (:mod:`~hyper_offload.passes.fx.
   tiling_rewrite`: each tile recomputed in its backward, one tile's intermediates alive
   at a time) with the **fewest tiles whose floor fits the budget** (``"auto"``: counts
   doubled from 2 while the floor falls, then bisected), or where tiles stop lowering
   it: once its floor is set by an op outside those spans, or more tiles lower it no
   more. Then again for the span that sets the new floor, until the floor fits, is set
   by an op no tiling lowers (attention, an embedding's gradient), or by spans already
   tiled. A tile count (``tile_sequence=8``) tiles those spans with that count instead;
   ``"off"`` (the default) analyses nothing and changes nothing;
3. the region is compiled from the tiled graph as from any Dynamo graph (the recompute
   search, the step plan, the lowerings all see the tiled graphs); its region report says
   what was tiled (:class:`~.tiling_report.TilingReport`), and that the plan is *not
   bit-exact* (sums over tokens are reassociated: weight gradients, a loss mean).

Every candidate is priced on the one timeline model: its floor from its own trace, its
compute (the tiles' recomputation included) by the roofline cost model. The budget a
floor must fit is ``max_resident_activation_mb``, or with a fraction that fraction of
the region's own peak without offload (the step's peak is only known after a step: the
step plan then reports whether the step fits). The choice is made once, at the region's
first compile; every later lowering of the region starts from the tiled graph.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.passes.fx.tiling import Span, sequence_length, tile_spans, token_axes
from hyper_offload.passes.fx.tiling_rewrite import TileUnit, tile_graph

from .options import BackendOptions
from .region_report import LOGGER
from .region_state import activation_inputs
from .tiling_probe import SPAN_KEY, Probe, probe_floor
from .tiling_report import TiledSpanReport, TilingReport

__all__ = ["MAX_TILES", "choose_tiling", "tile_region"]

MAX_TILES = 128
"""At most this many tiles per span (and never more than the sequence's tokens)."""

Prober = Callable[[fx.GraphModule], Probe]


def tile_region(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions, *,
    throughput: DeviceThroughput | None = None,
) -> tuple[fx.GraphModule, TilingReport]:
    """``gm`` tiled as ``options.tile_sequence`` says (module docstring), and the report;
    ``gm`` itself when nothing is tiled (never modified)."""
    inputs = _fake_inputs(gm, example_inputs)
    moving = activation_inputs(example_inputs)

    def probe(graph: fx.GraphModule) -> Probe:
        return probe_floor(graph, inputs, options, activation_inputs=moving,
                           throughput=throughput)

    started = time.perf_counter()
    try:
        return choose_tiling(gm, options.tile_sequence, probe, _budget(options),
                             seeds=_seeds(gm, example_inputs))
    except Exception as error:  # an optimisation failed: the region compiles untiled, exact
        LOGGER.warning(
            "hyper_offload: sequence tiling of a region failed (%s: %s); it compiles "
            "untiled (exact). Fix: report it, or pass tile_sequence='off'",
            type(error).__name__, error)
        return gm, _untiled(options.tile_sequence, None,
                            f"tiling failed ({type(error).__name__})", started)


def _budget(options: BackendOptions) -> Callable[[Probe], int] | int:
    if options.budget_fraction is not None:
        fraction = options.budget_fraction
        return lambda untiled: int(fraction * untiled.peak_without_offload)
    return options.config.budget_bytes


def choose_tiling(
    gm: fx.GraphModule, mode: str | int, probe: Prober, budget: Callable[[Probe], int] | int,
    *, seeds: Mapping[str, int | None] | None = None,
) -> tuple[fx.GraphModule, TilingReport]:
    """The search of the module docstring, with ``probe`` giving a candidate's floor and
    ``budget`` (bytes, or a function of the untiled probe) the floor to reach."""
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
    stopped = search.run(mode, limit)
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

    def run(self, mode: str | int, limit: int) -> str:
        """Tile span after span while the floor is set by one (module docstring); the
        reason it stopped."""
        counts: dict[str, int] = {}
        current = self.untiled
        while current.floor_bytes > limit:
            if current.floor_span is None:
                return f"the floor is set by {current.floor_op}, not a token-wise op"
            signature = self.spans[current.floor_span].signature
            if signature in counts:
                return f"the floor is set by {current.floor_op}, in a span already tiled"
            tiles = mode if isinstance(mode, int) else self._fewest(counts, signature, limit)
            if tiles is None:
                return f"more tiles do not lower the floor set by {current.floor_op}"
            counts[signature] = min(tiles, self.max_tiles)
            current = self.floor(counts)
            if current.floor_bytes < self.best[1].floor_bytes or isinstance(mode, int):
                self.best = (dict(counts), current)
        return "the floor fits the budget" if counts else "the floor fits the budget untiled"

    def _fewest(self, counts: dict[str, int], signature: str, limit: int) -> int | None:
        """The fewest tiles of ``signature``'s spans at which the floor fits ``limit``
        or is no longer theirs; where neither happens, the count past which more tiles
        lower the floor no more (None: two tiles already do not lower it)."""
        def done(tiles: int) -> bool:
            probed = self.floor({**counts, signature: tiles})
            spans = probed.floor_span
            return probed.floor_bytes <= limit or spans is None or (
                self.spans[spans].signature != signature)

        previous, tiles = self.floor(counts), 2
        while tiles <= self.max_tiles:
            if done(tiles):
                return self._bisect(done, tiles // 2, tiles)
            probed = self.floor({**counts, signature: tiles})
            if probed.floor_bytes >= previous.floor_bytes:
                return tiles // 2 if tiles > 2 else None
            previous, tiles = probed, tiles * 2
        return tiles // 2

    @staticmethod
    def _bisect(done: Callable[[int], bool], low: int, high: int) -> int:
        """The least count in (low, high] with ``done`` (``done(high)`` holds)."""
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if done(middle) else (middle, high)
        return max(high, 2)

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


def _fake_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """Each tensor input as the fake value Dynamo traced it as (probes compile on them)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    fakes = [node.meta.get("example_value") for node in placeholders]
    if len(fakes) != len(example_inputs):
        return list(example_inputs)
    return [fake if isinstance(value, torch.Tensor) and isinstance(fake, torch.Tensor) else value
            for value, fake in zip(example_inputs, fakes)]


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
