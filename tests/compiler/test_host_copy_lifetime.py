"""A host copy lives exactly as long as autograd can read it (issue 18, bugs 1 and 2).

Regression tests: a retained graph's second backward (failed with "the host copy ... was
already released" while release_host ended a copy's life), and host buffers of a region
that never runs again (stayed in use for the rest of the run while only that region's
next forward returned them)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import hyper_offload
from .compile_models import INNER_COMPILERS, deterministic  # noqa: F401 (autouse)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    )


def _options(inner: str) -> dict[str, object]:
    return {"inner_compiler": inner, "max_resident_activation_fraction": 0.5}


def _grads(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("inner", INNER_COMPILERS)
def test_a_retained_graph_runs_its_second_backward_exactly(inner: str) -> None:
    torch._dynamo.reset()
    x = torch.randn(32, 64)
    results = []
    for backend in (inner, hyper_offload.backend(**_options(inner))):
        net = _net()
        y = torch.compile(net, backend=backend)(x).pow(2).mean()
        y.backward(retain_graph=True)
        first = _grads(net)
        y.backward()
        results.append((first, _grads(net)))
    assert backend.reports[0].offloaded, "nothing was offloaded: the test would prove nothing"
    (plain_first, plain_second), (ours_first, ours_second) = results
    assert all(map(torch.equal, plain_first, ours_first))
    assert all(map(torch.equal, plain_second, ours_second))
    assert not torch.equal(ours_first[0], ours_second[0])  # the second pass accumulated


def test_autograd_grad_twice_on_one_graph_is_exact() -> None:
    torch._dynamo.reset()
    x = torch.randn(32, 64)
    grads = []
    for backend in ("aot_eager", hyper_offload.backend(**_options("aot_eager"))):
        net = _net()
        y = torch.compile(net, backend=backend)(x).pow(2).mean()
        params = list(net.parameters())
        first = torch.autograd.grad(y, params, retain_graph=True)
        second = torch.autograd.grad(y, params)
        grads.append(first + second)
    assert all(map(torch.equal, *grads))


def test_a_second_backward_without_retain_graph_gets_autograds_own_error() -> None:
    # The misuse is the caller's; the message must be autograd's, not one about our ops.
    torch._dynamo.reset()
    net = _net()
    y = torch.compile(net, backend=hyper_offload.backend(**_options("aot_eager")))(
        torch.randn(32, 64)
    ).pow(2).mean()
    y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as err:
        y.backward()
    assert "hyper_offload" not in str(err.value)


def test_host_copies_of_a_region_that_never_runs_again_come_back() -> None:
    # A step of another batch size (its own region with dynamic=False) whose loss raises
    # after the region's forward: its autograd graph dies with the exception.
    torch._dynamo.reset()
    net = _net()
    backend = hyper_offload.backend(**_options("aot_eager"))
    compiled = torch.compile(net, backend=backend, dynamic=False)
    F.mse_loss(compiled(torch.randn(32, 64)), torch.zeros(32, 64)).backward()
    with pytest.raises(RuntimeError, match="size"):
        F.mse_loss(compiled(torch.randn(16, 64)), torch.zeros(4, 64)).backward()
    assert len(backend.regions) == 2 and all(r.planned.report.offloaded for r in backend.regions)
    gc.collect()
    in_use = backend.runtime.pool.stats().buffers_in_use  # every region shares it
    assert in_use == 0, f"host buffers still in use: {in_use}"
    for _ in range(3):
        F.mse_loss(compiled(torch.randn(32, 64)), torch.zeros(32, 64)).backward()
        assert backend.runtime.pool.stats().pinned_bytes_in_use == 0


class _TwoRegions(torch.nn.Module):
    """A graph break between the body and the loss: the loss region's input is an
    activation (the body's output), as HF models hand their logits to the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        torch._dynamo.graph_break()
        return h.tanh().pow(2).mean()


def test_a_failed_step_that_compiled_a_region_holds_no_host_copy_nor_activation() -> None:
    """The region compiled in a failing step must not keep that step's activations: it
    kept Dynamo's real example inputs, and the loss region's input (an activation)
    held the step's whole autograd graph, so its host copies never came back (and the
    activation's device bytes stayed allocated) for as long as the region lived."""
    torch._dynamo.reset()
    model = _TwoRegions()
    backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=0)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    compiled(torch.randn(32, 64)).backward()
    body_outputs = []
    model.body.register_forward_hook(lambda m, i, out: body_outputs.append(weakref.ref(out)))
    with pytest.raises(RuntimeError, match="between the forward and the backward"):
        loss = compiled(torch.randn(16, 64))  # recompiles both regions
        raise RuntimeError("the user's loop fails between the forward and the backward")
    del loss
    gc.collect()  # a recompiling step's graph sits in a reference cycle (plain compile too)
    # The two regions the failing step compiled run at their floor: they offloaded.
    assert len(backend.regions) == 4
    assert all(r.planned.report.offloaded for r in backend.regions[2:])
    assert body_outputs and body_outputs[-1]() is None, "an activation of the step is alive"
    assert backend.runtime.pool.stats().buffers_in_use == 0
    assert backend.runtime.host_copies == 0
