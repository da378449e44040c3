"""FSDP pass: add UNSHARD / RESHARD / REDUCE_GRAD steps to a rank's compute + P2P order.

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

from collections.abc import Sequence

from hyper_offload.errors import ConfigurationError

from .meta_step import MetaStep, StepKind

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
