"""One budget for the whole step on real third-party models (issue 31): Hugging Face
GPT-2 and Llama built from configs, each decoder layer compiled on its own (torchtitan's
way), aot_eager. At 50% and 30% of the plain step's saved bytes, both steps (the first at
the floor, the second planned) keep at most the budget (+256 KiB) on the device after
the forward, and loss and gradients are ``torch.equal`` to plain per-layer compile."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hyper_offload
from hyper_offload.runtime.saved_bytes import saved_device_bytes

from .step_models import SLACK, assert_estimate_is_the_step_plan

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 4, 128, 128
_MIB = float(1 << 20)


def gpt2() -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    config = transformers.GPT2Config(
        n_layer=3, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    return model, model.transformer.h


def llama() -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
    )
    model = transformers.LlamaForCausalLM(config)
    return model, model.model.layers


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, Any]]] = {"gpt2": gpt2, "llama": llama}

COMPILE_STEP_BYTES = {"gpt2": 0, "llama": SEQ * 8}
"""What torch holds to the end of the step that compiles the layers and of no later step:
Llama's int64 ``cache_position`` (measured with plain aot_eager: the first step's eager
code frees it only after the step, the second while its forward runs). The real step
plan, made from that first step, counts it from the loss to the step's end; the fake
step of ``estimate`` does not."""


class _Loss(torch.nn.Module):
    """The causal LM's training loss on its own input ids: one positional input, as
    ``hyper_offload.estimate`` passes it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def _per_layer(name: str, backend: Any) -> torch.nn.Module:
    """The model's loss (seeded), each decoder layer compiled on its own with ``backend``."""
    torch.manual_seed(0)
    model, layers = MODELS[name]()
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, backend=backend)
    return _Loss(model)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


def _train(name: str, backend: Any, steps: int) -> list[tuple[int, torch.Tensor, list]]:
    torch._dynamo.reset()
    model = _per_layer(name, backend)
    ids = _ids()
    out = []
    measure = getattr(backend, "measuring", None)  # the first step measures eager code
    for number in range(steps):
        with measure() if measure is not None and number == 0 else contextlib.nullcontext():
            loss = model(ids)
            saved = saved_device_bytes(loss, exclude=[*model.parameters(), ids])
            loss.backward()
        out.append((saved, loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def plain() -> dict[str, tuple[int, torch.Tensor, list]]:
    return {name: _train(name, "aot_eager", 1)[0] for name in MODELS}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fraction"), [
    # make test: both models at 0.3, GPT-2 at 0.5 too; Llama at 0.5 (45 s) is extended
    pytest.param(name, fraction, id=f"{name}-{fraction}",
                 marks=(pytest.mark.extended,) if (name, fraction) == ("llama", 0.5) else ())
    for name in MODELS for fraction in (0.5, 0.3)])
def test_per_layer_compile_fits_every_step_and_is_exact(name, fraction, plain):
    saved, loss, grads = plain[name]
    budget = int(fraction * saved)
    backend = hyper_offload.backend(
        inner_compiler="aot_eager", max_resident_activation_mb=budget / _MIB
    )
    for number, (got_saved, got_loss, got_grads) in enumerate(_train(name, backend, 2), 1):
        assert got_saved <= budget + SLACK, f"{name} step {number}: {got_saved} B for {budget} B"
        assert torch.equal(got_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(got_grads, grads)), f"step {number}"
    report = backend.step_report
    assert report is not None and len(report.invocations) >= 3  # every layer
    assert report.peak_bytes <= max(budget, report.floor_peak_bytes)
    # estimate (fake tensors, the same loss, its eager code measured as the real step's
    # first step was) gives this step plan.
    assert_estimate_is_the_step_plan(
        _per_layer(name, "aot_eager"), (_ids(),), backend, inner_compiler="aot_eager",
        max_resident_activation_mb=budget / _MIB, compile_step_bytes=COMPILE_STEP_BYTES[name],
    )
