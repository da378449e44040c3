"""One op of an :class:`~.trace.ActivationTrace`: its records, the parsing of their JSON,
and which storages a collective op accesses until its wait.

A :class:`TraceOp` names the storages it touches (:class:`StorageAccess`: a storage id and
an :class:`AccessKind`), the storage of each output leaf, and its duration. The JSON format
is the trace's (:mod:`.trace`); the parsers here reject, naming the field and op index, a
storage named twice, an unknown field and a non-finite number. :mod:`.trace` re-exports
the records: import them from there. Pure; no torch.

**Collectives**: an asynchronous collective uses its buffers until its wait. A functional
collective (``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``, ...)
returns as soon as the communication is *issued*; the library reads its input and writes
its output until the matching ``_c10d_functional.wait_tensor`` returns. A plan that
offloads and frees such an input right after the collective (its last use in program
order) would free memory that is still being read, and one that copies the output to the
host right after the collective (where it was "written") would copy unfinished bytes. So a
trace records, at the wait, the collective's tensor inputs as READ and its output as
WRITTEN (:func:`wait_accesses`): no plan moves or frees the inputs, or copies the output,
before it. Both doors use the rule: the FX trace (:mod:`..fx.graph_trace`) and the eager
warmup trace. Non-functional ``c10d`` ops (``send``, ``recv_``, ``allreduce_``,
``_allgather_base_``, ...: torch.distributed's eager API, pipelining's P2P, FSDP2's hooks)
return a ``Work`` whose ``wait()`` is no op: no trace sees when their communication ends
(:func:`returns_work`). The rule for them is stricter: every storage such an op reads or
writes is *pinned* from that op to the end of the step, never released, moved or reused (a
trace records it as accessed by every later op and retained; the communication library
frees it when it is done, through its own reference).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

from hyper_offload.errors import TraceFormatError

TRACE_FORMAT = "hyper-offload.trace"
TRACE_VERSION = 1

StorageId = int


class AccessKind(str, Enum):
    """How an op touches a storage. ``WRITE`` includes read-modify-write."""

    READ = "R"
    WRITE = "W"

    def __repr__(self) -> str:
        return self.value


class StorageAccess(NamedTuple):
    """One op's access to one storage."""

    storage: StorageId
    kind: AccessKind

    def __repr__(self) -> str:
        return f"{self.kind.value}{self.storage}"


@dataclass(frozen=True)
class TraceOp:
    """One op of the step.

    Invariant: ``accesses`` names each storage at most once (sorted by storage id, each
    kind an :class:`AccessKind`); ``outputs`` lists the storage of each output tensor
    leaf in leaf order and every output storage is also in ``accesses``. Construction
    sorts the accesses and turns ``"R"`` / ``"W"`` into ``AccessKind``: the planners
    and the validator test ``kind is AccessKind.WRITE``, and a plain ``"W"`` would
    otherwise read as a READ and hide a write epoch.
    """

    name: str
    accesses: tuple[StorageAccess, ...]
    outputs: tuple[StorageId, ...] = ()
    duration_s: float | None = None

    def __post_init__(self) -> None:
        accesses = tuple(self.accesses)
        if any(type(a) is not StorageAccess or type(a.kind) is not AccessKind for a in accesses):
            accesses = tuple(
                StorageAccess(storage, access_kind(kind, f"TraceOp({self.name})"))
                for storage, kind in accesses
            )
        if any(a.storage > b.storage for a, b in zip(accesses, accesses[1:])):
            accesses = tuple(sorted(accesses, key=lambda a: a.storage))
        object.__setattr__(self, "accesses", accesses)
        object.__setattr__(self, "outputs", tuple(self.outputs))

    def __repr__(self) -> str:
        acc = " ".join(repr(a) for a in self.accesses)
        return f"TraceOp({self.name}: {acc})"

    @property
    def storages(self) -> tuple[StorageId, ...]:
        return tuple(a.storage for a in self.accesses)

# A storage id written as text: optional minus sign, ASCII digits (``str.isdigit`` also
# accepts characters such as "²" that ``int`` rejects).
SID_TEXT = re.compile(r"-?[0-9]+")


def parse_sid(value: Any, where: str) -> StorageId:
    if isinstance(value, bool):
        raise TraceFormatError(f"{where}: storage id {value!r} is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and SID_TEXT.fullmatch(value.strip()):
        return int(value)
    raise TraceFormatError(f"{where}: storage id {value!r} is not an integer")

OP_FIELDS = frozenset({"name", "accesses", "outputs", "duration_s"})


def reject_unknown_fields(data: Mapping[Any, Any], known: frozenset[str], where: str) -> None:
    # A misspelt optional field ("retaind") would otherwise vanish silently, and with it
    # the storages that must survive the step.
    for key in data:
        if key not in known:
            raise TraceFormatError(
                f"{where}.{key}: unknown field in a version-{TRACE_VERSION} trace; "
                f"expected only {', '.join(sorted(known))}"
            )


def is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def access_kind(kind: Any, where: str) -> AccessKind:
    try:
        return AccessKind(kind)
    except ValueError:
        raise TraceFormatError(f"{where}: access kind {kind!r} is not 'R' or 'W'") from None


def parse_accesses(accesses: Mapping[Any, Any], where: str) -> tuple[StorageAccess, ...]:
    parsed: dict[StorageId, AccessKind] = {}
    for sid, kind in accesses.items():
        storage = parse_sid(sid, f"{where}.accesses")
        if storage in parsed:
            # Merging would keep whichever kind came last: a WRITE read back as a READ
            # hides a new write epoch, and a planner would then reload a stale host copy.
            raise TraceFormatError(
                f"{where}.accesses: storage {storage} is listed twice (key {sid!r}); "
                "list each storage once, as 'W' if the op writes it at all"
            )
        try:
            parsed[storage] = AccessKind(kind)
        except ValueError:
            raise TraceFormatError(
                f"{where}.accesses[{sid!r}]: expected 'R' or 'W', got {kind!r}"
            ) from None
    return tuple(StorageAccess(s, parsed[s]) for s in sorted(parsed))


def op_from_dict(entry: Any, index: int) -> TraceOp:
    where = f"trace.ops[{index}]"
    if not isinstance(entry, Mapping):
        raise TraceFormatError(f"{where}: expected an object")
    reject_unknown_fields(entry, OP_FIELDS, where)
    accesses = entry.get("accesses")
    if not isinstance(accesses, Mapping):
        raise TraceFormatError(f"{where}.accesses: expected an object id -> 'R'|'W'")
    outputs = entry.get("outputs", [])
    if not isinstance(outputs, list):
        raise TraceFormatError(f"{where}.outputs: expected a list of storage ids")
    duration = entry.get("duration_s")
    if duration is not None and (not is_number(duration) or not 0 <= duration < math.inf):
        raise TraceFormatError(
            f"{where}.duration_s: expected a finite number >= 0, got {duration!r}"
        )
    name = entry.get("name", f"op{index}")
    if not isinstance(name, str):
        raise TraceFormatError(f"{where}.name: expected a string, got {name!r}")
    return TraceOp(
        name=name,
        accesses=parse_accesses(accesses, where),
        outputs=tuple(parse_sid(s, f"{where}.outputs") for s in outputs),
        duration_s=None if duration is None else float(duration),
    )


# ---------------------------------------------------------------- collectives

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
    """Apply the collectives' rule (module docstring) to one op's ``accesses`` (storage ->
    kind) in place: at a ``wait_tensor``, each pending output among its ``arguments`` (the
    storages it waits on) is WRITTEN (``write``) and its collective's inputs are READ
    (``read``)."""
    if not is_wait_op(target):
        return
    for sid in tuple(arguments):
        inputs = pending.waited(sid)
        if inputs is None:
            continue
        accesses[sid] = write
        for input_sid in inputs:
            accesses.setdefault(input_sid, read)
