"""Lower a :class:`ResidencySchedule` onto a region's forward and backward FX graphs.

The unit that moves is a storage (:mod:`.saved`): its *base* tensor ``base`` and the
saved activations on it, ``act_1 .. act_k`` (the base itself, or views of it). For a
storage ``s`` that the schedule offloads, the forward gets, and returns the host copy in
place of every ``act_i`` among its saved outputs (its model outputs stay as they were,
even one that is the same node as an ``act_i``)::

    base = <producer>(...)
    act_1 = <view>(base)                                      # first saved tensor on s
    host = hyper_offload.copy_d2h(base, dim_order, s)         # post[..]: COPY_D2H s
    ...                                                       # s's forward readers
    host_w = hyper_offload.wait_transfer(host, keepalive=base) # post[last read]: RELEASE_DEVICE s
    return (..., host_w, ..., host_w, ...)                    # for act_1 .. act_k

and the backward, whose placeholders ``act_1 .. act_k`` now all hold that host copy::

    dev   = hyper_offload.copy_h2d(act_1, device)             # pre[k]: COPY_H2D s (hoisted)
    ...
    dev_w = hyper_offload.wait_transfer(dev, keepalive=act_1) # pre[first read]: WAIT_H2D s
    act_i' = aten.as_strided(dev_w, size_i, stride_i, offset_i)  # each view, rebuilt
    act_i' = aten._conj(act_i')                               # ... with its bits, if any
    <readers of act_i>(act_i', ...)                           # (dev_w itself if act_i is base)
    hyper_offload.release_host(act_1, after=dev_w)            # post[last reload]: RELEASE_HOST s

Why the copy sits right after the first saved tensor: Inductor realizes a node into a
buffer when it is lowered if one of its users is the graph output; in the plain graph
that happens to ``base``'s buffer when ``act_1`` is lowered. Once the output reads the
wait instead, an extern copy of ``base`` at that same point realizes it at the same
moment (earlier would change which readers see it inlined, later lets Inductor inline a
bf16 value unrounded: docs/architecture.md, "Compile path"). The copy of the *base*, not
of the views, is what moves each byte once; the base's layout is exact in both inner
compilers (a dense extern input keeps its fake strides), and each rebuilt view is an
``as_strided`` of the reloaded buffer, whose layout the copy op's fake kernel fixes,
followed by ``_conj`` / ``_neg_view`` where the saved tensor carries those bits (and
preceded by a flat ``view(dtype)`` where it views the storage in another dtype):
:func:`.saved.rebuild_steps`, so the readers get the saved tensor in every property.

A host copy the schedule spills to disk (``SPILL_TO_DISK`` / ``LOAD_FROM_DISK`` /
``RELEASE_DISK``, the disk tier) leaves the forward as the spill's handle instead, and
the backward reads it back into a host copy before its reload::

    host = hyper_offload.copy_d2h(base, dim_order, s)
    handle = hyper_offload.spill_to_disk(host)                # post[..]: SPILL_TO_DISK s
    return (..., handle, ...)                                 # for act_1 .. act_k
    ...
    host2 = hyper_offload.load_from_disk(act_1, size, stride, dtype)  # LOAD_FROM_DISK s
    hyper_offload.release_disk(act_1, after=host2)            # RELEASE_DISK s
    dev   = hyper_offload.copy_h2d(host2, device)             # as above, from host2
    ...
    hyper_offload.hold([host2, ...])                          # each graph's end (and the
                                                              # forward's, for host)

The schedule's COPY_D2H slot must not precede the storage's last forward write; the
lowering then places the copy as above (never before that write), and the schedule
re-derived from the lowered graphs is what ``check_schedule`` judges. Every other action
must be an end-of-life ``RELEASE_DEVICE`` (the graph frees a value after its last reader
by itself); anything else raises :class:`LoweringError`. The graphs are rewritten in
place and returned; :mod:`.lowering_check` re-derives the schedule from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from hyper_offload.errors import LoweringError

from ..analysis.liveness import storage_liveness
from ..ir.ops import (
    COPY_D2H,
    COPY_H2D,
    HOLD,
    LOAD_FROM_DISK,
    RELEASE_DISK,
    RELEASE_HOST,
    SPILL_TO_DISK,
    WAIT_TRANSFER,
    dim_order_of,
    host_layout,
)
from ..ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from ..ir.trace import AccessKind, StorageId
from .fx_trace import FxTrace
from .graph_trace import (
    REBUILT_VIEW_META,
    RELOADED_AS_META,
    SAVED_NAMES_META,
    saved_output_names,
)
from .saved import RebuildStep, SavedActivation, rebuild_steps

__all__ = ["LoweringError", "lower_schedule"]


@dataclass
class _Graphs:
    fw: fx.GraphModule
    bw: fx.GraphModule
    fx_trace: FxTrace
    movable: Mapping[StorageId, tuple[SavedActivation, ...]]
    fw_nodes: dict[str, fx.Node] = field(default_factory=dict)
    bw_nodes: dict[str, fx.Node] = field(default_factory=dict)
    fw_order: dict[fx.Node, int] = field(default_factory=dict)
    after_cursor: dict[fx.Node, fx.Node] = field(default_factory=dict)
    d2h: dict[StorageId, fx.Node] = field(default_factory=dict)
    d2h_anchor: dict[StorageId, fx.Node] = field(default_factory=dict)
    fw_wait: dict[StorageId, fx.Node] = field(default_factory=dict)
    h2d: dict[StorageId, fx.Node] = field(default_factory=dict)
    bw_wait: dict[StorageId, fx.Node] = field(default_factory=dict)
    spill: dict[StorageId, fx.Node] = field(default_factory=dict)
    loaded: dict[StorageId, fx.Node] = field(default_factory=dict)
    disk_released: set[StorageId] = field(default_factory=set)

    def host(self, s: StorageId, group: Sequence[SavedActivation]) -> fx.Node:
        """The backward's host copy of ``s``: its load from disk, else its placeholder."""
        return self.loaded.get(s, self.bw_nodes[group[0].name])

    def node(self, op: int) -> fx.Node:
        graph, name = self.fx_trace.op_nodes[op].split(":", 1)
        return (self.fw_nodes if graph == "fw" else self.bw_nodes)[name]

    def later(self, a: fx.Node, b: fx.Node) -> fx.Node:
        """The later of two nodes of the original forward graph."""
        return a if self.fw_order[a] >= self.fw_order[b] else b

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
    graphs = _Graphs(fw, bw, fx_trace, fx_trace.movable())
    graphs.fw_nodes = {n.name: n for n in fw.graph.nodes}
    graphs.bw_nodes = {n.name: n for n in bw.graph.nodes}
    graphs.fw_order = {n: i for i, n in enumerate(fw.graph.nodes)}
    last_access = {s: live.last for s, live in storage_liveness(fx_trace.trace).items()}
    last_write = _last_forward_writes(fx_trace)
    for op, slot, action in schedule.actions():
        _lower_action(graphs, last_access, last_write, op, slot, action)
    _rewire_outputs(graphs)
    for module in (fw, bw):
        module.graph.lint()
        module.recompile()
    return fw, bw


def _last_forward_writes(fx_trace: FxTrace) -> dict[StorageId, int]:
    last: dict[StorageId, int] = {}
    for index, op in enumerate(fx_trace.trace.ops[: fx_trace.num_fw_ops]):
        for access in op.accesses:
            if access.kind is AccessKind.WRITE:
                last[access.storage] = index
    return last


def _fail(op: int, action: ResidencyAction, fx_trace: FxTrace, rule: str) -> LoweringError:
    return LoweringError(
        f"lower_schedule: op {op} ({fx_trace.op_nodes[op]}), {action!r}: {rule}. The compile "
        "path offloads a saved activation only between its last forward and first backward "
        "access; plan with a trace from passes.fx.graph_trace"
    )


def _lower_action(
    g: _Graphs,
    last_access: Mapping[StorageId, int],
    last_write: Mapping[StorageId, int],
    op: int,
    slot: str,
    action: ResidencyAction,
) -> None:
    s, kind, in_fw = action.storage, action.kind, op < g.fx_trace.num_fw_ops
    if kind is ActionKind.RELEASE_DEVICE and s not in g.d2h and op == last_access.get(s):
        return  # end of life: the graph frees a value after its last reader
    if s not in g.movable:
        raise _fail(op, action, g.fx_trace, "the storage is not an offloadable saved activation")
    group = g.movable[s]
    if kind is ActionKind.COPY_D2H and in_fw and slot == "post" and s not in g.d2h:
        if op < last_write.get(s, -1):
            raise _fail(op, action, g.fx_trace, "COPY_D2H precedes the storage's last write")
        _lower_copy_d2h(g, s, group, g.node(last_write[s]) if s in last_write else None)
    elif kind is ActionKind.RELEASE_DEVICE and in_fw and slot == "post" and s in g.d2h:
        _lower_forward_release(g, s, group, g.node(op))
    elif kind is ActionKind.RELEASE_DEVICE and s in g.bw_wait and op == last_access.get(s):
        return  # the reloaded copy's end of life
    elif kind in _DISK_KINDS:
        _lower_disk_action(g, op, slot, action, group)
    elif kind is ActionKind.COPY_H2D and not in_fw and slot == "pre" and s in g.fw_wait:
        if s in g.spill and s not in g.loaded:
            raise _fail(op, action, g.fx_trace, "a reload of a spilled copy before its load")
        device = g.fw_nodes[group[0].base].meta["val"].device  # type: ignore[index]
        with g.bw.graph.inserting_before(g.node(op)):
            node = g.bw.graph.call_function(COPY_H2D, (g.host(s, group), device))
        node.meta["val"] = _device_value(g.d2h[s].meta["val"], device)
        g.h2d[s] = node
    elif kind is ActionKind.WAIT_H2D and not in_fw and slot == "pre" and s in g.h2d:
        if s in g.bw_wait:
            raise _fail(op, action, g.fx_trace, "a second reload of one host copy")
        _lower_wait_h2d(g, s, group, g.node(op))
    elif kind is ActionKind.RELEASE_HOST and not in_fw and slot == "post" and s in g.bw_wait:
        node = g.insert_after(g.node(op), RELEASE_HOST, (g.host(s, group), g.bw_wait[s]))
        node.meta["val"] = None
    else:
        raise _fail(op, action, g.fx_trace, f"no lowering for this action in the {slot} slot here")


_DISK_KINDS = (ActionKind.SPILL_TO_DISK, ActionKind.LOAD_FROM_DISK, ActionKind.RELEASE_DISK)


def _lower_disk_action(
    g: _Graphs, op: int, slot: str, action: ResidencyAction, group: Sequence[SavedActivation]
) -> None:
    """The disk tier (:mod:`hyper_offload.runtime.disk_ops` shows the IR): the spill right
    after the copy it writes (forward, the copy's slot), the load and the file's release
    at the schedule's slot in the backward (before its op for ``pre``, after it for
    ``post``); the forward then returns the spill's handle for every saved tensor."""
    s, kind, in_fw = action.storage, action.kind, op < g.fx_trace.num_fw_ops
    if kind is ActionKind.SPILL_TO_DISK and in_fw and slot == "post" and s in g.d2h:
        if s in g.spill:
            raise _fail(op, action, g.fx_trace, "a second spill of one host copy")
        node = g.insert_after(g.d2h_anchor[s], SPILL_TO_DISK, (g.d2h[s],))
        with _in_fake_mode(g.d2h[s].meta["val"]):
            node.meta["val"] = SPILL_TO_DISK(g.d2h[s].meta["val"])  # its fake kernel
        g.spill[s] = node
    elif kind is ActionKind.LOAD_FROM_DISK and not in_fw and s in g.spill and s not in g.loaded:
        host = g.d2h[s].meta["val"]
        layout = (list(host.shape), list(host.stride()))
        if not all(isinstance(n, int) for n in (*layout[0], *layout[1])):
            raise _fail(op, action, g.fx_trace, "a spilled copy needs concrete sizes (its "
                        "load names them); a region with dynamic sizes plans without the disk tier")
        args = (g.bw_nodes[group[0].name], *layout, host.dtype)
        if slot == "pre":
            with g.bw.graph.inserting_before(g.node(op)):
                node = g.bw.graph.call_function(LOAD_FROM_DISK, args)
        else:
            node = g.insert_after(g.node(op), LOAD_FROM_DISK, args)
        with _in_fake_mode(host):
            node.meta["val"] = LOAD_FROM_DISK(g.spill[s].meta["val"], *args[1:])
        g.loaded[s] = node
    elif kind is ActionKind.RELEASE_DISK and not in_fw and s in g.loaded and (
            s not in g.disk_released):
        load = g.loaded[s]
        with g.bw.graph.inserting_after(load):
            node = g.bw.graph.call_function(RELEASE_DISK, (g.bw_nodes[group[0].name], load))
        node.meta["val"] = None
        if slot == "post":
            g.after_cursor[g.node(op)] = node  # later inserts of this slot follow it
        g.disk_released.add(s)
    else:
        raise _fail(op, action, g.fx_trace, f"no lowering for this action in the {slot} slot here")


def _lower_copy_d2h(
    g: _Graphs, s: StorageId, group: Sequence[SavedActivation], writer: fx.Node | None
) -> None:
    """``copy_d2h(base)`` right after the first saved tensor on ``s`` (and never before
    the storage's last forward write)."""
    base = g.fw_nodes[group[0].base]  # type: ignore[index]
    anchor = min((g.fw_nodes[a.name] for a in group), key=g.fw_order.__getitem__)
    # In the plain graph this node is a graph output, which Inductor realizes when it
    # lowers it, with its fake value's stride order. Now the output reads the wait, so
    # ask for exactly that treatment (Inductor's ``inductor_realize_to_strides``):
    # otherwise the producing kernel may be scheduled differently (HF Llama's rotary
    # ``add`` got another loop order and vectorized sin/cos: fp32 gradients differed).
    if base.op == "placeholder":
        # A saved activation input exists before any op: the schedule copies it after
        # its first access (the candidates' rule for a storage no op creates).
        anchor = g.node(g.fx_trace.trace.accesses_of(s)[0][0])
    else:
        anchor.meta["inductor_realize_to_strides"] = True
    if writer is not None:
        anchor = g.later(anchor, writer)
    # The host copy's layout comes from the fake value, not from whatever layout the
    # inner compiler gives the base at run time (see passes/ir/ops.py, ``dim_order``).
    dim_order = dim_order_of(base.meta["val"])
    # The storage id is the copy's slot: a step plan keeps a slot of one invocation on
    # the device without lowering the graph again (passes/ir/ops.py, ``slot``).
    node = g.insert_after(anchor, COPY_D2H, (base, dim_order, int(s)))
    node.meta["val"] = _host_value(base.meta["val"], dim_order)
    g.d2h[s], g.d2h_anchor[s] = node, anchor


def _lower_forward_release(
    g: _Graphs, s: StorageId, group: Sequence[SavedActivation], reader: fx.Node
) -> None:
    """``wait_transfer(host, keepalive=base)`` after the storage's last forward reader;
    right after the copy when that reader comes first (the producer itself, or a reader
    between the producer and the first saved tensor), and before anything inserted after
    the copy's slot since."""
    copy, base = g.d2h[s], g.fw_nodes[group[0].base]  # type: ignore[index]
    slot = g.d2h_anchor[s]
    after_copy = g.later(slot, reader) is slot
    node = g.insert_after(copy if after_copy else reader, WAIT_TRANSFER, (copy, base))
    if after_copy:
        g.after_cursor[slot] = node  # later inserts at the copy's slot follow the wait
    node.meta["val"] = copy.meta["val"]
    g.fw_wait[s] = node


def _lower_wait_h2d(
    g: _Graphs, s: StorageId, group: Sequence[SavedActivation], reader: fx.Node
) -> None:
    """Wait before the storage's first backward reader, then give each saved tensor's
    readers the reloaded base or, where the saved tensor differs from its base in any
    observable property, the saved tensor rebuilt on it (:func:`.saved.rebuild_steps`).
    The node each reader now gets carries the saved name in ``RELOADED_AS_META``."""
    copy = g.h2d[s]
    with g.bw.graph.inserting_before(reader):
        wait = g.bw.graph.call_function(WAIT_TRANSFER, (copy, g.host(s, group)))
    wait.meta["val"] = copy.meta["val"]
    g.bw_wait[s] = wait
    base_value = g.fw_nodes[group[0].base].meta["val"]  # type: ignore[index]
    cursor = wait
    for saved in group:
        placeholder, value = g.bw_nodes[saved.name], g.fw_nodes[saved.name].meta["val"]
        source = wait
        for step in rebuild_steps(value, base_value):
            with g.bw.graph.inserting_after(cursor):
                source = g.bw.graph.call_function(step.target, (source, *step.args))
            source.meta["val"] = _fake_view(step, source.args[0].meta["val"])  # type: ignore[union-attr]
            source.meta[REBUILT_VIEW_META] = saved.name
            cursor = source
        source.meta[RELOADED_AS_META] = (*source.meta.get(RELOADED_AS_META, ()), saved.name)
        for user in list(placeholder.users):
            if user not in (copy, wait) and user.target not in _HOST_USERS:
                user.replace_input_with(placeholder, source)


_HOST_USERS = (RELEASE_HOST, LOAD_FROM_DISK, RELEASE_DISK)
"""Ops that take a backward placeholder as the host copy (or the handle) itself."""


def _rewire_outputs(g: _Graphs) -> None:
    """The forward returns each offloaded storage's host copy (its spill's handle, if it
    went to disk) in place of every saved tensor on it; the backward placeholders of those
    names now hold that. The model outputs stay what they were: a saved tensor that is
    also a model output (one node, returned twice: HF's logits, saved for the loss's
    backward) leaves the device only as the saved one, and the caller still gets the
    device tensor (the wait there handed the caller a host copy of the storage's base:
    logits of shape (32, 64), not (2, 16, 64), and autograd's tangent for them could not
    be made)."""
    incomplete = set(g.d2h) ^ set(g.bw_wait)
    if incomplete or set(g.d2h) != set(g.fw_wait):
        raise LoweringError(
            f"lower_schedule: storages {sorted(incomplete | (set(g.d2h) ^ set(g.fw_wait)))} "
            "lack part of COPY_D2H / RELEASE_DEVICE / COPY_H2D / WAIT_H2D; an offloaded "
            "saved activation needs all four"
        )
    unloaded = set(g.spill) ^ set(g.loaded) | set(g.spill) ^ g.disk_released
    if unloaded:
        raise LoweringError(
            f"lower_schedule: storages {sorted(unloaded)} lack part of SPILL_TO_DISK / "
            "LOAD_FROM_DISK / RELEASE_DISK; a spilled host copy needs all three"
        )
    replace = {saved.name: g.spill.get(s, g.fw_wait[s]) for s in g.fw_wait
               for saved in g.movable[s]}
    output = g.fw.graph.find_nodes(op="output")[0]
    num_model = g.fx_trace.num_fwd_outputs
    nodes = list(output.args[0])
    names = saved_output_names(g.fw, num_model)
    saved = [replace.get(name, n) if name is not None else n
             for name, n in zip(names, nodes[num_model:])]
    output.meta[SAVED_NAMES_META] = (*[None] * num_model, *names)
    output.args = ((*nodes[:num_model], *saved),) + tuple(output.args[1:])
    for name, wait in replace.items():
        g.bw_nodes[name].meta["val"] = wait.meta["val"]
    _hold_to_the_end(g.fw, [g.d2h[s] for s in g.spill])
    _hold_to_the_end(g.bw, list(g.loaded.values()))


def _hold_to_the_end(module: fx.GraphModule, hosts: list[fx.Node]) -> None:
    """``hold(hosts + outputs)`` right before the output: a spilled or loaded host copy
    gives its pool buffer back before the graph ends, and the inner compiler reuses a
    buffer as scratch once its last reader ran (Inductor on a CPU model wrote into one
    the pool had handed to the next copy). Reading every output too, the hold runs after
    all compute, whatever order the inner compiler schedules: nothing can reuse them."""
    if not hosts:
        return
    output = module.graph.find_nodes(op="output")[0]
    outputs: list[fx.Node] = []
    fx.node.map_arg(output.args, outputs.append)
    held = [*hosts, *(n for n in outputs if isinstance(n.meta.get("val"), torch.Tensor))]
    with module.graph.inserting_before(output):
        module.graph.call_function(HOLD, (list(dict.fromkeys(held)),)).meta["val"] = None


def _in_fake_mode(value: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    fake_mode = getattr(value, "fake_mode", None)  # keep values fake (and their SymInts)
    return fake_mode if fake_mode is not None else contextlib.nullcontext()


def _host_value(value: torch.Tensor, dim_order: list[int]) -> torch.Tensor:
    """Fake value of the host copy: ``host_layout`` of ``value`` on the CPU."""
    shape, stride = host_layout(value, dim_order)
    with _in_fake_mode(value):
        return torch.empty_strided(shape, stride, dtype=value.dtype, device="cpu")


def _device_value(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Fake value of a reload of ``host``: its layout, on ``device``."""
    with _in_fake_mode(host):
        return torch.empty_strided(
            tuple(host.shape), tuple(host.stride()), dtype=host.dtype, device=device
        )


def _fake_view(step: RebuildStep, source: torch.Tensor) -> torch.Tensor:
    """The fake value of one rebuild step, computed by the op itself (so the properties
    :mod:`.lowering_check` compares are the ones the real kernel gives)."""
    with _in_fake_mode(source):
        return step.target(source, *step.args)
