"""Tiny Hugging Face MoE configs shared by the eager and compile tests of changing sizes."""

from __future__ import annotations

from typing import Any

import pytest


def moe_config(name: str) -> Any:
    """A 2-layer HF MoE config (8 experts, top-2) of ``name``: "qwen3_moe" or "mixtral"
    (skips the test without transformers)."""
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=64, num_experts_per_tok=2)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=8,
                                           decoder_sparse_step=1)
    return transformers.MixtralConfig(**common, num_local_experts=8)
