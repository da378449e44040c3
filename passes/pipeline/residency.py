"""Residency model of one rank's order: the device bytes every step keeps alive.

The swap pass and its cost model judge an order by this one model; the executor's
measured peak is what it predicts (``benchmarks/pp_swap.py`` compares the two per rank).

A chunk ``(stage, micro)`` holds, on the device, a level of bytes that changes only at its
own steps (:class:`StageFootprint` names the levels, the same for every micro-batch of a
stage)::

    FWD          -> forward_bytes     its saved activations, output, loss
    BWD          -> tail_bytes        what outlives the backward until the step ends
    BWD_INPUT    -> weight_bytes      the dW state (retained saved activations, the
                                      gradients at the weight-path intermediates) and
                                      the input gradient it sends
    BWD_WEIGHT   -> weight_tail_bytes (what outlives BWD_INPUT + BWD_WEIGHT; more than
                                      tail_bytes when W leaves nodes unvisited)
    (first BWD / BWD_WEIGHT of the stage: + grad_bytes, the parameter gradients)
    SWAP_WAIT_OFFLOAD / SWAP_LAUNCH_LOAD   -activations / +activations
    DW_WAIT_OFFLOAD   / DW_LAUNCH_LOAD     -weight_state / +weight_state
    with group_swap the packed bytes move as one staging buffer that takes the members'
    place: the same levels, plus a transient of the packed bytes while LAUNCH_OFFLOAD packs
    and WAIT_LOAD unpacks (packed_activations, packed_weight_state)

The levels count a chunk's sent tensors as if every send were waited at the end of the
step: its output (``sent_output``, alive from FWD) and its input gradient (``sent_grad``,
alive from BWD / BWD_INPUT) are part of what the chunk keeps until then. With ``releases``
(:func:`~.execution.send_releases`, the executor's default) a send is waited, and its
tensor dropped, right after the receive that proves its peer has it: the input gradient
leaves the level there; the output leaves it there too if the chunk's backward (BWD, or
BWD_WEIGHT under dx/dw split, which is when torch's stage drops its own reference) ran
already, else at that backward.

The rank's level is the sum over its chunks. Each top-level step ``p`` gets one value,
``curve[p]``:

* a compute step: the level before it plus the most the step adds while it runs,
  ``max(working, delta, 0)`` per leaf (an OVERLAP composite runs its leaves one after the
  other), where ``working`` is the transient of that kind of leaf above the level it
  started from (:attr:`StageFootprint.working`) — so a backward still counts the chunk it
  frees;
* any other step: the level after it (a WAIT_OFFLOAD no longer counts what it freed, a
  LAUNCH_LOAD counts what it allocated), plus a group_swap pack / unpack transient.

Invariants: the curve is additive over chunks (a chunk's contribution at every step is
independent of the others), so moving one chunk's bytes off the device over a span of
steps lowers the curve by exactly those bytes there; with every ``working`` 0 and every
level but ``activations`` 0 it is the activation-only curve of the original swap pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from hyper_offload.errors import ConfigurationError

from .execution import SendReleases
from .meta_step import (
    COMPUTE_KINDS,
    MetaStep,
    RECV_KINDS,
    SWAP_INDEX_OF,
    SWAP_PHASE_OF,
    StepKind,
    SwapPhase,
)


ChunkKey = tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class StageFootprint:
    """Device bytes one micro-batch of a stage keeps alive, phase by phase (see the module
    docstring). Every field is a byte count ``>= 0``; ``activations <= forward_bytes`` and
    ``weight_state <= weight_bytes`` (the swappable parts)."""

    activations: int = 0
    """Bytes of the swap group: what SWAP_WAIT_OFFLOAD frees and SWAP_LAUNCH_LOAD restores."""
    forward_resident: int = 0
    """Other bytes the FWD leaves alive until the consumer (its output, the loss, saved
    tensors no wrapper selected)."""
    weight_state: int = 0
    """The part of the dW state that DW_WAIT_OFFLOAD frees and DW_LAUNCH_LOAD restores."""
    weight_resident: int = 0
    """Other bytes BWD_INPUT leaves alive until BWD_WEIGHT (its sent input gradient, ...)."""
    tail_bytes: int = 0
    """Bytes that outlive the chunk's full BWD until the end of the step, counting its sends
    as waited there (``sent_output``, ``sent_grad``)."""
    split_tail_bytes: int | None = None
    """Bytes that outlive BWD_INPUT + BWD_WEIGHT (``None``: ``tail_bytes``). They can
    differ: BWD_WEIGHT visits only the weight paths, so nodes a kept output still
    references keep their saved tensors."""
    packed_activations: int = 0
    """The part of ``activations`` moved as one packed buffer (``group_swap=True``): its
    staging buffer replaces the members from LAUNCH_OFFLOAD to WAIT_LOAD, and both exist
    while the pack and the unpack run."""
    packed_weight_state: int = 0
    """The same for ``weight_state``."""
    sent_output: int = 0
    """Bytes of the output its SEND_F sends: part of ``forward_resident``, ``weight_resident``
    and the tails until the send is released."""
    sent_grad: int = 0
    """Bytes of the input gradient its SEND_B sends: part of ``weight_resident`` and the tails
    until the send is released."""
    grad_bytes: int = 0
    """Parameter gradients the stage's first weight-gradient leaf (BWD, or BWD_WEIGHT under
    dx/dw split) allocates once per step, when they start from ``None`` (``zero_grad(
    set_to_none=True)``); later leaves accumulate in place."""
    working: Mapping[StepKind, int] = field(default_factory=dict)
    """Transient bytes above the starting level while a leaf of that compute kind runs."""

    def __post_init__(self) -> None:
        for name in _FOOTPRINT_FIELDS:
            check_bytes(f"StageFootprint.{name}", getattr(self, name))
        if self.split_tail_bytes is not None:
            check_bytes("StageFootprint.split_tail_bytes", self.split_tail_bytes)
        table = dict(self.working)
        for kind, value in table.items():
            if kind not in COMPUTE_KINDS:
                raise ConfigurationError(f"StageFootprint.working: {kind!r} is not a compute kind (F, B, I, W)")
            check_bytes(f"StageFootprint.working[{kind!r}]", value)
        object.__setattr__(self, "working", MappingProxyType(table))

    def __reduce__(self) -> tuple[object, ...]:
        # Picklable (ranks gather footprints) although ``working`` is a read-only proxy.
        fields = {f: getattr(self, f) for f in (*_FOOTPRINT_FIELDS, "split_tail_bytes")}
        return (_rebuild, (StageFootprint, {**fields, "working": dict(self.working)}))

    @property
    def forward_bytes(self) -> int:
        return self.activations + self.forward_resident

    @property
    def weight_bytes(self) -> int:
        return self.weight_state + self.weight_resident

    @property
    def weight_tail_bytes(self) -> int:
        return self.tail_bytes if self.split_tail_bytes is None else self.split_tail_bytes

    def delta(self, kind: StepKind) -> int:
        """How a leaf of ``kind`` changes this chunk's level (0 for non-compute kinds)."""
        if kind is StepKind.FWD:
            return self.forward_bytes
        if kind is StepKind.BWD:
            return self.tail_bytes - self.forward_bytes
        if kind is StepKind.BWD_INPUT:
            return self.weight_bytes - self.forward_bytes
        if kind is StepKind.BWD_WEIGHT:
            return self.weight_tail_bytes - self.weight_bytes
        return 0


_FOOTPRINT_FIELDS = (
    "activations", "forward_resident", "weight_state", "weight_resident", "tail_bytes",
    "packed_activations", "packed_weight_state", "sent_output", "sent_grad", "grad_bytes",
)


def _rebuild(cls: type, kwargs: dict[str, object]) -> object:
    return cls(**kwargs)


class ChunkSizes(Protocol):
    """Anything that gives each chunk its footprint (``ActivationSizes``, ``StageFootprints``)."""

    def footprint(self, chunk: ChunkKey) -> StageFootprint: ...


@dataclass(frozen=True, kw_only=True)
class StageFootprints:
    """Footprint of every stage: ``per_stage[stage]``, else ``default``."""

    per_stage: Mapping[int, StageFootprint] = field(default_factory=dict)
    default: StageFootprint = field(default_factory=StageFootprint)

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_stage", MappingProxyType(dict(self.per_stage)))

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (StageFootprints, {"per_stage": dict(self.per_stage), "default": self.default}))

    def footprint(self, chunk: ChunkKey) -> StageFootprint:
        return self.per_stage.get(chunk[0], self.default)


WEIGHT_GRAD_KINDS = (StepKind.BWD, StepKind.BWD_WEIGHT)
"""The leaves that allocate a stage's parameter gradients (its first one per step)."""
# How each swap step changes its window's level, by its place in the phase's sequence:
# WAIT_OFFLOAD frees the window's bytes, LAUNCH_LOAD allocates them again; LAUNCH_OFFLOAD
# (the pack) and WAIT_LOAD (the unpack) leave the level, but a packed window (group_swap)
# holds the pack beside the members while they run. The window's footprint fields are
# named by the phase: ``activations`` / ``packed_activations``, ``weight_state`` /
# ``packed_weight_state``.
_LEVEL_SIGN = {1: -1, 2: +1}


def step_curve(
    order: Sequence[MetaStep],
    sizes: ChunkSizes,
    *,
    swapped: Iterable[ChunkKey] | None = None,
    weight_swapped: Iterable[ChunkKey] | None = None,
    releases: SendReleases | None = None,
) -> list[int]:
    """``curve[p]`` of every top-level step (module docstring).

    ``swapped`` / ``weight_swapped``: the chunks whose activation / dW-state swap steps in
    ``order`` count; ``None`` counts every swap step present, ``()`` none (the order as if
    it were not swapped). ``releases``: this rank's send release points (``None``: every
    send is waited at the end of the step).
    """
    counted = {
        SwapPhase.ACTIVATIONS: None if swapped is None else set(swapped),
        SwapPhase.WEIGHT_STATE: None if weight_swapped is None else set(weight_swapped),
    }
    level = 0
    curve: list[int] = []
    graded: set[int] = set()  # stages whose parameter gradients exist already
    sends = _SendLevels(sizes, releases)
    for step in order:
        if step.is_compute_slot:
            peak = level
            for leaf in step.leaves():
                footprint = sizes.footprint(leaf.chunk)  # type: ignore[arg-type]
                delta, grads = footprint.delta(leaf.kind) + sends.at_compute(leaf), 0
                if leaf.kind in WEIGHT_GRAD_KINDS and leaf.stage not in graded:
                    graded.add(leaf.stage)  # type: ignore[arg-type]
                    grads = footprint.grad_bytes  # allocated while the chunk's bytes still live
                    delta += grads
                peak = max(peak, level + max(footprint.working.get(leaf.kind, 0) + grads, delta, 0))
                level += delta
            curve.append(peak)
            continue
        if step.is_p2p:
            level += sends.at_p2p(step)
            curve.append(level)
            continue
        transient = 0
        phase = SWAP_PHASE_OF.get(step.kind)
        chosen = counted[phase] if phase is not None else set()
        if phase is not None and (chosen is None or step.chunk in chosen):
            footprint = sizes.footprint(step.chunk)  # type: ignore[arg-type]
            sign = _LEVEL_SIGN.get(SWAP_INDEX_OF[step.kind])
            if sign is not None:
                level += sign * getattr(footprint, phase.value)
            else:
                transient = getattr(footprint, f"packed_{phase.value}")
        curve.append(level + transient)
    return curve


OUTPUT_FREEING_KINDS = (StepKind.BWD, StepKind.BWD_WEIGHT)
"""Where torch's stage drops its own reference to a chunk's output (``fwd_cache`` at BWD,
``backward_state`` at BWD_WEIGHT): a released send's output dies there."""


class _SendLevels:
    """How early send releases change the level (module docstring): one walk's state."""

    def __init__(self, sizes: ChunkSizes, releases: SendReleases | None) -> None:
        self.sizes = sizes
        self.releases = releases if releases is not None else {}
        self.released_outputs: set[ChunkKey] = set()  # SEND_F waited before the backward
        self.backward_done: set[ChunkKey] = set()

    def at_compute(self, leaf: MetaStep) -> int:
        """Correction to ``leaf``'s delta: its backward frees an output already released."""
        if not self.releases or leaf.kind not in OUTPUT_FREEING_KINDS:
            return 0
        chunk = leaf.chunk
        assert chunk is not None
        self.backward_done.add(chunk)
        return -self.sizes.footprint(chunk).sent_output if chunk in self.released_outputs else 0

    def at_p2p(self, step: MetaStep) -> int:
        """Level change of the sends ``step``'s receives prove received."""
        change = 0
        for leaf in step.leaves():
            if leaf.kind not in RECV_KINDS:
                continue
            proven = self.releases.get((leaf.kind, leaf.stage, leaf.micro), ())  # type: ignore[arg-type]
            for kind, stage, micro in proven:
                footprint = self.sizes.footprint((stage, micro))
                if kind is StepKind.SEND_B:
                    change -= footprint.sent_grad
                elif (stage, micro) in self.backward_done:
                    change -= footprint.sent_output
                else:
                    self.released_outputs.add((stage, micro))
        return change


def predicted_peak(
    order: Sequence[MetaStep],
    sizes: ChunkSizes,
    *,
    swapped: Iterable[ChunkKey] | None = None,
    weight_swapped: Iterable[ChunkKey] | None = None,
    releases: SendReleases | None = None,
) -> int:
    """The rank's predicted peak device bytes over one step: ``max(step_curve(...))``."""
    curve = step_curve(order, sizes, swapped=swapped, weight_swapped=weight_swapped, releases=releases)
    return max(curve, default=0)


def check_bytes(name: str, value: object) -> None:
    """Raise ConfigurationError, naming ``name``, unless ``value`` is a byte count (an int >= 0)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{name}: expected a byte count (int >= 0), got {value!r}")


__all__ = [
    "ActivationSizes",
    "ChunkLife",
    "ChunkSizes",
    "OUTPUT_FREEING_KINDS",
    "StageFootprint",
    "StageFootprints",
    "WEIGHT_GRAD_KINDS",
    "check_bytes",
    "chunk_lives",
    "peak_bytes",
    "predicted_peak",
    "resident_curve",
    "step_curve",
]


_CONSUMER_KINDS = (StepKind.BWD, StepKind.BWD_INPUT)


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
        check_bytes("ActivationSizes.default_bytes", self.default_bytes)
        for name in ("per_stage", "per_chunk"):
            table = dict(getattr(self, name))
            for key, value in table.items():
                check_bytes(f"ActivationSizes.{name}[{key!r}]", value)
            object.__setattr__(self, name, MappingProxyType(table))

    def bytes_of(self, chunk: ChunkKey) -> int:
        if chunk in self.per_chunk:
            return self.per_chunk[chunk]
        return self.per_stage.get(chunk[0], self.default_bytes)

    def footprint(self, chunk: ChunkKey) -> StageFootprint:
        """Activations only: every other level of the residency model is 0."""
        return StageFootprint(activations=self.bytes_of(chunk))


@dataclass(frozen=True)
class ChunkLife:
    """Top-level positions of one chunk's FWD, first consumer, BWD_WEIGHT and swap steps."""

    stage: int
    micro: int
    forward: int
    consumer: int | None
    swaps: Mapping[SwapPhase, tuple[int | None, ...]] = field(default_factory=dict)
    """Per phase: positions of its LAUNCH_OFFLOAD, WAIT_OFFLOAD, LAUNCH_LOAD, WAIT_LOAD."""

    @property
    def key(self) -> ChunkKey:
        return (self.stage, self.micro)

    def has_swap_steps(self, phase: SwapPhase = SwapPhase.ACTIVATIONS) -> bool:
        positions = self.swaps.get(phase)
        return positions is not None and None not in positions

    def swap_positions(self, phase: SwapPhase = SwapPhase.ACTIVATIONS) -> tuple[int, int, int, int]:
        """Positions of the phase's LAUNCH_OFFLOAD, WAIT_OFFLOAD, LAUNCH_LOAD, WAIT_LOAD."""
        if not self.has_swap_steps(phase):
            raise ConfigurationError(
                f"stage {self.stage} micro-batch {self.micro} is treated as swapped ({phase.value}) but "
                "the order lacks some of its four swap steps; inject them first (inject_swap_steps)"
            )
        return self.swaps[phase]  # type: ignore[return-value]

    def away_span(self, phase: SwapPhase = SwapPhase.ACTIVATIONS) -> range:
        """Positions at which the window's bytes are off the device (empty without swap steps)."""
        if not self.has_swap_steps(phase):
            return range(0)
        _, wait_offload, launch_load, _ = self.swap_positions(phase)
        return range(wait_offload, launch_load)


def chunk_lives(order: Sequence[MetaStep]) -> dict[ChunkKey, ChunkLife]:
    """Where each chunk's FWD, first consumer and swap steps sit (top-level positions)."""
    forward: dict[ChunkKey, int] = {}
    consumer: dict[ChunkKey, int] = {}
    swaps: dict[ChunkKey, dict[SwapPhase, list[int | None]]] = {}
    for position, step in enumerate(order):
        for leaf in step.leaves():
            key = leaf.chunk
            if key is None:
                continue
            if leaf.kind is StepKind.FWD:
                forward.setdefault(key, position)
            elif leaf.kind in _CONSUMER_KINDS:
                consumer.setdefault(key, position)
            elif leaf.kind in SWAP_PHASE_OF:
                slots = swaps.setdefault(key, {}).setdefault(SWAP_PHASE_OF[leaf.kind], [None] * 4)
                index = SWAP_INDEX_OF[leaf.kind]
                if slots[index] is None:
                    slots[index] = position
    return {
        key: ChunkLife(
            key[0], key[1], forward[key], consumer.get(key),
            {phase: tuple(p) for phase, p in swaps.get(key, {}).items()},
        )
        for key in sorted(forward)
    }


def resident_curve(
    order: Sequence[MetaStep],
    sizes: ChunkSizes,
    swapped: Iterable[ChunkKey] | None = None,
    weight_swapped: Iterable[ChunkKey] | None = None,
    releases: SendReleases | None = None,
) -> list[int]:
    """The residency model's curve of ``order`` (:func:`.residency.step_curve`), after
    checking that every window counted as swapped has its four steps in ``order``.

    ``swapped`` / ``weight_swapped`` list the chunks whose activation / dW-state window
    counts as swapped; ``None`` means every window that has its swap steps. ``releases``:
    the rank's send release points (``None``: sends waited at the end of the step).
    """
    lives = chunk_lives(order)
    for name, chosen, phase in (
        ("swapped", swapped, SwapPhase.ACTIVATIONS), ("weight_swapped", weight_swapped, SwapPhase.WEIGHT_STATE)
    ):
        if chosen is None:
            continue
        unknown = sorted(set(chosen) - set(lives))
        if unknown:
            raise ConfigurationError(
                f"resident_curve: {name} chunks {unknown} have no FWD in the order; known: {sorted(lives)}"
            )
        for key in chosen:
            lives[key].swap_positions(phase)  # raises, naming the chunk, if a swap step is missing
    return step_curve(order, sizes, swapped=swapped, weight_swapped=weight_swapped, releases=releases)


def peak_bytes(
    order: Sequence[MetaStep],
    sizes: ChunkSizes,
    swapped: Iterable[ChunkKey] | None = None,
    weight_swapped: Iterable[ChunkKey] | None = None,
    releases: SendReleases | None = None,
) -> int:
    return max(resident_curve(order, sizes, swapped, weight_swapped, releases), default=0)
