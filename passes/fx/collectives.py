"""Collectives in an activation trace: an asynchronous collective uses its buffers until
its wait.

A functional collective (``_c10d_functional.all_gather_into_tensor``,
``reduce_scatter_tensor``, ...) returns as soon as the communication is *issued*; the
library reads its input and writes its output until the matching
``_c10d_functional.wait_tensor`` returns. A plan that offloads and frees such an input
right after the collective (its last use in program order) would free memory that is
still being read, and one that copies the output to the host right after the
collective (where it was "written") would copy unfinished bytes. So a trace records,
at the wait, the collective's tensor inputs as READ and its output as WRITTEN
(:func:`wait_accesses`): no plan moves or frees the inputs, or copies the output,
before it. Both
doors use the rule: the FX trace (:mod:`.graph_trace`) and the eager warmup trace.
Non-functional ``c10d`` ops (``send``, ``recv_``, ``allreduce_``, ``_allgather_base_``,
...: torch.distributed's eager API, pipelining's P2P, FSDP2's hooks) return a ``Work``
whose ``wait()`` is no op: no trace sees when their communication ends
(:func:`returns_work`). The rule for them is stricter: every storage such an op reads or
writes is *pinned* from that op to the end of the step, never released, moved or reused
(a trace records it as accessed by every later op and retained; the communication
library frees it when it is done, through its own reference).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = [
    "COLLECTIVE_NAMESPACES", "PendingCollectives", "is_collective_op", "is_wait_op",
    "returns_work", "wait_accesses",
]

COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor"})
"""Operator namespaces whose ops communicate with other ranks."""

_FUNCTIONAL_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional"})
_WAIT_NAMES = frozenset({"wait_tensor"})


def is_collective_op(target: Any) -> bool:
    """Whether ``target`` (an op overload or packet) communicates with other ranks."""
    return getattr(target, "namespace", None) in COLLECTIVE_NAMESPACES


def is_wait_op(target: Any) -> bool:
    """Whether ``target`` waits for an issued collective (``wait_tensor``)."""
    return is_collective_op(target) and _op_name(target) in _WAIT_NAMES


def returns_work(target: Any) -> bool:
    """Whether ``target``'s schema returns a c10d ``Work``: its communication outlives the
    call and ends at a ``Work.wait()`` that is no op (see the module docstring). Such an
    op may write every tensor it is given (``recv_``, ``broadcast_`` and ``allreduce_``
    declare no alias annotation for the tensors they fill)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(
        str(ret.type).endswith("c10d.Work") for ret in schema.returns
    )


def _op_name(target: Any) -> str:
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return str(getattr(target, "__name__", "")).split(".")[0]


class PendingCollectives:
    """Storages of issued functional collectives, keyed by each output, until its wait.

    Invariant: an output is pending from :meth:`issued` until :meth:`waited` pops it;
    :attr:`in_flight` is every storage a pending collective may still touch (inputs and
    outputs), which nothing may move meanwhile; :attr:`buffers` is every storage any
    collective touched (the communication library may hold them a moment past the wait).
    """

    def __init__(self) -> None:
        self._inputs: dict[int, tuple[int, ...]] = {}
        self.buffers: set[int] = set()

    def issued(self, target: Any, inputs: Iterable[int], outputs: Iterable[int]) -> None:
        """Record op ``target``'s storages if it issues a functional collective."""
        if getattr(target, "namespace", None) in _FUNCTIONAL_NAMESPACES and not is_wait_op(target):
            read = tuple(inputs)
            for output in outputs:
                self._inputs[output] = read
                self.buffers.add(output)
            self.buffers.update(read)

    def waited(self, output: int) -> tuple[int, ...] | None:
        """The inputs of the collective whose ``output`` was just waited on, or None if
        ``output`` is not pending. The wait is where the output is written (an early
        copy would read it unfinished) and where the inputs are last read."""
        return self._inputs.pop(output, None)

    @property
    def in_flight(self) -> set[int]:
        busy = set(self._inputs)
        for inputs in self._inputs.values():
            busy.update(inputs)
        return busy


def wait_accesses(pending: PendingCollectives, target: Any, arguments: Iterable[int],
                  accesses: dict[int, Any], read: Any, write: Any) -> None:
    """Apply the module's rule to one op's ``accesses`` (storage -> kind) in place: at a
    ``wait_tensor``, each pending output among its ``arguments`` (the storages it waits
    on) is WRITTEN (``write``) and its collective's inputs are READ (``read``)."""
    if not is_wait_op(target):
        return
    for sid in tuple(arguments):
        inputs = pending.waited(sid)
        if inputs is None:
            continue
        accesses[sid] = write
        for input_sid in inputs:
            accesses.setdefault(input_sid, read)
