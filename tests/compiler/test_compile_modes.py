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
