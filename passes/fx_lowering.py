"""Lower a :class:`ResidencySchedule` onto a region's forward and backward FX graphs.

For a saved activation ``act`` (storage ``s``) that the schedule offloads, the forward
gets, and returns the host copy in place of ``act``::

    act  = <producer>(...)
    host = hyper_offload.copy_d2h(act)                        # post[producer]: COPY_D2H s
    ...                                                       # act's forward readers
    host_w = hyper_offload.wait_transfer(host, keepalive=act) # post[last read]: RELEASE_DEVICE s
    return (..., host_w, ...)

and the backward, whose placeholder ``act`` now holds the host copy::

    dev   = hyper_offload.copy_h2d(act, device)               # pre[k]: COPY_H2D s (hoisted)
    ...
    dev_w = hyper_offload.wait_transfer(dev, keepalive=act)   # pre[first read]: WAIT_H2D s
    <first reader>(dev_w, ...)                                # every reader now takes dev_w
    hyper_offload.release_host(act, after=dev_w)              # post[last reload]: RELEASE_HOST s

Why the copy sits right after the producer: Inductor realizes a node into a buffer when
it is lowered if one of its users is the graph output. Once the output reads the wait's
result instead, a copy placed late lets Inductor inline the (bf16) value unrounded into
its consumers, which changes results; an extern copy right after the producer realizes
it at the same point as before (docs/architecture.md, "Compile path").

Every other action must be an end-of-life ``RELEASE_DEVICE`` (the graph frees a value
after its last reader by itself); anything else raises :class:`LoweringError`. The
graphs are rewritten in place and returned; ``passes.fx_schedule`` re-derives the
schedule from them for ``check_schedule``.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from hyper_offload.runtime.op_declarations import COPY_D2H, COPY_H2D, RELEASE_HOST, WAIT_TRANSFER

from .fx_trace import SAVED_NAME_META, FxTrace, fw_outputs, saved_name
from .liveness import storage_liveness
from .schedule import ActionKind, ResidencyAction, ResidencySchedule
from .trace import StorageId

__all__ = ["LoweringError", "lower_schedule"]


class LoweringError(ValueError):
    """The schedule asks for something the FX lowering cannot express (names the
    action, the op and the rule)."""


@dataclass
class _Graphs:
    fw: fx.GraphModule
    bw: fx.GraphModule
    fx_trace: FxTrace
    fw_nodes: dict[str, fx.Node] = field(default_factory=dict)
    bw_nodes: dict[str, fx.Node] = field(default_factory=dict)
    after_cursor: dict[fx.Node, fx.Node] = field(default_factory=dict)
    d2h: dict[StorageId, fx.Node] = field(default_factory=dict)
    d2h_op: dict[StorageId, int] = field(default_factory=dict)
    fw_wait: dict[StorageId, fx.Node] = field(default_factory=dict)
    h2d: dict[StorageId, fx.Node] = field(default_factory=dict)
    bw_wait: dict[StorageId, fx.Node] = field(default_factory=dict)

    def node(self, op: int) -> fx.Node:
        graph, name = self.fx_trace.op_nodes[op].split(":", 1)
        return (self.fw_nodes if graph == "fw" else self.bw_nodes)[name]

    def insert_after(self, anchor: fx.Node, target: object, args: tuple[object, ...]) -> fx.Node:
        """Insert after ``anchor`` and after what was inserted there before (keeps the
        schedule's order within one slot)."""
        where = self.after_cursor.get(anchor, anchor)
        with where.graph.inserting_after(where):
            node = where.graph.call_function(target, args)
        self.after_cursor[anchor] = node
        return node


def lower_schedule(
    fw: fx.GraphModule, bw: fx.GraphModule, fx_trace: FxTrace, schedule: ResidencySchedule
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Insert the transfer ops ``schedule`` asks for (see the module docstring)."""
    if schedule.num_ops != fx_trace.trace.num_ops:
        raise LoweringError(
            f"lower_schedule: the schedule has {schedule.num_ops} op slots but the trace "
            f"has {fx_trace.trace.num_ops} ops; plan the schedule from this region's trace"
        )
    graphs = _Graphs(fw, bw, fx_trace)
    graphs.fw_nodes = {n.name: n for n in fw.graph.nodes}
    graphs.bw_nodes = {n.name: n for n in bw.graph.nodes}
    saved = fx_trace.saved_by_storage()
    last_access = {s: live.last for s, live in storage_liveness(fx_trace.trace).items()}
    for op, slot, action in schedule.actions():
        _lower_action(graphs, saved, last_access, op, slot, action)
    _rewire_outputs(graphs, saved)
    for module in (fw, bw):
        module.graph.lint()
        module.recompile()
    return fw, bw


def _fail(op: int, action: ResidencyAction, fx_trace: FxTrace, rule: str) -> LoweringError:
    return LoweringError(
        f"lower_schedule: op {op} ({fx_trace.op_nodes[op]}), {action!r}: {rule}. The compile "
        "path offloads a saved activation only between its last forward and first backward "
        "access; plan with a trace from passes.fx_trace"
    )


def _lower_action(
    g: _Graphs,
    saved: Mapping[StorageId, object],
    last_access: Mapping[StorageId, int],
    op: int,
    slot: str,
    action: ResidencyAction,
) -> None:
    s, kind, in_fw = action.storage, action.kind, op < g.fx_trace.num_fw_ops
    if kind is ActionKind.RELEASE_DEVICE and s not in g.d2h and op == last_access.get(s):
        return  # end of life: the graph frees the value after its last reader
    if s not in saved:
        raise _fail(op, action, g.fx_trace, "the storage is not an offloadable saved activation")
    name = saved[s].name  # type: ignore[attr-defined]
    if kind is ActionKind.COPY_D2H and in_fw and slot == "post" and s not in g.d2h:
        act = g.fw_nodes[name]
        producer = act.args[0] if act.target is operator.getitem else act
        if g.node(op) is not producer:
            raise _fail(op, action, g.fx_trace, f"COPY_D2H must follow the producer of {name}")
        node = g.insert_after(act, COPY_D2H, (act,))
        node.meta["val"] = _host_value(act.meta["val"])
        g.d2h[s], g.d2h_op[s] = node, op
    elif kind is ActionKind.RELEASE_DEVICE and in_fw and slot == "post" and s in g.d2h:
        copy, reader = g.d2h[s], g.node(op)
        # The last forward reader lies after the activation (so after its copy) unless
        # it is the producer itself, whose getitem may still come before the copy.
        anchor = copy if op == g.d2h_op[s] else reader
        node = g.insert_after(anchor, WAIT_TRANSFER, (copy, g.fw_nodes[name]))
        node.meta["val"] = copy.meta["val"]
        node.meta[SAVED_NAME_META] = name
        g.fw_wait[s] = node
    elif kind is ActionKind.RELEASE_DEVICE and s in g.bw_wait and op == last_access.get(s):
        return  # the reloaded copy's end of life
    elif kind is ActionKind.COPY_H2D and not in_fw and slot == "pre" and s in g.fw_wait:
        placeholder = g.bw_nodes[name]
        with g.bw.graph.inserting_before(g.node(op)):
            node = g.bw.graph.call_function(
                COPY_H2D, (placeholder, placeholder.meta["val"].device)
            )
        node.meta["val"] = placeholder.meta["val"]
        g.h2d[s] = node
    elif kind is ActionKind.WAIT_H2D and not in_fw and slot == "pre" and s in g.h2d:
        if s in g.bw_wait:
            raise _fail(op, action, g.fx_trace, "a second reload of one host copy")
        placeholder, copy = g.bw_nodes[name], g.h2d[s]
        with g.bw.graph.inserting_before(g.node(op)):
            node = g.bw.graph.call_function(WAIT_TRANSFER, (copy, placeholder))
        node.meta["val"] = copy.meta["val"]
        for user in list(placeholder.users):
            if user is not copy and user is not node:
                user.replace_input_with(placeholder, node)
        g.bw_wait[s] = node
    elif kind is ActionKind.RELEASE_HOST and not in_fw and slot == "post" and s in g.bw_wait:
        node = g.insert_after(g.node(op), RELEASE_HOST, (g.bw_nodes[name], g.bw_wait[s]))
        node.meta["val"] = None
    else:
        raise _fail(op, action, g.fx_trace, f"no lowering for this action in the {slot} slot here")


def _rewire_outputs(g: _Graphs, saved: Mapping[StorageId, object]) -> None:
    """The forward returns each offloaded activation's host copy in its place; the
    backward's placeholder of that name now holds the host copy."""
    incomplete = set(g.d2h) ^ set(g.bw_wait)
    if incomplete or set(g.d2h) != set(g.fw_wait):
        raise LoweringError(
            f"lower_schedule: storages {sorted(incomplete | (set(g.d2h) ^ set(g.fw_wait)))} "
            "lack part of COPY_D2H / RELEASE_DEVICE / COPY_H2D / WAIT_H2D; an offloaded "
            "saved activation needs all four"
        )
    replace = {saved[s].name: wait for s, wait in g.fw_wait.items()}  # type: ignore[attr-defined]
    output = g.fw.graph.find_nodes(op="output")[0]
    outputs = [
        replace.get(saved_name(n), n) if isinstance(n, fx.Node) else n for n in fw_outputs(g.fw)
    ]
    output.args = (tuple(outputs),) + tuple(output.args[1:])
    for s, wait in g.fw_wait.items():
        g.bw_nodes[saved[s].name].meta["val"] = wait.meta["val"]  # type: ignore[attr-defined]


def _host_value(value: torch.Tensor) -> torch.Tensor:
    """Fake value of the host copy: ``dense_layout`` of ``value`` on the CPU."""
    from hyper_offload.runtime.op_declarations import dense_layout

    shape, stride = dense_layout(value)
    fake_mode = getattr(value, "fake_mode", None)  # keep the value fake (and its SymInts)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return torch.empty_strided(shape, stride, dtype=value.dtype, device="cpu")
