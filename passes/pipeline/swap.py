"""Swap pass: offload a chunk's activations to host inside its forward→backward window.

A *chunk* is one ``(stage, micro)`` whose forward and first backward consumer both run on
this rank. Analysis and rewriting are separate: :func:`find_swap_chunks` measures each
chunk's window, :func:`swap_anchors` places the four steps of the chosen chunks, and
:func:`apply_swap_anchors` inserts them, changing nothing else. :func:`inject_swap_steps`
runs the three.

Leaves and slots. Compute leaves are FWD, BWD, BWD_INPUT and BWD_WEIGHT. Each top-level
compute step is one *slot* — an OVERLAP composite counts once, so two concurrent leaves are
never counted as two hiding windows. ``compute_index`` numbers the slots 0, 1, 2, ...

Pairing. A chunk pairs its FWD with its BWD, or with its BWD_INPUT under dx/dw split;
BWD_WEIGHT is never a consumer of the activation window (it reuses what BWD_INPUT kept).

The dW window (phase WEIGHT_STATE, :func:`find_weight_windows`). Under dx/dw split what
BWD_WEIGHT reads — the saved activations its weight gradients need, kept alive by the
retained autograd graph, and the gradients BWD_INPUT left at the weight-path
intermediates — stays on the device from BWD_INPUT to BWD_WEIGHT. Zero-bubble schedules
delay W on purpose, so that gap is long. It is swapped by four more steps, DW_LAUNCH_OFFLOAD,
DW_WAIT_OFFLOAD, DW_LAUNCH_LOAD and DW_WAIT_LOAD, placed by exactly the rules below with
BWD_INPUT in the forward's role and BWD_WEIGHT in the backward's (same ``min_gap``, same
cover points, same FSDP lookahead). A chunk may have both windows swapped: its
activations come back for BWD_INPUT and what BWD_INPUT left goes out again after it.
``gap = backward.compute_index - forward.compute_index``; the chunk is eligible when
``gap >= min_gap`` (default 4: at gap 1 no load window exists, at 2 the freed memory is
claimed back at once, at 3 one edge window rarely hides the copies). ``min_gap`` below 2 is
rejected: the anchors need one compute slot between the forward and the backward.

Anchors (``f`` / ``b``: top-level positions of the forward / backward slots; all four steps
sit between top-level steps, so none ever enters a ``BATCH_SEND_RECV``)::

    SWAP_LAUNCH_OFFLOAD  right after slot f (so before the FSDP_RESHARD that follows it)
    SWAP_WAIT_OFFLOAD    after the first slot following f and the comm block after it,
                         i.e. right before the second slot following f
    SWAP_LAUNCH_LOAD     the last cover point before b, never before SWAP_WAIT_OFFLOAD:
                         - no FSDP on the stage: right before the slot preceding b, so that
                           slot's compute hides the H2D;
                         - FSDP with a lookahead FSDP_UNSHARD of the stage after
                           SWAP_WAIT_OFFLOAD and no compute of the stage between it and b:
                           right before that UNSHARD, giving
                           LAUNCH_LOAD → UNSHARD → WAIT_LOAD → BWD;
                         - FSDP but the stage stays unsharded (no such UNSHARD): with
                           ``unsharded_load="cover"`` (default) the same cover point as
                           without FSDP; with ``"delay"`` (the design document's rule) at
                           the start of the comm block before b, where no compute hides
                           the H2D (one stage per rank: every load exposed, measured in
                           benchmarks/pp_swap.py and docs/architecture.md);
    SWAP_WAIT_LOAD       right before slot b (after its receives).

Several swap steps at one place are ordered LAUNCH_OFFLOAD, WAIT_OFFLOAD, LAUNCH_LOAD,
WAIT_LOAD, then by the chunk's forward position.

Example (GPipe, rank 0 of 1, 5 micro-batches, min_gap 4; the comm-free order)::

    0F0 0SWAP_LAUNCH_OFFLOAD0 0F1 0SWAP_LAUNCH_OFFLOAD1 0SWAP_WAIT_OFFLOAD0 0F2 ...
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple

from hyper_offload.errors import ConfigurationError

from .meta_step import SWAP_SEQUENCES, MetaStep, StepKind, SwapPhase

#: Default threshold: a chunk is swapped only if its window spans at least this many slots.
MIN_SWAP_GAP = 4
#: Where SWAP_LAUNCH_LOAD goes when the chunk's stage stays unsharded under FSDP.
UNSHARDED_LOAD_PLACEMENTS = ("cover", "delay")
_CONSUMER_KINDS = (StepKind.BWD, StepKind.BWD_INPUT)
_PAIR_NAMES = {"only": "forward + backward", "weight_only": "BWD_INPUT + BWD_WEIGHT"}


class SwapChunk(NamedTuple):
    """One (stage, micro) chunk's swap window on this rank.

    ``phase`` ACTIVATIONS: the window runs from the FWD to the first backward consumer;
    WEIGHT_STATE: from the BWD_INPUT to the BWD_WEIGHT (the "forward" / "backward" fields
    then name those two steps). ``forward_index`` / ``backward_index`` are compute-slot
    indices (composites count once); ``forward_step`` / ``backward_step`` are top-level
    positions in the analysed order. ``gap = backward_index - forward_index``;
    ``eligible`` is ``gap >= min_gap``.
    """

    stage: int
    micro: int
    forward_index: int
    backward_index: int
    gap: int
    eligible: bool
    forward_step: int
    backward_step: int
    phase: SwapPhase = SwapPhase.ACTIVATIONS

    @property
    def key(self) -> tuple[int, int]:
        return (self.stage, self.micro)


def find_swap_chunks(order: Sequence[MetaStep], *, min_gap: int = MIN_SWAP_GAP) -> list[SwapChunk]:
    """Analyse ``order``: every chunk with a forward and a backward consumer, by forward position.

    Swap steps already in ``order`` are ignored (they are not compute).
    """
    return _windows(order, (StepKind.FWD,), _CONSUMER_KINDS, SwapPhase.ACTIVATIONS, min_gap)


def find_weight_windows(order: Sequence[MetaStep], *, min_gap: int = MIN_SWAP_GAP) -> list[SwapChunk]:
    """Analyse ``order``: every chunk with a BWD_INPUT and a later BWD_WEIGHT on this rank
    (phase WEIGHT_STATE), by BWD_INPUT position. Swap steps in ``order`` are ignored."""
    return _windows(order, (StepKind.BWD_INPUT,), (StepKind.BWD_WEIGHT,), SwapPhase.WEIGHT_STATE, min_gap)


def _windows(
    order: Sequence[MetaStep],
    opens: tuple[StepKind, ...],
    closes: tuple[StepKind, ...],
    phase: SwapPhase,
    min_gap: int,
) -> list[SwapChunk]:
    """Each chunk's first ``opens`` leaf and its first ``closes`` leaf, counted in compute
    slots, as windows sorted by where they open. A dW window closes only after it opened
    (a BWD_WEIGHT pairs with the BWD_INPUT before it); a second FWD of a chunk is refused."""
    _check_min_gap(min_gap)
    opened: dict[tuple[int, int], tuple[int, int]] = {}  # chunk -> (slot, position)
    closed: dict[tuple[int, int], tuple[int, int]] = {}
    slot = -1
    for pos, step in enumerate(order):
        if not step.is_compute_slot:
            continue
        slot += 1
        for leaf in step.leaves():
            key = leaf.chunk
            if key is None:
                continue
            if leaf.kind in opens:
                if leaf.kind is StepKind.FWD and key in opened:
                    raise ConfigurationError(f"step {pos} ({step!r}): second FWD for stage {key[0]} micro {key[1]}")
                opened.setdefault(key, (slot, pos))
            elif leaf.kind in closes and key not in closed:
                if phase is SwapPhase.ACTIVATIONS or key in opened:
                    closed[key] = (slot, pos)
    windows = []
    for key, (open_slot, open_pos) in opened.items():
        if key not in closed:
            continue  # e.g. forward-only on this rank: nothing consumes the activations here
        close_slot, close_pos = closed[key]
        gap = close_slot - open_slot
        windows.append(
            SwapChunk(key[0], key[1], open_slot, close_slot, gap, gap >= min_gap, open_pos, close_pos, phase)
        )
    return sorted(windows, key=lambda c: c.forward_step)


class SwapAnchor(NamedTuple):
    """Insert ``step`` right before top-level position ``position`` of the analysed order
    (``position == len(order)`` appends)."""

    position: int
    step: MetaStep


def swap_anchors(
    order: Sequence[MetaStep], chunks: Iterable[SwapChunk], *, unsharded_load: str = "cover"
) -> list[SwapAnchor]:
    """Analysis: where the four swap steps of each chunk go (rules in the module docstring).

    ``chunks`` come from :func:`find_swap_chunks` on the same ``order`` and need
    ``gap >= 2``. The result is sorted in insertion order: by position, then
    LAUNCH_OFFLOAD, WAIT_OFFLOAD, LAUNCH_LOAD, WAIT_LOAD, then by forward position.
    """
    slot_positions = [i for i, step in enumerate(order) if step.is_compute_slot]
    fsdp_stages = {s.stage for s in order if s.is_fsdp}
    keyed: list[tuple[int, int, int, SwapAnchor]] = []
    for chunk in chunks:
        if chunk.gap < 2:
            raise ConfigurationError(f"chunk {chunk.key}: gap {chunk.gap} leaves no slot for SWAP_WAIT_OFFLOAD")
        wait_offload = slot_positions[chunk.forward_index + 2]
        positions = (
            chunk.forward_step + 1,
            wait_offload,
            _launch_load_position(order, chunk, slot_positions, wait_offload, fsdp_stages, unsharded_load),
            chunk.backward_step,
        )
        for kind_order, (kind, position) in enumerate(zip(SWAP_SEQUENCES[chunk.phase], positions)):
            anchor = SwapAnchor(position, MetaStep(kind, chunk.stage, chunk.micro))
            keyed.append((position, kind_order, chunk.forward_step, anchor))
    return [anchor for *_, anchor in sorted(keyed, key=lambda t: t[:3])]


def apply_swap_anchors(order: Sequence[MetaStep], anchors: Sequence[SwapAnchor]) -> list[MetaStep]:
    """Rewrite: ``order`` with each anchor's step inserted; anchors at one position keep
    their given order."""
    by_position: dict[int, list[MetaStep]] = {}
    for anchor in anchors:
        if not 0 <= anchor.position <= len(order):
            raise ConfigurationError(f"anchor {anchor}: position outside 0..{len(order)}")
        by_position.setdefault(anchor.position, []).append(anchor.step)
    out: list[MetaStep] = []
    for pos in range(len(order) + 1):
        out.extend(by_position.get(pos, ()))
        if pos < len(order):
            out.append(order[pos])
    return out


def inject_swap_steps(
    order: Sequence[MetaStep],
    *,
    min_gap: int = MIN_SWAP_GAP,
    only: Collection[tuple[int, int]] | None = None,
    unsharded_load: str = "cover",
    weight_swap: bool = True,
    weight_only: Collection[tuple[int, int]] | None = None,
) -> list[MetaStep]:
    """Insert the four swap steps for each eligible chunk (or each chunk of ``only``), and
    the four DW_* steps for each eligible BWD_INPUT → BWD_WEIGHT window (or each chunk of
    ``weight_only``; none with ``weight_swap=False``).

    ``unsharded_load`` places the load of a chunk whose stage stays unsharded under FSDP
    (see the module docstring): ``"cover"`` or ``"delay"``.

    ``only`` / ``weight_only`` restrict injection to a subset of the eligible
    ``(stage, micro)`` windows (a cost model's choice); naming a chunk that is unknown or
    ineligible raises ConfigurationError. Removing the swap steps from the result gives back
    ``order`` exactly.
    """
    for pos, step in enumerate(order):
        if step.is_swap:
            raise ConfigurationError(
                f"step {pos} ({step!r}): order already holds swap steps; "
                "inject_swap_steps runs once, as the last pass"
            )
    if unsharded_load not in UNSHARDED_LOAD_PLACEMENTS:
        raise ConfigurationError(
            f"unsharded_load must be one of {', '.join(UNSHARDED_LOAD_PLACEMENTS)}, got {unsharded_load!r}"
        )
    chosen = _choose(find_swap_chunks(order, min_gap=min_gap), only, min_gap, "only")
    if weight_swap:
        chosen += _choose(find_weight_windows(order, min_gap=min_gap), weight_only, min_gap, "weight_only")
    elif weight_only:
        raise ConfigurationError("weight_only names dW windows to swap, but weight_swap=False swaps none")
    return apply_swap_anchors(order, swap_anchors(order, chosen, unsharded_load=unsharded_load))


def strip_swap_steps(order: Sequence[MetaStep]) -> list[MetaStep]:
    """``order`` without its swap steps: the inverse of :func:`inject_swap_steps`."""
    return [step for step in order if not step.is_swap]


def _launch_load_position(
    order: Sequence[MetaStep],
    chunk: SwapChunk,
    slot_positions: list[int],
    wait_offload: int,
    fsdp_stages: set[int | None],
    unsharded_load: str,
) -> int:
    cover = max(slot_positions[chunk.backward_index - 1], wait_offload)
    if chunk.stage not in fsdp_stages:
        return cover
    lookahead = lookahead_unshard_position(order, chunk.stage, chunk.backward_step, wait_offload)
    if lookahead is not None:
        return lookahead
    if unsharded_load == "cover":
        return cover  # the stage stays unsharded: hide the load like a stage without FSDP
    # "delay": start the load at the comm block right before the backward (not hidden).
    return max(slot_positions[chunk.backward_index - 1] + 1, wait_offload)


def lookahead_unshard_position(
    order: Sequence[MetaStep], stage: int, backward_step: int, start: int
) -> int | None:
    """Position of the FSDP_UNSHARD of ``stage`` that serves the backward at ``backward_step``.

    It is the last UNSHARD of the stage in ``[start, backward_step)`` with no compute of the
    stage between it and the backward; ``None`` when the stage stays unsharded instead.
    """
    for pos in range(backward_step - 1, start - 1, -1):
        step = order[pos]
        if step.kind is StepKind.FSDP_UNSHARD and step.stage == stage:
            return pos
        if step.is_compute_slot and any(leaf.stage == stage for leaf in step.leaves()):
            return None
    return None


def _choose(
    chunks: list[SwapChunk], only: Collection[tuple[int, int]] | None, min_gap: int, name: str
) -> list[SwapChunk]:
    if only is None:
        return [c for c in chunks if c.eligible]
    by_key = {c.key: c for c in chunks}
    wanted = {tuple(k) for k in only}
    for key in sorted(wanted):
        chunk = by_key.get(key)  # type: ignore[arg-type]
        if chunk is None:
            raise ConfigurationError(
                f"{name}: chunk (stage {key[0]}, micro {key[1]}) has no {_PAIR_NAMES[name]} pair on this "
                f"rank; known chunks: {sorted(by_key)}"
            )
        if not chunk.eligible:
            raise ConfigurationError(
                f"{name}: chunk (stage {key[0]}, micro {key[1]}) has gap {chunk.gap} < min_gap {min_gap}; "
                "only eligible chunks can be swapped"
            )
    return [c for c in chunks if c.key in wanted]


def _check_min_gap(min_gap: int) -> None:
    if min_gap < 2:
        raise ConfigurationError(
            f"min_gap must be >= 2, got {min_gap}: at gap 1 the backward follows its forward "
            "directly and no slot is left to hold SWAP_WAIT_OFFLOAD"
        )
