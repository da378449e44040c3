"""The recompute search's bound (issue 31; work, not time, since issue 43): compile + one
step, ``recompute="auto"`` against ``recompute="off"``, per-region budgets
(``budget_scope="region"``, where the search runs), aot_eager.

Models: HF RWKV (2 layers, from a config) at 10% of its saved bytes, the issue's case
(135.7 s against 25.5 s before the bound), and HF GPT-2 / Llama (3 layers) at 30%. Per
model, in one process, alternating ``off`` and ``auto`` ``--repeats`` times after a
warm-up compile: wall seconds from ``torch.compile`` to the end of the first backward
(measured), whether the search hit its bound, and whether both are ``torch.equal`` to
plain aot_eager. One JSON line per model; target ratio auto/off <= 2.

Run from the repository root: ``python benchmarks/search_bound.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

import hyper_offload
from hyper_offload.runtime.saved_bytes import saved_device_bytes

BATCH, SEQ, VOCAB = 2, 64, 128
_MIB = float(1 << 20)


def rwkv() -> torch.nn.Module:
    import transformers

    return transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
        intermediate_size=128, context_length=SEQ,
    ))


def gpt2() -> torch.nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ))


def llama() -> torch.nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
    ))


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], float]] = {
    "hf_rwkv": (rwkv, 0.1), "hf_gpt2": (gpt2, 0.3), "hf_llama": (llama, 0.3),
}


def _step(factory: Callable[[], torch.nn.Module], backend: Any) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = factory()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    started = time.perf_counter()
    loss = torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss
    saved = saved_device_bytes(loss, exclude=[*model.parameters(), ids])
    loss.backward()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "saved": saved, "loss": loss.detach(),
            "grads": [p.grad for p in model.parameters()]}


def _exact(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["loss"], b["loss"]) and all(
        torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]) if x is not None)


def run(name: str, repeats: int) -> dict[str, Any]:
    factory, fraction = MODELS[name]
    plain = _step(factory, "aot_eager")  # also the warm-up
    budget_mb = fraction * plain["saved"] / _MIB
    times: dict[str, list[float]] = {"off": [], "auto": []}
    exact, bounded = True, False
    for _ in range(repeats):
        for mode in ("off", "auto"):
            backend = hyper_offload.backend(
                inner_compiler="aot_eager", max_resident_activation_mb=budget_mb,
                recompute=mode, budget_scope="region",
            )
            result = _step(factory, backend)
            times[mode].append(result["seconds"])
            exact &= _exact(result, plain)
            bounded |= any(r.recompute is not None and r.recompute.work_bounded
                           for r in backend.reports)
    return {
        "benchmark": "search_bound", "model": name, "fraction": fraction,
        "off_s": min(times["off"]), "auto_s": min(times["auto"]),
        "ratio_auto_over_off": min(times["auto"]) / min(times["off"]),
        "plain_s": plain["seconds"], "search_hit_bound": bounded, "exact": exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    for name in args.models:
        print(json.dumps(run(name, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
