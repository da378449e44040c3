"""Re-derive the residency schedule from lowered FX graphs, for ``check_schedule``.

The lowering (:mod:`.lowering`) is judged by the same validator as every planner:
this pass reads the transfer ops back out of the rewritten forward and backward graphs
and turns their positions into actions on the region's trace::

    copy_d2h(x)                      after op i   ->  post[i]  COPY_D2H s(x)
    wait_transfer(<copy_d2h>, ...)   after op i   ->  post[i]  RELEASE_DEVICE s
    copy_h2d(p, device)              before op k  ->  pre[k]   COPY_H2D s(p)
    wait_transfer(<copy_h2d>, ...)   before op k  ->  pre[k]   WAIT_H2D s
    release_host(p, ...)             after op m   ->  post[m]  RELEASE_HOST s
    spill_to_disk(<copy_d2h>)        after op i   ->  post[i]  SPILL_TO_DISK s
    load_from_disk(p, ...)           before op k  ->  pre[k]   LOAD_FROM_DISK s
    release_disk(p, ...)             before op k  ->  pre[k]   RELEASE_DISK s
    (every non-retained storage)                  ->  post[last access] RELEASE_DEVICE

It also checks the model outputs are the plain graph's own values (:func:`check_outputs`:
no transfer op's result reaches the caller), and every reload hands its readers the saved
tensor itself
(:func:`check_reloads`: dtype, sizes, strides, offset, conjugate and negative bits, read
from the fake values the rebuild's own ops computed), and rebuilds the trace from the
lowered graphs (transfer ops alias their source, so
readers of a reloaded value are accesses of the saved storage) and requires it to equal
the planned one: a lowering that dropped, added or rewired a compute op is rejected
here, and one that put a reader before its wait, or released a host copy too early, is
rejected by ``check_schedule``.
"""

from __future__ import annotations

import operator

from torch import fx

from ..analysis.liveness import storage_liveness
from ..analysis.validator import ScheduleReport, check_schedule
from ..ir.ops import (
    COPY_D2H,
    COPY_H2D,
    DISK_OPS,
    HOLD,
    LOAD_FROM_DISK,
    RELEASE_DISK,
    RELEASE_HOST,
    SPILL_TO_DISK,
    TRANSFER_OPS,
    WAIT_TRANSFER,
)
from ..ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from .fx_trace import FxTrace
from .graph_trace import RELOADED_AS_META, build_fx_trace, fw_outputs, is_rebuilt_view
from .lowering import LoweringError
from .saved import TensorProperties

__all__ = ["check_lowering", "check_outputs", "check_reloads", "derive_schedule"]

_POST_PHASE = {ActionKind.RELEASE_HOST: 0, ActionKind.COPY_D2H: 1, ActionKind.SPILL_TO_DISK: 2,
               ActionKind.RELEASE_DEVICE: 3}
_PENDING = {COPY_H2D: ActionKind.COPY_H2D, LOAD_FROM_DISK: ActionKind.LOAD_FROM_DISK,
            RELEASE_DISK: ActionKind.RELEASE_DISK}


def derive_schedule(
    fw: fx.GraphModule, bw: fx.GraphModule, fx_trace: FxTrace, *, num_fwd_outputs: int
) -> ResidencySchedule:
    """The schedule the lowered graphs ``fw`` / ``bw`` execute, on ``fx_trace.trace``."""
    lowered = build_fx_trace(
        fw, bw, num_fwd_outputs=num_fwd_outputs, activation_inputs=fx_trace.activation_inputs,
        outputs_move=fx_trace.outputs_move, may_move=fx_trace.may_move,
    )
    planned = [(op.name, op.accesses) for op in fx_trace.trace.ops]
    rebuilt = [(op.name, op.accesses) for op in lowered.trace.ops]
    if planned != rebuilt:
        first = next(
            (i for i, (a, b) in enumerate(zip(planned, rebuilt)) if a != b),
            min(len(planned), len(rebuilt)),
        )
        raise LoweringError(
            f"derive_schedule: the lowered graphs no longer compute the planned ops; first "
            f"difference at op {first} (planned "
            f"{planned[first] if first < len(planned) else 'nothing'}, lowered "
            f"{rebuilt[first] if first < len(rebuilt) else 'nothing'}). Rule: lowering only "
            "inserts transfer ops"
        )
    n = fx_trace.trace.num_ops
    pre: list[list[ResidencyAction]] = [[] for _ in range(n)]
    post: list[list[ResidencyAction]] = [[] for _ in range(n)]
    cursor = -1
    pending: list[ResidencyAction] = []
    storage = lowered.node_storage
    for prefix, module in (("fw", fw), ("bw", bw)):
        for node in module.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            if is_rebuilt_view(node) or node.target is HOLD:
                continue  # a saved view rebuilt on its reloaded base, a hold: not ops
            target = node.target
            if target in (COPY_D2H, WAIT_TRANSFER, RELEASE_HOST, SPILL_TO_DISK) and cursor < 0 and (
                    prefix == "fw"):
                raise LoweringError(
                    f"derive_schedule: fw:{node.name} comes before the forward's first op; "
                    "a copy follows the op that produced its source"
                )
            sid = storage.get(f"{prefix}:{node.args[0].name}") if node.args and isinstance(
                node.args[0], fx.Node) else None
            if target is COPY_D2H:
                post[cursor].append(ResidencyAction(ActionKind.COPY_D2H, sid))
            elif target is WAIT_TRANSFER and node.args[0].target is COPY_D2H:
                post[cursor].append(ResidencyAction(ActionKind.RELEASE_DEVICE, sid))
            elif target is SPILL_TO_DISK:
                post[cursor].append(ResidencyAction(ActionKind.SPILL_TO_DISK, sid))
            elif target in _PENDING:
                pending.append(ResidencyAction(_PENDING[target], sid))
            elif target is WAIT_TRANSFER and node.args[0].target is COPY_H2D:
                pending.append(ResidencyAction(ActionKind.WAIT_H2D, sid))
            elif target is RELEASE_HOST:
                post[cursor].append(ResidencyAction(ActionKind.RELEASE_HOST, sid))
            elif target is WAIT_TRANSFER:
                raise LoweringError(
                    f"derive_schedule: {prefix}:{node.name} waits on {node.args[0].name}, "
                    "which is neither a copy_d2h nor a copy_h2d"
                )
            else:
                cursor += 1
                pre[cursor].extend(pending)
                pending = []
    if pending:
        raise LoweringError(
            f"derive_schedule: {pending} come after the backward's last op; a reload "
            "must precede a reader"
        )
    for sid, live in storage_liveness(fx_trace.trace).items():
        if not live.retained:
            post[live.last].append(ResidencyAction(ActionKind.RELEASE_DEVICE, sid))
    for actions in post:
        actions.sort(key=lambda a: _POST_PHASE[a.kind])  # stable: graph order within a kind
    return ResidencySchedule(pre=pre, post=post)


def check_reloads(bw: fx.GraphModule, fx_trace: FxTrace) -> None:
    """Raise :class:`LoweringError` unless the readers of every saved tensor whose storage
    the lowered backward reloads get a tensor equal to the saved one in every
    :class:`~.saved.TensorProperties` field (the round-trip rule, docs/architecture.md),
    and nothing but transfer ops reads its host copy."""
    placeholders = {node.name: node for node in bw.graph.find_nodes(op="placeholder")}
    reloaded = {
        name: node for node in bw.graph.nodes for name in node.meta.get(RELOADED_AS_META, ())
    }
    moved = {
        saved.storage for saved in fx_trace.saved if saved.name in placeholders
        and any(user.target in (COPY_H2D, LOAD_FROM_DISK)
                for user in placeholders[saved.name].users)
    }
    for saved in fx_trace.saved:
        if saved.storage not in moved or saved.storage is None:
            continue
        stray = [u.name for u in placeholders[saved.name].users
                 if u.target not in TRANSFER_OPS and u.target not in DISK_OPS]
        node = reloaded.get(saved.name)
        if stray or node is None or saved.properties is None:
            raise LoweringError(
                f"check_reloads: saved {saved.name} (storage {saved.storage}) is reloaded, but "
                f"{'bw:' + ', bw:'.join(stray) + ' read its host copy' if stray else 'no node hands its readers the reload'}. "
                "Rule: every reader of a moved saved tensor reads its reload. Fix: report it; "
                "compile with max_resident_activation_mb large enough that nothing moves"
            )
        differences = saved.properties.differences(TensorProperties.of(node.meta["val"]))
        if differences:
            raise LoweringError(
                f"check_reloads: bw:{node.name} hands the readers of saved {saved.name} "
                f"another tensor: {'; '.join(differences)} (saved != reloaded). Rule: a "
                "reload is the saved tensor in everything the backward can observe; one "
                "that cannot be rebuilt stays on the device (passes/fx/saved.py). Fix: "
                "report it; until then the region cannot move this storage"
            )


def check_outputs(fw: fx.GraphModule, *, num_fwd_outputs: int) -> None:
    """Raise :class:`LoweringError` if a model output of the lowered forward is a transfer
    op's result. The trace cannot see it (a transfer op aliases its source, so the
    rebuilt trace is the planned one), yet the caller would get a host copy of a whole
    storage in place of its device tensor: with one node both a model output and a saved
    view, the logits came back with their storage base's sizes."""
    for index, node in enumerate(fw_outputs(fw)[:num_fwd_outputs]):
        if isinstance(node, fx.Node) and node.target in TRANSFER_OPS:
            raise LoweringError(
                f"check_outputs: model output {index} of the lowered forward is "
                f"fw:{node.name}, a {node.target}. Rule: the lowering rewires only saved "
                "outputs; the caller gets every model output as the plain graph returns it. "
                "Fix: report it; compile with budget_scope='region' until then"
            )


def check_lowering(
    fw: fx.GraphModule, bw: fx.GraphModule, fx_trace: FxTrace, *, num_fwd_outputs: int
) -> ScheduleReport:
    """``check_schedule`` of the schedule the lowered graphs execute, once
    :func:`check_outputs` found the model outputs untouched and :func:`check_reloads`
    every reload to be the saved tensor."""
    check_outputs(fw, num_fwd_outputs=num_fwd_outputs)
    check_reloads(bw, fx_trace)
    return check_schedule(
        fx_trace.trace, derive_schedule(fw, bw, fx_trace, num_fwd_outputs=num_fwd_outputs)
    )
