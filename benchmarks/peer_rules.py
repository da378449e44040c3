"""The two peers of ``benchmarks/peers.py`` as residency schedules of our trace model.

Both are re-implemented from their public descriptions (no code copied), on the FX graphs
our trace is built from, so the one validator judges them and the one timeline model
prices them next to our plans:

* **torchtitan's graph_trainer CPU offload** (``torchtitan/experiments/graph_trainer/
  cpu_offload.py``, read through the search tool): every saved forward node of a
  ``layers.N`` module except the last layer's, that is not a view (its list: ``t``,
  ``transpose``, ``view``, ``_unsafe_view``, ``reshape``, ``unsqueeze``, ``squeeze``,
  ``slice``, ``select``, ``expand``, ``permute``, ``as_strided``, ``alias``, ``split``,
  ``narrow``, ``unfold``, ``detach``; a ``getitem`` is allowed), not a collective, is
  contiguous and at least 4 KiB, is copied right after it is produced; the wait that
  frees its device bytes is deferred to the last forward op of the layer after its last
  consumer's layer; its reload starts at the first backward op of the next layer (one
  layer ahead) and is waited for at its first backward reader. No budget (its CPU budget
  is 100 GB), no planner.
* **torch 2.13's AOT activation offloading** with every node marked ``should_offload``
  (``torch/_functorch/_activation_offloading/activation_offloading.py``): every saved
  forward output that is not a model output, a view (torch's own ``is_view``) or a
  ``getitem``, and is contiguous, is copied after its last forward use; with
  ``activation_offload_sink_wait`` the waits that free the device bytes sink to the end
  of the forward (else each wait follows its copy); each reload is waited for at its
  first backward user and, with ``activation_reload_prefetch``, started earlier by
  walking the backward in reverse: a FIFO of reloads, the head's transfer time (bytes /
  ``activation_offload_cpu_gpu_bw`` GiB/s, set to the link) paid down by each compute op
  (``is_compute_node``: ops with a flop formula) at its runtime (here the same roofline
  as every other op), placed where paid, the rest at the backward's start.

A storage the rule would offload but our trace cannot move (``FxTrace.movable``: e.g. it
shares its storage with a model output) stays; each function returns how many.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from hyper_offload.passes import ResidencySchedule, check_schedule
from hyper_offload.passes.analysis.liveness import OffloadCandidate, offload_candidates
from hyper_offload.passes.analysis.predicted_timeline import op_durations
from hyper_offload.passes.fx.fx_trace import FxTrace
from hyper_offload.passes.ir.schedule import ActionKind, ResidencyAction
from hyper_offload.passes.plan.report import lower_offload_choice
from hyper_offload.passes.plan.placement import with_reload_starts

__all__ = ["aot_schedule", "layer_of", "titan_schedule"]

_TITAN_VIEWS = frozenset({
    "t", "transpose", "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "slice",
    "select", "expand", "permute", "as_strided", "alias", "split", "narrow", "unfold", "detach",
})
_MIN_BYTES = 4096
_LAYER = re.compile(r"layers[.\[']*(\d+)")


def layer_of(node: fx.Node) -> int | None:
    """The ``layers.N`` index of the innermost module a node ran in (forward nodes:
    ``nn_module_stack``; backward nodes: the forward's, ``fwd_nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    found = _LAYER.findall(str(path))
    return int(found[-1]) if found else None


def _nodes(fx_trace: FxTrace, fw: fx.GraphModule, bw: fx.GraphModule) -> list[fx.Node]:
    by_name = {f"fw:{n.name}": n for n in fw.graph.nodes}
    by_name.update({f"bw:{n.name}": n for n in bw.graph.nodes})
    return [by_name[name] for name in fx_trace.op_nodes]


def _gap(fx_trace: FxTrace, storage: int) -> OffloadCandidate | None:
    """The forward-to-backward gap of ``storage`` (the only one a region's trace has)."""
    num_fw = fx_trace.num_fw_ops
    for cand in offload_candidates(fx_trace.trace):
        if cand.storage == storage and cand.start < num_fw <= cand.end:
            return cand
    return None


def _contiguous_and_large(node: fx.Node) -> bool:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return False
    return bool(value.is_contiguous()) and value.numel() * value.element_size() >= _MIN_BYTES


def _moved(schedule: ResidencySchedule, releases: Mapping[int, int]) -> ResidencySchedule:
    """``schedule`` with each storage's forward RELEASE_DEVICE moved to ``releases[s]``."""
    post = [list(slot) for slot in schedule.post]
    for storage, op in releases.items():
        action = ResidencyAction(ActionKind.RELEASE_DEVICE, storage)
        for slot in post:
            if action in slot:
                slot.remove(action)
                break
        post[op].append(action)
    return ResidencySchedule(schedule.pre, tuple(tuple(s) for s in post))


def _checked(fx_trace: FxTrace, schedule: ResidencySchedule) -> ResidencySchedule:
    trace = fx_trace.trace.with_budget(1 << 62)  # the rules have no budget
    report = check_schedule(trace, schedule)
    if report.violations:
        raise AssertionError(f"peer schedule rejected: {report.violations[0]}")
    return schedule


def titan_schedule(
    fx_trace: FxTrace, fw: fx.GraphModule, bw: fx.GraphModule
) -> tuple[ResidencySchedule, int]:
    """torchtitan's rule (module docstring) on ``fx_trace``; and how many storages it would
    offload that our trace cannot move."""
    nodes = _nodes(fx_trace, fw, bw)
    num_fw = fx_trace.num_fw_ops
    layers = [layer_of(n) for n in nodes]
    fw_layers = sorted({layer for layer in layers[:num_fw] if layer is not None})
    last = fw_layers[-1] if len(fw_layers) > 1 else None
    last_fw_op = {layer: op for op, layer in enumerate(layers[:num_fw]) if layer is not None}
    first_bw_op: dict[int, int] = {}
    for op in range(num_fw, len(nodes)):
        if layers[op] is not None:
            first_bw_op.setdefault(layers[op], op)
    movable = fx_trace.movable()
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    chosen, skipped, own_layer = [], 0, {}
    for saved in fx_trace.saved:
        node = fw_nodes.get(saved.name)
        if node is None or node.op != "call_function" or saved.storage is None:
            continue
        layer = layer_of(node)
        packet = getattr(node.target, "overloadpacket", None)
        view = packet is not None and packet.__name__ in _TITAN_VIEWS
        collective = getattr(node.target, "namespace", None) == "_c10d_functional"
        if (layer is None or layer == last or (view and node.target is not operator.getitem)
                or collective or not _contiguous_and_large(node)):
            continue
        gap = _gap(fx_trace, saved.storage)
        if saved.storage not in movable or gap is None:
            skipped += 1
            continue
        if saved.storage not in own_layer:
            own_layer[saved.storage] = layer
            chosen.append(gap)
    schedule = lower_offload_choice(fx_trace.trace, chosen)
    releases, starts = {}, {}
    for gap in chosen:
        accessed = [layers[op] for op, _ in fx_trace.trace.accesses_of(gap.storage)
                    if op < num_fw and layers[op] is not None]
        consumer = max([own_layer[gap.storage], *accessed])
        later = [layer for layer in fw_layers if layer > consumer]
        anchor = last_fw_op.get(later[0], gap.start) if later else gap.start
        releases[gap.storage] = max(anchor, gap.start)
        target = own_layer[gap.storage] + 1
        start = first_bw_op.get(target, gap.end)
        starts[(gap.storage, gap.end)] = min(max(start, num_fw), gap.end)
    schedule = with_reload_starts(_moved(schedule, releases), starts)
    return _checked(fx_trace, schedule), skipped


def aot_schedule(
    fx_trace: FxTrace, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
    link_gbps: float, *, sink_wait: bool = True,
) -> tuple[ResidencySchedule, int]:
    """torch 2.13's AOT offloading with every node marked (module docstring) on
    ``fx_trace``; and how many storages it would offload that our trace cannot move."""
    from torch._functorch.partitioners import get_default_op_list
    from torch._inductor.fx_passes.overlap_scheduling import is_compute_node

    op_types = get_default_op_list()
    nodes = _nodes(fx_trace, fw, bw)
    num_fw = fx_trace.num_fw_ops
    outputs = list(fw.graph.find_nodes(op="output")[0].args[0])
    model_outputs = {n for n in outputs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    movable = fx_trace.movable()
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    chosen, skipped, seen = [], 0, set()
    for saved in fx_trace.saved:
        node = fw_nodes.get(saved.name)
        if (node is None or node.op != "call_function" or node in model_outputs
                or op_types.is_view(node) or node.target is operator.getitem
                or not isinstance(node.meta.get("val"), torch.Tensor)
                or not node.meta["val"].is_contiguous() or saved.storage is None):
            continue
        gap = _gap(fx_trace, saved.storage)
        if saved.storage not in movable or gap is None:
            skipped += 1
            continue
        if saved.storage not in seen:
            seen.add(saved.storage)
            chosen.append(gap)
    # The copy starts after the last forward use (where the plan releases it); the wait
    # that frees it sinks to the forward's end, or follows the copy.
    moved = [g._replace(d2h_op=g.start) for g in chosen]
    schedule = lower_offload_choice(fx_trace.trace, moved)
    if sink_wait:
        schedule = _moved(schedule, {g.storage: num_fw - 1 for g in chosen})
    starts = _aot_prefetch(fx_trace, nodes, chosen, link_gbps, is_compute_node)
    return _checked(fx_trace, with_reload_starts(schedule, starts)), skipped


def _aot_prefetch(
    fx_trace: FxTrace, nodes: list[fx.Node], chosen: list[OffloadCandidate], link_gbps: float,
    is_compute: Any,
) -> dict[tuple[int, int], int]:
    """Where torch's ``reorder_for_prefetch`` starts each reload (module docstring)."""
    num_fw = fx_trace.num_fw_ops
    durations = op_durations(fx_trace.trace)
    by_reader: dict[int, list[OffloadCandidate]] = {}
    for gap in chosen:
        by_reader.setdefault(gap.end, []).append(gap)
    queue: list[list[Any]] = []  # [gap, remaining ms], FIFO
    starts = {}
    for op in range(len(nodes) - 1, num_fw - 1, -1):
        if queue and is_compute(nodes[op]):
            queue[0][1] -= durations[op] * 1e3
            if queue[0][1] <= 0:
                gap = queue.pop(0)[0]
                starts[(gap.storage, gap.end)] = op
        for gap in sorted(by_reader.get(op, ()), key=lambda g: g.storage):
            queue.append([gap, gap.size / (1 << 30) * 1e3 / link_gbps])
    for gap, _ in queue:  # the backward's inputs: nothing earlier
        starts[(gap.storage, gap.end)] = num_fw
    return starts
