"""The order passes a rank's order goes through, and the fixed pipeline that runs them.

Build every rank's finalized order by running the pipeline passes in their fixed order.

    compute order (gpipe / 1f1b here, the others from torch)
      → [overlap B/F]  → [dx/dw split]       compute-order variants
      → add P2P                               plain SEND/RECV leaves
      → [inject FSDP]                         unshard lookahead / reshard / reduce-grad
      → rewrite transport                     plain | batch | boundary
      → [inject swap]                         last: sees the final FSDP and P2P containers;
                                              activation windows and, under dx/dw split,
                                              dW-state windows

What each schedule supports (ranks R, stages per rank V, micro-batches M):

* ``gpipe``, ``1f1b``: V = 1, any R, M >= 1;
* ``interleaved-1f1b``, ``interleaved-zb``: any V >= 1 with torch's constraint on M
  (M must be a multiple of the number of rounds ``max(1, M // R)``);
* ``zbv``: V = 2 (V-shaped placement), any M >= 1;
* ``dualpipev``: V = 2 (V-shaped placement), M >= 2R (at least as many micro-batches as
  stages);
* ``overlap`` and ``dxdw_split`` apply to any of them; the zero-bubble schedules already
  split dx/dw, and ``dualpipev`` already carries torch's OVERLAP_F_B composites.

P2P transport pass: how the P2P leaves of an order are issued.

* ``plain``    — unchanged: one isend / irecv per leaf.
* ``batch``    — every maximal run of adjacent P2P leaves becomes one ``BATCH_SEND_RECV``
  container (one ``batch_isend_irecv``), a run of one included.
* ``boundary`` — all P2P leaves between two consecutive compute slots (and before the first
  / after the last) become one ``BATCH_SEND_RECV`` at the place of the first of them, even
  when FSDP steps sit between them: one fused exchange per compute boundary.

In every mode the sequence of P2P leaves (flattened, in order) is unchanged, and no
non-P2P step enters a container.

FSDP pass: add UNSHARD / RESHARD / REDUCE_GRAD steps to a rank's compute + P2P order.

Policy (one-slot lookahead, torch's ``_add_unshard_reshard`` with a window counted in
compute slots instead of distinct stages):

* before compute slot ``i`` the stages of slots ``i`` and ``i+1`` must be unsharded. Stages
  outside that window are resharded, missing ones unsharded (in order of first use). So the
  all-gather for slot ``i+1`` is issued before slot ``i`` and overlaps it.
* that FSDP block sits **right after the previous compute slot** (before its sends): a
  reshard frees parameters as early as possible and an unshard starts as early as possible.
  The very first block sits at the top of the order.
* ``REDUCE_GRAD s`` comes right after the slot holding stage ``s``'s last gradient compute
  (BWD or BWD_WEIGHT), ahead of the FSDP block that follows that slot; every stage still
  unsharded at the end is resharded after the last slot.

A stage used by every slot (one stage per rank) therefore stays unsharded for the whole
step: its only UNSHARD is at the top, its only RESHARD at the bottom.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence

from hyper_offload.errors import ConfigurationError

from .meta_step import MetaStep, P2P_KINDS, StepKind
from .orders import add_p2p, compute_orders, fuse_overlap_b_f, layout_for, split_dx_dw
from .swap import MIN_SWAP_GAP, inject_swap_steps


TRANSPORTS = ("plain", "batch", "boundary")


def rewrite_transport(order: Sequence[MetaStep], transport: str = "plain") -> list[MetaStep]:
    """Return ``order`` with its P2P leaves issued the way ``transport`` says."""
    if transport not in TRANSPORTS:
        raise ConfigurationError(f"unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")
    for step in order:
        if step.kind is StepKind.BATCH_SEND_RECV or step.is_swap:
            raise ConfigurationError(
                f"rewrite_transport: order already holds {step!r}; the transport pass runs once, "
                "after the FSDP pass and before the swap pass"
            )
    if transport == "plain":
        return list(order)
    if transport == "batch":
        return _fuse_adjacent(order)
    return _fuse_per_boundary(order)


def _fuse_adjacent(order: Sequence[MetaStep]) -> list[MetaStep]:
    out: list[MetaStep] = []
    run: list[MetaStep] = []
    for step in order:
        if step.kind in P2P_KINDS:
            run.append(step)
            continue
        if run:
            out.append(MetaStep(StepKind.BATCH_SEND_RECV, None, None, tuple(run)))
            run = []
        out.append(step)
    if run:
        out.append(MetaStep(StepKind.BATCH_SEND_RECV, None, None, tuple(run)))
    return out


def _fuse_per_boundary(order: Sequence[MetaStep]) -> list[MetaStep]:
    out: list[MetaStep] = []
    segment: list[MetaStep] = []  # steps since the last compute slot

    def flush() -> None:
        p2p = tuple(s for s in segment if s.kind in P2P_KINDS)
        placed = False
        for s in segment:
            if s.kind in P2P_KINDS:
                if not placed:
                    out.append(MetaStep(StepKind.BATCH_SEND_RECV, None, None, p2p))
                    placed = True
            else:
                out.append(s)
        segment.clear()

    for step in order:
        if step.is_compute_slot:
            flush()
            out.append(step)
        else:
            segment.append(step)
    flush()
    return out


#: How many compute slots ahead the FSDP pass unshards.
UNSHARD_LOOKAHEAD = 1


def inject_fsdp_steps(order: Sequence[MetaStep], *, lookahead: int = UNSHARD_LOOKAHEAD) -> list[MetaStep]:
    """Return ``order`` with FSDP steps added (policy in the module docstring)."""
    if lookahead < 0:
        raise ConfigurationError(f"lookahead must be >= 0 compute slots, got {lookahead}")
    for step in order:
        if step.is_fsdp or step.is_swap:
            raise ConfigurationError(
                f"inject_fsdp_steps: order already holds {step!r}; the FSDP pass runs once, "
                "before the transport and swap passes"
            )
    slot_positions = [i for i, step in enumerate(order) if step.is_compute_slot]
    slot_stages = [_stages_in(order[i]) for i in slot_positions]
    last_grad_slot = _last_gradient_slots(order, slot_positions)

    blocks: dict[int, list[MetaStep]] = {}  # insert after top-level position (-1: at the top)
    active: list[int] = []
    for k, pos in enumerate(slot_positions):
        window: list[int] = []
        for stages in slot_stages[k : k + lookahead + 1]:
            window.extend(s for s in stages if s not in window)
        evict = [s for s in active if s not in window]
        fetch = [s for s in window if s not in active]
        active = [s for s in active if s in window] + fetch
        prev = slot_positions[k - 1] if k else -1
        block = blocks.setdefault(prev, [])
        block.extend(MetaStep(StepKind.FSDP_RESHARD, s) for s in evict)
        block.extend(MetaStep(StepKind.FSDP_UNSHARD, s) for s in fetch)
        # REDUCE_GRAD for stages whose gradients finished in this slot go after the slot.
        done = [s for s, slot in last_grad_slot.items() if slot == k]
        if done:
            blocks.setdefault(pos, []).extend(MetaStep(StepKind.REDUCE_GRAD, s) for s in sorted(done))
    if slot_positions:
        blocks.setdefault(slot_positions[-1], []).extend(MetaStep(StepKind.FSDP_RESHARD, s) for s in active)

    out = list(blocks.get(-1, []))
    for i, step in enumerate(order):
        out.append(step)
        out.extend(blocks.get(i, []))
    return out


def _stages_in(step: MetaStep) -> list[int]:
    stages: list[int] = []
    for leaf in step.leaves():
        if leaf.stage is not None and leaf.stage not in stages:
            stages.append(leaf.stage)
    return stages


def _last_gradient_slots(order: Sequence[MetaStep], slot_positions: list[int]) -> dict[int, int]:
    """stage -> index (among compute slots) of its last BWD / BWD_WEIGHT."""
    last: dict[int, int] = {}
    for k, pos in enumerate(slot_positions):
        for leaf in order[pos].leaves():
            if leaf.kind in (StepKind.BWD, StepKind.BWD_WEIGHT) and leaf.stage is not None:
                last[leaf.stage] = k
    return last


# Pass-by-pass step counts at DEBUG level (STYLE: observable passes).
logger = logging.getLogger(__name__)

# One rank-local pass: (order, rank) -> order.
_Pass = Callable[[list[MetaStep], int], list[MetaStep]]


def build_rank_orders(
    schedule: str,
    *,
    num_ranks: int,
    stages_per_rank: int,
    num_microbatches: int,
    fsdp: bool = False,
    transport: str = "plain",
    swap: bool = False,
    min_gap: int = MIN_SWAP_GAP,
    dxdw_split: bool = False,
    overlap: bool = False,
    swap_only: Mapping[int, Collection[tuple[int, int]]] | None = None,
    unsharded_load: str = "cover",
    weight_swap: bool = True,
    weight_swap_only: Mapping[int, Collection[tuple[int, int]]] | None = None,
) -> dict[int, list[MetaStep]]:
    """Every rank's finalized order for ``schedule`` (see the module docstring).

    ``swap_only`` (rank → chunks) restricts swap injection per rank to the given eligible
    ``(stage, micro)`` chunks; ranks absent from it swap every eligible chunk.
    ``weight_swap`` also swaps the dW state across each eligible BWD_INPUT → BWD_WEIGHT
    gap (orders that split dx/dw only); ``weight_swap_only`` restricts it per rank the
    same way.
    """
    layout = layout_for(schedule, num_ranks=num_ranks, stages_per_rank=stages_per_rank)
    orders = compute_orders(
        schedule, num_ranks=num_ranks, stages_per_rank=stages_per_rank, num_microbatches=num_microbatches
    )
    passes: list[tuple[str, _Pass]] = []
    if overlap:
        passes.append(("fuse_overlap_b_f", lambda o, r: fuse_overlap_b_f(o)))
    if dxdw_split:
        passes.append(("split_dx_dw", lambda o, r: split_dx_dw(o)))
    passes.append(("add_p2p", lambda o, r: add_p2p(o, layout, r)))
    if fsdp:
        passes.append(("inject_fsdp_steps", lambda o, r: inject_fsdp_steps(o)))
    passes.append((f"rewrite_transport[{transport}]", lambda o, r: rewrite_transport(o, transport)))
    if swap:
        chosen = {} if swap_only is None else dict(swap_only)
        chosen_weight = {} if weight_swap_only is None else dict(weight_swap_only)
        passes.append((
            f"inject_swap_steps[min_gap={min_gap}]",
            lambda o, r: inject_swap_steps(
                o, min_gap=min_gap, only=chosen.get(r), unsharded_load=unsharded_load,
                weight_swap=weight_swap, weight_only=chosen_weight.get(r),
            ),
        ))
    logger.debug("%s: pass order %s", schedule, " -> ".join(name for name, _ in passes))
    return {rank: _run_passes(order, rank, passes) for rank, order in orders.items()}


def _run_passes(order: Sequence[MetaStep], rank: int, passes: list[tuple[str, _Pass]]) -> list[MetaStep]:
    current = list(order)
    for name, run in passes:
        before = len(current)
        current = run(current, rank)
        logger.debug("rank %d: %s: %d -> %d steps", rank, name, before, len(current))
    return current
