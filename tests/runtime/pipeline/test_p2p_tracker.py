"""P2PTracker's send release on fake requests: plain sends, and a coalesced batch (NCCL's
shape, which gloo never produces, so the multi-process tests cannot reach it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hyper_offload.passes.pipeline.meta_step import MetaStep, StepKind, parse_order
from hyper_offload.runtime.pipeline import p2p
from hyper_offload.runtime.pipeline.p2p import P2PTracker


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    """P2POp needs a default group; nothing is ever sent (the requests are fakes)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Work:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self, timeout: object = None) -> bool:
        self.log.append(self.name)
        return True


class _Stage:
    """Stage 1 of a pipeline: it sends outputs and input gradients, receives inputs."""

    def __init__(self) -> None:
        self.outputs = {m: torch.full((4,), float(m)) for m in range(2)}
        self.grads = {m: torch.full((4,), 10.0 + m) for m in range(2)}
        self.buffers = {m: torch.zeros(4, requires_grad=True) for m in range(2)}
        for m, buffer in self.buffers.items():
            buffer.grad = self.grads[m]  # what stage_backward_input leaves there
        self.args_recv_info = {m: (SimpleNamespace(buffer=self.buffers[m]),) for m in range(2)}

    def get_fwd_send_ops(self, m: int) -> list[dist.P2POp]:
        return [dist.P2POp(dist.isend, self.outputs[m], group_peer=0)]

    def get_bwd_send_ops(self, m: int) -> list[dist.P2POp]:
        return [dist.P2POp(dist.isend, self.grads[m], group_peer=0)]

    def get_fwd_recv_ops(self, m: int) -> list[dist.P2POp]:
        return [dist.P2POp(dist.irecv, torch.empty(4), group_peer=0)]


def _tracker(monkeypatch, releases, coalesced: bool) -> tuple[P2PTracker, _Stage, list[str]]:
    log: list[str] = []
    counter = iter(range(100))
    monkeypatch.setattr(p2p, "_post_one", lambda op: _Work(log, f"w{next(counter)}"))

    def batch(ops):
        if coalesced:
            return [_Work(log, "batch")]
        return [_Work(log, f"w{next(counter)}") for _ in ops]

    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", batch)
    stage = _Stage()
    return P2PTracker({1: stage}, None, num_stages=4, releases=releases), stage, log


def _key(text: str) -> tuple[StepKind, int, int]:
    leaf = MetaStep.from_str(text)
    return (leaf.kind, leaf.stage, leaf.micro)


RELEASES = {_key("1RECV_F1"): (_key("1SEND_F0"), _key("1SEND_B0"))}


def test_plain_sends_are_waited_after_the_receive_that_proves_them(monkeypatch) -> None:
    tracker, stage, log = _tracker(monkeypatch, RELEASES, coalesced=False)
    order = parse_order("1SEND_F0 1SEND_B0 1SEND_F1 1RECV_F1")
    for position, step in enumerate(order):
        tracker.run(step, position)
    # w0, w1, w2: the three sends; w3: the receive, waited at once; then the proven two.
    assert log == ["w3", "w0", "w1"]
    assert tracker.sent[_key("1SEND_F0")] == (16, 3)
    assert tracker.sent[_key("1SEND_B0")] == (16, 3)
    assert tracker.sent[_key("1SEND_F1")] == (16, None)  # not proven: waited at the end
    assert stage.buffers[0].grad is None  # the sent gradient's second owner let go
    assert stage.buffers[1].grad is stage.grads[1]  # not sent: untouched
    tracker.wait_sends()
    assert log[-1] == "w2"


def test_a_coalesced_batch_completes_its_own_sends_and_releases_the_proven_ones(monkeypatch) -> None:
    tracker, stage, log = _tracker(monkeypatch, {_key("1RECV_F1"): (_key("1SEND_F0"),)}, coalesced=True)
    tracker.run(MetaStep.from_str("1SEND_F0"), 0)
    batch = MetaStep(StepKind.BATCH_SEND_RECV, None, None, tuple(parse_order("1SEND_B0 1RECV_F1")))
    tracker.run(batch, 1)
    assert log == ["batch", "w0"]  # the batch as a whole, then the send it proves
    assert tracker.sent[_key("1SEND_B0")].released_after == 1  # complete with its batch
    assert tracker.sent[_key("1SEND_F0")].released_after == 1
    assert stage.buffers[0].grad is None
    tracker.wait_sends()
    assert log == ["batch", "w0"]  # nothing was left pending
