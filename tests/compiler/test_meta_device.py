"""A model on the meta device through the compile door (issue 45, case 3): its tensors hold
no bytes, so nothing moves; forward and backward run as plain ``torch.compile`` does, with
no ``with`` block, and a warning points at ``hyper_offload.estimate`` for real figures."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import hyper_offload


def _meta_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.GELU()).to("meta")


@pytest.mark.parametrize(("scope", "inner"), [
    ("step", "aot_eager"), ("region", "aot_eager"), ("step", "inductor"),
])
def test_a_meta_model_trains_like_plain_compile_and_moves_nothing(
    scope: str, inner: str, caplog: pytest.LogCaptureFixture
) -> None:
    torch._dynamo.reset()
    model = _meta_model()
    # A budget far under the step's activations, recompute off: on a real device this
    # plan offloads every saved activation.
    backend = hyper_offload.backend(max_resident_activation_mb=0.001, inner_compiler=inner,
                                    budget_scope=scope, recompute="off")
    compiled = torch.compile(model, backend=backend)
    x = torch.empty(8, 16, device="meta")
    with caplog.at_level(logging.WARNING, logger="hyper_offload"):
        for _ in range(2):
            out = compiled(x)
            out.sum().backward()
    assert out.device.type == "meta" and out.shape == (8, 16)
    for parameter in model.parameters():
        assert parameter.grad is not None and parameter.grad.device.type == "meta"
        assert parameter.grad.shape == parameter.shape
    assert backend.reports == [] and backend.step_report is None
    warnings = [r.getMessage() for r in caplog.records if "meta device" in r.getMessage()]
    assert len(warnings) == 1 and "hyper_offload.estimate" in warnings[0]


def test_estimate_of_the_same_meta_model_still_plans_it() -> None:
    """What the warning recommends works on the same model: the figures of a real step."""
    report = hyper_offload.estimate(_meta_model(), (torch.empty(8, 16, device="meta"),),
                                    budget=0.001, inner_compiler="aot_eager", device="cpu")
    assert report.peak_without_offload > 0
