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
* Every op carries a tag unique to its ``(direction, sending stage, micro)``. Gloo (and
  NCCL) match messages between two ranks in posting order per tag; with one tag for all,
  a rank whose order receives ``RECV_F 3 m`` before ``RECV_B 1 m'`` while its peer sends
  the other way round would silently swap two same-shaped tensors (it happens for
  interleaved zero-bubble and ZBV orders). With tags each message can only land in the
  buffer of its own leaf, which is what ``check_execution`` assumes.
* Every wait takes the schedule's ``timeout``, so a rank whose peer died raises instead
  of hanging forever.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch.distributed as dist

from hyper_offload.passes.pipeline.meta_step import MetaStep, StepKind

__all__ = ["P2PTracker", "PipelineCommError"]

_RECV_KINDS = (StepKind.RECV_F, StepKind.RECV_B)


class PipelineCommError(RuntimeError):
    """A P2P operation of the pipeline failed or timed out."""


class P2PTracker:
    """Posts the P2P ops of one step and remembers what is still to be waited for."""

    def __init__(self, stages: Mapping[int, object], timeout: timedelta | None, num_stages: int) -> None:
        self._stages = stages
        self._num_stages = num_stages
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
            ops = stage.get_fwd_send_ops(micro)  # type: ignore[attr-defined]
        elif leaf.kind is StepKind.RECV_F:
            ops = stage.get_fwd_recv_ops(micro)  # type: ignore[attr-defined]
        elif leaf.kind is StepKind.SEND_B:
            ops = stage.get_bwd_send_ops(micro)  # type: ignore[attr-defined]
        elif leaf.kind is StepKind.RECV_B:
            ops = stage.get_bwd_recv_ops(micro)  # type: ignore[attr-defined]
        else:
            raise ValueError(f"{leaf!r} is not a P2P leaf")
        tag = p2p_tag(leaf, self._num_stages)
        return [dist.P2POp(op.op, op.tensor, group=op.group, tag=tag, group_peer=op.group_peer) for op in ops]

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


def p2p_tag(leaf: MetaStep, num_stages: int) -> int:
    """Tag shared by a P2P leaf and its matching leaf on the peer rank.

    Both name the *sending* stage: ``SEND_F s m`` ↔ ``RECV_F s+1 m`` use stage ``s``,
    ``SEND_B s m`` ↔ ``RECV_B s-1 m`` use stage ``s``; forward and backward differ in the
    lowest bit. Tag 0 stays free for other traffic.
    """
    assert leaf.stage is not None and leaf.micro is not None
    if leaf.kind is StepKind.SEND_F:
        sender, backward = leaf.stage, 0
    elif leaf.kind is StepKind.RECV_F:
        sender, backward = leaf.stage - 1, 0
    elif leaf.kind is StepKind.SEND_B:
        sender, backward = leaf.stage, 1
    elif leaf.kind is StepKind.RECV_B:
        sender, backward = leaf.stage + 1, 1
    else:
        raise ValueError(f"{leaf!r} is not a P2P leaf")
    return 1 + 2 * (leaf.micro * num_stages + sender) + backward
