"""``torch.compile(..., backend="hyper_offload", mode=...)``: the mode reaches the inner
Inductor (issue 18, item 5; it used to raise ``TypeError: unexpected keyword 'mode'``).
``torch.compile`` refuses ``mode`` and ``options`` together, so a mode with options goes
through ``hyper_offload.backend(mode=..., **options)``."""

from __future__ import annotations

import pytest
import torch

import hyper_offload

from .compile_models import deterministic  # noqa: F401 (autouse)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _step(backend, mode: str | None = None) -> list[torch.Tensor]:
    net = _net()
    torch._dynamo.reset()
    compiled = torch.compile(net, backend=backend, mode=mode)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    loss = compiled(x).pow(2).mean()
    loss.backward()
    torch._dynamo.reset()
    return [loss.detach(), *(p.grad for p in net.parameters())]


@pytest.mark.slow
def test_a_mode_reaches_the_inner_inductor_and_stays_exact():
    expected = _step("inductor", mode="lite")
    assert all(torch.equal(a, b) for a, b in zip(expected, _step("hyper_offload", mode="lite")))
    backend = hyper_offload.backend(mode="lite", max_resident_activation_fraction=0.5,
                                    recompute="off")
    got = _step(backend)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    (report,) = backend.reports
    assert report.transfers > 0 and report.bytes_d2h > 0  # planned and offloaded in that mode


def test_aot_eager_refuses_a_mode_when_the_backend_is_made():
    with pytest.raises(ValueError, match="Inductor mode") as raised:
        hyper_offload.backend(inner_compiler="aot_eager", mode="max-autotune")
    assert "inner_compiler='inductor'" in str(raised.value)


def _mlp_64x128() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 128))


@pytest.mark.parametrize("mode", [None, "max-autotune"])
def test_max_autotune_plans_the_tiny_mlp_as_mode_none_and_names_the_floors_operands(mode):
    """Issue 51: Linear-GELU-Linear-GELU-Linear on 64 x 128 under mode="max-autotune" at
    50% of its peak was reported to move nothing (floor = peak = 163,840 B). On Inductor's
    graphs with the mode's settings (the estimate runs the backend's own partition on
    fake tensors) both modes partition and plan alike: the floor is 163,840 B, over the
    50% budget, so the plan reaches the floor, moving the 64 KiB that lower the peak to it.
    The floor is the GELU backward as Inductor decomposes it: the saved pre-GELU output,
    the incoming gradient and three pointwise results of the decomposition, five 32 KiB
    storages, which the report now names. The step also holds the backward's seed
    (``ones_like`` of the 32 KiB output, made by the eager code between the forward and
    the backward, measured since the step model counts that code): 32 KiB beside the
    region's own floor and peak."""
    options = {} if mode is None else {"mode": mode}
    report = hyper_offload.estimate(_mlp_64x128(), (torch.randn(64, 128),),
                                    max_resident_activation_fraction=0.5, **options)
    seed = 32_768
    assert report.peak_without_offload == 229_376 + seed
    assert report.budget_bytes == (229_376 + seed) // 2  # the fraction of the step's peak
    assert report.min_feasible_budget_bytes == report.peak_with_plan == 163_840 + seed
    assert report.bytes_d2h == 65_536  # moved: the peak comes down to the floor
    floor = report.floor_op
    assert floor is not None and floor.op_bytes == 163_840
    assert floor.floor_bytes == 163_840 + seed
    assert floor.op.endswith("(of aten.gelu_backward)")
    assert sorted(nbytes for _, nbytes in floor.operands) == [32_768] * 5
    assert sum(name.startswith("fw:") for name, _ in floor.operands) == 1  # the saved one
    assert "160.0 KiB of the floor's 192.0 KiB (fw:addmm_1 32.0 KiB, " in report.floor_explained
