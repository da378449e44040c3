"""Cost-aware swap eligibility: swap only chunks whose copies hide and that lower the peak.

The gap rule (``gap >= min_gap``) says when a chunk *may* be swapped. This module, the
design document's own future work, decides which eligible chunks are *worth* swapping on
one rank, from three inputs: activation bytes per chunk (:class:`ActivationSizes`), D2H /
H2D bandwidth and per-step compute durations (:class:`SwapCostModel`).

Analysis and rewrite are separate: :func:`choose_swaps` reads an order in which every
candidate chunk already has its four swap steps (the gap rule's output) and returns a
:class:`SwapCostReport`; the caller hands ``report.chosen`` to
``inject_swap_steps(order, only=...)``. :func:`plan_swaps` does both analysis calls for a
plain order.

Model (all of it is in these functions; nothing is measured here):

* **Residency.** A chunk's activations occupy the device from the top-level step holding
  its FWD leaf through the step holding its first consumer (BWD, or BWD_INPUT under dx/dw
  split; to the end of the order if there is none). A swapped chunk is off the device from
  its ``SWAP_WAIT_OFFLOAD`` (which frees the device storage) up to, not including, its
  ``SWAP_LAUNCH_LOAD`` (which allocates it again). The curve is sampled at every top-level
  step; its maximum is the rank's peak of resident activation bytes.
* **Time.** A rank-local clock advances only at compute slots: a compute leaf takes
  ``SwapCostModel.seconds(kind, stage)``; an ``OVERLAP_*`` composite runs its sub-steps
  concurrently and takes the longest of them. Other steps take no time. Cross-rank
  bubbles are ignored, which can only *under*-estimate a window: a chunk judged hideable
  is hideable.
* **Copy stream.** All D2H and H2D copies of a rank share one in-order copy stream: a copy
  starts at ``max(launch time, end of the previous copy)``. A chunk is hideable when, with
  every chosen chunk on the stream, its offload ends by its ``SWAP_WAIT_OFFLOAD`` and its
  load by its ``SWAP_WAIT_LOAD``.
* **Choice.** Greedy on the peak: repeatedly take the hideable chunk that is off the
  device at a peak position and lowers ``(peak, number of peak positions)`` the most
  (largest chunk first on ties); stop when nothing lowers it or the target is met. Then
  drop, latest choice first, any chunk whose removal leaves the peak unchanged: swapping a
  chunk that is not resident at the peak costs bandwidth and saves nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from .meta_step import MetaStep, StepKind
from .swap import MIN_SWAP_GAP, find_swap_chunks, inject_swap_steps

ChunkKey = tuple[int, int]
"""``(stage, micro)``: the unit the swap pass works on."""

_CONSUMER_KINDS = (StepKind.BWD, StepKind.BWD_INPUT)

#: Default compute time per step kind in seconds: backward ≈ 2× forward, as in a transformer.
DEFAULT_STEP_SECONDS: Mapping[StepKind, float] = MappingProxyType(
    {
        StepKind.FWD: 0.010,
        StepKind.BWD: 0.020,
        StepKind.BWD_INPUT: 0.010,
        StepKind.BWD_WEIGHT: 0.010,
    }
)


@dataclass(frozen=True, kw_only=True)
class ActivationSizes:
    """Activation bytes of each chunk: ``per_chunk``, else ``per_stage``, else ``default_bytes``."""

    default_bytes: int = 0
    """Bytes of a chunk with no entry below."""

    per_stage: Mapping[int, int] = field(default_factory=dict)
    """``stage -> bytes`` of every micro-batch of that stage."""

    per_chunk: Mapping[ChunkKey, int] = field(default_factory=dict)
    """``(stage, micro) -> bytes``; wins over ``per_stage``."""

    def __post_init__(self) -> None:
        _check_bytes("ActivationSizes.default_bytes", self.default_bytes)
        for name in ("per_stage", "per_chunk"):
            table = dict(getattr(self, name))
            for key, value in table.items():
                _check_bytes(f"ActivationSizes.{name}[{key!r}]", value)
            object.__setattr__(self, name, MappingProxyType(table))

    def bytes_of(self, chunk: ChunkKey) -> int:
        if chunk in self.per_chunk:
            return self.per_chunk[chunk]
        return self.per_stage.get(chunk[0], self.default_bytes)


@dataclass(frozen=True, kw_only=True)
class SwapCostModel:
    """Copy bandwidths and compute durations used to decide whether a copy hides."""

    d2h_bytes_per_s: float = 20e9
    """Device-to-host copy bandwidth (pinned memory over PCIe 4 x16 sustains ~20 GB/s)."""

    h2d_bytes_per_s: float = 20e9
    """Host-to-device copy bandwidth."""

    step_seconds: Mapping[StepKind, float] = field(default_factory=lambda: dict(DEFAULT_STEP_SECONDS))
    """Compute time per kind (FWD, BWD, BWD_INPUT, BWD_WEIGHT); missing kinds use the default."""

    stage_step_seconds: Mapping[tuple[int, StepKind], float] = field(default_factory=dict)
    """``(stage, kind) -> seconds`` for stages that differ (e.g. the last stage with the loss)."""

    def __post_init__(self) -> None:
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SwapCostModel.{name}: expected bytes per second > 0, got {value!r}")
        merged = {**DEFAULT_STEP_SECONDS, **dict(self.step_seconds)}
        for table_name, table in (("step_seconds", merged), ("stage_step_seconds", self.stage_step_seconds)):
            for key, value in table.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(
                        f"SwapCostModel.{table_name}[{key!r}]: expected seconds >= 0, got {value!r}"
                    )
        object.__setattr__(self, "step_seconds", MappingProxyType(merged))
        object.__setattr__(self, "stage_step_seconds", MappingProxyType(dict(self.stage_step_seconds)))

    def seconds(self, kind: StepKind, stage: int | None) -> float:
        """Compute time of one leaf of ``kind`` on ``stage``; 0 for non-compute kinds."""
        if (stage, kind) in self.stage_step_seconds:
            return self.stage_step_seconds[(stage, kind)]
        return self.step_seconds.get(kind, 0.0)

    def slot_seconds(self, step: MetaStep) -> float:
        """Duration of one top-level step: a composite's sub-steps run concurrently."""
        return max((self.seconds(leaf.kind, leaf.stage) for leaf in step.leaves()), default=0.0)


class RejectReason(str, Enum):
    """Why a chunk stays resident."""

    NOT_ELIGIBLE = "NOT_ELIGIBLE"  # the gap rule gave it no swap steps
    NO_ACTIVATIONS = "NO_ACTIVATIONS"  # zero bytes: nothing to move
    OFFLOAD_WINDOW_TOO_SHORT = "OFFLOAD_WINDOW_TOO_SHORT"  # D2H alone outlasts its window
    LOAD_WINDOW_TOO_SHORT = "LOAD_WINDOW_TOO_SHORT"  # H2D alone outlasts its window
    COPY_STREAM_BUSY = "COPY_STREAM_BUSY"  # would lower the peak, hides alone, not behind the chosen copies
    NOT_AT_PEAK = "NOT_AT_PEAK"  # swapping it does not lower the rank's peak
    TARGET_MET = "TARGET_MET"  # the peak already meets the target without it

    def __repr__(self) -> str:
        return self.value


@dataclass(frozen=True)
class RejectedChunk:
    stage: int
    micro: int
    reason: RejectReason
    detail: str

    def __str__(self) -> str:
        return f"stage {self.stage} micro-batch {self.micro}: {self.reason.value} ({self.detail})"


@dataclass(frozen=True)
class ChunkWindow:
    """One candidate's copy budget: window lengths vs. copy times, in seconds."""

    stage: int
    micro: int
    bytes: int
    offload_window_s: float
    load_window_s: float
    d2h_s: float
    h2d_s: float

    @property
    def hides_alone(self) -> bool:
        return fits(self.d2h_s, self.offload_window_s) and fits(self.h2d_s, self.load_window_s)


def fits(copy_s: float, window_s: float) -> bool:
    """``copy_s <= window_s`` up to float rounding of summed durations."""
    return copy_s <= window_s * (1 + 1e-9) + 1e-12


@dataclass(frozen=True)
class SwapCostReport:
    """The decision for one rank.

    ``peak_without`` is the rank's peak of resident activation bytes with no chunk swapped;
    ``peak_with`` with exactly ``chosen`` swapped (``peak_with <= peak_without``). Every
    chunk of the order is either in ``chosen`` or in ``rejected``, never both.
    """

    peak_without: int
    peak_with: int
    chosen: tuple[ChunkKey, ...]
    rejected: tuple[RejectedChunk, ...]
    windows: tuple[ChunkWindow, ...]

    @property
    def saved_bytes(self) -> int:
        return self.peak_without - self.peak_with


@dataclass(frozen=True)
class ChunkLife:
    """Top-level positions of one chunk's FWD, first consumer and swap steps in an order."""

    stage: int
    micro: int
    forward: int
    consumer: int | None
    launch_offload: int | None = None
    wait_offload: int | None = None
    launch_load: int | None = None
    wait_load: int | None = None

    @property
    def key(self) -> ChunkKey:
        return (self.stage, self.micro)

    @property
    def has_swap_steps(self) -> bool:
        return None not in (self.launch_offload, self.wait_offload, self.launch_load, self.wait_load)

    def resident_span(self, order_length: int) -> range:
        end = order_length - 1 if self.consumer is None else self.consumer
        return range(self.forward, end + 1)

    @property
    def swap_positions(self) -> tuple[int, int, int, int]:
        """Positions of LAUNCH_OFFLOAD, WAIT_OFFLOAD, LAUNCH_LOAD, WAIT_LOAD."""
        positions = (self.launch_offload, self.wait_offload, self.launch_load, self.wait_load)
        if None in positions:
            raise ValueError(
                f"stage {self.stage} micro-batch {self.micro} is treated as swapped but the order "
                "lacks some of its four swap steps; inject them first (inject_swap_steps)"
            )
        return positions  # type: ignore[return-value]

    def away_span(self) -> range:
        """Positions at which a swapped chunk is off the device (empty if it has no swap steps)."""
        if not self.has_swap_steps:
            return range(0)
        _, wait_offload, launch_load, _ = self.swap_positions
        return range(wait_offload, launch_load)


def chunk_lives(order: Sequence[MetaStep]) -> dict[ChunkKey, ChunkLife]:
    """Where each chunk's FWD, first consumer and swap steps sit (top-level positions)."""
    found: dict[ChunkKey, dict[str, int]] = {}
    swap_fields = {
        StepKind.SWAP_LAUNCH_OFFLOAD: "launch_offload",
        StepKind.SWAP_WAIT_OFFLOAD: "wait_offload",
        StepKind.SWAP_LAUNCH_LOAD: "launch_load",
        StepKind.SWAP_WAIT_LOAD: "wait_load",
    }
    for position, step in enumerate(order):
        for leaf in step.leaves():
            key = leaf.chunk
            if key is None:
                continue
            if leaf.kind is StepKind.FWD:
                found.setdefault(key, {}).setdefault("forward", position)
            elif leaf.kind in _CONSUMER_KINDS:
                found.setdefault(key, {}).setdefault("consumer", position)
            elif leaf.kind in swap_fields:
                found.setdefault(key, {}).setdefault(swap_fields[leaf.kind], position)
    return {
        key: ChunkLife(stage=key[0], micro=key[1], consumer=places.get("consumer"), **_without(places, "consumer"))
        for key, places in sorted(found.items())
        if "forward" in places
    }


def _without(mapping: Mapping[str, int], name: str) -> dict[str, int]:
    return {k: v for k, v in mapping.items() if k != name}


def resident_curve(
    order: Sequence[MetaStep], sizes: ActivationSizes, swapped: Iterable[ChunkKey] | None = None
) -> list[int]:
    """Resident activation bytes at each top-level step of ``order``.

    ``swapped`` lists the chunks counted as swapped (each must have its four swap steps in
    ``order``); ``None`` means every chunk that has them.
    """
    lives = chunk_lives(order)
    chosen = {k for k, life in lives.items() if life.has_swap_steps} if swapped is None else set(swapped)
    unknown = sorted(chosen - set(lives))
    if unknown:
        raise ValueError(f"resident_curve: swapped chunks {unknown} have no FWD in the order; known: {sorted(lives)}")
    curve = [0] * len(order)
    for key, life in lives.items():
        if key in chosen:
            _ = life.swap_positions  # raises, naming the chunk, if one of its swap steps is missing
        away = life.away_span() if key in chosen else range(0)
        size = sizes.bytes_of(key)
        for position in life.resident_span(len(order)):
            if position not in away:
                curve[position] += size
    return curve


def peak_bytes(
    order: Sequence[MetaStep], sizes: ActivationSizes, swapped: Iterable[ChunkKey] | None = None
) -> int:
    return max(resident_curve(order, sizes, swapped), default=0)


def copy_stream_misses(
    order: Sequence[MetaStep],
    lives: Mapping[ChunkKey, ChunkLife],
    chosen: Iterable[ChunkKey],
    sizes: ActivationSizes,
    cost: SwapCostModel,
) -> list[ChunkKey]:
    """Chunks among ``chosen`` whose offload or load is not done by its wait step when all of
    ``chosen`` share one in-order copy stream (empty: every copy hides)."""
    clock = _step_start_times(order, cost)
    copies: list[tuple[int, int, float, ChunkKey]] = []  # (launch pos, wait pos, seconds, chunk)
    for key in chosen:
        launch_offload, wait_offload, launch_load, wait_load = lives[key].swap_positions
        size = sizes.bytes_of(key)
        copies.append((launch_offload, wait_offload, size / cost.d2h_bytes_per_s, key))
        copies.append((launch_load, wait_load, size / cost.h2d_bytes_per_s, key))
    stream_free = 0.0
    missed: list[ChunkKey] = []
    for launch, wait, seconds, key in sorted(copies):
        done = max(clock[launch], stream_free) + seconds
        stream_free = done
        if not fits(done, clock[wait]) and key not in missed:
            missed.append(key)
    return missed


def _step_start_times(order: Sequence[MetaStep], cost: SwapCostModel) -> list[float]:
    starts, now = [], 0.0
    for step in order:
        starts.append(now)
        if step.is_compute_slot:
            now += cost.slot_seconds(step)
    return starts


def chunk_windows(
    order: Sequence[MetaStep], sizes: ActivationSizes, cost: SwapCostModel
) -> dict[ChunkKey, ChunkWindow]:
    """Copy budget of every chunk that has its four swap steps in ``order``."""
    clock = _step_start_times(order, cost)
    windows = {}
    for key, life in chunk_lives(order).items():
        if not life.has_swap_steps:
            continue
        launch_offload, wait_offload, launch_load, wait_load = life.swap_positions
        size = sizes.bytes_of(key)
        windows[key] = ChunkWindow(
            stage=key[0],
            micro=key[1],
            bytes=size,
            offload_window_s=clock[wait_offload] - clock[launch_offload],
            load_window_s=clock[wait_load] - clock[launch_load],
            d2h_s=size / cost.d2h_bytes_per_s,
            h2d_s=size / cost.h2d_bytes_per_s,
        )
    return windows


def choose_swaps(
    swapped_order: Sequence[MetaStep],
    *,
    sizes: ActivationSizes,
    cost: SwapCostModel,
    target_peak_bytes: int | None = None,
    ineligible_detail: Mapping[ChunkKey, str] | None = None,
) -> SwapCostReport:
    """Decide which candidate chunks of one rank to swap (see the module docstring).

    ``swapped_order`` is the rank's order with the four swap steps of every *candidate*
    chunk (e.g. ``inject_swap_steps(order)``); chunks without them are rejected as
    ``NOT_ELIGIBLE`` (``ineligible_detail`` may say why, e.g. their gap). The greedy stops
    early once the peak is ``<= target_peak_bytes``.
    """
    if target_peak_bytes is not None:
        _check_bytes("choose_swaps: target_peak_bytes", target_peak_bytes)
    lives = chunk_lives(swapped_order)
    windows = chunk_windows(swapped_order, sizes, cost)
    rejected: dict[ChunkKey, RejectedChunk] = {}
    for key in lives:
        if key not in windows:
            detail = (ineligible_detail or {}).get(key, "no swap steps in the order (gap below the minimum)")
            rejected[key] = RejectedChunk(*key, RejectReason.NOT_ELIGIBLE, detail)
        else:
            verdict = _alone_verdict(windows[key])
            if verdict is not None:
                rejected[key] = verdict
    candidates = [k for k in windows if k not in rejected]
    base = resident_curve(swapped_order, sizes, swapped=())
    chosen = _greedy_on_peak(swapped_order, lives, base, candidates, sizes, cost, target_peak_bytes, rejected)
    chosen = _drop_unneeded(lives, base, chosen, sizes)
    final_peak = _peak(base, lives, chosen, sizes)
    for key, verdict in list(rejected.items()):
        # A chunk refused for the copy stream while the greedy chased a plateau may not matter
        # for the final peak at all; then that is the more useful reason to report.
        if verdict.reason is RejectReason.COPY_STREAM_BUSY and _peak(base, lives, [*chosen, key], sizes) >= final_peak:
            del rejected[key]
    for key in candidates:
        if key not in chosen and key not in rejected:
            met = target_peak_bytes is not None and _peak(base, lives, chosen, sizes) <= target_peak_bytes
            reason = RejectReason.TARGET_MET if met else RejectReason.NOT_AT_PEAK
            detail = (
                f"peak already <= target {target_peak_bytes} bytes"
                if met
                else "off the device only where the rank is below its peak; swapping it would not lower the peak"
            )
            rejected[key] = RejectedChunk(*key, reason, detail)
    return SwapCostReport(
        peak_without=max(base, default=0),
        peak_with=_peak(base, lives, chosen, sizes),
        chosen=tuple(sorted(chosen)),
        rejected=tuple(rejected[k] for k in sorted(rejected)),
        windows=tuple(windows[k] for k in sorted(windows)),
    )


def plan_swaps(
    order: Sequence[MetaStep],
    *,
    sizes: ActivationSizes,
    cost: SwapCostModel,
    min_gap: int = MIN_SWAP_GAP,
    target_peak_bytes: int | None = None,
) -> SwapCostReport:
    """Cost-aware choice for one rank's order *before* the swap pass.

    The gap rule names the candidates (``inject_swap_steps(order, min_gap=min_gap)`` gives
    their anchors); :func:`choose_swaps` picks among them. Apply the result with
    ``inject_swap_steps(order, min_gap=min_gap, only=report.chosen)``.
    """
    chunks = find_swap_chunks(order, min_gap=min_gap)
    detail = {c.key: f"gap {c.gap} < min gap {min_gap}" for c in chunks if not c.eligible}
    return choose_swaps(
        inject_swap_steps(order, min_gap=min_gap),
        sizes=sizes,
        cost=cost,
        target_peak_bytes=target_peak_bytes,
        ineligible_detail=detail,
    )


def plan_rank_swaps(
    orders: Mapping[int, Sequence[MetaStep]],
    *,
    sizes: ActivationSizes,
    cost: SwapCostModel,
    min_gap: int = MIN_SWAP_GAP,
    target_peak_bytes: int | None = None,
) -> dict[int, SwapCostReport]:
    """:func:`plan_swaps` for every rank; ``{rank: report}``."""
    return {
        rank: plan_swaps(order, sizes=sizes, cost=cost, min_gap=min_gap, target_peak_bytes=target_peak_bytes)
        for rank, order in orders.items()
    }


def _alone_verdict(window: ChunkWindow) -> RejectedChunk | None:
    key = (window.stage, window.micro)
    if window.bytes == 0:
        return RejectedChunk(*key, RejectReason.NO_ACTIVATIONS, "0 activation bytes")
    if not fits(window.d2h_s, window.offload_window_s):
        return RejectedChunk(
            *key,
            RejectReason.OFFLOAD_WINDOW_TOO_SHORT,
            f"D2H of {window.bytes} bytes takes {window.d2h_s * 1e3:.3g} ms, the offload window "
            f"covers {window.offload_window_s * 1e3:.3g} ms of compute",
        )
    if not fits(window.h2d_s, window.load_window_s):
        return RejectedChunk(
            *key,
            RejectReason.LOAD_WINDOW_TOO_SHORT,
            f"H2D of {window.bytes} bytes takes {window.h2d_s * 1e3:.3g} ms, the load window "
            f"covers {window.load_window_s * 1e3:.3g} ms of compute",
        )
    return None


def _curve_with(
    base: Sequence[int], lives: Mapping[ChunkKey, ChunkLife], chosen: Iterable[ChunkKey], sizes: ActivationSizes
) -> list[int]:
    curve = list(base)
    for key in chosen:
        size = sizes.bytes_of(key)
        for position in lives[key].away_span():
            curve[position] -= size
    return curve


def _peak(
    base: Sequence[int], lives: Mapping[ChunkKey, ChunkLife], chosen: Iterable[ChunkKey], sizes: ActivationSizes
) -> int:
    return max(_curve_with(base, lives, chosen, sizes), default=0)


def _greedy_on_peak(
    order: Sequence[MetaStep],
    lives: Mapping[ChunkKey, ChunkLife],
    base: Sequence[int],
    candidates: Sequence[ChunkKey],
    sizes: ActivationSizes,
    cost: SwapCostModel,
    target: int | None,
    rejected: dict[ChunkKey, RejectedChunk],
) -> list[ChunkKey]:
    """Add chunks while one lowers ``(peak, number of peak positions)``; see the module docstring."""
    chosen: list[ChunkKey] = []
    while True:
        curve = _curve_with(base, lives, chosen, sizes)
        peak = max(curve, default=0)
        if target is not None and peak <= target:
            return chosen
        at_peak = [p for p, value in enumerate(curve) if value == peak]
        scored = []
        for key in candidates:
            if key in chosen or key in rejected:
                continue
            away, size = lives[key].away_span(), sizes.bytes_of(key)
            if not any(p in away for p in at_peak):
                continue
            lowered = [v - size if p in away else v for p, v in enumerate(curve)]
            new_peak = max(lowered)
            scored.append(((new_peak, lowered.count(new_peak), -size, key), key))
        picked = None
        for (new_peak, count, _, _), key in sorted(scored):
            if (new_peak, count) >= (peak, len(at_peak)):
                break
            if copy_stream_misses(order, lives, [*chosen, key], sizes, cost):
                rejected[key] = RejectedChunk(
                    *key,
                    RejectReason.COPY_STREAM_BUSY,
                    "its copies hide alone but not behind the copies of the chunks chosen "
                    "before it on the shared copy stream",
                )
                continue
            picked = key
            break
        if picked is None:
            return chosen
        chosen.append(picked)


def _drop_unneeded(
    lives: Mapping[ChunkKey, ChunkLife], base: Sequence[int], chosen: Sequence[ChunkKey], sizes: ActivationSizes
) -> list[ChunkKey]:
    """Remove, latest choice first, chunks whose removal keeps the peak where it is.

    Removing a chunk never makes the remaining copies slower, so the rest stays hideable.
    """
    kept = list(chosen)
    peak = _peak(base, lives, kept, sizes)
    for key in reversed(chosen):
        trial = [k for k in kept if k != key]
        if _peak(base, lives, trial, sizes) <= peak:
            kept = trial
    return kept


def _check_bytes(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected a byte count (int >= 0), got {value!r}")
