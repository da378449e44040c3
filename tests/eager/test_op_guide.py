"""``OpGuide``: the eager replay's per-op check against the warmup trace."""

from __future__ import annotations

import pytest

from hyper_offload.eager.replay_checks import OpGuide
from hyper_offload.errors import ReplayMismatchError
from hyper_offload.passes import AccessKind, ActivationTrace, StorageAccess, TraceOp


def test_op_guide_binds_leaves_and_detects_a_changed_step() -> None:
    trace = ActivationTrace(
        ops=(TraceOp("split", (StorageAccess(0, AccessKind.WRITE), StorageAccess(1, AccessKind.WRITE)), outputs=(0, 1)),),
        storage_sizes={0: 4, 1: 4},
        budget_bytes=8,
    )
    guide = OpGuide.from_trace(trace)
    assert guide.storage_of_leaf(0, 1) == 1
    assert guide.check_op(0, "split", 2).output_leaf_count == 2
    with pytest.raises(ReplayMismatchError, match="warmup recorded split with 2 output tensors, replay ran mm with 1"):
        guide.check_op(0, "mm", 1)
    with pytest.raises(ReplayMismatchError, match="recorded only 1 ops"):
        guide.check_op(1, "mm", 1)
    with pytest.raises(ReplayMismatchError, match="op indices start at 0"):
        guide.check_op(-1, "split", 2)
