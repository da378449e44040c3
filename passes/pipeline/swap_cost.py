"""Cost-aware swap eligibility: swap only windows whose copies hide and that lower the peak.

The gap rule (``gap >= min_gap``) says when a window *may* be swapped: a chunk's
activation window (FWD → first backward consumer) or, under dx/dw split, its dW-state
window (BWD_INPUT → BWD_WEIGHT). This module, the design document's own future work,
decides which eligible windows are *worth* swapping on one rank, from three inputs: the
bytes each chunk keeps alive (:class:`~.residency.ActivationSizes` for activations only, or the full
:class:`~.residency.StageFootprints`), D2H / H2D bandwidth and per-step compute durations
(:class:`SwapCostModel`).

Analysis and rewrite are separate: :func:`choose_swaps` reads an order in which every
candidate window already has its four swap steps (the gap rule's output) and returns a
:class:`SwapCostReport`; the caller hands ``report.chosen`` and ``report.chosen_weight``
to ``inject_swap_steps(order, only=..., weight_only=...)``. :func:`plan_swaps` does both
analysis calls for a plain order.

Model (all of it is in these functions and in :mod:`.residency`; nothing is measured here):

* **Residency.** The residency model of :mod:`.residency`: per chunk, levels that change
  at its FWD, BWD / BWD_INPUT / BWD_WEIGHT and swap steps, summed per top-level step. A
  swapped window's bytes are off the device from its WAIT_OFFLOAD (which frees the device
  storage) up to, not including, its LAUNCH_LOAD (which allocates it again). The curve's
  maximum is the rank's predicted peak.
* **Time.** A rank-local clock advances only at compute slots: a compute leaf takes
  ``SwapCostModel.seconds(kind, stage)``; an ``OVERLAP_*`` composite runs its sub-steps
  concurrently and takes the longest of them. Other steps take no time. Cross-rank
  bubbles are ignored, which can only *under*-estimate a window: a window judged hideable
  is hideable.
* **Copy stream.** All D2H and H2D copies of a rank share one in-order copy stream: a copy
  starts at ``max(launch time, end of the previous copy)``. A window is hideable when, with
  every chosen window on the stream, its offload ends by its WAIT_OFFLOAD and its load by
  its WAIT_LOAD.
* **Choice.** Greedy on the peak: repeatedly take the hideable window that is off the
  device at a peak position and lowers ``(peak, number of peak positions)`` the most
  (largest first on ties); stop when nothing lowers it or the target is met. Then drop,
  latest choice first, any window whose removal leaves the peak unchanged: swapping bytes
  that are not resident at the peak costs bandwidth and saves nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from hyper_offload.errors import ConfigurationError

from .execution import SendReleases, send_releases
from .meta_step import MetaStep, StepKind, SwapPhase
from .residency import ChunkLife, ChunkSizes, check_bytes, chunk_lives, step_curve
from .swap import MIN_SWAP_GAP, find_swap_chunks, find_weight_windows, inject_swap_steps


ChunkKey = tuple[int, int]
"""``(stage, micro)``: the unit the swap pass works on."""


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
                raise ConfigurationError(f"SwapCostModel.{name}: expected bytes per second > 0, got {value!r}")
        merged = {**DEFAULT_STEP_SECONDS, **dict(self.step_seconds)}
        for table_name, table in (("step_seconds", merged), ("stage_step_seconds", self.stage_step_seconds)):
            for key, value in table.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ConfigurationError(
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
    phase: SwapPhase = SwapPhase.ACTIVATIONS

    def __str__(self) -> str:
        window = "" if self.phase is SwapPhase.ACTIVATIONS else " dW state"
        return f"stage {self.stage} micro-batch {self.micro}{window}: {self.reason.value} ({self.detail})"


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
    phase: SwapPhase = SwapPhase.ACTIVATIONS

    @property
    def hides_alone(self) -> bool:
        return fits(self.d2h_s, self.offload_window_s) and fits(self.h2d_s, self.load_window_s)


def fits(copy_s: float, window_s: float) -> bool:
    """``copy_s <= window_s`` up to float rounding of summed durations."""
    return copy_s <= window_s * (1 + 1e-9) + 1e-12


WindowKey = tuple[int, int, SwapPhase]
"""``(stage, micro, phase)``: one swap window of one chunk."""


@dataclass(frozen=True)
class SwapCostReport:
    """The decision for one rank.

    ``peak_without`` is the rank's predicted peak (the residency model of
    :mod:`.residency`) with no window swapped; ``peak_with`` with exactly ``chosen``
    (activation windows) and ``chosen_weight`` (dW-state windows) swapped
    (``peak_with <= peak_without``). Every window of the order is either chosen or in
    ``rejected`` (with its phase), never both.
    """

    peak_without: int
    peak_with: int
    chosen: tuple[ChunkKey, ...]
    rejected: tuple[RejectedChunk, ...]
    windows: tuple[ChunkWindow, ...]
    chosen_weight: tuple[ChunkKey, ...] = ()

    @property
    def saved_bytes(self) -> int:
        return self.peak_without - self.peak_with


def _window_bytes(sizes: ChunkSizes, window: WindowKey) -> int:
    """Bytes a window moves: its chunk's footprint field named by the phase."""
    return getattr(sizes.footprint(window[:2]), window[2].value)  # type: ignore[arg-type]


def _as_windows(chosen: Iterable[ChunkKey | WindowKey]) -> list[WindowKey]:
    """Window keys; a bare ``(stage, micro)`` names the activation window."""
    return [(c[0], c[1], SwapPhase.ACTIVATIONS) if len(c) == 2 else c for c in chosen]  # type: ignore[misc]


def copy_stream_misses(
    order: Sequence[MetaStep],
    lives: Mapping[ChunkKey, ChunkLife],
    chosen: Iterable[ChunkKey | WindowKey],
    sizes: ChunkSizes,
    cost: SwapCostModel,
) -> list[ChunkKey | WindowKey]:
    """Windows among ``chosen`` whose offload or load is not done by its wait step when all
    of ``chosen`` share one in-order copy stream (empty: every copy hides). A bare
    ``(stage, micro)`` names the activation window and is reported the same way."""
    clock = _step_start_times(order, cost)
    copies: list[tuple[int, int, float, ChunkKey | WindowKey]] = []  # (launch, wait, seconds, as given)
    for given, window in zip(list(chosen), _as_windows(list(chosen))):
        life = lives[window[:2]]  # type: ignore[index]
        launch_offload, wait_offload, launch_load, wait_load = life.swap_positions(window[2])
        size = _window_bytes(sizes, window)
        copies.append((launch_offload, wait_offload, size / cost.d2h_bytes_per_s, given))
        copies.append((launch_load, wait_load, size / cost.h2d_bytes_per_s, given))
    stream_free = 0.0
    missed: list[ChunkKey | WindowKey] = []
    for launch, wait, seconds, key in sorted(copies, key=lambda c: c[:3]):
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
    order: Sequence[MetaStep], sizes: ChunkSizes, cost: SwapCostModel, phase: SwapPhase = SwapPhase.ACTIVATIONS
) -> dict[ChunkKey, ChunkWindow]:
    """Copy budget of every chunk whose ``phase`` window has its four swap steps in ``order``."""
    clock = _step_start_times(order, cost)
    windows = {}
    for key, life in chunk_lives(order).items():
        if not life.has_swap_steps(phase):
            continue
        launch_offload, wait_offload, launch_load, wait_load = life.swap_positions(phase)
        size = _window_bytes(sizes, (*key, phase))
        windows[key] = ChunkWindow(
            stage=key[0],
            micro=key[1],
            bytes=size,
            offload_window_s=clock[wait_offload] - clock[launch_offload],
            load_window_s=clock[wait_load] - clock[launch_load],
            d2h_s=size / cost.d2h_bytes_per_s,
            h2d_s=size / cost.h2d_bytes_per_s,
            phase=phase,
        )
    return windows


def choose_swaps(
    swapped_order: Sequence[MetaStep],
    *,
    sizes: ChunkSizes,
    cost: SwapCostModel,
    target_peak_bytes: int | None = None,
    ineligible_detail: Mapping[ChunkKey, str] | None = None,
    releases: SendReleases | None = None,
) -> SwapCostReport:
    """Decide which candidate windows of one rank to swap (see the module docstring).

    ``swapped_order`` is the rank's order with the four swap steps of every *candidate*
    window (e.g. ``inject_swap_steps(order)``); chunks without activation swap steps are
    rejected as ``NOT_ELIGIBLE`` (``ineligible_detail`` may say why, e.g. their gap), and
    so are dW windows without DW_* steps. The greedy stops early once the peak is
    ``<= target_peak_bytes``. ``releases``: the rank's send release points
    (:func:`.execution.send_releases`), which the executor applies by default.
    """
    if target_peak_bytes is not None:
        check_bytes("choose_swaps: target_peak_bytes", target_peak_bytes)
    lives = chunk_lives(swapped_order)
    weight_pairs = {w.key for w in find_weight_windows(swapped_order)}
    rejected: dict[WindowKey, RejectedChunk] = {}
    windows: dict[WindowKey, ChunkWindow] = {}
    for phase in SwapPhase:
        for key, window in chunk_windows(swapped_order, sizes, cost, phase).items():
            windows[(*key, phase)] = window
    for key in lives:
        for phase, exists in ((SwapPhase.ACTIVATIONS, True), (SwapPhase.WEIGHT_STATE, key in weight_pairs)):
            window_key = (*key, phase)
            if not exists:
                continue
            if window_key not in windows:
                detail = (ineligible_detail or {}).get(key, "") if phase is SwapPhase.ACTIVATIONS else ""
                rejected[window_key] = RejectedChunk(
                    *key, RejectReason.NOT_ELIGIBLE, detail or "no swap steps in the order (gap below the minimum)",
                    phase,
                )
            else:
                verdict = _alone_verdict(windows[window_key])
                if verdict is not None:
                    rejected[window_key] = verdict
    candidates = [k for k in windows if k not in rejected]
    base = step_curve(swapped_order, sizes, swapped=(), weight_swapped=(), releases=releases)
    chosen = _greedy_on_peak(swapped_order, lives, base, candidates, sizes, cost, target_peak_bytes, rejected)
    chosen = _drop_unneeded(lives, base, chosen, sizes)
    final_peak = _peak(base, lives, chosen, sizes)
    for key, verdict in list(rejected.items()):
        # A window refused for the copy stream while the greedy chased a plateau may not
        # matter for the final peak at all; then that is the more useful reason to report.
        if verdict.reason is RejectReason.COPY_STREAM_BUSY and _peak(base, lives, [*chosen, key], sizes) >= final_peak:
            del rejected[key]
    met = target_peak_bytes is not None and final_peak <= target_peak_bytes
    for key in candidates:
        if key not in chosen and key not in rejected:
            reason = RejectReason.TARGET_MET if met else RejectReason.NOT_AT_PEAK
            detail = (
                f"peak already <= target {target_peak_bytes} bytes"
                if met
                else "off the device only where the rank is below its peak; swapping it would not lower the peak"
            )
            rejected[key] = RejectedChunk(key[0], key[1], reason, detail, key[2])
    return SwapCostReport(
        peak_without=max(base, default=0),
        peak_with=final_peak,
        chosen=tuple(sorted(k[:2] for k in chosen if k[2] is SwapPhase.ACTIVATIONS)),  # type: ignore[misc]
        rejected=tuple(rejected[k] for k in sorted(rejected)),
        windows=tuple(windows[k] for k in sorted(windows)),
        chosen_weight=tuple(sorted(k[:2] for k in chosen if k[2] is SwapPhase.WEIGHT_STATE)),  # type: ignore[misc]
    )


def plan_swaps(
    order: Sequence[MetaStep],
    *,
    sizes: ChunkSizes,
    cost: SwapCostModel,
    min_gap: int = MIN_SWAP_GAP,
    target_peak_bytes: int | None = None,
    weight_swap: bool = True,
    releases: SendReleases | None = None,
) -> SwapCostReport:
    """Cost-aware choice for one rank's order *before* the swap pass.

    The gap rule names the candidates (``inject_swap_steps(order, min_gap=min_gap)`` gives
    their anchors); :func:`choose_swaps` picks among them. Apply the result with
    ``inject_swap_steps(order, min_gap=min_gap, only=report.chosen,
    weight_only=report.chosen_weight)``.
    """
    chunks = find_swap_chunks(order, min_gap=min_gap)
    detail = {c.key: f"gap {c.gap} < min gap {min_gap}" for c in chunks if not c.eligible}
    return choose_swaps(
        inject_swap_steps(order, min_gap=min_gap, weight_swap=weight_swap),
        sizes=sizes,
        cost=cost,
        target_peak_bytes=target_peak_bytes,
        ineligible_detail=detail,
        releases=releases,
    )


def plan_rank_swaps(
    orders: Mapping[int, Sequence[MetaStep]],
    *,
    sizes: ChunkSizes,
    cost: SwapCostModel,
    min_gap: int = MIN_SWAP_GAP,
    target_peak_bytes: int | None = None,
    weight_swap: bool = True,
    release_sends: bool = True,
) -> dict[int, SwapCostReport]:
    """:func:`plan_swaps` for every rank; ``{rank: report}``. ``orders`` are every rank's
    orders of one pipeline; ``release_sends`` prices each rank's sends as the executor
    waits them by default (once proven received, :func:`.execution.send_releases`)."""
    releases = send_releases(orders) if release_sends else {}
    return {
        rank: plan_swaps(
            order, sizes=sizes, cost=cost, min_gap=min_gap, target_peak_bytes=target_peak_bytes,
            weight_swap=weight_swap, releases=releases.get(rank),
        )
        for rank, order in orders.items()
    }


def _alone_verdict(window: ChunkWindow) -> RejectedChunk | None:
    key = (window.stage, window.micro)
    if window.bytes == 0:
        return RejectedChunk(*key, RejectReason.NO_ACTIVATIONS, "0 bytes to move", window.phase)
    if not fits(window.d2h_s, window.offload_window_s):
        return RejectedChunk(
            *key,
            RejectReason.OFFLOAD_WINDOW_TOO_SHORT,
            f"D2H of {window.bytes} bytes takes {window.d2h_s * 1e3:.3g} ms, the offload window "
            f"covers {window.offload_window_s * 1e3:.3g} ms of compute",
            window.phase,
        )
    if not fits(window.h2d_s, window.load_window_s):
        return RejectedChunk(
            *key,
            RejectReason.LOAD_WINDOW_TOO_SHORT,
            f"H2D of {window.bytes} bytes takes {window.h2d_s * 1e3:.3g} ms, the load window "
            f"covers {window.load_window_s * 1e3:.3g} ms of compute",
            window.phase,
        )
    return None


def _curve_with(
    base: Sequence[int], lives: Mapping[ChunkKey, ChunkLife], chosen: Iterable[WindowKey], sizes: ChunkSizes
) -> list[int]:
    """``base`` with each chosen window's bytes removed over its away span (the curve is
    additive over chunks, see :mod:`.residency`)."""
    curve = list(base)
    for window in chosen:
        size = _window_bytes(sizes, window)
        for position in lives[window[:2]].away_span(window[2]):  # type: ignore[index]
            curve[position] -= size
    return curve


def _peak(
    base: Sequence[int], lives: Mapping[ChunkKey, ChunkLife], chosen: Iterable[WindowKey], sizes: ChunkSizes
) -> int:
    return max(_curve_with(base, lives, chosen, sizes), default=0)


def _greedy_on_peak(
    order: Sequence[MetaStep],
    lives: Mapping[ChunkKey, ChunkLife],
    base: Sequence[int],
    candidates: Sequence[WindowKey],
    sizes: ChunkSizes,
    cost: SwapCostModel,
    target: int | None,
    rejected: dict[WindowKey, RejectedChunk],
) -> list[WindowKey]:
    """Add windows while one lowers ``(peak, number of peak positions)``; see the module docstring."""
    chosen: list[WindowKey] = []
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
            away, size = lives[key[:2]].away_span(key[2]), _window_bytes(sizes, key)  # type: ignore[index]
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
                    key[0], key[1],
                    RejectReason.COPY_STREAM_BUSY,
                    "its copies hide alone but not behind the copies of the windows chosen "
                    "before it on the shared copy stream",
                    key[2],
                )
                continue
            picked = key
            break
        if picked is None:
            return chosen
        chosen.append(picked)


def _drop_unneeded(
    lives: Mapping[ChunkKey, ChunkLife], base: Sequence[int], chosen: Sequence[WindowKey], sizes: ChunkSizes
) -> list[WindowKey]:
    """Remove, latest choice first, windows whose removal keeps the peak where it is.

    Removing a window never makes the remaining copies slower, so the rest stays hideable.
    """
    kept = list(chosen)
    peak = _peak(base, lives, kept, sizes)
    for key in reversed(chosen):
        trial = [k for k in kept if k != key]
        if _peak(base, lives, trial, sizes) <= peak:
            kept = trial
    return kept
