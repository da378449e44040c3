"""Backend objects deep-copy and pickle (issue 49 case 6): a copy is a fresh backend with
the same options. Lightning needs it: its ``torch.compile`` wrapper deep-copies the
arguments of every compile of a module (``TypeError: cannot pickle '_thread.lock'``
before)."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

import hyper_offload
from hyper_offload.compiler import HyperOffloadBackend
from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.runtime.device import TransferBandwidth

OPTIONS = dict(inner_compiler="aot_eager", max_resident_activation_mb=0.01)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 1))


def _steps(model: nn.Module, compiled: nn.Module, steps: int = 2) -> list[torch.Tensor]:
    """Loss and gradients of ``steps`` training steps (no optimizer: same batch)."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(steps):
        loss = compiled(x).pow(2).mean()
        loss.backward()
        out += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        model.zero_grad(set_to_none=True)
    return out


def _trained_backend() -> HyperOffloadBackend:
    """A backend that compiled and ran a step: regions, a step plan, a runtime in use."""
    backend = hyper_offload.backend(**OPTIONS)
    model = _mlp()
    _steps(model, torch.compile(model, backend=backend))
    assert backend.regions and backend.step_plan is not None
    return backend


def _is_fresh_copy(copied: object, original: HyperOffloadBackend) -> None:
    assert isinstance(copied, HyperOffloadBackend) and copied is not original
    assert copied.options == original.options
    assert copied.options.host_budget_bytes == original.options.host_budget_bytes
    assert copied.regions == [] and copied.step_plan is None and copied.controller.steps == 0
    assert copied.runtime is not original.runtime


def test_deepcopy_and_pickle_give_a_fresh_backend_with_the_same_options() -> None:
    torch._dynamo.reset()
    backend = _trained_backend()
    _is_fresh_copy(copy.deepcopy(backend), backend)
    _is_fresh_copy(pickle.loads(pickle.dumps(backend)), backend)


def test_a_copy_keeps_the_prices_it_plans_with() -> None:
    link = TransferBandwidth(0.5, 0.5, measured=False)
    throughput = DeviceThroughput(flops_per_s=1e12, bytes_per_s=1e11)
    backend = HyperOffloadBackend(hyper_offload.backend(**OPTIONS).options, link=link,
                                  throughput=throughput, fake_steps=True)
    copied = pickle.loads(pickle.dumps(backend))
    assert (copied.link, copied.throughput, copied.fake_steps) == (link, throughput, True)


def test_a_model_compiled_with_a_backend_object_deep_copies_and_trains_exactly() -> None:
    torch._dynamo.reset()
    plain_model = _mlp()
    want = _steps(plain_model, torch.compile(plain_model, backend="aot_eager"))
    torch._dynamo.reset()
    model = _mlp()
    compiled = torch.compile(model, backend=hyper_offload.backend(**OPTIONS))
    twin = copy.deepcopy(compiled)  # before its first compile
    assert twin._orig_mod is not model
    got = _steps(twin._orig_mod, twin)
    assert all(map(torch.equal, want, got))
    twice = copy.deepcopy(compiled)  # after a compile as well
    assert isinstance(twice, type(compiled))


def test_torch_compile_with_a_backend_object_after_import_lightning(lightning_imported) -> None:
    """Lightning keeps the copy for ``Fabric.setup`` to compile again with; the model
    returned is compiled by the user's object."""
    torch._dynamo.reset()
    backend = hyper_offload.backend(**OPTIONS)
    model = _mlp()
    compiled = torch.compile(model, backend=backend)  # Lightning's wrapper deep-copies kwargs
    _is_fresh_copy(compiled._compile_kwargs["backend"], backend)
    _steps(model, compiled)
    assert backend.regions and backend.runtime.bytes_d2h > 0


def test_check_compile_door_after_import_lightning(lightning_imported) -> None:
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    report = hyper_offload.check(_mlp(), (x,), door="compile")
    assert report.passed and report.moved_bytes > 0, report
