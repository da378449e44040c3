"""An asynchronous collective reads its input until its wait: the FX trace says so, and
the pending-collectives record both doors share keeps the storages in flight."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hyper_offload.passes.ir.trace_op import (
    PendingCollectives,
    is_collective_op,
    is_wait_op,
    wait_accesses,
)
from hyper_offload.passes.fx.graph_trace import build_fx_trace
from hyper_offload.passes.ir.trace import AccessKind

funcol = torch.ops._c10d_functional


def _forward(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    shard = x.relu()
    gathered = funcol.all_gather_into_tensor.default(shard, 2, "0")
    other = x * 3  # runs while the gather is in flight
    gathered = funcol.wait_tensor.default(gathered)
    return (gathered.sum() + other.sum(),)


def _graphs() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    fw = make_fx(_forward, tracing_mode="fake")(torch.randn(4, 8))

    def backward(tangent: torch.Tensor) -> tuple[torch.Tensor]:
        return (tangent * 2,)

    return fw, make_fx(backward, tracing_mode="fake")(torch.randn(()))


def test_the_wait_reads_what_the_collective_reads():
    fw, bw = _graphs()
    trace = build_fx_trace(fw, bw, num_fwd_outputs=1)
    names = list(trace.op_nodes)
    ops = trace.trace.ops
    relu = names.index("fw:relu")
    shard = next(a.storage for a in ops[relu].accesses if a.kind is AccessKind.WRITE)
    wait = next(i for i, n in enumerate(names) if n.startswith("fw:wait_tensor"))
    gather = next(i for i, n in enumerate(names) if n.startswith("fw:all_gather"))
    assert gather < names.index("fw:mul") < wait  # the gather's input is idle in between
    waited = {a.storage: a.kind for a in ops[wait].accesses}
    assert waited[shard] is AccessKind.READ
    # the gather's output is written at the wait, where its bytes are complete
    output = next(a.storage for a in ops[gather].accesses if a.kind is AccessKind.WRITE)
    assert waited[output] is AccessKind.WRITE
    # so it is resident (READ) at every op up to the wait: no plan can free it earlier
    assert all(shard in {a.storage for a in ops[i].accesses} for i in range(relu, wait + 1))


def test_pending_collectives_hold_inputs_and_outputs_until_the_wait():
    pending = PendingCollectives()
    pending.issued(funcol.all_gather_into_tensor.default, inputs=[1], outputs=[7])
    pending.issued(torch.ops.aten.mul.Tensor, inputs=[2], outputs=[8])  # not a collective
    assert pending.in_flight == {1, 7} and pending.buffers == {1, 7}
    assert pending.waited(7) == (1,)
    assert pending.in_flight == set() and pending.waited(7) is None
    assert pending.buffers == {1, 7}  # the library may hold them a moment past the wait


def test_namespaces():
    assert is_collective_op(funcol.all_reduce.default) and not is_wait_op(funcol.all_reduce.default)
    assert is_wait_op(funcol.wait_tensor.default)
    assert not is_collective_op(torch.ops.aten.mm.default)


def test_a_wait_ends_only_the_collective_it_waits_on():
    pending = PendingCollectives()
    gather = funcol.all_gather_into_tensor.default
    pending.issued(gather, inputs=[1], outputs=[7])
    pending.issued(gather, inputs=[2], outputs=[8])
    # an op's accesses in the eager trace hold every in-flight storage, the wait's
    # argument is only the one it waits on
    accesses = {s: AccessKind.READ for s in (1, 2, 7, 8)}
    wait_accesses(pending, funcol.wait_tensor.default, [7], accesses,
                  AccessKind.READ, AccessKind.WRITE)
    assert accesses[7] is AccessKind.WRITE and accesses[8] is AccessKind.READ
    assert pending.in_flight == {2, 8}  # the second gather is still running
    accesses = {7: AccessKind.READ}
    wait_accesses(pending, torch.ops.aten.mul.Tensor, [7], accesses,
                  AccessKind.READ, AccessKind.WRITE)  # not a wait: nothing changes
    assert accesses == {7: AccessKind.READ} and pending.in_flight == {2, 8}


def test_a_saved_activation_a_work_returning_op_touched_never_moves(one_rank):
    """Dynamo graph-breaks on ``dist.all_reduce(..., async_op=True)``; a hand-made graph
    may still hold the ``c10d`` op. Its communication ends at ``Work.wait()``, which no
    graph shows, so the tensor it was given stays on the device (issue 41, item 5)."""
    import torch.distributed as dist

    from .test_saved import _tail, hand_graphs

    def forward(asynchronous: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
        def fw(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            y = x @ w
            if asynchronous:
                dist.all_reduce(y, async_op=True)
            return (_tail(y.sum()), y)
        return fw

    def backward(saved: torch.Tensor, tangent: torch.Tensor) -> tuple[torch.Tensor]:
        return (saved.sin() * tangent,)

    for asynchronous in (False, True):
        fw, bw = hand_graphs(forward(asynchronous), backward)
        fx_trace = build_fx_trace(fw, bw, num_fwd_outputs=1)
        (saved,) = fx_trace.saved
        assert saved.offloadable is not asynchronous, saved
        if asynchronous:
            assert "returns a c10d Work" in saved.reason
            names = list(fx_trace.op_nodes)
            reduce = next(i for i, n in enumerate(names) if "allreduce" in n)
            kinds = {a.storage: a.kind for a in fx_trace.trace.ops[reduce].accesses}
            assert kinds == {saved.storage: AccessKind.WRITE}  # it may fill the tensor
