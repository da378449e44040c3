"""Sizes decided at run time under the step scope (issue 43, passes/fx/sizes.py).

HF Llama (2 layers, from a config) compiled whole with aot_eager, a sequence length that
changes every step (32, 48, 64, 48, 32, 64), under ``dynamic=True`` and under automatic
dynamic (the first length compiles static, the second recompiles with symbolic sizes),
at 50% of plain compile's most saved bytes. Before issue 43 the plan made at the first
length was applied to every later one (step 2 held 0.76 MiB for a 0.475 MiB budget).

Every step keeps at most the budget (+256 KiB) of saved device bytes after the forward,
loss and gradients are ``torch.equal`` to plain compile with the same dynamic setting,
and no more step plans are made than distinct size buckets were seen.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hyper_offload
from hyper_offload.runtime.saved_bytes import saved_device_bytes

transformers = pytest.importorskip("transformers")

LENGTHS = (32, 48, 64, 48, 32, 64)
SLACK = 256 * 1024
VOCAB = 128


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def _train(backend: Any, dynamic: bool | None) -> tuple[list[dict[str, Any]], Any]:
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    steps = []
    for number, length in enumerate(LENGTHS):
        ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(number))
        loss = compiled(input_ids=ids, labels=ids).loss
        saved = saved_device_bytes(loss, exclude=[*model.parameters(), ids])
        loss.backward()
        steps.append({"saved": saved, "loss": loss.detach(),
                      "grads": [p.grad.clone() for p in model.parameters()]})
        model.zero_grad(set_to_none=True)
    return steps, backend


@pytest.mark.parametrize("dynamic", (True, None), ids=("dynamic", "automatic"))
def test_each_step_is_planned_at_its_own_sizes_once_per_bucket(dynamic):
    plain, _ = _train("aot_eager", dynamic)
    budget = int(0.5 * max(step["saved"] for step in plain))
    backend = hyper_offload.backend(inner_compiler="aot_eager",
                                    max_resident_activation_mb=budget / (1 << 20))
    steps, backend = _train(backend, dynamic)
    for number, (got, want) in enumerate(zip(steps, plain), 1):
        assert torch.equal(got["loss"], want["loss"]), f"step {number}"
        assert all(torch.equal(a, b) for a, b in zip(got["grads"], want["grads"])), number
        assert got["saved"] <= budget + SLACK, f"step {number}: {got['saved']} B > {budget} B"
    # Distinct buckets: each length with symbolic sizes, plus the static first compile
    # of automatic dynamic. A length seen before reuses its plan. A region the recompute
    # search gave another partition has its step planned once more on it (the plans made
    # on the old partition are dropped): under automatic dynamic the symbolic region is
    # searched at 48 and re-partitioned (measured), so 4 buckets made 5 plans.
    buckets = len(set(LENGTHS)) + (dynamic is None)
    repartitioned = len(backend.step_report.relowered)
    assert 0 < backend.plans_made <= buckets + repartitioned
    symbolic = [r for r in backend.regions if r.size_inputs]
    assert symbolic  # the sizes were symbolic, and read at each call
    assert backend.step_report is not None and backend.step_report.moved_bytes > 0
