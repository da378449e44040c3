"""A saved tensor that is also a model output, under the defaults (Inductor, step scope).

Inductor's decompositions turn Hugging Face GPT-2's logits into one node,
``view(mm, (2, 16, 64))``, that the forward returns twice: as the model output and as a
tensor saved for the loss's backward (which flattens it again). The step scope lets a
saved model output move (``outputs_move``), and the lowering returned the host copy of
its (32, 64) base in *both* places: ``out.logits`` had shape (32, 64) and the backward
raised. aot_eager (another node: no shared output), ``budget_scope="region"`` (no model
output moves) and returning the loss alone hid it. The caller must get loss, logits and
every gradient ``torch.equal`` to plain Inductor (deterministic algorithms on: plain
Inductor on CPU is not run-to-run deterministic without them).

``make test`` runs the repro's form (a lambda returning the ``ModelOutput``); compiling
the module itself gives the same graphs and is ``extended``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hyper_offload

from .compile_models import deterministic  # noqa: F401 (autouse)

transformers = pytest.importorskip("transformers")

Step = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=64, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def _as_lambda(model: torch.nn.Module, backend: Any) -> Callable[[torch.Tensor], Any]:
    return torch.compile(lambda ids: model(input_ids=ids, labels=ids), backend=backend)


def _as_module(model: torch.nn.Module, backend: Any) -> Callable[[torch.Tensor], Any]:
    compiled = torch.compile(model, backend=backend)
    return lambda ids: compiled(input_ids=ids, labels=ids)


FORMS = {"lambda": _as_lambda, "module": _as_module}


def _step(form: str, backend: Any) -> Step:
    """One forward and ``loss.backward()``: loss, logits, every parameter's gradient."""
    torch._dynamo.reset()
    model = _gpt2()
    ids = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(1))
    out = FORMS[form](model, backend)(ids)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), [p.grad for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "form", ["lambda", pytest.param("module", marks=pytest.mark.extended)]
)
def test_logits_and_gradients_equal_plain_inductor_when_logits_are_saved(form: str) -> None:
    want = _step(form, "inductor")
    backend = hyper_offload.backend(max_resident_activation_mb=1e6)  # the defaults otherwise
    got = _step(form, backend)
    (region,) = backend.regions
    fx_trace = region.planned.fx_trace
    offloaded = set(region.planned.report.offloaded)
    moved = {s.storage for s in fx_trace.saved if s.name in offloaded}
    moved_outputs = moved & fx_trace.trace.retained
    assert moved_outputs, "no model output's storage moved: the case proves nothing"
    assert got[1].shape == want[1].shape == (2, 16, 64)
    assert torch.equal(got[0], want[0]), "loss differs"
    assert torch.equal(got[1], want[1]), "logits differ"
    assert len(got[2]) == len(want[2])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2])), "a gradient differs"
