"""Build every rank's finalized order by running the pipeline passes in their fixed order.

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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence

from .fsdp import inject_fsdp_steps
from .meta_step import MetaStep
from .orders import add_p2p, compute_orders, fuse_overlap_b_f, layout_for, split_dx_dw
from .swap import MIN_SWAP_GAP, inject_swap_steps
from .transport import rewrite_transport

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
