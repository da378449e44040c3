"""Sequence tiling in the compile door (``tile_sequence``, ``compiler/tiling.py``).

A one-block Llama over 128 tokens (examples/llama_model.py) trained one step three
ways, compiled once each (module fixture): plain ``torch.compile`` (aot_eager), the
backend with ``tile_sequence="off"`` and with ``tile_sequence=4``, every movable saved
activation moved (budget 0). Off is ``torch.equal`` to plain and touches no graph;
tiled is within the stated tolerance, says it is not bit-exact in every report, and
lowers the floor, predicted and measured (the allocator's own events on CPU).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import hyper_offload
from hyper_offload.compiler.options import parse_backend_options
from hyper_offload.errors import ConfigurationError
from hyper_offload.exactness.runs import deviations
from hyper_offload.exactness.runs import StepValues

from examples.step_memory import profiled_step

from .compile_models import deterministic  # noqa: F401 (autouse)
from .tiling_models import SEQ, EagerBetween, batch, llama, token_model

TOLERANCE = 1e-5
"""Largest relative deviation (of a value's largest magnitude) tiling may cause in fp32:
sums over 128 tokens added in another order move results by a few ulps."""


def _step(backend: Any) -> dict[str, Any]:
    model, inputs = llama(), batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    params = list(model.parameters())

    def step() -> torch.Tensor:
        loss = compiled(*inputs)
        loss.backward()
        return loss.detach()

    loss, memory = profiled_step(step, torch.device("cpu"), params)
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"values": StepValues(loss, grads), "backend": backend, "peak": memory.peak_bytes}


def _offload(tile: str | int) -> Any:
    return hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=0,
                                 recompute="off", tile_sequence=tile)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return {"plain": _step("aot_eager"), "off": _step(_offload("off")),
                "tiled": _step(_offload(4))}
    finally:
        torch.use_deterministic_algorithms(previous)


def test_tiling_off_is_bit_exact_and_analyses_nothing(runs):
    plain, off = runs["plain"]["values"], runs["off"]["values"]
    assert torch.equal(plain.loss, off.loss)
    assert all(torch.equal(grad, off.grads[name]) for name, grad in plain.grads.items())
    regions = runs["off"]["backend"].regions
    assert regions and all(r.tiling is None and r.planned.report.tiling is None for r in regions)
    assert runs["off"]["backend"].step_report.tiled == ()


def test_tiled_loss_and_gradients_are_within_the_stated_tolerance(runs):
    plain, tiled = runs["plain"]["values"], runs["tiled"]["values"]
    found = deviations([plain], [tiled])
    assert [d.what for d in found][:2] == ["loss", "gradient of tok_embeddings.weight"]
    assert len(found) == 1 + len(plain.grads)
    assert max(d.max_rel for d in found) <= TOLERANCE, found
    report = runs["tiled"]["backend"].regions[0].tiling
    assert report.tiled and {s.tiles for s in report.spans} == {4}


def test_every_report_of_the_tiled_plan_says_it_is_not_bit_exact(runs):
    backend = runs["tiled"]["backend"]
    region = backend.reports[0]
    assert "TILED" in str(region) and "NOT bit-exact" in str(region)
    assert region.summary()["tiling"]["exact"] is False
    step = backend.step_report
    assert step.tiled == (0,) and "NOT bit-exact" in str(step)
    assert step.summary()["bit_exact"] is False


def test_tiling_lowers_the_floor_predicted_and_measured(runs):
    off, tiled = runs["off"], runs["tiled"]
    report = tiled["backend"].regions[0].tiling
    assert report.floor_after_bytes < 0.8 * report.floor_before_bytes
    assert report.compute_after_s > report.compute_before_s  # the tiles' recompute, priced
    assert tiled["backend"].step_report.floor_peak_bytes < off["backend"].step_report.floor_peak_bytes
    assert tiled["peak"] < off["peak"]  # the step's allocations on CPU, measured


def test_check_prints_the_deviation_of_each_gradient_and_keeps_the_exact_verdict():
    model, inputs = token_model(), batch()
    report = hyper_offload.check(model, inputs, steps=1, loss_fn=lambda loss: loss,
                                 options={"tile_sequence": 4})
    assert report.passed  # tiling off: moving everything is exact
    assert report.tiling is not None and report.tiling.tiled
    text = str(report)
    assert "NOT bit-exact by design" in text and "max abs" in text and "max rel" in text
    names = [name for name, _ in model.named_parameters()]
    assert [v.what for v in report.tiling.values] == ["loss", *(f"gradient of {n}" for n in names)]
    assert max(v.max_rel for v in report.tiling.values) <= TOLERANCE


def test_estimate_tiles_to_the_fewest_tiles_that_fit_and_says_it_is_not_bit_exact():
    with torch.device("meta"):
        model = token_model().to(torch.bfloat16)
    inputs = [torch.empty(1, 2 * SEQ, dtype=torch.long, device="meta")] * 2
    options = dict(device="cpu", recompute="off", inner_compiler="aot_eager")
    floor = hyper_offload.estimate(model, inputs, budget=0.0, **options).min_feasible_budget_bytes
    budget = 0.6 * floor / (1 << 20)  # MiB: under the untiled floor, above a tiled one
    plain = hyper_offload.estimate(model, inputs, budget=budget, **options)
    tiled = hyper_offload.estimate(model, inputs, budget=budget, tile_sequence="auto", **options)
    assert not plain.fits and tiled.fits
    report = tiled.regions[0].tiling
    assert report.stopped == "the floor fits the budget"
    assert report.floor_after_bytes <= budget * (1 << 20) < report.floor_before_bytes
    assert "TILED" in tiled.summary() and "NOT bit-exact" in tiled.summary()
    assert "TILED" not in plain.summary()
    assert tiled.to_dict()["tiling"][0]["tiled"] and plain.to_dict()["tiling"] == []
    with pytest.raises(ConfigurationError, match="budget_scope='step'"):
        hyper_offload.estimate(model, inputs, budget=budget, budget_scope="region",
                               tile_sequence="auto", **options)


@pytest.mark.parametrize("value", ["off", "auto", 2, 64])
def test_tile_sequence_accepts_off_auto_and_counts(value):
    assert parse_backend_options({"tile_sequence": value}).tile_sequence == value
    keys = {parse_backend_options({"tile_sequence": v}).cache_key() for v in ("off", "auto", 8)}
    assert len(keys) == 3  # a tiled graph never serves an untiled compile


@pytest.mark.parametrize("value", [1, 0, -4, True, "on", 2.0, None])
def test_tile_sequence_refuses_anything_else_naming_the_choices(value):
    with pytest.raises(ConfigurationError, match=r"'tile_sequence' must be 'off'.*not bit-exact"):
        parse_backend_options({"tile_sequence": value})


def test_the_step_has_a_region_tiled_again_for_the_floor_it_needs_once():
    from types import SimpleNamespace

    from hyper_offload.passes import required_bytes
    from hyper_offload.passes.plan.step import FloorOp

    backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=64,
                                    recompute="off", tile_sequence="auto")
    model, inputs = token_model(), batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    first = compiled(*inputs)
    first.backward()
    region = backend.regions[0]
    assert not region.tiling.tiled and region.tiling.stopped == "the floor fits the budget untiled"
    own = max(required_bytes(region.planned.fx_trace.trace))
    # The step's floor at this region's op is over its budget by half the region's floor
    # (what the rest of a step can hold there): the region must reach half its floor.
    plan = SimpleNamespace(floor_op=FloorOp(0, "bw:mm", own, 3 * own), floor_peak_bytes=3 * own,
                           budget_bytes=3 * own - own // 2)
    lowerings = backend.lowerings
    assert lowerings.retiling(plan) == (0,)
    assert lowerings.retile_targets == {0: own - own // 2}
    assert lowerings.retile() and lowerings.retile_targets == {}
    assert region.tiling.tiled and region.planned.report.tiling is region.tiling
    assert max(required_bytes(region.planned.fx_trace.trace)) <= own - own // 2
    assert not region.relowered  # the recompute search may search the tiled graph
    assert lowerings.retiling(plan) == ()  # once per region
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    again = compiled(*inputs)  # the tiled lowering runs from now on
    again.backward()
    found = deviations([StepValues(first.detach(), grads)], [StepValues(
        again.detach(), {name: p.grad for name, p in model.named_parameters()})])
    assert max(d.max_rel for d in found) <= TOLERANCE


def test_a_step_over_its_budget_at_a_region_op_has_it_tiled_again_before_the_next_step():
    from hyper_offload.compiler.step.controller import StepEventName, StepState

    def train(backend: Any, measure: bool) -> tuple[Any, StepValues]:
        torch.manual_seed(0)
        model = EagerBetween()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        for _ in range(3):
            model.zero_grad()
            with backend.measuring() if measure else contextlib.nullcontext():
                loss = compiled(*batch())
                loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        return backend, StepValues(loss.detach(), grads)

    _, plain = train("aot_eager", measure=False)
    budget_mb = 0.25  # over each region's own floor, under the step's (the eager code's)
    backend, tiled = train(hyper_offload.backend(
        inner_compiler="aot_eager", max_resident_activation_mb=budget_mb, recompute="off",
        tile_sequence="auto"), measure=True)
    head = backend.regions[1]
    assert head.untiled is not None and backend.lowerings.retiled == {1}
    controller = backend.controller
    assert (StepState.LEARNING, StepEventName.STEP_DONE, StepState.RETILING) in controller.transitions
    assert controller.state is StepState.PLANNED
    first = controller.transitions.index(
        (StepState.LEARNING, StepEventName.STEP_DONE, StepState.RETILING))
    assert controller.transitions[first + 1][:2] == (StepState.RETILING, StepEventName.FORWARD)
    # At its compile the head fit its own floor untiled; the step had it tiled.
    assert head.tiling.tiled and head.tiling.floor_after_bytes < head.tiling.floor_before_bytes
    assert head.tiling.floor_before_bytes <= budget_mb * (1 << 20)
    report = backend.step_report
    assert report.tiled == (1,) and report.floor_peak_bytes <= report.budget_bytes
    assert head.planned.report.tiling is head.tiling
    found = deviations([plain], [tiled])
    assert max(d.max_rel for d in found) <= TOLERANCE, found
