"""The roofline prices fused attention on any traced device (issue 44): torch's flop
registry has no formula for the CPU (and "overrideable") SDPA kernels, so a graph traced
on CPU priced a 128K-token attention at its bytes alone (0.90 ms instead of ~352 ms)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from hyper_offload.passes.fx.cost_model import DeviceThroughput, attention_flops, node_seconds

GPU = DeviceThroughput(flops_per_s=400e12, bytes_per_s=3e12)


def _attention_graph(seq: int, causal: bool, heads: int = 32, kv_heads: int = 8,
                     head_dim: int = 128) -> torch.fx.GraphModule:
    """Forward and backward of one GQA attention, traced on fake CPU tensors."""
    with FakeTensorMode():
        q = torch.empty(1, heads, seq, head_dim, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(1, kv_heads, seq, head_dim, dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))

        def step(q, k, v):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            return torch.autograd.grad(out.sum(), (q, k, v))

        return make_fx(step)(q, k, v)


def _priced(graph: torch.fx.GraphModule) -> dict[str, float]:
    return {str(n.target).split(".")[1]: node_seconds(n, GPU) for n in graph.graph.nodes
            if "scaled_dot_product" in str(n.target)}


def test_a_cpu_traced_causal_attention_at_128k_is_priced_by_its_flops():
    priced = _priced(_attention_graph(131072, causal=True))
    forward = priced["_scaled_dot_product_flash_attention_for_cpu"]
    backward = priced["_scaled_dot_product_flash_attention_for_cpu_backward"]
    # 4 * heads * s^2 * head_dim FLOPs, half of the score matrix computed, at 400 TFLOP/s
    by_hand = 4 * 32 * 131072 ** 2 * 128 / 2 / 400e12
    assert forward == pytest.approx(by_hand, rel=1e-4)  # ~0.352 s
    assert backward == pytest.approx(2.5 * by_hand, rel=1e-4)  # torch's backward count


def test_causality_halves_the_price_and_a_full_attention_is_torchs_count():
    full = _priced(_attention_graph(4096, causal=False))
    causal = _priced(_attention_graph(4096, causal=True))
    for name, seconds in full.items():
        assert causal[name] == pytest.approx(seconds * 4097 / 8192, rel=1e-6)
    with FakeTensorMode():
        q = torch.empty(1, 32, 4096, 128)
        kv = torch.empty(1, 8, 4096, 128)
    ours = attention_flops(torch.ops.aten._scaled_dot_product_flash_attention.default,
                           (q, kv, kv), {})
    registry = torch.utils.flop_counter.sdpa_flop_count(q.shape, kv.shape, kv.shape)
    assert ours == registry


def test_other_ops_are_not_attention():
    assert attention_flops(torch.ops.aten.mm.default, (), {}) is None
