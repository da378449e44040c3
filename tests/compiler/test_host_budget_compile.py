"""The compile door keeps the host budget (issue 44), measured on CPU with aot_eager.

A 4-block model at half its saved bytes on the device, with a host budget of 1.5 MiB
(about half of what that device budget would move):

* ``recompute="off"``: the plan keeps on the device what the host cannot take, past the
  device budget, and says the host binds; the host pool's high-water mark stays within
  the host budget (the step scope's first step, at its floor, is held by the runtime);
* ``recompute="auto"``: the same budget pair gets recompute and then fits both budgets.

Every step's loss and gradients are ``torch.equal`` to plain aot_eager of the same layout.
"""

from __future__ import annotations

import pytest
import torch

import hyper_offload

from .step_models import SLACK, build, exact, train

HOST_MIB = 1.5
HOST = int(HOST_MIB * (1 << 20))
STEPS = 3


@pytest.fixture(scope="module")
def plain() -> dict[str, object]:
    results = {}
    for layout in ("per_block", "whole"):
        torch._dynamo.reset()
        model, step = build(layout, "aot_eager")
        results[layout] = train(model, step, 1)[0]
    return results


def _run(layout: str, budget: int, **options):
    torch._dynamo.reset()
    backend = hyper_offload.backend(
        inner_compiler="aot_eager", max_resident_activation_mb=budget / (1 << 20),
        max_host_activation_mb=HOST_MIB, **options,
    )
    model, step = build(layout, backend)
    return backend, train(model, step, STEPS)


def _host_kept(backend, results, reference) -> None:
    """Exact steps, and the host pool never held more than the host budget."""
    for number, result in enumerate(results, 1):
        assert exact(result, reference), f"step {number} differs from plain aot_eager"
    pool = backend.runtime.pool.stats()
    assert pool.pinned_bytes_peak <= HOST, pool  # measured high-water mark, in buckets
    assert pool.pageable_fallbacks == 0


@pytest.mark.parametrize("recompute", ["off", "auto"])
def test_step_scope_keeps_the_host_budget(plain, recompute: str) -> None:
    reference = plain["per_block"]
    budget = reference.saved_bytes // 2
    backend, results = _run("per_block", budget, recompute=recompute)
    _host_kept(backend, results, reference)
    report = backend.step_report
    assert report is not None and report.host_budget_bytes == HOST
    assert report.peak_host_bytes <= HOST
    # The first step runs at the floor (everything moved): the host budget held it, by
    # keeping on the device what its pool had no room for.
    assert backend.runtime.bytes_kept_for_host > 0
    if recompute == "off":
        # The device budget alone would move more than the host holds: the plan keeps
        # it on the device, over the device budget, and says the host binds.
        assert report.binding == "host" and not report.fits
        assert all(r.saved_bytes > budget for r in results[1:])
        assert "binding: host" in str(report)
    else:
        # The pair needs recompute: the step's regions were lowered again, and the step
        # then fits both budgets.
        assert report.relowered and report.fits and report.binding == "device"
        assert all(r.saved_bytes <= budget + SLACK for r in results[1:])


@pytest.mark.parametrize("recompute", ["off", "auto"])
def test_region_scope_keeps_the_host_budget(plain, recompute: str) -> None:
    reference = plain["whole"]
    budget = reference.saved_bytes // 2
    backend, results = _run("whole", budget, recompute=recompute, budget_scope="region")
    _host_kept(backend, results, reference)
    (region,) = backend.reports
    assert region.host_budget_bytes == HOST and region.peak_host_bytes <= HOST
    assert backend.runtime.bytes_kept_for_host == 0  # the plan itself kept the budget
    if recompute == "off":
        assert region.binding == "host" and region.predicted_peak_after > budget
    else:
        assert region.recompute is not None and region.recompute.recomputed
        assert region.binding == "device" and region.predicted_peak_after <= budget
