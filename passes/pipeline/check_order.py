"""check_order: the one validator for rank-local pipeline orders with swap steps.

It re-derives everything from the order itself (it does not call the swap pass), so it
judges the pass rather than repeating it. Rules (:class:`OrderRule`):

* every chosen chunk has exactly its four swap steps, in the order LAUNCH_OFFLOAD,
  WAIT_OFFLOAD, LAUNCH_LOAD, WAIT_LOAD; nothing is swapped for other chunks. The chosen set
  is ``swapped`` when given (it must hold eligible chunks only), else every eligible chunk
  (``gap >= min_gap``, gaps counted in compute slots, a composite counting once);
* SWAP_LAUNCH_OFFLOAD comes after the chunk's forward slot, in the block right after it: no
  compute slot and no FSDP_RESHARD of the stage lies between the forward and the launch
  (``FWD → SWAP_LAUNCH_OFFLOAD → FSDP_RESHARD``);
* exactly one compute slot (the first intervening compute) lies between SWAP_LAUNCH_OFFLOAD
  and SWAP_WAIT_OFFLOAD, and the wait comes after the communication block that follows that
  slot (only swap steps between the wait and the next compute slot);
* on a stage without FSDP, SWAP_LAUNCH_LOAD sits at the last cover point: one compute slot
  lies between it and SWAP_WAIT_LOAD when the window after SWAP_WAIT_OFFLOAD has one (none
  otherwise), and only swap steps lie between the launch and that compute slot — the load
  is hidden, and the activation does not come back earlier than it must;
* SWAP_WAIT_LOAD comes before the chunk's first backward consumer (BWD or BWD_INPUT), and
  the next compute slot after it is that consumer's slot — a BWD_WEIGHT never loads;
* the dW-state window of a chunk (BWD_INPUT → BWD_WEIGHT, under dx/dw split) follows the
  same rules with its own four steps DW_LAUNCH_OFFLOAD, DW_WAIT_OFFLOAD, DW_LAUNCH_LOAD,
  DW_WAIT_LOAD, the BWD_INPUT in the forward's role and the BWD_WEIGHT in the consumer's:
  launched right after the BWD_INPUT, waited after one compute slot, loaded at the last
  cover point, waited right before the BWD_WEIGHT. The chosen set is ``weight_swapped``
  when given, else every eligible window (``gap >= min_gap`` between the two slots);
* no swap step sits inside a container (BATCH_SEND_RECV or OVERLAP composite);
* with FSDP on the stage: when an FSDP_UNSHARD of the stage after SWAP_WAIT_OFFLOAD feeds the
  consumer (no compute of the stage in between), the order is SWAP_LAUNCH_LOAD →
  FSDP_UNSHARD → SWAP_WAIT_LOAD → consumer, with only swap steps between the launch and
  that UNSHARD; when the stage stays unsharded, the load sits at the cover point of a
  stage without FSDP (``unsharded_load="cover"``, default) or no compute slot lies between
  SWAP_LAUNCH_LOAD and SWAP_WAIT_LOAD (``"delay"``, the design document's rule);
* given the ``reference`` order the swap pass started from: the P2P send/recv sequence
  (containers included) is unchanged, and removing the swap steps gives ``reference`` back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from enum import Enum
from typing import NamedTuple

from hyper_offload.errors import OrderError

from .meta_step import (
    SWAP_PHASE_OF,
    SWAP_SEQUENCES,
    MetaStep,
    StepFormatError,
    StepKind,
    SwapPhase,
    validate_step,
)
from .swap import MIN_SWAP_GAP  # the default threshold only; the rules are re-derived here


class OrderRule(str, Enum):
    """The invariant a violation breaks; the value is the short name printed in messages."""

    MALFORMED_STEP = "malformed-step"
    SWAP_IN_CONTAINER = "swap-step-in-container"
    UNKNOWN_CHUNK = "swap-for-unknown-chunk"
    CHOSEN_INELIGIBLE = "chosen-chunk-ineligible"
    NOT_CHOSEN_SWAPPED = "swapped-chunk-not-chosen"
    MISSING_SWAP_STEP = "missing-swap-step"
    DUPLICATE_SWAP_STEP = "duplicate-swap-step"
    SWAP_STEP_ORDER = "swap-steps-out-of-order"
    OFFLOAD_BEFORE_FORWARD = "offload-before-forward"
    OFFLOAD_NOT_AT_FORWARD = "launch-offload-not-right-after-forward"
    OFFLOAD_NOT_COVERED = "wait-offload-without-compute"
    WAIT_OFFLOAD_LATE = "wait-offload-not-after-first-compute"
    LOAD_NOT_AT_COVER_POINT = "launch-load-not-at-last-cover-point"
    LOAD_AFTER_CONSUMER = "wait-load-after-consumer"
    LOAD_NOT_AT_CONSUMER = "wait-load-not-before-consumer"
    WEIGHT_LOADS = "bwd-weight-loads"
    FSDP_LOAD_ORDER = "fsdp-load-order"
    P2P_ORDER_CHANGED = "p2p-order-changed"
    ORDER_CHANGED = "order-changed-by-swap"
    # cross-rank rules, reported by execution.check_execution
    DEPENDENCY = "input-not-ready"
    NOT_UNSHARDED = "compute-on-sharded-stage"
    DEADLOCK = "deadlock"
    UNMATCHED_P2P = "unmatched-p2p"

    def __repr__(self) -> str:
        return self.value


class OrderViolation(NamedTuple):
    """One broken rule: where (rank, top-level step index, stage, micro-batch) and why."""

    rank: int | None
    step: int
    stage: int | None
    micro: int | None
    rule: OrderRule
    message: str

    def __str__(self) -> str:
        where = f"rank {self.rank}, step {self.step} (stage {self.stage}, micro {self.micro})"
        return f"{where}: [{self.rule.value}] {self.message}"


_Where = tuple[int | None, int | None]  # (stage, micro)
_Report = Callable[[int, _Where, OrderRule, str], None]


class _Chunk(NamedTuple):
    forward_slot: int
    forward_pos: int
    consumer_slot: int
    consumer_pos: int


def check_order(
    order: Sequence[MetaStep],
    *,
    rank: int | None = None,
    min_gap: int = MIN_SWAP_GAP,
    swapped: Collection[tuple[int, int]] | None = None,
    reference: Sequence[MetaStep] | None = None,
    unsharded_load: str = "cover",
    weight_swapped: Collection[tuple[int, int]] | None = None,
) -> list[OrderViolation]:
    """Every violation of the rules in the module docstring, in step order.

    ``swapped`` / ``weight_swapped``: the chunks whose activation / dW-state window must be
    swapped (``None``: every eligible one)."""
    out: list[OrderViolation] = []

    def report(step: int, chunk: _Where, rule: OrderRule, message: str) -> None:
        out.append(OrderViolation(rank, step, chunk[0], chunk[1], rule, message))

    _check_structure(order, report)
    slot_of = _slot_index(order)
    chunks, weights, weight_windows = _pair_chunks(order, slot_of)
    windows = {SwapPhase.ACTIVATIONS: chunks, SwapPhase.WEIGHT_STATE: weight_windows}
    steps_of: dict[tuple[int, int, SwapPhase], dict[StepKind, list[int]]] = defaultdict(lambda: defaultdict(list))
    for pos, step in enumerate(order):
        if step.is_swap and step.chunk is not None:
            steps_of[(*step.chunk, SWAP_PHASE_OF[step.kind])][step.kind].append(pos)
    for phase, given in ((SwapPhase.ACTIVATIONS, swapped), (SwapPhase.WEIGHT_STATE, weight_swapped)):
        found = windows[phase]
        eligible = {k for k, c in found.items() if c.consumer_slot - c.forward_slot >= min_gap}
        chosen = eligible if given is None else {tuple(k) for k in given}
        label = _PHASE_LABEL[phase]
        for key in sorted(chosen - eligible):
            where = found[key].forward_pos if key in found else 0
            gap = found[key].consumer_slot - found[key].forward_slot if key in found else None
            report(where, key, OrderRule.CHOSEN_INELIGIBLE,
                   f"{label} is in the chosen set but is not eligible (gap {gap}, min_gap {min_gap})")
        for (stage, micro, step_phase), by_kind in sorted(steps_of.items()):
            key = (stage, micro)
            if step_phase is not phase:
                continue
            first = min(p for ps in by_kind.values() for p in ps)
            if key not in found:
                report(first, key, OrderRule.UNKNOWN_CHUNK,
                       f"swap step for a chunk without the {_PHASE_PAIR[phase]} pair on this rank; remove it")
            elif key not in chosen:
                why = "eligible but not in the chosen set" if key in eligible else "not eligible (gap < min_gap)"
                report(first, key, OrderRule.NOT_CHOSEN_SWAPPED,
                       f"{label} has swap steps but is {why}; it must stay resident")
        for key in sorted(chosen & set(found)):
            _check_chunk(order, key, found[key], steps_of.get((*key, phase), {}), weights.get(key, []), slot_of,
                         report, unsharded_load, phase)
    if reference is not None:
        _check_reference(order, reference, report)
    return sorted(out, key=lambda v: v.step)


def assert_valid_order(
    order: Sequence[MetaStep],
    *,
    rank: int | None = None,
    min_gap: int = MIN_SWAP_GAP,
    swapped: Collection[tuple[int, int]] | None = None,
    reference: Sequence[MetaStep] | None = None,
    unsharded_load: str = "cover",
    weight_swapped: Collection[tuple[int, int]] | None = None,
) -> None:
    """Raise :class:`OrderError` listing every violation, with the order printed as a table."""
    violations = check_order(
        order, rank=rank, min_gap=min_gap, swapped=swapped, reference=reference, unsharded_load=unsharded_load,
        weight_swapped=weight_swapped,
    )
    if not violations:
        return
    lines = [f"rank {rank}: {len(violations)} pipeline-order violation(s):"]
    lines += [f"  {v}" for v in violations]
    lines += ["", "Fix the pass that produced the order (or the expected swapped set). Order:"]
    lines.append(format_order_table(order, violations))
    raise OrderError("\n".join(lines), violations)


def format_order_table(order: Sequence[MetaStep], violations: Sequence[OrderViolation] = ()) -> str:
    """The order as a table: step index, step, and the rules broken at that step."""
    marks: dict[int, list[str]] = defaultdict(list)
    for v in violations:
        marks[v.step].append(v.rule.value)
    width = max((len(repr(s)) for s in order), default=4)
    digits = len(str(max(len(order) - 1, 0)))
    rows = [f"{'step':>{max(digits, 4)}}  {'action':<{width}}"]
    for i, step in enumerate(order):
        note = f"  <-- {', '.join(marks[i])}" if i in marks else ""
        rows.append(f"{i:>{max(digits, 4)}}  {repr(step):<{width}}{note}")
    return "\n".join(rows)


# -- helpers ----------------------------------------------------------------------------------


def _check_structure(order: Sequence[MetaStep], report: _Report) -> None:
    for pos, step in enumerate(order):
        inner_swaps = [leaf for leaf in step.leaves() if leaf.is_swap] if step.sub_steps else []
        for leaf in inner_swaps:
            report(pos, (leaf.stage, leaf.micro), OrderRule.SWAP_IN_CONTAINER,
                   f"{leaf!r} sits inside {step.kind.name}; swap steps go between top-level steps")
        if inner_swaps:
            continue
        try:
            validate_step(step)
        except StepFormatError as exc:
            report(pos, (step.stage, step.micro), OrderRule.MALFORMED_STEP, str(exc))


def _slot_index(order: Sequence[MetaStep]) -> dict[int, int]:
    slots: dict[int, int] = {}
    for pos, step in enumerate(order):
        if step.is_compute_slot:
            slots[pos] = len(slots)
    return slots


def _pair_chunks(
    order: Sequence[MetaStep], slot_of: dict[int, int]
) -> tuple[dict[tuple[int, int], _Chunk], dict[tuple[int, int], list[int]], dict[tuple[int, int], _Chunk]]:
    """Chunks with a forward and a first backward consumer; positions of each chunk's
    BWD_WEIGHTs; and the dW windows: a BWD_INPUT and the first BWD_WEIGHT after it, the
    BWD_INPUT in the forward's role."""
    forwards: dict[tuple[int, int], int] = {}
    consumers: dict[tuple[int, int], int] = {}
    inputs: dict[tuple[int, int], int] = {}
    weights: dict[tuple[int, int], list[int]] = defaultdict(list)
    for pos in slot_of:
        for leaf in order[pos].leaves():
            key = leaf.chunk
            if key is None:
                continue
            if leaf.kind is StepKind.FWD:
                forwards.setdefault(key, pos)
            elif leaf.kind in (StepKind.BWD, StepKind.BWD_INPUT):
                consumers.setdefault(key, pos)
                if leaf.kind is StepKind.BWD_INPUT:
                    inputs.setdefault(key, pos)
            elif leaf.kind is StepKind.BWD_WEIGHT:
                weights[key].append(pos)
    chunks = {
        key: _Chunk(slot_of[f], f, slot_of[consumers[key]], consumers[key])
        for key, f in forwards.items()
        if key in consumers
    }
    weight_windows = {}
    for key, i in inputs.items():
        w = next((p for p in weights.get(key, ()) if p > i), None)
        if w is not None:
            weight_windows[key] = _Chunk(slot_of[i], i, slot_of[w], w)
    return chunks, weights, weight_windows


def _in_weight_terms(report: _Report) -> _Report:
    """The activation window's messages, named for the dW window (same rules, other steps)."""
    words = (("SWAP_", "DW_"), ("backward consumer", "BWD_WEIGHT"), ("the consumer", "the BWD_WEIGHT"),
             ("the forward", "the BWD_INPUT"), ("forward slot", "BWD_INPUT slot"))

    def renamed(step: int, chunk: _Where, rule: OrderRule, message: str) -> None:
        for old, new in words:
            message = message.replace(old, new)
        report(step, chunk, rule, f"dW state: {message}")

    return renamed


_PHASE_LABEL = {SwapPhase.ACTIVATIONS: "chunk", SwapPhase.WEIGHT_STATE: "dW-state window"}
_PHASE_PAIR = {SwapPhase.ACTIVATIONS: "forward + backward consumer", SwapPhase.WEIGHT_STATE: "BWD_INPUT + BWD_WEIGHT"}


def _check_chunk(
    order: Sequence[MetaStep],
    key: tuple[int, int],
    chunk: _Chunk,
    by_kind: dict[StepKind, list[int]],
    weight_positions: list[int],
    slot_of: dict[int, int],
    report: _Report,
    unsharded_load: str = "cover",
    phase: SwapPhase = SwapPhase.ACTIVATIONS,
) -> None:
    """One chosen window's four steps. For the dW window ``chunk`` holds the BWD_INPUT in
    the forward's place and the BWD_WEIGHT in the consumer's; the rules are the same."""
    if phase is SwapPhase.WEIGHT_STATE:
        report = _in_weight_terms(report)
    positions: dict[StepKind, int] = {}
    sequence = SWAP_SEQUENCES[phase]
    for kind in sequence:
        found = by_kind.get(kind, [])
        if not found:
            report(chunk.forward_pos, key, OrderRule.MISSING_SWAP_STEP,
                   f"chosen {_PHASE_LABEL[phase]} has no {kind.name}")
        elif len(found) > 1:
            report(found[1], key, OrderRule.DUPLICATE_SWAP_STEP, f"{kind.name} appears {len(found)} times")
        else:
            positions[kind] = found[0]
    if len(positions) != 4:
        return
    launch_off, wait_off, launch_load, wait_load = (positions[k] for k in sequence)
    if not launch_off < wait_off < launch_load < wait_load:
        report(launch_off, key, OrderRule.SWAP_STEP_ORDER,
               f"swap steps at {launch_off}, {wait_off}, {launch_load}, {wait_load}; expected "
               "LAUNCH_OFFLOAD < WAIT_OFFLOAD < LAUNCH_LOAD < WAIT_LOAD")
    if launch_off < chunk.forward_pos:
        report(launch_off, key, OrderRule.OFFLOAD_BEFORE_FORWARD,
               f"SWAP_LAUNCH_OFFLOAD before the forward at step {chunk.forward_pos}")
    else:
        _check_offload_anchors(order, key, chunk, (launch_off, wait_off), slot_of, report)
    if wait_load > chunk.consumer_pos:
        report(wait_load, key, OrderRule.LOAD_AFTER_CONSUMER,
               f"SWAP_WAIT_LOAD after the backward consumer at step {chunk.consumer_pos}")
    else:
        next_slot = min((p for p in slot_of if p > wait_load), default=None)
        if phase is SwapPhase.ACTIVATIONS and next_slot in weight_positions and next_slot != chunk.consumer_pos:
            report(wait_load, key, OrderRule.WEIGHT_LOADS,
                   f"SWAP_WAIT_LOAD feeds the BWD_WEIGHT at step {next_slot}; only BWD / BWD_INPUT load")
        elif next_slot != chunk.consumer_pos:
            report(wait_load, key, OrderRule.LOAD_NOT_AT_CONSUMER,
                   f"the next compute after SWAP_WAIT_LOAD is step {next_slot}, not the consumer at "
                   f"step {chunk.consumer_pos}; move the wait right before the consumer")
    if any(s.is_fsdp and s.stage == key[0] for s in order):
        _check_fsdp_load(order, key, chunk, (wait_off, launch_load, wait_load), slot_of, report, unsharded_load)
    elif wait_off < launch_load < wait_load:
        _check_load_cover(order, key, (wait_off, launch_load, wait_load), slot_of, report)


def _slots_between(slot_of: dict[int, int], start: int, end: int) -> list[int]:
    """Positions of the compute slots strictly between top-level positions ``start`` and ``end``."""
    return [p for p in slot_of if start < p < end]


def _only_swaps_between(order: Sequence[MetaStep], start: int, end: int) -> bool:
    return all(order[p].is_swap for p in range(start + 1, end))


def _check_offload_anchors(
    order: Sequence[MetaStep],
    key: tuple[int, int],
    chunk: _Chunk,
    positions: tuple[int, int],
    slot_of: dict[int, int],
    report: _Report,
) -> None:
    """LAUNCH_OFFLOAD right after the forward's container (ahead of the stage's RESHARD);
    WAIT_OFFLOAD after the first intervening compute slot and the comm block after it."""
    launch_off, wait_off = positions
    early = _slots_between(slot_of, chunk.forward_pos, launch_off)
    reshards = [p for p in range(chunk.forward_pos + 1, launch_off)
                if order[p].kind is StepKind.FSDP_RESHARD and order[p].stage == key[0]]
    if early or reshards:
        what = f"compute slot at step {early[0]}" if early else f"FSDP_RESHARD at step {reshards[0]}"
        report(launch_off, key, OrderRule.OFFLOAD_NOT_AT_FORWARD,
               f"a {what} lies between the forward at step {chunk.forward_pos} and SWAP_LAUNCH_OFFLOAD; "
               "launch the offload right after the forward's container (FWD → LAUNCH_OFFLOAD → RESHARD)")
    between = _slots_between(slot_of, launch_off, wait_off)
    if not between:
        report(wait_off, key, OrderRule.OFFLOAD_NOT_COVERED,
               "no compute slot between SWAP_LAUNCH_OFFLOAD and SWAP_WAIT_OFFLOAD")
        return
    next_slot = min((p for p in slot_of if p > wait_off), default=len(order))
    if len(between) > 1 or not _only_swaps_between(order, wait_off, next_slot):
        report(wait_off, key, OrderRule.WAIT_OFFLOAD_LATE,
               f"{len(between)} compute slot(s) between SWAP_LAUNCH_OFFLOAD and SWAP_WAIT_OFFLOAD, "
               "or non-swap steps between the wait and the next compute slot; wait right before the "
               "second compute slot after the forward (after the first one and its comm block)")


def _check_load_cover(
    order: Sequence[MetaStep],
    key: tuple[int, int],
    positions: tuple[int, int, int],
    slot_of: dict[int, int],
    report: _Report,
) -> None:
    """Stage without FSDP: LAUNCH_LOAD right before the last compute slot ahead of the
    consumer, so that slot hides the copy and the activation is not back any earlier."""
    wait_off, launch_load, wait_load = positions
    cover = _slots_between(slot_of, launch_load, wait_load)
    wanted = min(1, len(_slots_between(slot_of, wait_off, wait_load)))
    if len(cover) != wanted or (cover and not _only_swaps_between(order, launch_load, cover[0])):
        report(launch_load, key, OrderRule.LOAD_NOT_AT_COVER_POINT,
               f"{len(cover)} compute slot(s) between SWAP_LAUNCH_LOAD and SWAP_WAIT_LOAD, expected "
               f"{wanted}; launch the load right before the last compute slot ahead of the consumer "
               "(or right after SWAP_WAIT_OFFLOAD when no slot is left)")


def _check_fsdp_load(
    order: Sequence[MetaStep],
    key: tuple[int, int],
    chunk: _Chunk,
    positions: tuple[int, int, int],
    slot_of: dict[int, int],
    report: _Report,
    unsharded_load: str,
) -> None:
    wait_off, launch_load, wait_load = positions
    stage = key[0]
    feeding = None
    for pos in range(chunk.consumer_pos - 1, wait_off, -1):
        step = order[pos]
        if step.kind is StepKind.FSDP_UNSHARD and step.stage == stage:
            feeding = pos
            break
        if pos in slot_of and any(leaf.stage == stage for leaf in step.leaves()):
            break
    if feeding is not None and not launch_load < feeding < wait_load:
        report(launch_load, key, OrderRule.FSDP_LOAD_ORDER,
               f"expected SWAP_LAUNCH_LOAD → FSDP_UNSHARD (step {feeding}) → SWAP_WAIT_LOAD → consumer")
    elif feeding is not None and not _only_swaps_between(order, launch_load, feeding):
        report(launch_load, key, OrderRule.FSDP_LOAD_ORDER,
               f"SWAP_LAUNCH_LOAD is not right before the lookahead FSDP_UNSHARD at step {feeding}; "
               "launch the load there so the activation comes back with the parameters, not earlier")
    if feeding is None and unsharded_load == "cover":
        if wait_off < launch_load < wait_load:
            _check_load_cover(order, key, positions, slot_of, report)
    elif feeding is None and any(launch_load < p < wait_load for p in slot_of):
        report(launch_load, key, OrderRule.FSDP_LOAD_ORDER,
               "stage stays unsharded: SWAP_LAUNCH_LOAD must follow the last compute before the consumer")


def _p2p_sequence(order: Sequence[MetaStep]) -> list[tuple[int, MetaStep]]:
    return [(pos, s) for pos, s in enumerate(order) if s.is_p2p]


def _check_reference(order: Sequence[MetaStep], reference: Sequence[MetaStep], report: _Report) -> None:
    got, want = _p2p_sequence(order), [s for s in reference if s.is_p2p]
    for i in range(max(len(got), len(want))):
        g = got[i][1] if i < len(got) else None
        w = want[i] if i < len(want) else None
        if g != w:
            pos = got[i][0] if i < len(got) else len(order)
            report(pos, (None, None), OrderRule.P2P_ORDER_CHANGED,
                   f"P2P step #{i} is {g!r}, the order before the swap pass has {w!r}")
            break
    stripped = [(pos, s) for pos, s in enumerate(order) if not s.is_swap]
    for i in range(max(len(stripped), len(reference))):
        g = stripped[i][1] if i < len(stripped) else None
        w = reference[i] if i < len(reference) else None
        if g != w:
            pos = stripped[i][0] if i < len(stripped) else len(order)
            report(pos, (None, None), OrderRule.ORDER_CHANGED,
                   f"without swap steps, step #{i} is {g!r} but the reference has {w!r}")
            break
