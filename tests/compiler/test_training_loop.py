"""The training loop as users write it, through the compile door (issue 49 cases 1, 5, 9).

Case 1: a forward under ``no_grad`` (validation) between training steps once ended
training (the next loss had no ``grad_fn``). Case 9: a budget far above the step's peak
moved every saved byte at the first step. Case 5: ``backend(OffloadConfig(...))`` dropped
fields the runtime reads. Each test fails on the code before its fix; numerics are
``torch.equal`` to plain ``torch.compile`` with the same inner compiler and the same loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hyper_offload
from hyper_offload import OffloadConfig

MIB = 1 << 20


def _model() -> nn.Module:
    """The issue's model: dropout included (the twin draws the same random numbers)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128),
                         nn.GELU(), nn.Linear(128, 1))


def _loop(backend: Any, validate: Callable[[nn.Module, torch.Tensor], None]
          ) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Train, validate, train, validate, train (one batch, seeded); each step's loss
    and gradients. A loss without ``grad_fn`` fails here (case 1's symptom)."""
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    steps = []
    for number in range(3):
        if number:
            validate(compiled, x)
        torch.manual_seed(10 + number)
        loss = compiled(x).pow(2).mean()
        assert loss.grad_fn is not None, f"step {number}: the training loss has no grad_fn"
        loss.backward()
        steps.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    return steps


def _no_grad(model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        model(x)


def _inference_mode(model: nn.Module, x: torch.Tensor) -> None:
    with torch.inference_mode():
        model(x)


def _eval_no_grad(model: nn.Module, x: torch.Tensor) -> None:
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()


VALIDATIONS = {"no_grad": _no_grad, "inference_mode": _inference_mode, "eval": _eval_no_grad}


@pytest.mark.parametrize("fraction", (0.85, 0.3))
@pytest.mark.parametrize("validation", list(VALIDATIONS))
def test_validation_between_training_steps_keeps_training_exact(fraction, validation):
    validate = VALIDATIONS[validation]
    plain = _loop("aot_eager", validate)
    backend = hyper_offload.backend(inner_compiler="aot_eager",
                                    max_resident_activation_fraction=fraction)
    got = _loop(backend, validate)
    for number, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(got, plain)):
        assert torch.equal(loss, want_loss), f"step {number}"
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads)), f"step {number}"
    # A forward without grad is no step: every training step was counted, none other.
    assert backend.controller.steps == 3
    assert backend.step_report is not None and backend.step_report.moved_bytes > 0


def test_a_budget_above_the_peak_moves_nothing_from_the_first_step():
    backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=1e6)
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(64, 32)
    for number in range(2):
        compiled(x).pow(2).mean().backward()
        assert backend.runtime.bytes_d2h == 0, f"step {number} moved bytes"
    assert backend.step_report is not None and backend.step_report.moved_bytes == 0


def _every_field() -> OffloadConfig:
    """Every field the compile door reads set away from its default."""
    return OffloadConfig(
        max_resident_activation_mb=7, max_host_activation_mb=100, local_world_size=2,
        pageable_fallback=True, verify=True, max_warmups=5,
    )


ENTRY_POINTS: dict[str, Callable[[OffloadConfig], Any]] = {
    "backend(config)": lambda config: hyper_offload.backend(config),
    "backend(**fields)": lambda config: hyper_offload.backend(**{
        f.name: getattr(config, f.name) for f in dataclasses.fields(config)
        if f.name in ("max_resident_activation_mb", "max_host_activation_mb",
                      "local_world_size", "pageable_fallback", "verify", "max_warmups")}),
    "backend(config, options)": lambda config: hyper_offload.backend(
        config, inner_compiler="aot_eager"),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_config_field_reaches_the_compile_runtime(entry):
    config = _every_field()
    backend = ENTRY_POINTS[entry](config)
    got = backend.options.config
    for name in ("max_resident_activation_mb", "max_host_activation_mb", "local_world_size",
                 "pageable_fallback", "verify", "max_warmups"):
        assert getattr(got, name) == getattr(config, name), name
    assert backend.options.host_budget_bytes == 100 * MIB  # not the node view
    pool = backend.runtime.pool
    assert pool.max_host_bytes == 100 * MIB and pool.pageable_fallback


def test_verify_from_a_config_checks_the_transfers_of_a_step():
    backend = hyper_offload.backend(OffloadConfig(max_resident_activation_mb=0, verify=True),
                                    inner_compiler="aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(_model(), backend=backend)
    compiled(torch.randn(64, 32)).pow(2).mean().backward()
    assert backend.runtime.bytes_d2h > 0 and backend.runtime.checks > 0
