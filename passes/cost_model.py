"""Op durations and transfer times for the compile path: a roofline over fake metadata.

An FX node's estimated duration is ``max(flops / flops_per_s, bytes / bytes_per_s)``:
FLOPs from torch's own formulas (``torch.utils.flop_counter.flop_registry``; ops it does
not know count 0 FLOPs), bytes the sum of the node's tensor inputs and outputs as their
fake-tensor metadata says. Symbolic sizes are evaluated at their size hints. This is an
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

from .schedule import ActionKind, ResidencySchedule
from .trace import ActivationTrace

__all__ = [
    "DeviceThroughput",
    "TransferTime",
    "exposed_transfer_time",
    "node_seconds",
    "throughput_for",
    "to_hint",
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


class DynamicShapeError(ValueError):
    """A symbolic size has no hint to plan with (the message names it and the fix)."""


def to_hint(value: Any, where: str) -> int:
    """``value`` as an int: plain ints pass, a ``SymInt`` gives its size hint."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise DynamicShapeError(
                f"{where}: size {value} is symbolic and has no hint; hyper_offload plans on "
                "size hints. Fix: compile with dynamic=False, or mark the dimension with "
                "a concrete example before compiling"
            )
        return int(hint)
    return int(value)


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    flat, _ = tree_flatten(values)
    return (v for v in flat if isinstance(v, torch.Tensor))


def tensor_bytes(tensor: torch.Tensor, where: str) -> int:
    """Bytes of ``tensor``'s elements (numel x element size) at size hints."""
    return to_hint(tensor.numel(), where) * tensor.element_size()


def node_seconds(node: fx.Node, throughput: DeviceThroughput) -> float:
    """Estimated run time of ``node`` (0 for anything that is not a call_function)."""
    if node.op != "call_function":
        return 0.0
    out = node.meta.get("val")
    args = tuple(
        a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args
    )
    kwargs = {
        k: (v.meta.get("val") if isinstance(v, fx.Node) else v) for k, v in node.kwargs.items()
    }
    nbytes = sum(tensor_bytes(t, node.name) for t in _tensors((args, kwargs, out)))
    flops = 0
    packet = getattr(node.target, "overloadpacket", None)
    formula = torch.utils.flop_counter.flop_registry.get(packet)
    if formula is not None:
        try:
            flops = to_hint(formula(*args, out_val=out, **kwargs), node.name)
        except Exception:  # a formula that rejects these arguments: count bytes only
            flops = 0
    return max(flops / throughput.flops_per_s, nbytes / throughput.bytes_per_s)


class TransferTime(NamedTuple):
    """Predicted copy time of a schedule and the part compute does not hide."""

    d2h_s: float
    h2d_s: float
    exposed_s: float


def exposed_transfer_time(trace: ActivationTrace, schedule: ResidencySchedule) -> TransferTime:
    """Copy seconds of ``schedule`` and how many of them compute cannot hide.

    A D2H issued after op ``i`` overlaps the ops up to the ``RELEASE_DEVICE`` that ends
    its gap (the lowering waits there); an H2D issued before op ``j`` overlaps ops
    ``j .. k-1`` where ``k`` carries its ``WAIT_H2D``. What is not covered is exposed.
    Copies on one link run one after another; this estimate treats them independently,
    so it is a lower bound when copies overlap each other.
    """
    d2h_bw = trace.d2h_bandwidth_gbps * 1e9
    h2d_bw = trace.h2d_bandwidth_gbps * 1e9
    duration = [op.duration_s or 0.0 for op in trace.ops]
    started_d2h: dict[int, int] = {}
    started_h2d: dict[int, int] = {}
    d2h_s = h2d_s = exposed = 0.0
    for op, where, action in schedule.actions():
        size = trace.storage_sizes[action.storage]
        if action.kind is ActionKind.COPY_D2H:
            started_d2h[action.storage] = op + 1
        elif action.kind is ActionKind.RELEASE_DEVICE and action.storage in started_d2h:
            start = started_d2h.pop(action.storage)
            copy = size / d2h_bw
            d2h_s += copy
            exposed += max(0.0, copy - sum(duration[start : op + 1]))
        elif action.kind is ActionKind.COPY_H2D:
            started_h2d[action.storage] = op if where == "pre" else op + 1
        elif action.kind is ActionKind.WAIT_H2D and action.storage in started_h2d:
            start = started_h2d.pop(action.storage)
            copy = size / h2d_bw
            h2d_s += copy
            exposed += max(0.0, copy - sum(duration[start:op]))
    return TransferTime(d2h_s, h2d_s, exposed)
