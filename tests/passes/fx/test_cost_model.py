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


def _attention_kernels() -> list[torch._ops.OpOverload]:
    """Every fused attention kernel this torch has (forward and backward, each overload):
    a kernel torch adds is priced by this test too."""
    found = []
    for name in dir(torch.ops.aten):
        if name.startswith(("_scaled_dot_product_", "_flash_attention_", "_efficient_attention_")):
            packet = getattr(torch.ops.aten, name)
            found += [getattr(packet, overload) for overload in packet.overloads()]
    return found


@pytest.mark.parametrize("kernel", _attention_kernels(), ids=str)
def test_every_attention_kernel_is_priced_by_its_flops(kernel):
    names = {argument.name for argument in kernel._schema.arguments}
    assert {"query", "key", "value"} <= names, f"{kernel}: a kernel of another form"
    inner = str(kernel).startswith(("aten._flash", "aten._efficient"))
    heads, kv_heads, seq, dim = 8, 8, 256, 64
    shape = (1, seq, heads, dim) if inner else (1, heads, seq, dim)
    with FakeTensorMode():
        q = k = v = grad = torch.empty(shape)
    arguments = {"query": q, "key": k, "value": v}
    causal = "is_causal" in names or "custom_mask_type" in names
    arguments.update({"is_causal": True} if "is_causal" in names else
                     {"custom_mask_type": 1} if causal else {})
    backward = str(kernel._schema.name).endswith("_backward")
    if backward:
        arguments["grad_out" if "grad_out" in names else "grad_out_"] = grad
    flops = attention_flops(kernel, (), arguments)
    bhsd = (1, heads, seq, dim)
    count = (torch.utils.flop_counter.sdpa_backward_flop_count(bhsd, bhsd, bhsd, bhsd) if backward
             else torch.utils.flop_counter.sdpa_flop_count(bhsd, bhsd, bhsd))
    assert flops == (count * (seq + 1) // (2 * seq) if causal else count) > 0


def test_flex_attention_is_priced_by_torchs_count():
    """A higher-order op's formula is registered under the op itself, not a packet."""
    from torch.nn.attention.flex_attention import flex_attention

    with FakeTensorMode():
        q = torch.empty(1, 8, 1024, 64)
        graph = make_fx(lambda q: flex_attention(q, q, q))(q)
    (node,) = [n for n in graph.graph.nodes if "flex_attention" in str(n.target)]
    count = torch.utils.flop_counter.sdpa_flop_count(q.shape, q.shape, q.shape)
    assert node_seconds(node, GPU) == pytest.approx(count / GPU.flops_per_s, rel=1e-9)


def _checkpointed_attention_graph() -> torch.fx.GraphModule:
    """A checkpointed attention's forward as AOTAutograd traces it: SDPA inside
    ``run_and_save_rng_state`` (AOTAutograd treats SDPA as random under checkpoint)."""
    from torch._prims.rng_prims import run_and_save_rng_state

    with FakeTensorMode():
        q = torch.empty(1, 8, 1024, 64, dtype=torch.bfloat16)
        return make_fx(lambda q: run_and_save_rng_state(
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q,
            is_causal=True))(q)


def test_a_random_state_wrapper_is_priced_as_the_op_it_runs():
    """Before: 0 FLOPs, so a checkpointed layer's attention (and its recomputation,
    ``run_with_rng_state``) was priced at its few bytes (docs/long-context.md)."""
    graph = _checkpointed_attention_graph()
    (wrapper,) = [n for n in graph.graph.nodes if "rng_state" in str(n.target)]
    by_hand = 4 * 8 * 1024 ** 2 * 64 * 1025 // 2048  # causal: (s + 1) / 2s of the scores
    assert node_seconds(wrapper, GPU) == pytest.approx(by_hand / GPU.flops_per_s, rel=1e-9)


def test_a_view_costs_nothing():
    """A view is an alias: no kernel runs and no byte moves (before, a permute of a
    128K x 4096 bf16 tensor was priced as two passes over it)."""
    with FakeTensorMode():
        x = torch.empty(4096, 4096)
        graph = make_fx(lambda x: (x.permute(1, 0).unsqueeze(0) * 2, x.t().contiguous()))(x)
    priced = {str(n.target): node_seconds(n, GPU) for n in graph.graph.nodes
              if n.op == "call_function"}
    assert priced["aten.permute.default"] == priced["aten.unsqueeze.default"] == 0.0
    assert priced["aten.t.default"] == 0.0
    assert priced["aten.mul.Tensor"] == priced["aten.clone.default"] > 0  # a pass each
