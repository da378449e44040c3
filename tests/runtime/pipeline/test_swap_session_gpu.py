"""PipelineSwapSession on CUDA: copies on the engine's copy stream, stream waits only.
Skipped without CUDA (run by scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyper_offload.pipeline import swap_wrapper
from hyper_offload.passes.pipeline import StepKind, build_rank_orders
from hyper_offload.runtime.pipeline import PipelineSwapSession, SwapStateError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MICRO = 6


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()


def _step(net: nn.Module, xs: list[torch.Tensor], session: PipelineSwapSession | None) -> dict[str, torch.Tensor]:
    order = build_rank_orders("gpipe", num_ranks=1, stages_per_rank=1, num_microbatches=MICRO, swap=True)[0]
    losses: dict[int, torch.Tensor] = {}
    offloaded_sizes: list[int] = []
    for step in order:
        if step.kind is StepKind.FWD:
            if session is None:
                losses[step.micro] = net(xs[step.micro]).square().mean()
                continue
            with session.forward_scope(step, [*net.parameters(), xs[step.micro]]):
                losses[step.micro] = net(xs[step.micro]).square().mean()
            session.protect(step.chunk, [losses[step.micro]])
        elif step.kind is StepKind.BWD:
            if session is not None and step.micro == 0:
                offloaded_sizes.append(session.group((0, 2)).resident_bytes())
            losses.pop(step.micro).backward()
            if session is not None:
                session.after_compute(step)
        elif step.is_swap and session is not None:
            session.run_swap_step(step)
    if session is not None:
        assert offloaded_sizes == [0], "chunk 2 is off the device while chunk 0's backward runs"
    torch.cuda.synchronize()
    return {n: p.grad.clone() for n, p in net.named_parameters()}


def test_cuda_swap_is_bit_identical_and_frees_device_memory() -> None:
    xs = [torch.randn(512, 256, device="cuda", generator=None) for _ in range(MICRO)]
    reference = _step(_net(), xs, None)
    net = swap_wrapper(_net())
    session = PipelineSwapSession(
        build_rank_orders("gpipe", num_ranks=1, stages_per_rank=1, num_microbatches=MICRO, swap=True)[0],
        device="cuda",
    )
    assert session.manager.engine.is_async
    for _ in range(3):  # several generations reuse the pool
        net.zero_grad(set_to_none=True)
        session.begin()
        grads = _step(net, xs, session)
        session.end()
        assert all(torch.equal(grads[k], reference[k]) for k in reference)
        assert session.live_groups() == []


def test_cuda_read_while_loading_raises() -> None:
    net = swap_wrapper(_net())
    order = build_rank_orders("gpipe", num_ranks=1, stages_per_rank=1, num_microbatches=MICRO, swap=True)[0]
    session = PipelineSwapSession(order, device="cuda")
    session.begin()
    fwd = next(s for s in order if s.kind is StepKind.FWD and s.micro == 0)
    x = torch.randn(512, 256, device="cuda")
    with session.forward_scope(fwd, [*net.parameters(), x]):
        loss = net(x).square().mean()
    session.protect((0, 0), [loss])
    for kind in (StepKind.SWAP_LAUNCH_OFFLOAD, StepKind.SWAP_WAIT_OFFLOAD, StepKind.SWAP_LAUNCH_LOAD):
        session.run_swap_step(fwd._replace(kind=kind))
    with pytest.raises(SwapStateError, match="still loading"):
        loss.backward(retain_graph=True)
    session.run_swap_step(fwd._replace(kind=StepKind.SWAP_WAIT_LOAD))
    loss.backward()
    session.abort()
