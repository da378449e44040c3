"""Memory: resident activation bytes stay under the budget, and replay follows the plan.

``DeviceMemoryMeter`` (entered before the session, so it sees every op the model runs
and none of the runtime's copies) counts the bytes of every storage the step creates:
exactly the storages the session tracks.
"""

from __future__ import annotations

import pytest
import torch

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.config import MIB
from hyper_offload.passes import required_bytes, resident_bytes_without_offload
from hyper_offload.runtime import DeviceMemoryMeter

from .models import CASES, make_pair, train_step

# Inputs large enough that activations, not the (retained) gradients, dominate.
BIG_INPUT = {"mlp": (256, 32), "transformer": (8, 32, 32)}


def _metered_step(session: OffloadSession, model, x, opt, step: int) -> DeviceMemoryMeter:
    meter = DeviceMemoryMeter("cpu")
    with meter:
        with session:
            train_step(model, x, opt, step)
    return meter


def _feasible_budget(case_name: str) -> tuple[int, int]:
    """A budget every op can meet (>= the largest unavoidable bytes) yet well below the
    plain peak, found from a probe warmup with an unlimited budget."""
    model, _, x = make_pair(CASES[case_name], torch.float32, input_shape=BIG_INPUT[case_name])
    probe = OffloadSession(OffloadConfig())
    with probe:
        train_step(model, x, torch.optim.SGD(model.parameters(), lr=0.0), 0)
    trace = probe.trace
    assert trace is not None
    peak = max(resident_bytes_without_offload(trace))
    need = max(required_bytes(trace))
    assert need < peak * 0.8, "the model offers nothing to offload; the test proves nothing"
    return max(need, int(peak * 0.6)), peak


@pytest.mark.parametrize("case_name", ["mlp", "transformer"])
def test_peak_within_budget_and_replay_follows_plan(case_name: str) -> None:
    budget, plain_peak = _feasible_budget(case_name)
    model, _, x = make_pair(CASES[case_name], torch.float32, input_shape=BIG_INPUT[case_name])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    warm = _metered_step(session, model, x, opt, 0)
    assert warm.peak_bytes <= budget < plain_peak, (warm.peak_bytes, budget, plain_peak)
    assert session.last_stats.evictions > 0
    report = session.report
    assert report is not None and report.ok and report.feasible
    for step in (1, 2):
        meter = _metered_step(session, model, x, opt, step)
        # The measured curve is the validator's prediction, op for op.
        assert meter.curve() == list(report.resident_bytes)[:-1]  # the last: the step-end op
        assert session.last_stats.resident_curve == list(report.resident_bytes)
        assert meter.peak_bytes <= budget
        assert session.last_stats.peak_resident_bytes == report.peak_resident_bytes
        assert session.last_stats.bytes_d2h == report.bytes_d2h
        assert session.last_stats.bytes_h2d == report.bytes_h2d


def test_infeasible_budget_is_met_where_possible() -> None:
    """Budget 0: every op is over, but replay never exceeds the unavoidable bytes."""
    model, _, x = make_pair(CASES["mlp"], torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    _metered_step(session, model, x, opt, 0)
    need = required_bytes(session.trace)
    meter = _metered_step(session, model, x, opt, 1)
    assert meter.curve() == list(session.report.resident_bytes)[:-1]  # the last: the step-end op
    assert all(c <= n for c, n in zip(meter.curve(), need))
