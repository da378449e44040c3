"""``hyper_offload.register_backend`` and ``hyper_offload.step_report`` (issue 45, case 8):
a configured backend under a name, for trainers that take the backend as a string
(torchtitan's ``--compile.backend``), and its step plan read back by that name."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch import nn

import hyper_offload
from hyper_offload.compiler import NamedBackend

from .step_models import BATCH, SEQ, Stack


@dataclasses.dataclass
class _CompileConfig:
    """What a trainer's configuration holds: a backend *name* (it pickles, it is a flag)."""

    backend: str


def _train_like_torchtitan(backend: str, steps: int = 2) -> tuple[nn.Module, list[torch.Tensor]]:
    """torchtitan's ``apply_compile``: each block compiled in place with the configured
    backend (``fullgraph=True``), and the loss compiled with the same backend."""
    torch.manual_seed(0)
    model = Stack(d=32)
    config = pickle.loads(pickle.dumps(_CompileConfig(backend)))
    for block in model.layers:
        block.compile(backend=config.backend, fullgraph=True)
    loss_fn = torch.compile(lambda out: out.float().pow(2).mean(), backend=config.backend)
    losses = []
    for step in range(steps):
        x = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(step))
        for block in model.layers:
            x = block(x)
        loss = loss_fn(model.head(x))
        loss.backward()
        losses.append(loss.detach())
    return model, losses


def test_a_registered_name_trains_exactly_under_its_budget_and_reports_by_name() -> None:
    torch._dynamo.reset()
    _, plain_losses = _train_like_torchtitan("aot_eager")
    plain_grads = [p.grad for p in _train_like_torchtitan("aot_eager")[0].parameters()]
    # 95% of the step's peak: above its floor (everything movable moved), so it fits and moves.
    named = hyper_offload.register_backend("ho_test_named_budget", inner_compiler="aot_eager",
                                           max_resident_activation_fraction=0.95)
    assert isinstance(named, NamedBackend)
    assert hyper_offload.step_report("ho_test_named_budget") is None  # nothing compiled yet
    model, losses = _train_like_torchtitan("ho_test_named_budget")
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads))
    report = hyper_offload.step_report("ho_test_named_budget")
    assert report is not None and report is not named.backend.step_report  # built per read
    assert report == named.backend.step_report == hyper_offload.step_report(named)
    assert report.budget_bytes == int(0.95 * report.peak_without_offload_bytes)
    assert len(report.invocations) == 5  # four blocks (one region) and the loss
    assert report.moved_bytes > 0 and report.fits


def test_registering_again_is_idempotent_and_a_taken_name_or_bad_option_is_refused() -> None:
    first = hyper_offload.register_backend("ho_test_named_twice", max_resident_activation_mb=64)
    assert hyper_offload.register_backend("ho_test_named_twice",
                                          max_resident_activation_mb=64) is first
    with pytest.raises(hyper_offload.ConfigurationError, match="taken.*other options"):
        hyper_offload.register_backend("ho_test_named_twice", max_resident_activation_mb=32)
    with pytest.raises(hyper_offload.ConfigurationError, match="taken.*torch's backend"):
        hyper_offload.register_backend("inductor", max_resident_activation_mb=32)
    with pytest.raises(hyper_offload.ConfigurationError, match="unknown key 'budget'"):
        hyper_offload.register_backend("ho_test_named_bad", budget=32)  # at once, not at compile
    with pytest.raises(hyper_offload.ConfigurationTypeError, match="identifier"):
        hyper_offload.register_backend("not a name")
    with pytest.raises(hyper_offload.ConfigurationError, match="no hyper_offload backend"):
        hyper_offload.step_report("ho_test_never_registered")
