"""Op durations and transfer times for the compile path: a roofline over fake metadata.

An FX node's estimated duration is ``max(flops / flops_per_s, bytes / bytes_per_s)``:
FLOPs from torch's own formulas (``torch.utils.flop_counter.flop_registry``; ops it does
not know count 0 FLOPs), bytes the sum of the node's tensor inputs and outputs as their
fake-tensor metadata says. Fused attention is priced by :func:`attention_flops` for every
``scaled_dot_product`` kernel, forward and backward, whatever device the graph was traced
on (torch's registry has no formula for the CPU and "overrideable" kernels, which a
CPU-traced long-context graph then priced at its bytes alone: 0.90 ms for a 128K-token
layer that computes ~350 ms on a 400 TFLOP/s device), and a causal one at the fraction
of the score matrix a flash kernel computes. A view costs nothing (no kernel runs), and
an op a checkpointed region's random-state wrapper runs (``run_and_save_rng_state``,
``run_with_rng_state``: SDPA under ``torch.utils.checkpoint``) is priced as that op
(before, full checkpointing's recomputed attention was free: docs/long-context.md,
"Pricing"). Symbolic sizes take the value a plan assumes (:mod:`.sizes`:
the largest their guards allow, else their hint). This is an
estimate for *placing* prefetches and *predicting* exposed copy time, never for
correctness: every schedule is still judged by ``check_schedule``.

Transfer times use the trace's bandwidths (GB/s, 10^9 bytes/s, as the design means),
which the backend fills from ``runtime.profile_transfer_bandwidth``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..analysis.predicted_timeline import predict_timeline
from ..ir.schedule import ActionKind, ResidencySchedule
from ..ir.trace import ActivationTrace
from .sizes import planning_size

__all__ = [
    "DeviceThroughput",
    "attention_flops",
    "TransferTime",
    "exposed_transfer_time",
    "node_seconds",
    "throughput_for",
]


class DeviceThroughput(NamedTuple):
    """Sustained compute and memory throughput used by the roofline estimate."""

    flops_per_s: float
    bytes_per_s: float


# Deliberately round figures: a 2-core CPU and a recent datacenter GPU. Only ratios
# between op time and copy time matter to the prefetch placement.
_CPU = DeviceThroughput(flops_per_s=5e10, bytes_per_s=2e10)
_ACCELERATOR = DeviceThroughput(flops_per_s=5e13, bytes_per_s=1e12)


def throughput_for(device: torch.device) -> DeviceThroughput:
    """Default throughput for ``device`` (CPU or any accelerator)."""
    return _CPU if device.type == "cpu" else _ACCELERATOR


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    flat, _ = tree_flatten(values)
    return (v for v in flat if isinstance(v, torch.Tensor))


def tensor_bytes(tensor: torch.Tensor, where: str) -> int:
    """Bytes of ``tensor``'s elements (numel x element size) at the sizes a plan
    assumes (:func:`~.sizes.planning_size`)."""
    return planning_size(tensor.numel(), where) * tensor.element_size()


def node_seconds(node: fx.Node, throughput: DeviceThroughput) -> float:
    """Estimated run time of ``node``: 0 for anything that is not a call_function and
    for a view (an alias: no kernel runs, no byte moves); an op that a checkpointed
    region's random-state wrapper runs (``run_and_save_rng_state(op, ...)``,
    ``run_with_rng_state(state, op, ...)``: AOTAutograd wraps every op it treats as
    random, SDPA included, in a checkpointed forward and its recomputation) is priced
    as that op."""
    if node.op != "call_function" or _is_view(node.target):
        return 0.0
    value = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
    target, args, kwargs, out = _unwrapped(
        node.target, tuple(map(value, node.args)),
        {k: value(v) for k, v in node.kwargs.items()}, node.meta.get("val"),
    )
    nbytes = sum(tensor_bytes(t, node.name) for t in _tensors((args, kwargs, out)))
    flops = attention_flops(target, args, kwargs)
    # An aten op's formula is registered by its packet, a higher-order op's (flex
    # attention) by the op itself.
    packet = getattr(target, "overloadpacket", target)
    formula = flop_registry.get(packet)
    if flops is None and formula is not None:
        try:
            flops = planning_size(formula(*args, out_val=out, **kwargs), node.name)
        except Exception:  # a formula that rejects these arguments: count bytes only
            flops = 0
    return max(planning_size(flops or 0, node.name) / throughput.flops_per_s,
               nbytes / throughput.bytes_per_s)


def _is_view(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def _unwrapped(
    target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any]:
    """The op a random-state wrapper runs, with its own arguments and result (the
    wrapper's state argument and state output are a few bytes and no work); any other
    op as it is. Before this, a checkpointed layer's attention and its recomputation
    were priced at 0 FLOPs: full checkpointing looked +10% over plain where its extra
    forward costs about +20% (docs/long-context.md, "Pricing")."""
    name = getattr(target, "__name__", "")
    if name == "run_and_save_rng_state" and args:
        inner = out[1] if isinstance(out, tuple) and len(out) == 2 else out
        return args[0], args[1:], kwargs, inner
    if name == "run_with_rng_state" and len(args) > 1:
        return args[1], args[2:], kwargs, out
    if name == "graphsafe_run_with_rng_state" and args:
        return args[0], args[1:], {k: v for k, v in kwargs.items() if k != "rng_state"}, out
    return target, args, kwargs, out


def attention_flops(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """FLOPs of a fused attention kernel (forward or backward, any backend's), or None
    when ``target`` is no such kernel. torch's own counts (two matmuls forward, four
    backward, GQA included) times the causal fraction: a causal kernel computes
    ``(s + 1) / 2s`` of an ``s x s`` score matrix (flash skips the masked blocks; the
    other kernels are priced alike, as the better estimate of what a device runs).

    Kernels: every ``aten::_scaled_dot_product_*`` (flash, efficient, cuDNN, the CPU
    flash, the "overrideable" one, MPS math; ``(batch, heads, seq, dim)``), and the
    kernels below them, ``aten::_flash_attention_*`` / ``aten::_efficient_attention_*``
    (``(batch, seq, heads, dim)``; a varlen call, 3-D, is left to torch's registry).
    ``flex_attention`` (a higher-order op) is priced by torch's registry
    (:func:`node_seconds`), at its full score matrix."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    name = getattr(getattr(target, "_schema", None), "name", "")
    fused = name.startswith("aten::_scaled_dot_product_")
    inner = name.startswith(("aten::_flash_attention_", "aten::_efficient_attention_"))
    if not (fused or inner):
        return None
    bound = _bind(target, args, kwargs)
    query, key, value = bound.get("query"), bound.get("key"), bound.get("value")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        return None
    layout = (lambda t: t.shape) if fused else (lambda t: t.transpose(1, 2).shape)
    shapes = (layout(query), layout(key), layout(value))
    if name.endswith("_backward"):
        grad = bound.get("grad_out", bound.get("grad_out_"))
        if not isinstance(grad, torch.Tensor):
            return None
        flops = sdpa_backward_flop_count(layout(grad), *shapes)
    else:
        flops = sdpa_flop_count(*shapes)
    if bound.get("is_causal") or bound.get("custom_mask_type") in (1, 2):
        s_q, s_k = shapes[0][-2], shapes[1][-2]
        # the lower triangle with its diagonal, of the square the causal mask aligns
        flops = flops * (torch.sym_min(s_q, s_k) + 1) // (2 * s_k)
    return flops


def _bind(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An op's arguments by their schema names (defaults left out)."""
    names = [argument.name for argument in target._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


class TransferTime(NamedTuple):
    """Predicted copy time of a schedule and the part compute does not hide."""

    d2h_s: float
    h2d_s: float
    exposed_s: float


def exposed_transfer_time(trace: ActivationTrace, schedule: ResidencySchedule) -> TransferTime:
    """Copy seconds of ``schedule`` and how many of them compute cannot hide.

    The compile lowering's timeline (:func:`~..analysis.predicted_timeline.predict_timeline` with
    ``release_waits_for_d2h=True``, ops without a duration priced by the one default of
    :func:`~..analysis.predicted_timeline.op_durations`): one serial copy stream; a D2H is waited
    for where its device bytes are released, an H2D at its ``WAIT_H2D``. Exposed is the
    compute time those waits stall, what the planning pipeline minimised.
    """
    timeline = predict_timeline(trace, schedule, release_waits_for_d2h=True)
    d2h_s = sum(t.end_s - t.start_s for t in timeline.transfers if t.kind is ActionKind.COPY_D2H)
    h2d_s = sum(t.end_s - t.start_s for t in timeline.transfers if t.kind is ActionKind.COPY_H2D)
    return TransferTime(d2h_s, h2d_s, timeline.exposed_transfer_s)
