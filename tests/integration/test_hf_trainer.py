"""Hugging Face ``Trainer`` and a plain loop with gradient accumulation, on a GPT-2 built
from a config (no weights downloaded), both exact against plain ``torch.compile``
(issue 18, point 7; docs/integrations.md, "Hugging Face Trainer").

``TrainingArguments(torch_compile_backend="hyper_offload")`` cannot work: accelerate
accepts only its own list of backends, and Trainer passes no options. What works is
handing Trainer a model compiled by the user; these tests run that recipe.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers  # the test extra; Trainer also needs accelerate (the "trainer" extra)

import hyper_offload

VOCAB, SEQ = 64, 16


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
    )
    return transformers.GPT2LMHeadModel(config)


def _examples(n: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(VOCAB, (n, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def _offload_backend() -> hyper_offload.compiler.HyperOffloadBackend:
    return hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_fraction=0.5)


def _train_with_trainer(backend: object, output_dir: Path) -> list[torch.Tensor]:
    model = _gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, seed=0, use_cpu=True,
        remove_unused_columns=False,  # the compiled model's forward hides its signature
        report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
    )
    compiled = torch.compile(model, backend=backend)
    transformers.Trainer(model=compiled, args=args, train_dataset=_examples(12)).train()
    return [p.detach().clone() for p in model.parameters()]


def test_trainer_with_a_compiled_model_is_exact(tmp_path: Path) -> None:
    torch._dynamo.reset()
    plain = _train_with_trainer("aot_eager", tmp_path / "plain")
    backend = _offload_backend()
    ours = _train_with_trainer(backend, tmp_path / "ours")
    assert any(report.offloaded for report in backend.reports), "nothing offloaded"
    assert all(map(torch.equal, plain, ours))


def test_plain_loop_with_gradient_accumulation_is_exact() -> None:
    torch._dynamo.reset()
    results = []
    for backend in ("aot_eager", _offload_backend()):
        model = _gpt2()
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = torch.stack([e["input_ids"] for e in _examples(8)]).split(2)
        for step in range(2):
            for micro in batches[2 * step: 2 * step + 2]:  # 2 micro-batches per step
                (compiled(input_ids=micro, labels=micro).loss / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        results.append([p.detach().clone() for p in model.parameters()])
    assert any(report.offloaded for report in backend.reports), "nothing offloaded"
    assert all(map(torch.equal, *results))
