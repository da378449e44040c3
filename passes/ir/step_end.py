"""The end of the step as an op: lets a plan offload retained storages in their last gap.

Under the residency model of :mod:`.trace`, a retained storage (a gradient, an output)
must be on the device after the last op, and nothing between its last access and the
end of the step may move it: ``required_bytes`` counts it there, so a step whose
gradients are a large share of its bytes cannot be planned under a budget that a step
moving them out and back can meet (the eager warmup's online eviction met it; a plan could not).

A door that can run actions *after* the step's last op (the eager replay, at the end of
its ``with`` block) appends :data:`STEP_END`: one op that reads every retained storage.
Each retained storage's stretch from its last access to the end of the step is then an
ordinary gap; a planner may offload it, the reload runs before :data:`STEP_END`, and
``check_schedule`` judges it like any other. Nothing else changes: a trace without the
op is planned as before, so a door that cannot reload at its end (the compile door,
whose graph outputs leave with the graph) never gets such a plan.

Example: ops ``0: W0``, ``1: R0``, ``2..9`` unrelated, storage 0 retained. Without the
end op storage 0 is pinned over ops 2..9; with it (op 10 reads 0) the gap 1 -> 10 is a
candidate: ``post[1]: COPY_D2H 0, RELEASE_DEVICE 0``, ``pre[10]: COPY_H2D 0, WAIT_H2D 0``.
"""

from __future__ import annotations

import dataclasses

from .trace import AccessKind, ActivationTrace, StorageAccess, TraceOp

__all__ = ["STEP_END", "has_step_end", "with_step_end"]

STEP_END = "step_end"
"""Name of the op that reads every retained storage at the end of the step."""


def with_step_end(trace: ActivationTrace) -> ActivationTrace:
    """``trace`` with :data:`STEP_END` appended (duration 0, no outputs): it reads every
    retained storage. Invariant: the other ops, sizes, holds and the budget are
    unchanged, so the result's ``num_ops`` is ``trace.num_ops + 1``."""
    end = TraceOp(
        name=STEP_END,
        accesses=tuple(StorageAccess(s, AccessKind.READ) for s in sorted(trace.retained)),
        duration_s=0.0,
    )
    return dataclasses.replace(trace, ops=(*trace.ops, end))


def has_step_end(trace: ActivationTrace) -> bool:
    """Whether the trace's last op is :data:`STEP_END`."""
    return bool(trace.ops) and trace.ops[-1].name == STEP_END
