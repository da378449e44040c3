"""The eager session on CUDA with real copy streams and events (``make gpu-check``)."""

from __future__ import annotations

import pytest
import torch

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.config import MIB
from hyper_offload.runtime import DeviceMemoryMeter

from .models import CASES, assert_same_state, make_pair, train_step

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _on_cuda(case_name: str, shape: tuple[int, ...]):  # type: ignore[no-untyped-def]
    model, ref, x = make_pair(CASES[case_name], torch.float32, input_shape=shape)
    return model.cuda(), ref.cuda(), x.cuda()


@needs_cuda
@pytest.mark.parametrize("case_name,shape", [("mlp", (512, 32)), ("transformer", (8, 64, 32))])
def test_cuda_numerics_and_plan_curve(case_name: str, shape: tuple[int, ...]) -> None:
    model, ref, x = _on_cuda(case_name, shape)
    probe = OffloadSession(OffloadConfig(), device="cuda")
    probe_model, _, _ = _on_cuda(case_name, shape)
    with probe:
        train_step(probe_model, x, torch.optim.SGD(probe_model.parameters(), lr=0.0), 0)
    from hyper_offload.passes import required_bytes, resident_bytes_without_offload

    peak = max(resident_bytes_without_offload(probe.trace))
    budget = max(max(required_bytes(probe.trace)), peak // 2)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB), device="cuda")
    assert session.engine.is_async  # a real copy stream
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    for step in range(4):
        meter = DeviceMemoryMeter("cuda")
        with meter:
            with session:
                loss = train_step(model, x, opt, step)
        ref_loss = train_step(ref, x, ref_opt, step)
        torch.cuda.synchronize()
        where = f"cuda {case_name} step {step}"
        assert torch.equal(loss, ref_loss), where
        assert_same_state(model, ref, where)
        assert meter.peak_bytes <= budget, where
        if step > 0:
            assert meter.curve() == list(session.report.resident_bytes)[:-1], where
            assert session.last_stats.bytes_d2h > 0 and session.last_stats.demand_loads == 0
        opt.step()
        ref_opt.step()
    stats = session.pool.stats()
    assert stats.pinned and stats.buffers_in_use == 0


@needs_cuda
def test_cuda_exception_mid_backward_leaves_nothing_in_flight() -> None:
    model, _, x = _on_cuda("mlp", (512, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=64 / 1024), device="cuda")
    armed = [False]

    def fail(*_: object) -> None:
        if armed[0]:
            raise RuntimeError("injected")

    model.layers[1].register_full_backward_hook(fail)
    with session:
        train_step(model, x, opt, 0)
    armed[0] = True
    with pytest.raises(RuntimeError, match="injected"):
        with session:
            train_step(model, x, opt, 1)
    assert session.manager.transfers_in_flight() == 0 and len(session.manager) == 0
    assert session.pool.stats().buffers_in_use == 0
