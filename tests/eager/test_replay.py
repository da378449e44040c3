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


def test_reading_a_released_activation_raises_instead_of_crashing() -> None:
    x = torch.randn(1024)
    session = OffloadSession(TIGHT)
    with session:
        (torch.tanh(x * 2) + 1).sum()  # x*2 dies after tanh in the warmup step
    assert any(a.kind is ActionKind.RELEASE_DEVICE for _, _, a in session.schedule.actions())
    with pytest.raises(OffloadSessionError, match="were both released"):
        with session:
            kept = x * 2  # this step keeps it: the schedule releases it after tanh
            (torch.tanh(kept) + 1).sum()
            kept.sum()  # would read a 0-byte storage; the guard refuses
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
        assert stats.demand_loads == 0 and stats.ops == session.trace.num_ops
