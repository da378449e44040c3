"""The eager session with functional collectives, wrapper subclasses and fake tensors
(what tensor parallel runs through the session), on one gloo rank in this process.

The multi-rank checks (DTensor models, FSDP2's refusal) are in
``tests/integration/test_tensor_parallel.py``; these pin each rule on its own.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.eager.executor_base import settle_communication
from hyper_offload.passes import AccessKind

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    h = torch.relu(x @ w)
    gathered = all_gather_tensor_autograd(h, 0, dist.group.WORLD)  # an AsyncCollectiveTensor
    return (torch.tanh(gathered) * h.sum()).pow(2).mean()


def _run(session: OffloadSession | None, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    x, w = torch.randn(64, 32), torch.randn(32, 32, requires_grad=True)
    out = []
    for _ in range(steps):
        if session is None:
            loss = _step(x, w)
            loss.backward()
        else:
            with session:
                loss = _step(x, w)
                loss.backward()
        out.append((loss.detach(), w.grad.clone()))
        w.grad = None
    return out


def test_a_collective_step_replays_exactly_with_everything_moved(one_rank):
    plain = _run(None, 1)[0]
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    for loss, grad in _run(session, 3):
        assert torch.equal(loss, plain[0]) and torch.equal(grad, plain[1])
    assert session.last_stats.phase == "replay" and session.last_stats.bytes_d2h > 0
    trace = session.trace
    names = [op.name for op in trace.ops]
    wrap = next(i for i, n in enumerate(names) if "_wrap_tensor_autograd" in n)
    assert trace.ops[wrap].outputs == ()  # the wrapper subclass's storage is not tracked
    gather = next(i for i, n in enumerate(names) if "all_gather_into_tensor" in n)
    wait = next(i for i, n in enumerate(names) if "wait_tensor" in n and i > gather)
    issued = {a.storage: a.kind for a in trace.ops[gather].accesses}
    waited = {a.storage: a.kind for a in trace.ops[wait].accesses}
    (source,) = [s for s, k in issued.items() if k is AccessKind.READ]
    (output,) = trace.ops[gather].outputs
    assert waited[source] is AccessKind.READ  # the gather reads its input until the wait
    assert waited[output] is AccessKind.WRITE  # and writes its output until then
    for between in trace.ops[gather:wait + 1]:  # in use at every op: no offload gap
        assert {source, output} <= {a.storage for a in between.accesses}
    # no copy of the output before the wait: it would copy unfinished bytes
    copies = [i for i, _, a in session.schedule.actions()
              if a.storage == output and a.kind.value == "COPY_D2H"]
    assert all(i >= wait for i in copies)


def test_ops_under_a_fake_mode_run_on_it_and_are_not_traced():
    torch.manual_seed(0)
    x = torch.randn(16, 16, requires_grad=True)

    def step(with_fake: bool) -> OffloadSession:
        x.grad = None
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
        with session:
            y = torch.relu(x @ x)
            if with_fake:  # what DTensor's sharding propagation does mid-step
                with FakeTensorMode():
                    shape = (torch.empty(4, 8) @ torch.empty(8, 2)).shape
                assert shape == (4, 2)
            y.sum().backward()
        return session

    plain, faked = step(False), step(True)
    assert [op.name for op in faked.trace.ops] == [op.name for op in plain.trace.ops]


def test_settle_communication_waits_for_the_release_and_no_longer_than_its_bound():
    # Counted, not timed (issue 45: no wall-clock limits in tests): it asks until the
    # buffer is released and not once more; held for good, it gives up after its bound.
    answers = iter([True, True, True, False])
    asked = []
    settle_communication(lambda: asked.append(1) or next(answers), timeout_s=60)
    assert len(asked) == 4
    started = time.perf_counter()
    settle_communication(lambda: True, timeout_s=0.02)  # held for good: gives up
    assert time.perf_counter() - started >= 0.02
