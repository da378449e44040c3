"""``hyper_offload.estimate``: the same figures as the compile backend, nothing allocated.

Under ``budget_scope="region"`` the estimate is the backend's region report of the model
compiled whole; under ``"step"`` (the default) the backend's step report of the model as
it was compiled (``test_estimate_step.py`` compares those per layout). The properties
below hold in both scopes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import hyper_offload
from examples.gpt_model import GPT, GPTConfig, random_batch
from examples.llama_model import llama_tiny
from hyper_offload.passes import required_bytes

from .compile_models import BATCH, HIDDEN, SEQ, mlp

_GPT = GPTConfig(layers=2, dim=32, heads=2, seq_len=16, vocab=64)
_COMPARED = (
    "fw_nodes", "bw_nodes", "saved_activation_bytes", "budget_bytes", "predicted_peak_before",
    "predicted_peak_after", "bytes_d2h", "bytes_h2d", "transfers", "offloaded", "d2h_s",
    "h2d_s", "exposed_transfer_s",
)


def _mlp_case() -> tuple[nn.Module, tuple[torch.Tensor, ...], bool]:
    torch.manual_seed(0)
    return mlp(d=HIDDEN), (torch.randn(BATCH, SEQ, HIDDEN),), False


def _gpt_case() -> tuple[nn.Module, tuple[torch.Tensor, ...], bool]:
    torch.manual_seed(0)
    return GPT(_GPT), random_batch(_GPT, 2), True


@pytest.mark.parametrize(
    ("case", "inner"),
    [(_mlp_case, "aot_eager"), (_gpt_case, "aot_eager"),
     pytest.param(_gpt_case, "inductor", marks=pytest.mark.slow)],
    ids=["mlp-aot_eager", "gpt-aot_eager", "gpt-inductor"],
)
def test_estimate_equals_the_backends_region_report(case, inner: str) -> None:
    model, inputs, scalar_loss = case()
    backend = hyper_offload.backend(
        inner_compiler=inner, max_resident_activation_fraction=0.5, budget_scope="region"
    )
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(*inputs)
    (out if scalar_loss else out.float().pow(2).mean()).backward()
    (compiled,) = backend.reports
    fresh, _, _ = case()
    report = hyper_offload.estimate(
        fresh, inputs, inner_compiler=inner, max_resident_activation_fraction=0.5,
        budget_scope="region",
    )
    for name in _COMPARED:
        assert getattr(report.region, name) == getattr(compiled, name), name
    assert report.peak_without_offload == compiled.predicted_peak_before
    assert report.peak_with_plan == compiled.predicted_peak_after
    assert report.bytes_d2h > 0  # half the peak is a real plan, not a no-op


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Cheap to trace (~0.5 s): most tests only need some model with saved activations."""
    model, inputs, _ = _mlp_case()
    return model, inputs


SCOPES = pytest.mark.parametrize("scope", ["step", "region"])


@SCOPES
def test_min_feasible_budget_is_the_boundary_of_fits(tiny, scope: str) -> None:
    model, inputs = tiny
    loose = hyper_offload.estimate(model, inputs, budget=1024, inner_compiler="aot_eager",
                                   budget_scope=scope)
    assert loose.budget_scope == scope
    assert loose.fits and loose.bytes_d2h == 0
    # Nothing moves: the peak is the step's without offload (under the step scope the one
    # region run once is lowered for the step, moving nothing: no kept device copies).
    assert loose.peak_with_plan == loose.peak_without_offload
    needed = loose.min_feasible_budget_bytes
    assert 0 < needed < loose.peak_without_offload
    mib = 1 << 20
    at = hyper_offload.estimate(model, inputs, budget=needed / mib, inner_compiler="aot_eager",
                                budget_scope=scope)
    below = hyper_offload.estimate(model, inputs, budget=(needed - 1) / mib,
                                   inner_compiler="aot_eager", budget_scope=scope)
    assert at.budget_bytes == needed and at.fits and at.peak_with_plan <= needed
    assert below.budget_bytes == needed - 1 and not below.fits
    assert below.peak_with_plan == needed  # the best any schedule can do (the floor)
    assert at.bytes_d2h == at.bytes_h2d > 0


def test_report_summary_and_json(tiny) -> None:
    model, inputs = tiny
    report = hyper_offload.estimate(model, inputs, max_resident_activation_fraction=0.5,
                                    inner_compiler="aot_eager", bandwidth=8.0,
                                    budget_scope="region")
    data = json.loads(report.to_json())
    assert data["peak_without_offload_bytes"] == report.peak_without_offload
    assert data["peak_with_plan_bytes"] == report.peak_with_plan
    assert data["min_feasible_budget_bytes"] == report.min_feasible_budget_bytes
    assert data["bytes_d2h"] == report.bytes_d2h and data["fits"] == report.fits
    assert data["d2h_bandwidth_gbps"] == data["h2d_bandwidth_gbps"] == 8.0
    assert report.region.d2h_s == pytest.approx(report.bytes_d2h / 8e9)
    text = report.summary()
    assert text.splitlines()[0].startswith("Sequential on cpu (aot_eager graphs")
    assert "smallest feasible budget" in text and "predicted exposed" in text
    # the bound is a floor under the plan's own predicted stall, and both are reported
    assert 0 <= report.stall_lower_bound_s <= report.exposed_transfer_s * (1 + 1e-9)
    assert data["stall_lower_bound_s"] == report.stall_lower_bound_s
    assert f"no plan under {report.stall_lower_bound_s * 1e3:.1f} ms" in text
    with pytest.raises(Exception):
        report.budget_bytes = 0  # type: ignore[misc]  # frozen


@SCOPES
def test_model_and_inputs_are_untouched(tiny, scope: str) -> None:
    model, inputs = tiny
    before = [(id(p), p.device, p.grad) for p in model.parameters()]
    hyper_offload.estimate(model, inputs, budget=0, inner_compiler="aot_eager", budget_scope=scope)
    assert [(id(p), p.device, p.grad) for p in model.parameters()] == before
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"budget": -1}, "max_resident_activation_mb"),
        ({"max_resident_activation_fraction": 1.5}, "(0, 1]"),
        ({"budget": 10, "max_resident_activation_fraction": 0.5}, "only one of them"),
        ({"budget": 10, "max_resident_activation_mb": 10}, "only one of them"),
        ({"inner_compiler": "eager"}, "inner_compiler"),
        ({"colour": "blue"}, "unknown key"),
        ({"bandwidth": 0.0}, "bandwidth"),
        ({"device": "meta"}, "meta device"),
        ({"budget": 10, "budget_scope": "block"}, "budget_scope"),
    ],
)
def test_bad_options_are_rejected_with_the_backends_messages(tiny, options, message) -> None:
    model, inputs = tiny
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hyper_offload.estimate(model, inputs, **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build's refusal")
def test_an_unavailable_accelerator_is_refused_not_crashed(tiny) -> None:
    model, inputs = tiny
    with pytest.raises(ValueError, match="no cuda device"):
        hyper_offload.estimate(model, inputs, budget=1, device="cuda")


@SCOPES
def test_a_step_without_backward_is_an_error(scope: str) -> None:
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="no backward"):
        hyper_offload.estimate(model, (torch.randn(2, 4),), budget=1, inner_compiler="aot_eager",
                               budget_scope=scope)


@pytest.mark.parametrize("scope", ["step", pytest.param("region", marks=pytest.mark.extended)])
def test_meta_inputs_and_meta_model_match_the_real_model(scope: str) -> None:
    model = llama_tiny()
    tokens = torch.randint(64, (2, 16))
    inputs = (tokens, tokens)
    real = hyper_offload.estimate(model, inputs, budget=0, inner_compiler="aot_eager",
                                  budget_scope=scope)
    meta_model = llama_tiny().to("meta")
    meta_inputs = tuple(x.to("meta") for x in inputs)
    meta = hyper_offload.estimate(meta_model, meta_inputs, budget=0, inner_compiler="aot_eager",
                                  device="cpu", budget_scope=scope)
    assert meta.device == real.device == "cpu"
    assert (meta.peak_without_offload, meta.peak_with_plan, meta.bytes_d2h,
            meta.min_feasible_budget_bytes) == (real.peak_without_offload, real.peak_with_plan,
                                                real.bytes_d2h, real.min_feasible_budget_bytes)
    assert all(p.device.type == "meta" for p in meta_model.parameters())


def test_required_bytes_is_what_the_report_calls_smallest_feasible(tiny) -> None:
    from hyper_offload.compiler.fake_capture import capture_graphs
    from hyper_offload.passes.fx.graph_trace import build_fx_trace

    model, inputs = tiny
    graphs = capture_graphs(model, inputs, device=torch.device("cpu"), inner_compiler="aot_eager")
    trace = build_fx_trace(graphs.fw, graphs.bw, num_fwd_outputs=graphs.num_fwd_outputs).trace
    report = hyper_offload.estimate(model, inputs, budget=0, inner_compiler="aot_eager",
                                    budget_scope="region")
    assert report.min_feasible_budget_bytes == max(required_bytes(trace))


def test_region_is_the_region_scopes_report_and_a_clear_error_under_the_step_scope(tiny) -> None:
    """Issue 45, case 7: ``report.region`` was None under the (new default) step scope, so
    code written against the region report broke with "'NoneType' object has no attribute".
    Now: the RegionReport where there is one; under the step scope a ReportScopeError
    (an AttributeError) that names what to read, and the scope-free figures agree."""
    model, inputs = tiny
    region = hyper_offload.estimate(model, inputs, budget=0.05, inner_compiler="aot_eager",
                                    budget_scope="region")
    assert region.region is region.region_report and region.region.bytes_d2h == region.bytes_d2h
    step = hyper_offload.estimate(model, inputs, budget=0.05, inner_compiler="aot_eager")
    scope_error = r"report\.step.*budget_scope='region'"
    with pytest.raises(hyper_offload.ReportScopeError, match=scope_error):
        step.region.bytes_d2h  # noqa: B018  (what code written against the old report does)
    assert isinstance(hyper_offload.ReportScopeError("x"), AttributeError)
    assert getattr(step, "region", None) is None and step.region_report is None
    for name in ("fits", "peak_with_plan", "peak_without_offload", "bytes_d2h",
                 "min_feasible_budget_bytes"):
        assert getattr(step, name) is not None and getattr(region, name) is not None
    assert "region_report" not in json.loads(step.to_json())
