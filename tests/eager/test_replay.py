"""ReplayExecutor: schedule actions, output-structure checks, safety against released bytes."""

from __future__ import annotations

import pytest
import torch

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.eager import OffloadSessionError, ReplayMismatchError
from hyper_offload.config import MIB
from hyper_offload.passes import ActionKind

# Strict from the first replay (max_warmups=1): these tests pin the mismatch errors; the
# session's settling (re-warming by itself until two steps agree) has its own tests.
TIGHT = OffloadConfig(max_resident_activation_mb=4 * 1024 / MIB, max_warmups=1)


def _chunks(x: torch.Tensor, n: int) -> torch.Tensor:
    parts = (x * 2).chunk(n)
    return torch.stack([p.sum() for p in parts]).sum()


def test_leaf_count_mismatch_names_both_counts() -> None:
    x = torch.randn(64)
    session = OffloadSession(TIGHT)
    with session:
        _chunks(x, 2)
    with pytest.raises(ReplayMismatchError) as info:
        with session:
            _chunks(x, 4)
    index = next(i for i, op in enumerate(session.trace.ops) if "split" in op.name)
    assert f"replay op {index}: warmup recorded aten.split.Tensor with 2 output leaves" in str(info.value)
    assert "replay ran aten.split.Tensor with 4" in str(info.value)
    assert session.pool.stats().buffers_in_use == 0 and len(session.manager) == 0


def test_longer_step_is_reported() -> None:
    x = torch.randn(64)
    session = OffloadSession(TIGHT)
    with session:
        y = x * 2
    with pytest.raises(ReplayMismatchError, match="recorded only 1 ops"):
        with session:
            y = x * 2
            y = y + 1
    del y


def test_a_step_that_reads_what_its_warmup_freed_is_caught_before_the_read() -> None:
    """The warmup saw ``x*2`` die after tanh; this step keeps it and reads it again. The
    plan's drop of its bytes waits until nothing references it, so the replay keeps them
    (on the host) and sees the read as a step whose ops changed, before the kernel runs:
    strict, it raises ``ReplayMismatchError`` naming the op and the storage (it used to
    raise "device and host copies were both released": the bytes were gone)."""
    x = torch.randn(1024)
    session = OffloadSession(TIGHT)
    with session:
        (torch.tanh(x * 2) + 1).sum()  # x*2 dies after tanh in the warmup step
    assert any(a.kind is ActionKind.RELEASE_DEVICE for _, _, a in session.schedule.actions())
    with pytest.raises(ReplayMismatchError, match=r"reads storage \d+, which its warmup saw "
                       r"freed after op \d+"):
        with session:
            kept = x * 2  # this step keeps it: the schedule releases it after tanh
            (torch.tanh(kept) + 1).sum()
            kept.sum()  # reads it again: refused before the kernel, not read at 0 bytes
    assert torch.equal(kept, x * 2)  # its bytes were kept and paged back
    assert session.pool.stats().buffers_in_use == 0


def test_settling_the_same_step_re_warms_and_computes_exactly() -> None:
    x = torch.randn(1024)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=4 * 1024 / MIB))
    with session:
        (torch.tanh(x * 2) + 1).sum()
    with session:
        kept = x * 2
        (torch.tanh(kept) + 1).sum()
        total = kept.sum()
    assert torch.equal(total, (x * 2).sum()) and session.rewarms == 1
    assert session.last_stats.rescued == 1 and session.last_stats.phase == "warmup"
    assert session.pool.stats().buffers_in_use == 0


def test_replay_runs_exactly_the_planned_actions() -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    x = torch.randn(32, 64)

    def step() -> None:
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        h.sum().backward()

    session = OffloadSession(TIGHT)
    with session:
        step()
    report = session.report
    for _ in range(3):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        with session:
            step()
        stats = session.last_stats
        assert stats.transfers == report.num_transfers > 0
        assert (stats.bytes_d2h, stats.bytes_h2d) == (report.bytes_d2h, report.bytes_h2d)
        assert stats.resident_curve == list(report.resident_bytes)
        assert stats.demand_loads == 0
        assert stats.ops == session.trace.num_ops - 1  # the trace ends with the step-end op


def _growing_step(p: torch.Tensor, q: list[torch.Tensor]) -> torch.Tensor:
    """``addbmm_`` on a 0-dim activation grows its storage to (5, 10); the grown tensor
    is saved for the last multiply's backward."""
    generator = torch.Generator().manual_seed(0)
    x, b1, b2 = (torch.randn(shape, generator=generator) for shape in ((), (5, 5, 5), (5, 5, 10)))
    a = x * p
    a.addbmm_(b1 * q[0], b2 * q[1], beta=0.6, alpha=0.2)
    loss = (a * q[2]).sum()
    loss.backward()
    return loss.detach()


def test_an_in_place_op_that_grows_its_output_replays_exactly() -> None:
    """Found by the op database sweep (``addbmm_``, in-place variant): the replay raised
    "the storage was resized outside the manager" at the grown activation's D2H."""
    params = [torch.ones((), requires_grad=True), torch.ones(5, 5, 5, requires_grad=True),
              torch.ones(5, 5, 10, requires_grad=True), torch.ones((), requires_grad=True)]
    want = _growing_step(params[0], params[1:])
    want_grads = [p.grad.clone() for p in params]
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    for _ in range(3):
        for p in params:
            p.grad = None
        with session:
            got = _growing_step(params[0], params[1:])
        assert torch.equal(got, want)
        assert all(torch.equal(p.grad, g) for p, g in zip(params, want_grads))
    assert session.phase == "replay" and session.last_stats.bytes_d2h > 0
