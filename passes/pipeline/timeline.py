"""A global logical timeline of rank-local pipeline orders, for pictures and reports.

Each rank executes its order top to bottom; compute waits for data from other ranks. This
module places every rank's compute slots on one shared axis of *logical* slots (one compute
slot = one unit; the axis is not wall-clock), so pipeline bubbles appear, and turns each
chunk's swap steps into copy windows on the same axis — the picture of the design
document's section 6.8.

Model (earliest-start list schedule, deterministic):

* a rank keeps a clock; a compute slot (a compute leaf or an ``OVERLAP_*`` composite, which
  counts once) starts at ``max(clock, ready time of every input)`` and ends one unit later;
* inputs: ``FWD(s, m)`` needs ``FWD(s-1, m)``; ``BWD`` / ``BWD_INPUT`` of ``(s, m)`` need
  ``FWD(s, m)`` and the input gradient from ``BWD`` / ``BWD_INPUT`` of ``(s+1, m)`` (not
  for the last stage); ``BWD_WEIGHT(s, m)`` needs ``BWD_INPUT(s, m)``;
* a ``RECV_F`` / ``RECV_B`` (leaf or inside a ``BATCH_SEND_RECV``) blocks the rank's clock
  until its producer has finished — the stage index of a RECV is the receiving stage;
* every other step (send, FSDP, swap) takes no time and happens at the rank's clock.

A copy window runs from the time of the chunk's ``SWAP_LAUNCH_*`` step to the time of its
``SWAP_WAIT_*`` step (``DW_LAUNCH_*`` to ``DW_WAIT_*`` for the dW state of a dx/dw split
order: the "dW offload" / "dW load" windows). Offload and load are separate windows; on one copy stream they do not
run at the same time, the picture only draws them in separate lanes for readability.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from hyper_offload.errors import TimelineError

from .meta_step import MetaStep, StepKind

#: One-letter names of compute kinds, as torch.distributed.pipelining writes them.
COMPUTE_LETTER = {
    StepKind.FWD: "F",
    StepKind.BWD: "B",
    StepKind.BWD_INPUT: "I",
    StepKind.BWD_WEIGHT: "W",
}


class WindowKind(str, Enum):
    """Direction of a copy window."""

    OFFLOAD = "offload"
    LOAD = "load"
    WEIGHT_OFFLOAD = "dW offload"
    WEIGHT_LOAD = "dW load"

    def __repr__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ComputeSlot:
    """One compute slot of ``rank``: ``step`` (a compute leaf or an OVERLAP composite) runs
    in ``[start, start + 1)``; ``position`` is its index in the rank's order."""

    rank: int
    start: int
    position: int
    step: MetaStep

    @property
    def end(self) -> int:
        return self.start + 1

    @property
    def leaves(self) -> tuple[MetaStep, ...]:
        return tuple(self.step.leaves())

    @property
    def label(self) -> str:
        """``F3`` for a leaf, ``B1+F3`` for a composite; the stage is not part of the label."""
        return "+".join(f"{COMPUTE_LETTER[leaf.kind]}{leaf.micro}" for leaf in self.leaves)


@dataclass(frozen=True)
class SwapWindow:
    """A copy window of chunk ``(stage, micro)`` on ``rank``: from its launch step's time
    ``start`` to its wait step's time ``end`` (``start <= end``; equal when nothing runs
    between the two steps)."""

    rank: int
    stage: int
    micro: int
    kind: WindowKind
    start: int
    end: int


@dataclass(frozen=True)
class Bubble:
    """Slots ``[start, end)`` in which ``rank`` runs no compute (a maximal idle run)."""

    rank: int
    start: int
    end: int


@dataclass(frozen=True)
class Timeline:
    """Every rank's compute slots, idle runs and copy windows on one logical axis.

    Invariants: slots of one rank never overlap and keep the rank's order; every slot lies
    in ``[0, num_slots)``; bubbles and slots of a rank tile ``[0, num_slots)`` exactly.
    """

    ranks: tuple[int, ...]
    num_slots: int
    slots: tuple[ComputeSlot, ...]
    bubbles: tuple[Bubble, ...]
    windows: tuple[SwapWindow, ...]

    def slots_of(self, rank: int) -> tuple[ComputeSlot, ...]:
        return tuple(s for s in self.slots if s.rank == rank)

    def bubbles_of(self, rank: int) -> tuple[Bubble, ...]:
        return tuple(b for b in self.bubbles if b.rank == rank)

    def windows_of(self, rank: int, kind: WindowKind | None = None) -> tuple[SwapWindow, ...]:
        return tuple(
            w for w in self.windows if w.rank == rank and (kind is None or w.kind is kind)
        )

    def idle_slots(self, rank: int) -> int:
        return sum(b.end - b.start for b in self.bubbles_of(rank))


# A produced value: ("fwd", stage, micro) is a forward output, ("dx", stage, micro) the
# input gradient a BWD / BWD_INPUT leaf computes for the previous stage.
_Value = tuple[str, int, int]


def build_timeline(orders: Mapping[int, Sequence[MetaStep]]) -> Timeline:
    """Place every rank's order on one logical timeline (see the module docstring).

    Raises :class:`TimelineError` naming the blocked rank, step and missing input when the
    orders deadlock (some step waits for a value no rank can produce first).
    """
    last_stage = _last_stage(orders)
    ready: dict[_Value, int] = {}  # value -> logical time it is available
    clock = {rank: 0 for rank in orders}
    cursor = {rank: 0 for rank in orders}
    times: dict[int, list[int]] = {rank: [] for rank in orders}  # per position
    slots: list[ComputeSlot] = []
    while True:
        progressed = False
        for rank, order in orders.items():
            while cursor[rank] < len(order):
                step = order[cursor[rank]]
                needs = _inputs(step, last_stage)
                if any(value not in ready for value in needs):
                    break
                start = max([clock[rank], *(ready[v] for v in needs)])
                times[rank].append(start)
                if step.is_compute_slot:
                    slots.append(ComputeSlot(rank, start, cursor[rank], step))
                    start += 1
                    for value in _outputs(step):
                        ready[value] = start
                clock[rank] = start
                cursor[rank] += 1
                progressed = True
        if all(cursor[r] == len(o) for r, o in orders.items()):
            break
        if not progressed:
            raise TimelineError(_deadlock_message(orders, cursor, ready, last_stage))
    num_slots = max((s.end for s in slots), default=0)
    return Timeline(
        ranks=tuple(sorted(orders)),
        num_slots=num_slots,
        slots=tuple(sorted(slots, key=lambda s: (s.rank, s.start))),
        bubbles=tuple(_bubbles(orders, slots, num_slots)),
        windows=tuple(_windows(orders, times)),
    )


def _last_stage(orders: Mapping[int, Sequence[MetaStep]]) -> int:
    stages = [
        leaf.stage
        for order in orders.values()
        for step in order
        for leaf in step.leaves()
        if leaf.kind in COMPUTE_LETTER and leaf.stage is not None
    ]
    return max(stages, default=0)


def _inputs(step: MetaStep, last_stage: int) -> tuple[_Value, ...]:
    """Values ``step`` must wait for: compute inputs, or the producer of a received tensor."""
    needs: list[_Value] = []
    produced_here = set(_outputs(step))
    for leaf in step.leaves():
        s, m = leaf.stage, leaf.micro
        if s is None or m is None:
            continue
        if leaf.kind is StepKind.FWD and s > 0:
            needs.append(("fwd", s - 1, m))
        elif leaf.kind in (StepKind.BWD, StepKind.BWD_INPUT):
            needs.append(("fwd", s, m))
            if s < last_stage:
                needs.append(("dx", s + 1, m))
        elif leaf.kind is StepKind.BWD_WEIGHT:
            needs.append(("dx", s, m))
        elif leaf.kind is StepKind.RECV_F and s > 0:
            needs.append(("fwd", s - 1, m))
        elif leaf.kind is StepKind.RECV_B and s < last_stage:
            needs.append(("dx", s + 1, m))
    # Sub-steps of one composite run as a unit: a dependency between them is not a wait.
    return tuple(v for v in needs if v not in produced_here)


def _outputs(step: MetaStep) -> tuple[_Value, ...]:
    out: list[_Value] = []
    for leaf in step.leaves():
        if leaf.stage is None or leaf.micro is None:
            continue
        if leaf.kind is StepKind.FWD:
            out.append(("fwd", leaf.stage, leaf.micro))
        elif leaf.kind in (StepKind.BWD, StepKind.BWD_INPUT):
            out.append(("dx", leaf.stage, leaf.micro))
    return tuple(out)


def _deadlock_message(
    orders: Mapping[int, Sequence[MetaStep]],
    cursor: Mapping[int, int],
    ready: Mapping[_Value, int],
    last_stage: int,
) -> str:
    blocked = []
    for rank, order in orders.items():
        if cursor[rank] < len(order):
            step = order[cursor[rank]]
            missing = [v for v in _inputs(step, last_stage) if v not in ready]
            names = ", ".join(f"{kind} of stage {s} micro-batch {m}" for kind, s, m in missing)
            blocked.append(f"rank {rank} step {cursor[rank]} ({step!r}) waits for {names}")
    return (
        "build_timeline: the orders deadlock — " + "; ".join(blocked) + ". Every input must be "
        "produced by a step that some rank reaches first; check the orders' cross-rank order"
    )


def _bubbles(
    orders: Iterable[int], slots: Sequence[ComputeSlot], num_slots: int
) -> Iterable[Bubble]:
    for rank in sorted(orders):
        busy = sorted(s.start for s in slots if s.rank == rank)
        previous_end = 0
        for start in [*busy, num_slots]:
            if start > previous_end:
                yield Bubble(rank, previous_end, start)
            previous_end = start + 1


_WINDOW_STEPS = {
    StepKind.SWAP_LAUNCH_OFFLOAD: (WindowKind.OFFLOAD, True),
    StepKind.SWAP_WAIT_OFFLOAD: (WindowKind.OFFLOAD, False),
    StepKind.SWAP_LAUNCH_LOAD: (WindowKind.LOAD, True),
    StepKind.SWAP_WAIT_LOAD: (WindowKind.LOAD, False),
    StepKind.DW_LAUNCH_OFFLOAD: (WindowKind.WEIGHT_OFFLOAD, True),
    StepKind.DW_WAIT_OFFLOAD: (WindowKind.WEIGHT_OFFLOAD, False),
    StepKind.DW_LAUNCH_LOAD: (WindowKind.WEIGHT_LOAD, True),
    StepKind.DW_WAIT_LOAD: (WindowKind.WEIGHT_LOAD, False),
}


def _windows(
    orders: Mapping[int, Sequence[MetaStep]], times: Mapping[int, Sequence[int]]
) -> Iterable[SwapWindow]:
    for rank in sorted(orders):
        launched: dict[tuple[int, int, WindowKind], int] = {}
        for position, step in enumerate(orders[rank]):
            if step.kind not in _WINDOW_STEPS or step.chunk is None:
                continue
            kind, is_launch = _WINDOW_STEPS[step.kind]
            key = (step.chunk[0], step.chunk[1], kind)
            if is_launch:
                launched[key] = times[rank][position]
            elif key in launched:
                start = launched.pop(key)
                yield SwapWindow(rank, key[0], key[1], kind, start, times[rank][position])
            else:
                raise TimelineError(
                    f"build_timeline: rank {rank} step {position} ({step!r}) waits for a "
                    f"{kind.value} of stage {key[0]} micro-batch {key[1]} that was never "
                    "launched; run check_order on the order first"
                )
