"""WarmupExecutor: trace recording (accesses, outputs, retained) and online eviction."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.eager import OffloadSessionError
from hyper_offload.config import MIB
from hyper_offload.passes import AccessKind, ResidencySchedule, resident_bytes_without_offload
from hyper_offload.runtime import DeviceMemoryMeter

KIB = 1024


def _kib(n: float) -> OffloadConfig:
    return OffloadConfig(max_resident_activation_mb=n * KIB / MIB)


def test_trace_records_reads_writes_views_and_outputs() -> None:
    w = torch.randn(16, 16, requires_grad=True)  # pre-existing: never in the trace
    x = torch.randn(8, 16)
    session = OffloadSession(OffloadConfig())
    with session:
        h = x @ w              # op 0: fresh output
        v = h.view(16, 8)      # op 1: a view of h
        v.mul_(2)              # op 2: in-place write through the view
        y = h.relu()           # op 3: reads h, writes y
        loss = y.sum()
    ops = session.trace.ops
    names = [op.name for op in ops]
    assert names[:4] == ["aten.mm.default", "aten.view.default", "aten.mul_.Tensor", "aten.relu.default"]
    sum_op = ops[names.index("aten.sum.default")]
    h_sid = ops[0].outputs[0]
    assert dict(ops[0].accesses) == {h_sid: AccessKind.WRITE}  # w and x are not tracked
    assert ops[1].outputs == (h_sid,) and dict(ops[1].accesses) == {h_sid: AccessKind.READ}
    assert dict(ops[2].accesses) == {h_sid: AccessKind.WRITE}  # schema: Tensor(a!) self
    y_sid = ops[3].outputs[0]
    assert dict(ops[3].accesses) == {h_sid: AccessKind.READ, y_sid: AccessKind.WRITE}
    assert session.trace.storage_sizes[h_sid] == 8 * 16 * 4
    # Alive after the step: h (through v), y, loss. All three are retained.
    assert session.trace.retained == frozenset({h_sid, y_sid, sum_op.outputs[0]})
    assert all(op.duration_s is not None and op.duration_s >= 0 for op in ops)
    del v, y, loss


def test_dead_storages_are_not_retained() -> None:
    x = torch.randn(64)
    session = OffloadSession(OffloadConfig())
    with session:
        tmp = x * 2
        out = tmp + 1
        del tmp
    assert session.trace.retained == frozenset({session.trace.ops[1].outputs[0]})
    del out


def test_online_eviction_fits_and_pages_back_on_use() -> None:
    session = OffloadSession(_kib(8))
    x = torch.randn(16)
    meter = DeviceMemoryMeter("cpu")
    with meter:
        with session:
            a, b = torch.split(x.repeat(64) + 0, [256, 768])  # op: one 4 KiB storage
            c = torch.randn(512) * 1  # 2 KiB + 2 KiB (randn, mul)
            d = torch.randn(1024) + 0  # needs room: a/b's storage (earliest) goes first
            total = a.sum() + b.sum() + c.sum() + d.sum()  # pages it back
    stats = session.last_stats
    assert stats.evictions >= 1 and stats.demand_loads >= 1
    assert meter.peak_bytes <= 8 * KIB
    assert torch.equal(total, a.sum() + b.sum() + c.sum() + d.sum())
    assert torch.equal(a, x.repeat(64)[:256]) and torch.equal(b, x.repeat(64)[256:])


def test_victim_order_earliest_producer_first() -> None:
    session = OffloadSession(_kib(7))
    with session:
        first = torch.ones(256)  # op 0: 1 KiB
        second = torch.ones(1280).split([256, 1024])  # op 1: one 5 KiB storage
        third = torch.ones(512)  # 6 + 2 KiB > 7 KiB: op 0's storage is evicted
        evicted = list(session.manager)
    assert [session.trace.ops[0].outputs[0]] == evicted
    assert torch.equal(first, torch.ones(256))  # paged back at the end of the step
    del second, third


def test_victim_order_larger_first_within_an_op() -> None:
    session = OffloadSession(_kib(4))
    with session:
        values, indices = torch.sort(torch.arange(256.0).flip(0))  # 1 KiB + 2 KiB (int64)
        more = torch.ones(512)  # 3 + 2 KiB > 4 KiB: the larger output of sort goes
        evicted = list(session.manager)
    sort_op = next(op for op in session.trace.ops if "sort" in op.name)
    assert evicted == [sort_op.outputs[1]]
    assert torch.equal(indices, torch.arange(256).flip(0)) and torch.equal(values, torch.arange(256.0))
    del more


def test_random_factory_ops_draw_the_same_numbers() -> None:
    """The output-size estimate runs ops on meta tensors only: no extra RNG draws."""
    torch.manual_seed(0)
    expected = [torch.randn(100), torch.rand(5), torch.nn.functional.dropout(torch.ones(50), 0.5)]
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    for _ in range(2):  # warmup, replay
        torch.manual_seed(0)
        with session:
            got = [torch.randn(100), torch.rand(5), torch.nn.functional.dropout(torch.ones(50), 0.5)]
        assert all(torch.equal(a, b) for a, b in zip(expected, got))


class EmptyPlanner:
    def plan(self, trace):  # type: ignore[no-untyped-def]
        return ResidencySchedule.empty(trace.num_ops)


def test_invalid_plan_is_refused() -> None:
    session = OffloadSession(OffloadConfig(planner=EmptyPlanner()))
    with pytest.raises(OffloadSessionError, match="check_schedule rejects"):
        with session:
            (torch.randn(4) * 2).sum()
    assert session.phase == "warmup"
    assert session.pool.stats().buffers_in_use == 0


def test_warmup_numerics_with_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(128, 16)
    expected = model(x).sum()
    expected.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    session = OffloadSession(_kib(40))
    with session:
        loss = model(x).sum()
        loss.backward()
    assert session.last_stats.evictions > 0
    assert torch.equal(loss, expected)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


# ------------------------------------------------------------------ budgets warmup cannot meet


def _gpt_step_session(zero_grad_inside: bool) -> tuple[list, list, float]:
    """The tiny GPT of ``benchmarks/eager_step.py`` (``opt.step()`` inside the session)
    at half its trace's peak: the warnings of warmup, every step's peak, the budget."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, dim=32, layers=2, heads=2, seq_len=16))
    idx = torch.randint(0, 64, (2, 16))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(idx, torch.roll(idx, -1, dims=1)).backward()
        opt.step()
        if zero_grad_inside:
            opt.zero_grad(set_to_none=True)

    probe = OffloadSession(OffloadConfig())
    with probe:
        step()
    budget = max(resident_bytes_without_offload(probe.trace)) // 2
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    peaks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with session:
                step()
            peaks.append(session.last_stats.peak_resident_bytes)
    return [w for w in caught if w.category.__name__ == "OffloadBudgetWarning"], peaks, budget


def test_warmup_counts_what_outlives_the_step_and_warns_with_the_figures() -> None:
    # Regression: warmup reported 88,192 B (under the 89,088 B budget) and every replay
    # 112,128 B. Warmup had left out the end of the step, where the gradients (112,128 B,
    # more than the budget by themselves) are paged back to the device.
    warned, peaks, budget = _gpt_step_session(zero_grad_inside=False)
    warmup_peak, *replay_peaks = peaks
    assert all(peak <= warmup_peak for peak in replay_peaks), peaks  # never above warmup
    assert warmup_peak > budget
    (warning,) = warned
    text = str(warning.message)
    assert f"budget of {budget} B" in text and f"plan's peak of {replay_peaks[0]} B" in text
    assert "outlives it" in text and "zero_grad(set_to_none=True)" in text
    assert warning.filename == __file__  # points at the caller's `with session:`


def test_freeing_the_gradients_in_the_session_meets_the_budget_without_a_warning() -> None:
    warned, peaks, budget = _gpt_step_session(zero_grad_inside=True)
    assert warned == [] and all(peak <= budget for peak in peaks), (peaks, budget)
