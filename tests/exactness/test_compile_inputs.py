"""A region's activation input that is a conjugate view (issue 41, found by the op
database sweep: ``svd_lowrank`` / ``pca_lowrank`` in complex64, whose graph break hands
the next region ``b.conj()``). The step scope moves a region's activation inputs; a copy
of this one would resolve the bit into its values (the step raised
``TransferMisuseError`` in the forward). It stays on the device, saying why, and the
step is exact."""

from __future__ import annotations

import torch

import hyper_offload


def _f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(y @ x.mH).sum()


def _grads(backend: object) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    p, q = (torch.randn(3, 2, dtype=torch.complex64, generator=generator).requires_grad_()
            for _ in range(2))
    torch._dynamo.reset()
    loss = torch.compile(_f, backend=backend)((p * 2).conj(), q * 2)
    loss.backward()
    return loss.detach(), p.grad, q.grad


def test_a_conjugate_view_input_stays_on_the_device_and_the_step_is_exact():
    backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=0)
    got, want = _grads(backend), _grads("aot_eager")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    kept = [s for region in backend.regions for s in region.planned.fx_trace.saved
            if "conjugate view" in s.reason]
    assert kept and all(not s.offloadable for s in kept)
