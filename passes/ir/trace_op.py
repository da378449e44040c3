"""One op of an :class:`~.trace.ActivationTrace`: its records and the parsing of their JSON.

A :class:`TraceOp` names the storages it touches (:class:`StorageAccess`: a storage id and
an :class:`AccessKind`), the storage of each output leaf, and its duration. The JSON format
is the trace's (:mod:`.trace`); the parsers here reject, naming the field and op index, a
storage named twice, an unknown field and a non-finite number. :mod:`.trace` re-exports
the records: import them from there. Pure; no torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
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
