"""The eager door keeps the host budget (issue 44): under ``max_host_activation_mb`` the
host pool never holds more than the budget (its high-water mark, in pool buckets), every
step is exact, and the session says the host budget binds and how to fix it."""

from __future__ import annotations

import warnings

import pytest
import torch

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.config import MIB
from hyper_offload.errors import ConfigurationError, OffloadBudgetWarning
from hyper_offload.passes.ir.schedule import MIN_BUCKET_BYTES
from hyper_offload.passes.plan.host_budget import host_curve

from .models import CASES, assert_same_state, make_pair, plain_peak_bytes, train_step


def _run(config: OffloadConfig, steps: int = 3) -> tuple[OffloadSession, list[str]]:
    """``steps`` steps of the transformer case against the plain model: every loss,
    gradient and parameter must be equal. Returns the session and its warnings."""
    model, ref, x = make_pair(CASES["transformer"], torch.float32)
    session = OffloadSession(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    caught: list[str] = []
    for step in range(steps):
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            with session:
                loss = train_step(model, x, opt, step)
        caught += [str(r.message) for r in records if issubclass(r.category, OffloadBudgetWarning)]
        ref_loss = train_step(ref, x, ref_opt, step)
        assert torch.equal(loss, ref_loss), f"step {step}: loss differs"
        assert_same_state(model, ref, f"step {step}")
        opt.step()
        ref_opt.step()
    return session, caught


@pytest.fixture(scope="module")
def device_budget_mb() -> float:
    model, _, x = make_pair(CASES["transformer"], torch.float32)
    return plain_peak_bytes(model, x) // 2 / MIB


@pytest.fixture(scope="module")
def unlimited_host_peak(device_budget_mb: float) -> int:
    """The host pool's high-water mark with a host budget that never binds."""
    session, caught = _run(OffloadConfig(max_resident_activation_mb=device_budget_mb,
                                         max_host_activation_mb=1024))
    assert not any("host budget" in m for m in caught)
    peak = session.pool.stats().pinned_bytes_peak
    assert peak > 4 * MIN_BUCKET_BYTES, "too little offloaded for the host budget to bind"
    return peak


def test_the_host_pool_stays_within_the_host_budget_and_the_steps_are_exact(
    device_budget_mb: float, unlimited_host_peak: int
) -> None:
    budget = unlimited_host_peak // 2
    session, caught = _run(OffloadConfig(max_resident_activation_mb=device_budget_mb,
                                         max_host_activation_mb=budget / MIB))
    stats = session.pool.stats()
    assert session.host_budget_bytes == budget
    assert stats.pinned_bytes_peak <= budget  # measured high-water mark, buckets counted
    assert stats.pageable_fallbacks == 0
    assert session.last_stats is not None and session.last_stats.bytes_d2h > 0  # still offloads
    plan = session._plan
    assert plan is not None and host_curve(plan.trace, plan.schedule).peak <= budget
    # The host budget kept bytes on the device: the session says so, with the knob.
    assert any("host budget" in m and "max_host_activation_mb" in m for m in caught), caught


def test_a_host_budget_of_nothing_offloads_nothing_and_stays_exact(device_budget_mb: float) -> None:
    session, caught = _run(OffloadConfig(max_resident_activation_mb=device_budget_mb,
                                         max_host_activation_mb=0), steps=2)
    assert session.pool.stats().pinned_bytes_peak == 0
    assert session.last_stats is not None and session.last_stats.bytes_d2h == 0
    assert any("host budget of 0 B" in m for m in caught), caught


def test_the_node_view_divides_available_memory_by_the_local_ranks() -> None:
    from hyper_offload.config import available_host_bytes

    one = OffloadConfig(local_world_size=1).host_budget_bytes()
    eight = OffloadConfig(local_world_size=8).host_budget_bytes()
    available = available_host_bytes()
    # Available memory moves a little between reads: compare with a slack of 1/16.
    assert abs(one - available) <= available // 16
    assert abs(eight - available // 8) <= available // 16 // 8 + 1
    assert OffloadConfig(max_host_activation_mb=3).host_budget_bytes() == 3 * MIB


@pytest.mark.parametrize("kwargs,field", [
    ({"max_host_activation_mb": -1}, "max_host_activation_mb"),
    ({"max_host_activation_mb": float("inf")}, "max_host_activation_mb"),
    ({"local_world_size": 0}, "local_world_size"),
    ({"local_world_size": True}, "local_world_size"),
    ({"pageable_fallback": 1}, "pageable_fallback"),
    ({"max_host_activation_mb": 2, "max_offload_activation_mb": 3}, "deprecated alias"),
])
def test_host_options_are_validated(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        OffloadConfig(**kwargs)


def test_the_old_pinned_cap_is_a_deprecated_alias_of_the_host_budget() -> None:
    with pytest.warns(DeprecationWarning, match="max_host_activation_mb"):
        config = OffloadConfig(max_offload_activation_mb=8)
    assert config.max_host_activation_mb == 8 and config.host_budget_bytes() == 8 * MIB
    assert config.max_offload_activation_mb is None  # one field holds the budget
