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

**Compute orders and P2P** (the first passes). Stages are numbered globally
``0 .. num_stages-1``; a rank holds ``stages_per_rank`` of them: ``loop`` placement puts
stage ``s`` on rank ``s % num_ranks`` (GPipe, 1F1B, interleaved schedules); ``v``
placement puts stages ``r`` and ``2R-1-r`` on rank ``r`` (ZBV, DualPipeV).

Compute orders hold compute slots only (FWD/BWD/BWD_INPUT/BWD_WEIGHT leaves and OVERLAP
composites). :func:`add_p2p` then adds, per compute leaf whose neighbour stage lives on
another rank (the stage in a P2P step is the stage that owns the step, as in torch):

* ``RECV_F s m`` right before the slot with ``F s m`` (s > 0), ``SEND_F s m`` right after it
  (s < last);
* ``RECV_B s m`` right before the slot with ``B s m`` / ``I s m`` (s < last), ``SEND_B s m``
  right after it (s > 0); ``W`` has no P2P.

Within one slot, receives follow the order of the slot's leaves, and so do sends.

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
from enum import Enum
from typing import NamedTuple

from hyper_offload.errors import ConfigurationError

from .meta_step import MetaStep, P2P_KINDS, StepKind
from .swap import MIN_SWAP_GAP, inject_swap_steps


# ---------------------------------------------------------------- compute orders and P2P

#: Schedule names accepted by :func:`compute_orders` and ``build_rank_orders``.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
_V_SCHEDULES = frozenset({"zbv", "dualpipev"})
_SINGLE_STAGE_SCHEDULES = frozenset({"gpipe", "1f1b"})


class Placement(str, Enum):
    """How global stages are laid out over ranks (see the module docstring)."""

    LOOP = "loop"
    V = "v"

    def __repr__(self) -> str:
        return self.value


class PipelineLayout(NamedTuple):
    """Which rank holds which global stage (see the module docstring for the two styles)."""

    num_ranks: int
    stages_per_rank: int
    style: Placement = Placement.LOOP

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ConfigurationError(f"stage {stage} outside 0..{self.num_stages - 1}")
        if self.style is Placement.LOOP:
            return stage % self.num_ranks
        lap, offset = divmod(stage, self.num_ranks)
        return offset if lap % 2 == 0 else self.num_ranks - 1 - offset

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if self.rank_of(s) == rank)


def layout_for(schedule: str, *, num_ranks: int, stages_per_rank: int) -> PipelineLayout:
    """The stage placement ``schedule`` uses; raises ConfigurationError for shapes it cannot run."""
    if schedule not in SCHEDULES:
        raise ConfigurationError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if num_ranks < 1 or stages_per_rank < 1:
        raise ConfigurationError(f"num_ranks ({num_ranks}) and stages_per_rank ({stages_per_rank}) must be >= 1")
    if schedule in _SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        raise ConfigurationError(
            f"schedule {schedule!r} runs one stage per rank, got stages_per_rank={stages_per_rank}; "
            "use interleaved-1f1b for several virtual stages"
        )
    if schedule in _V_SCHEDULES and stages_per_rank != 2:
        raise ConfigurationError(
            f"schedule {schedule!r} is V-shaped and needs stages_per_rank=2, got {stages_per_rank}"
        )
    style = Placement.V if schedule in _V_SCHEDULES else Placement.LOOP
    return PipelineLayout(num_ranks, stages_per_rank, style)


def gpipe_compute_order(rank: int, num_microbatches: int) -> list[MetaStep]:
    """GPipe on stage ``rank``: every forward, then every backward, micro-batches ascending."""
    return [MetaStep(StepKind.FWD, rank, m) for m in range(num_microbatches)] + [
        MetaStep(StepKind.BWD, rank, m) for m in range(num_microbatches)
    ]


def one_f_one_b_compute_order(rank: int, num_ranks: int, num_microbatches: int) -> list[MetaStep]:
    """Classic 1F1B on stage ``rank``, exactly as torch's ``Schedule1F1B`` runtime executes it.

    Warm-up runs ``min(M, R - rank)`` forwards; then backward and forward alternate (1B1F)
    until the forwards run out; the cool-down runs the remaining backwards.
    """
    warmup = min(num_microbatches, num_ranks - rank)
    order = [MetaStep(StepKind.FWD, rank, m) for m in range(warmup)]
    next_fwd, next_bwd = warmup, 0
    while next_bwd < num_microbatches:
        order.append(MetaStep(StepKind.BWD, rank, next_bwd))
        next_bwd += 1
        if next_fwd < num_microbatches:
            order.append(MetaStep(StepKind.FWD, rank, next_fwd))
            next_fwd += 1
    return order


def compute_orders(
    schedule: str, *, num_ranks: int, stages_per_rank: int, num_microbatches: int
) -> dict[int, list[MetaStep]]:
    """Compute-only order of every rank. GPipe and 1F1B are built here; the interleaved and
    V-shaped schedules come from torch's own order generators (see ``torch_actions``)."""
    layout_for(schedule, num_ranks=num_ranks, stages_per_rank=stages_per_rank)
    if num_microbatches < 1:
        raise ConfigurationError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if schedule == "gpipe":
        return {r: gpipe_compute_order(r, num_microbatches) for r in range(num_ranks)}
    if schedule == "1f1b":
        return {r: one_f_one_b_compute_order(r, num_ranks, num_microbatches) for r in range(num_ranks)}
    # Imported here: torch.distributed.pipelining is only needed for torch-built schedules.
    from .torch_actions import torch_compute_orders

    return torch_compute_orders(
        schedule, num_ranks=num_ranks, stages_per_rank=stages_per_rank, num_microbatches=num_microbatches
    )


def fuse_overlap_b_f(order: Sequence[MetaStep]) -> list[MetaStep]:
    """Pair each backward leaf (BWD / BWD_INPUT) that is directly followed by a forward leaf
    into one ``OVERLAP_B_F(backward, forward)`` slot — the steady-state B/F pairs of 1F1B-like
    orders. Everything else is kept as is."""
    out: list[MetaStep] = []
    i = 0
    while i < len(order):
        step = order[i]
        nxt = order[i + 1] if i + 1 < len(order) else None
        if step.kind in (StepKind.BWD, StepKind.BWD_INPUT) and nxt is not None and nxt.kind is StepKind.FWD:
            out.append(MetaStep(StepKind.OVERLAP_B_F, None, None, (step, nxt)))
            i += 2
        else:
            out.append(step)
            i += 1
    return out


def split_dx_dw(order: Sequence[MetaStep]) -> list[MetaStep]:
    """Split each BWD into BWD_INPUT (dx) and BWD_WEIGHT (dw).

    The BWD_INPUT takes the BWD's place (inside an OVERLAP composite too); the BWD_WEIGHT
    becomes its own slot right after. Stage 0 keeps a plain BWD: it sends no input gradient,
    so there is nothing to run early.
    """
    out: list[MetaStep] = []
    for step in order:
        weights: list[MetaStep] = []
        if step.kind in (StepKind.OVERLAP_B_F, StepKind.OVERLAP_F_B):
            subs = []
            for sub in step.sub_steps:
                dx, dw = _split_one(sub)
                subs.append(dx)
                weights.extend(dw)
            out.append(step._replace(sub_steps=tuple(subs)))
        else:
            dx, dw = _split_one(step)
            out.append(dx)
            weights.extend(dw)
        out.extend(weights)
    return out


def _split_one(step: MetaStep) -> tuple[MetaStep, list[MetaStep]]:
    if step.kind is not StepKind.BWD or step.stage == 0:
        return step, []
    return step._replace(kind=StepKind.BWD_INPUT), [step._replace(kind=StepKind.BWD_WEIGHT)]


def add_p2p(order: Sequence[MetaStep], layout: PipelineLayout, rank: int) -> list[MetaStep]:
    """Add plain P2P leaves around each compute slot (rules in the module docstring)."""
    out: list[MetaStep] = []
    for step in order:
        if not step.is_compute_slot:
            raise ConfigurationError(
                f"rank {rank}: add_p2p expects a compute-only order, found {step!r}; "
                "run it before the FSDP, transport and swap passes"
            )
        leaves = list(step.leaves())
        for leaf_step in leaves:
            _check_on_rank(leaf_step, layout, rank)
        out.extend(r for leaf_step in leaves if (r := _recv_for(leaf_step, layout)) is not None)
        out.append(step)
        out.extend(s for leaf_step in leaves if (s := _send_for(leaf_step, layout)) is not None)
    return out


def _check_on_rank(step: MetaStep, layout: PipelineLayout, rank: int) -> None:
    assert step.stage is not None
    if layout.rank_of(step.stage) != rank:
        raise ConfigurationError(
            f"rank {rank}: step {step!r} belongs to stage {step.stage}, which lives on rank "
            f"{layout.rank_of(step.stage)} in a {layout.style.value} layout"
        )


def _crosses(stage: int, neighbour: int, layout: PipelineLayout) -> bool:
    return 0 <= neighbour < layout.num_stages and layout.rank_of(neighbour) != layout.rank_of(stage)


def _recv_for(step: MetaStep, layout: PipelineLayout) -> MetaStep | None:
    assert step.stage is not None
    if step.kind is StepKind.FWD and _crosses(step.stage, step.stage - 1, layout):
        return MetaStep(StepKind.RECV_F, step.stage, step.micro)
    if step.kind in (StepKind.BWD, StepKind.BWD_INPUT) and _crosses(step.stage, step.stage + 1, layout):
        return MetaStep(StepKind.RECV_B, step.stage, step.micro)
    return None


def _send_for(step: MetaStep, layout: PipelineLayout) -> MetaStep | None:
    assert step.stage is not None
    if step.kind is StepKind.FWD and _crosses(step.stage, step.stage + 1, layout):
        return MetaStep(StepKind.SEND_F, step.stage, step.micro)
    if step.kind in (StepKind.BWD, StepKind.BWD_INPUT) and _crosses(step.stage, step.stage - 1, layout):
        return MetaStep(StepKind.SEND_B, step.stage, step.micro)
    return None


# ---------------------------------------------------------------- transport, FSDP, the pipeline

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
