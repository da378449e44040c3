"""P2P issue and wait for the executor: plain leaves and fused ``BATCH_SEND_RECV`` batches.

* A plain ``RECV_*`` posts its irecv and waits for it at once (the order places it right
  before the compute that needs it; ``check_execution`` proves no rank deadlocks under
  that rule). A plain ``SEND_*`` posts its isend and moves on; it is waited for later
  (below).
* A ``BATCH_SEND_RECV`` posts every op of the batch in one ``batch_isend_irecv`` and then
  waits **for its receives only**; its sends are waited for later, like plain sends.
  Waiting for the sends too would deadlock interleaved and V-shaped orders on a backend
  that completes a batch only when the peer has posted the matching ops of *its* next
  batch (see docs/architecture.md). Where the backend coalesces the batch into a single
  request (NCCL), that one request covers the sends too and is waited as a whole.
* A pending send is waited for as soon as the order proves its receiver has it
  (:func:`~hyper_offload.passes.pipeline.execution.send_releases`: after the step of
  a receive whose message the receiver posted after its matching receive). That wait
  returns at once, and dropping the request frees the sent tensor there instead of at the
  end of the step. Sends never proven are waited at the end of the step.
* A sent input gradient has a second owner: torch's stage stores it as the ``.grad`` of
  the chunk's receive buffer (``stage_backward`` accumulates into the inputs) and clears
  those only when the next step starts (``clear_runtime_states``). Once the send is proven,
  the tracker clears the ``.grad`` of that chunk's buffers whose storage it sent, which is
  what torch does for every chunk at the next step, done as early as the gradient is no
  longer needed.
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
from typing import NamedTuple

import torch.distributed as dist

from hyper_offload.errors import ConfigurationError, PipelineCommError
from hyper_offload.passes.pipeline.execution import P2PKey, SendReleases, p2p_key
from hyper_offload.passes.pipeline.meta_step import RECV_KINDS, MetaStep, StepKind

__all__ = ["P2PTracker", "PipelineCommError", "SentTensor"]


class SentTensor(NamedTuple):
    """What one send leaf of a step kept alive, and until when."""

    nbytes: int
    """Bytes of the distinct storages it sent (what the device meter counts)."""
    released_after: int | None
    """Position of the step after which it was waited: proven received, or complete with
    its coalesced batch; ``None``: waited with the sends left at the end of the step."""


class P2PTracker:
    """Posts the P2P ops of one step and remembers what is still to be waited for.

    ``releases`` (this rank's
    :func:`~hyper_offload.passes.pipeline.execution.send_releases` table) says after
    which receive each send is proven received; ``None`` waits every send at the end of the
    step. ``sent`` records every send leaf of the step (its bytes, where it was released).
    """

    def __init__(
        self,
        stages: Mapping[int, object],
        timeout: timedelta | None,
        num_stages: int,
        releases: SendReleases | None = None,
    ) -> None:
        self._stages = stages
        self._num_stages = num_stages
        self._timeout = timeout
        self._releases = releases if releases is not None else {}
        # send -> (leaf, its requests, the storages it sent)
        self._sends: dict[P2PKey, tuple[MetaStep, list[dist.Work], frozenset[int]]] = {}
        self.received: set[P2PKey] = set()
        self.sent: dict[P2PKey, SentTensor] = {}

    def run(self, step: MetaStep, position: int = -1) -> None:
        """Execute one plain P2P leaf or one ``BATCH_SEND_RECV`` (``position`` in the order)."""
        leaves = list(step.leaves())
        ops_per_leaf = [self._ops_of(leaf) for leaf in leaves]
        sent: dict[int, frozenset[int]] = {}  # leaf index -> the storages it sends
        for index, (leaf, ops) in enumerate(zip(leaves, ops_per_leaf)):
            if leaf.kind not in RECV_KINDS:
                storages = _storage_sizes(ops)
                sent[index] = frozenset(storages)
                self.sent[p2p_key(leaf)] = SentTensor(sum(storages.values()), None)
        flat = [op for ops in ops_per_leaf for op in ops]
        if not flat:
            self._mark_received(leaves)
            return
        works = self._post(step, flat)
        if len(works) != len(flat):  # a coalesced batch: one request for all of it
            for work in works:
                self._wait(step, work)
            self._mark_received(leaves)
            for index, storages in sent.items():  # complete with the batch
                self._released(leaves[index], storages, position)
            self._release_proven(leaves, position)
            return
        cursor = 0
        for index, (leaf, ops) in enumerate(zip(leaves, ops_per_leaf)):
            mine = works[cursor : cursor + len(ops)]
            cursor += len(ops)
            if leaf.kind in RECV_KINDS:
                for work in mine:
                    self._wait(leaf, work)
            else:
                self._sends[p2p_key(leaf)] = (leaf, mine, sent[index])
        self._mark_received(leaves)
        self._release_proven(leaves, position)

    def wait_sends(self) -> None:
        """End of step: every send still pending must complete."""
        sends, self._sends = self._sends, {}
        for leaf, works, _ in sends.values():
            for work in works:
                self._wait(leaf, work)

    def drop(self) -> None:
        """Exception path: forget posted sends (their requests die with the process group)."""
        self._sends.clear()
        self.received.clear()

    def _release_proven(self, leaves: Sequence[MetaStep], position: int) -> None:
        """Wait the sends this step's receives prove received, dropping their requests (and
        with them the last reference to the sent tensors)."""
        for leaf in leaves:
            if leaf.kind not in RECV_KINDS:
                continue
            for send in self._releases.get(p2p_key(leaf), ()):
                pending = self._sends.pop(send, None)
                if pending is None:
                    continue  # a send of an empty op list, or one waited already
                sent_leaf, works, storages = pending
                for work in works:
                    self._wait(sent_leaf, work)
                self._released(sent_leaf, storages, position)

    def _released(self, leaf: MetaStep, storages: frozenset[int], position: int) -> None:
        """Bookkeeping of a send waited after step ``position``: its log entry, and the
        receive buffers' ``.grad`` that still held a sent input gradient."""
        if leaf.kind is StepKind.SEND_B:
            self._drop_input_grads(leaf, storages)
        key = p2p_key(leaf)
        self.sent[key] = self.sent[key]._replace(released_after=position)

    def _drop_input_grads(self, leaf: MetaStep, storages: frozenset[int]) -> None:
        """Clear the ``.grad`` of the chunk's receive buffers that hold the gradient just sent."""
        stage = self._stages[leaf.stage]  # type: ignore[index]
        for info in getattr(stage, "args_recv_info", {}).get(leaf.micro, ()):
            buffer = getattr(info, "buffer", None)
            grad = getattr(buffer, "grad", None)
            if grad is not None and grad.untyped_storage().data_ptr() in storages:
                buffer.grad = None

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
            raise ConfigurationError(f"{leaf!r} is not a P2P leaf")
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
            if leaf.kind in RECV_KINDS:
                self.received.add(p2p_key(leaf))


def _storage_sizes(ops: Sequence[dist.P2POp]) -> dict[int, int]:
    """The distinct storages the ops send: data pointer -> bytes (what the meter counts)."""
    return {op.tensor.untyped_storage().data_ptr(): op.tensor.untyped_storage().nbytes() for op in ops}


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
        raise ConfigurationError(f"{leaf!r} is not a P2P leaf")
    return 1 + 2 * (leaf.micro * num_stages + sender) + backward
