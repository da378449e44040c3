"""The compile backend on CUDA with real copy streams (marked ``gpu``; run by
``make gpu-check`` on a machine with CUDA, skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from hyper_offload.runtime.saved_bytes import saved_device_bytes
from .compile_models import mlp, moved_views, offload_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

D, ROWS = 1024, 4096


@pytest.fixture(scope="module", autouse=True)
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(previous)


def _run(backend, dtype, steps=2):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mlp(layers=4, d=D).to("cuda", dtype)
    x = torch.randn(ROWS, D, device="cuda", dtype=dtype)
    compiled = torch.compile(model, backend=backend)
    for _ in range(steps):  # the last step is measured, after warm-up and compile
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = compiled(x).float().pow(2).mean()
        saved = saved_device_bytes(loss, exclude=[*model.parameters(), x])
        loss.backward()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], peak, saved


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_numerics_and_memory_below_plain_compile(inner, dtype):
    want_loss, want_grads, plain_peak, plain_saved = _run(inner, dtype)
    backend = offload_backend(inner, "tight")
    loss, grads, peak, saved = _run(backend, dtype)
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    assert backend.reports[0].offloaded
    assert saved < plain_saved
    assert peak < plain_peak, f"max_memory_allocated {peak} not below plain {plain_peak}"
    runtime = backend.regions[0].runtime
    assert runtime.transfers_pending == 0


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_saved_views_leave_the_device_bit_exact(inner, dtype):
    """The demo GPT (attention's q/k/v views, reshaped linear outputs) at 25% on CUDA:
    saved views move with their base through the copy stream, the device holds less for
    the backward, and loss and gradients equal plain compile's."""
    from examples.gpt_model import GPT, GPTConfig, random_batch

    def run(backend):
        torch._dynamo.reset()
        torch.manual_seed(0)
        config = GPTConfig(layers=2, dim=256, heads=4, seq_len=256, vocab=1024)
        model = GPT(config).to("cuda", dtype)
        batch = random_batch(config, 8, device="cuda")
        loss = torch.compile(model, backend=backend)(*batch)
        saved = saved_device_bytes(loss, exclude=[*model.parameters(), *batch])
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), [p.grad for p in model.parameters()], saved

    want = run(inner)
    backend = offload_backend(inner, "tight")
    got = run(backend)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert moved_views(backend) > 0 and got[2] < want[2] / 2
