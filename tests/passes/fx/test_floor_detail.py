"""The floor report names what is on the device at the floor's op (issue 50 item 1): the
op's own operands, and the largest other values, each with how it got there.

Before, a step report's "its own inputs and outputs" summed every storage the filled
trace lets the op read (every value alive inside the graph there), so it always equalled
the floor: 8B x 224K said "bw:mul_15: its own inputs and outputs 72,605.8 MiB of the
floor's 72,605.8 MiB", where the op itself reads and writes 36.7 GB.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition

import hyper_offload
from hyper_offload.passes.fx.fx_trace import floor_detail
from hyper_offload.passes.fx.graph_trace import build_fx_trace

N = 64


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = torch.tanh(x @ w)  # saved: read first (by the product's backward) and last (tanh's)
    b = torch.sigmoid(a @ w)  # saved
    return (b * a).sum()


@pytest.fixture(scope="module")
def traced() -> Any:
    graphs: dict[str, Any] = {}

    def partition(joint: Any, inputs: Any, **kwargs: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        graphs.update(fw=fw, bw=bw, n=kwargs["num_fwd_outputs"])
        return fw, bw

    x, w = (torch.randn(N, N, requires_grad=True) for _ in range(2))
    aot_function(_f, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                 partition_fn=partition)(x, w).backward()
    return graphs, build_fx_trace(graphs["fw"], graphs["bw"], num_fwd_outputs=graphs["n"])


def test_an_ops_operands_are_its_nodes_inputs_and_outputs(traced):
    graphs, fx_trace = traced
    (node,) = [n for n in graphs["bw"].graph.nodes if n.target is torch.ops.aten.sigmoid_backward.default]
    detail = floor_detail(fx_trace, f"bw:{node.name}", graphs=(graphs["fw"], graphs["bw"]))
    tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    assert len(detail.operands) == len(tensors) + 1  # its inputs and its one output
    assert [v.written for v in detail.operands].count(True) == 1
    assert detail.operand_bytes == (len(tensors) + 1) * N * N * 4
    # the filled trace lets the op "read" more: every value alive in the graph there
    index = fx_trace.op_index()[f"bw:{node.name}"]
    assert fx_trace.trace.operand_bytes(index) > detail.operand_bytes


def test_values_alive_beside_it_say_how_they_got_there(traced):
    graphs, fx_trace = traced
    (node,) = [n for n in graphs["bw"].graph.nodes if n.target is torch.ops.aten.sigmoid_backward.default]
    detail = floor_detail(fx_trace, f"bw:{node.name}")
    held = {v.name: v for v in detail.held}
    (tanh,) = [v for name, v in held.items() if "tanh" in name]  # read before and after
    assert tanh.how == "saved, reloaded" and tanh.nbytes == N * N * 4
    assert [v.nbytes for v in detail.held] == sorted((v.nbytes for v in detail.held), reverse=True)
    assert "reads" in detail.describe() and "also on the device" in detail.describe()


def test_an_estimate_names_the_floors_operands():
    from examples.llama_model import llama_tiny

    tokens = torch.zeros(1, 32, dtype=torch.int64)
    report = hyper_offload.estimate(llama_tiny(), (tokens, tokens), budget=0.01, device="cpu",
                                    recompute="off")
    detail = report.floor_detail
    assert detail is not None and report.floor_op is not None
    assert report.floor_op.op.startswith(detail.op) and detail.operands
    assert report.to_dict()["floor_detail"] == detail.describe()
    assert f"at the floor: {detail.describe()}" in report.summary()
