"""The floor of one candidate tiling of a region: its graphs compiled (no code), traced,
and the op where the most bytes must stay on the device (:mod:`.tiling` chooses with it).

A probe is the backend's own compile of the region minus code generation
(:func:`~.fake_capture.compile_graphs_only`: AOTAutograd with the inner compiler's
decompositions and partition pipeline, torch's min-cut partition), traced as the step
scope traces a region at its floor (:func:`~hyper_offload.passes.fx.graph_trace.
build_fx_trace`, everything movable moved), so the floor it reads is the one the region
would be lowered at. It runs in a fresh tracing context on the region's fake mode (as a
re-lowering does, :meth:`.region_state.CompiledRegion.compiling_again`), so Dynamo's own
compile of the region is untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from hyper_offload.passes import required_bytes
from hyper_offload.passes.analysis.predicted_timeline import op_durations
from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.passes.fx.graph_trace import build_fx_trace

from .fake_capture import compile_graphs_only
from .options import BackendOptions

__all__ = ["SPAN_KEY", "Probe", "probe_floor"]

SPAN_KEY = "hyper_offload_span"
"""``node.meta["custom"][SPAN_KEY]``: the span a Dynamo node belongs to. AOTAutograd
copies ``custom`` onto every aten node it traces from the node, backward nodes included,
so the floor's op names its span."""


class Probe(NamedTuple):
    """A candidate's predicted floor (bytes), the op that sets it (``"bw:mm_4"``) and
    its span (None: not a token-wise op), the compute of both graphs (seconds, the
    roofline), and the peak with nothing moved (bytes)."""

    floor_bytes: int
    floor_op: str
    floor_span: int | None
    compute_s: float
    peak_without_offload: int


class _Capture(CustomPartitionerFn):
    """Torch's min-cut partition, kept (the backend's partitioner without the plan)."""

    def __init__(self) -> None:
        self.graphs: tuple[fx.GraphModule, fx.GraphModule, int] | None = None

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.graphs = (fw, bw, kwargs["num_fwd_outputs"])
        return fw, bw

    def __deepcopy__(self, memo: dict[int, Any]) -> _Capture:
        return self  # Inductor snapshots its config; the capture is kept by reference

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, ("hyper_offload tiling probe",))

    def uuid(self) -> Any:
        return "hyper_offload tiling probe"


def probe_floor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions, *,
    activation_inputs: frozenset[str], throughput: DeviceThroughput | None,
) -> Probe:
    """The floor of ``gm`` compiled as the backend compiles it (module docstring)."""
    from torch._functorch import config as functorch_config

    capture = _Capture()
    context = torch._guards.TracingContext.try_get()
    fake_mode = context.fake_mode if context is not None else None
    tracing = (torch._guards.tracing(torch._guards.TracingContext(fake_mode))
               if fake_mode is not None else contextlib.nullcontext())
    with functorch_config.patch(enable_autograd_cache=False), tracing:
        compile_graphs_only(gm, example_inputs, capture, options.inner_compiler,
                            options.inductor_patches())
    assert capture.graphs is not None, "the region has a backward (it was compiled for one)"
    fw, bw, num_fwd_outputs = capture.graphs
    fx_trace = build_fx_trace(fw, bw, num_fwd_outputs=num_fwd_outputs, throughput=throughput,
                              activation_inputs=activation_inputs,
                              outputs_move=options.step_scoped)
    need = required_bytes(fx_trace.trace)
    at = max(range(len(need)), key=need.__getitem__)
    name = fx_trace.op_nodes[at]
    return Probe(need[at], name, _span_of(name, fw, bw), sum(op_durations(fx_trace.trace)),
                 fx_trace.peak_without_offload)


def _span_of(op: str, fw: fx.GraphModule, bw: fx.GraphModule) -> int | None:
    """The span of trace op ``op`` (``"bw:mm_4"``): its node's tag, else for an
    addition the tag its inputs share (autograd's accumulation of two gradients is
    traced untagged; any other untagged op is no span's)."""
    graph_name, _, node_name = op.partition(":")
    graph = (bw if graph_name == "bw" else fw).graph
    node = next((n for n in graph.nodes if n.name == node_name), None)
    if node is None:
        return None
    own = _tag(node)
    if own is not None or node.target is not torch.ops.aten.add.Tensor:
        return own
    tags = {_tag(arg) for arg in node.all_input_nodes} - {None}
    return tags.pop() if len(tags) == 1 else None


def _tag(node: fx.Node) -> int | None:
    custom = node.meta.get("custom")
    return custom.get(SPAN_KEY) if isinstance(custom, dict) else None
