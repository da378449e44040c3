"""P2P issue and wait for the executor: plain leaves and fused ``BATCH_SEND_RECV`` batches.

* A plain ``RECV_*`` posts its irecv and waits for it at once (the order places it right
  before the compute that needs it; ``check_execution`` proves no rank deadlocks under
  that rule). A plain ``SEND_*`` posts its isend and moves on; sends are waited for at the
  end of the step.
* A ``BATCH_SEND_RECV`` posts every op of the batch in one ``batch_isend_irecv`` and then
  waits **for its receives only**; its sends are waited for lazily, like plain sends.
  Waiting for the sends too would deadlock interleaved and V-shaped orders on a backend
  that completes a batch only when the peer has posted the matching ops of *its* next
  batch (see docs/architecture.md). Where the backend coalesces the batch into a single
  request (NCCL), that one request covers the sends too and is waited as a whole.
* Every wait takes the schedule's ``timeout``, so a rank whose peer died raises instead
  of hanging forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from hyper_offload.passes.pipeline.meta_step import MetaStep, StepKind

__all__ = ["P2PTracker", "PipelineCommError"]

_RECV_KINDS = (StepKind.RECV_F, StepKind.RECV_B)


class PipelineCommError(RuntimeError):
    """A P2P operation of the pipeline failed or timed out."""


class P2PTracker:
    """Posts the P2P ops of one step and remembers what is still to be waited for."""

    def __init__(self, stages: dict[int, object], timeout: timedelta | None) -> None:
        self._stages = stages
        self._timeout = timeout
        self._sends: list[tuple[MetaStep, dist.Work]] = []
        self.received: set[tuple[StepKind, int, int]] = set()

    def run(self, step: MetaStep) -> None:
        """Execute one plain P2P leaf or one ``BATCH_SEND_RECV``."""
        leaves = list(step.leaves())
        ops_per_leaf = [self._ops_of(leaf) for leaf in leaves]
        flat = [op for ops in ops_per_leaf for op in ops]
        if not flat:
            self._mark_received(leaves)
            return
        works = self._post(step, flat)
        if len(works) != len(flat):  # a coalesced batch: one request for all of it
            for work in works:
                self._wait(step, work)
            self._mark_received(leaves)
            return
        cursor = 0
        for leaf, ops in zip(leaves, ops_per_leaf):
            mine = works[cursor : cursor + len(ops)]
            cursor += len(ops)
            if leaf.kind in _RECV_KINDS:
                for work in mine:
                    self._wait(leaf, work)
            else:
                self._sends.extend((leaf, work) for work in mine)
        self._mark_received(leaves)

    def wait_sends(self) -> None:
        """End of step: every posted send must complete."""
        sends, self._sends = self._sends, []
        for leaf, work in sends:
            self._wait(leaf, work)

    def drop(self) -> None:
        """Exception path: forget posted sends (their requests die with the process group)."""
        self._sends.clear()
        self.received.clear()

    def _ops_of(self, leaf: MetaStep) -> list[dist.P2POp]:
        stage = self._stages[leaf.stage]  # type: ignore[index]
        micro = leaf.micro
        if leaf.kind is StepKind.SEND_F:
            return stage.get_fwd_send_ops(micro)  # type: ignore[attr-defined]
        if leaf.kind is StepKind.RECV_F:
            return stage.get_fwd_recv_ops(micro)  # type: ignore[attr-defined]
        if leaf.kind is StepKind.SEND_B:
            return stage.get_bwd_send_ops(micro)  # type: ignore[attr-defined]
        if leaf.kind is StepKind.RECV_B:
            return stage.get_bwd_recv_ops(micro)  # type: ignore[attr-defined]
        raise ValueError(f"{leaf!r} is not a P2P leaf")

    def _post(self, step: MetaStep, ops: Sequence[dist.P2POp]) -> list[dist.Work]:
        try:
            if step.kind is StepKind.BATCH_SEND_RECV and len(ops) > 1:
                return list(dist.batch_isend_irecv(list(ops)))
            return [_post_one(op) for op in ops]
        except Exception as exc:
            raise PipelineCommError(f"{step!r}: posting {len(ops)} P2P op(s) failed: {exc}") from exc

    def _wait(self, step: MetaStep, work: dist.Work) -> None:
        try:
            if self._timeout is None:
                work.wait()
            else:
                work.wait(self._timeout)
        except Exception as exc:
            raise PipelineCommError(
                f"{step!r}: P2P wait failed or timed out after {self._timeout}: {exc}. A peer rank "
                "probably failed or runs a different order; its own error says which"
            ) from exc

    def _mark_received(self, leaves: Sequence[MetaStep]) -> None:
        for leaf in leaves:
            if leaf.kind in _RECV_KINDS:
                assert leaf.stage is not None and leaf.micro is not None
                self.received.add((leaf.kind, leaf.stage, leaf.micro))


def _post_one(op: dist.P2POp) -> dist.Work:
    if op.op is dist.isend:
        return dist.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)
    return dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer)
