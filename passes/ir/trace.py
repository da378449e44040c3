"""The activation trace: what one training step did to which storage, in order.

Every front door (FX graphs on the compile path, the TorchDispatchMode recorder on
the eager path, hand-written JSON for the CLI) produces an :class:`ActivationTrace`;
every planner and the validator consume it. Storages, not tensors, are the unit:
views share a storage, so they share an id.

Residency model (shared by the planners, the validator and the lowerings):

* A storage is *born* on the device at its first access and needs no transfer then.
* Every access, READ or WRITE, requires the storage to be on the device during the op.
* An op that both reads and writes a storage (an in-place op) records ``WRITE``: the
  write is what matters, since it makes any host copy stale.
* ``retained`` storages must be on the device after the last op (step outputs,
  gradients); every other storage may be freed after its last access, or, when
  ``held_until`` names it, once op ``held_until[s]`` ended: a reference (a variable,
  autograd) still holds it that long though no op reads it. Its bytes must survive
  until then, on the device or as a valid host copy, and need no reload.

JSON format (``to_json`` / ``from_json``), version 1::

    {"format": "hyper-offload.trace", "version": 1,
     "budget_bytes": 1048576, "d2h_bandwidth_gbps": 16.0, "h2d_bandwidth_gbps": 16.0,
     "storage_sizes": {"0": 4096, "1": 512},
     "retained": [1], "held_until": {"0": 1},
     "ops": [{"name": "mm", "accesses": {"0": "W"}, "outputs": [0], "duration_s": 1e-5},
             {"name": "relu", "accesses": {"0": "R", "1": "W"}}]}

``outputs`` (storage per output tensor leaf, in leaf order) and ``duration_s`` are
optional per op; ``held_until`` is optional. ``disk_budget_bytes`` and
``disk_bandwidth_gbps`` (the disk tier below host memory: how many bytes its files may
hold at once, and how fast it writes and reads) are optional and written only when they
differ from their defaults (0: no disk tier; :data:`DEFAULT_DISK_BANDWIDTH_GBPS`).
``from_json`` rejects, with a message naming the field and op index,
unknown fields (a misspelt ``retained`` must not vanish silently), a storage named twice
by one op or in ``storage_sizes`` (``"1"`` and ``"01"``), and non-finite numbers. Bandwidths are in GB/s (10^9 bytes per second); the ``_gbps`` names and
the 16 default follow the design document, which means bytes, not bits.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from hyper_offload.errors import TraceFormatError

TRACE_FORMAT = "hyper-offload.trace"
TRACE_VERSION = 1
DEFAULT_BANDWIDTH_GBPS = 16.0
DEFAULT_DISK_BANDWIDTH_GBPS = 2.0
"""The disk tier's bandwidth when none was measured or given: a conservative NVMe SSD
(sequential writes of a few GB/s; the doors measure the real directory once,
``runtime.disk_bandwidth``)."""

FORWARD_GRAPH, BACKWARD_GRAPH = "fw", "bw"
"""Graph tags of a compile-path trace: :mod:`..fx.graph_trace` names each op ``"<tag>:<node>"``
(forward ops first), a JSON dump keeps the names, and
:func:`..plan.planning.backward_start` reads where the backward begins from them."""

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
                StorageAccess(storage, _access_kind(kind, f"TraceOp({self.name})"))
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


@dataclass(frozen=True)
class ActivationTrace:
    """Ops in execution order plus everything a planner needs to know about them.

    Invariants (checked on construction): every accessed storage has a size >= 0;
    every retained storage is accessed by some op; bandwidths are positive;
    ``budget_bytes`` >= 0; ``disk_budget_bytes`` >= 0 (0: no disk tier, the schedule may
    not spill); ``held_until`` names accessed, non-retained storages, each with an op
    index after its last access and before ``num_ops``.
    """

    ops: tuple[TraceOp, ...]
    storage_sizes: Mapping[StorageId, int]
    budget_bytes: int
    retained: frozenset[StorageId] = frozenset()
    d2h_bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS
    h2d_bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS
    disk_budget_bytes: int = 0
    """Bytes the disk tier's files may hold at once (raw storage bytes; 0: no disk tier)."""
    disk_bandwidth_gbps: float = DEFAULT_DISK_BANDWIDTH_GBPS
    """The disk tier's write and read bandwidth (one serial channel, GB/s)."""
    held_until: Mapping[StorageId, int] = field(default_factory=dict)
    """Storage -> the last op during which a reference still holds it, past its last
    access (the eager warmup records where each storage died). Its bytes must survive
    to the end of that op (device or host copy); no op reads them (module docstring)."""
    _accesses_by_storage: Mapping[StorageId, tuple[tuple[int, AccessKind], ...]] = field(
        init=False, repr=False, compare=False
    )
    _memo: dict[str, Any] = field(init=False, repr=False, compare=False)
    """Figures derived from the (immutable) trace, each computed once: a plan's passes
    ask for them many times (:meth:`memo`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "storage_sizes", dict(self.storage_sizes))
        object.__setattr__(self, "retained", frozenset(self.retained))
        object.__setattr__(self, "held_until", dict(self.held_until))
        _validate(self)
        by_storage: dict[StorageId, list[tuple[int, AccessKind]]] = {}
        for index, op in enumerate(self.ops):
            for access in op.accesses:
                by_storage.setdefault(access.storage, []).append((index, access.kind))
        object.__setattr__(
            self, "_accesses_by_storage", {s: tuple(v) for s, v in by_storage.items()}
        )
        object.__setattr__(self, "_memo", {})

    def __repr__(self) -> str:
        return (
            f"ActivationTrace(ops={len(self.ops)}, storages={len(self.storage_sizes)}, "
            f"budget_bytes={self.budget_bytes}, retained={sorted(self.retained)})"
        )

    # -- queries -------------------------------------------------------------------

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def accesses_of(self, storage: StorageId) -> tuple[tuple[int, AccessKind], ...]:
        """``(op_index, kind)`` of every access to ``storage``, in op order."""
        return self._accesses_by_storage.get(storage, ())

    def accessed_storages(self) -> tuple[StorageId, ...]:
        """Every storage some op touches, sorted by id."""
        return tuple(sorted(self._accesses_by_storage))

    @property
    def retained_bytes(self) -> int:
        """Bytes of the ``retained`` storages: all on the device after the last op."""
        return sum(self.storage_sizes[sid] for sid in self.retained)

    def operand_bytes(self, op_index: int) -> int:
        """Bytes of the distinct storages op ``op_index`` touches."""
        every = self.memo("operand_bytes", lambda: tuple(
            sum(self.storage_sizes[s] for s in op.storages) for op in self.ops))
        return every[op_index]

    def memo(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per trace and ``key``: a figure derived from the trace
        alone (it never changes), which planning passes ask for many times (an 8B x 512K
        estimate asked ``operand_bytes`` 2 M times). The caller must not mutate it."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def with_budget(self, budget_bytes: int) -> ActivationTrace:
        """The same trace under another budget."""
        return ActivationTrace(
            ops=self.ops,
            storage_sizes=self.storage_sizes,
            budget_bytes=budget_bytes,
            retained=self.retained,
            d2h_bandwidth_gbps=self.d2h_bandwidth_gbps,
            h2d_bandwidth_gbps=self.h2d_bandwidth_gbps,
            disk_budget_bytes=self.disk_budget_bytes,
            disk_bandwidth_gbps=self.disk_bandwidth_gbps,
            held_until=self.held_until,
        )

    def with_disk(self, budget_bytes: int, bandwidth_gbps: float | None = None) -> ActivationTrace:
        """The same trace with a disk tier of ``budget_bytes`` (0: none) at
        ``bandwidth_gbps`` (None: the trace's own)."""
        return dataclasses.replace(
            self, disk_budget_bytes=budget_bytes,
            disk_bandwidth_gbps=self.disk_bandwidth_gbps if bandwidth_gbps is None
            else bandwidth_gbps,
        )

    def held_end(self, storage: StorageId) -> int:
        """The last op during which ``storage``'s bytes must exist: ``held_until`` where
        given, else its last access."""
        held = self.held_until.get(storage)
        return self.accesses_of(storage)[-1][0] if held is None else held

    # -- construction from plain data ------------------------------------------------

    @classmethod
    def from_accesses(
        cls,
        ops: Sequence[Mapping[Any, str | AccessKind]],
        sizes: Mapping[Any, int],
        *,
        budget_bytes: int,
        retained: Iterable[Any] = (),
    ) -> ActivationTrace:
        """Build a trace from one ``{storage_id: "R" | "W"}`` mapping per op.

        Storage ids may be ints or decimal strings. Ops are named ``op0``, ``op1``, ...
        This signature is public API.
        """
        trace_ops = []
        for index, accesses in enumerate(ops):
            where = f"ops[{index}]"
            if not isinstance(accesses, Mapping):
                raise TraceFormatError(f"{where}: expected a mapping storage -> 'R'|'W'")
            trace_ops.append(
                TraceOp(name=f"op{index}", accesses=_parse_accesses(accesses, where))
            )
        return cls(
            ops=tuple(trace_ops),
            storage_sizes=_parse_sizes(sizes, "sizes"),
            budget_bytes=budget_bytes,
            retained=_parse_retained(retained, "retained"),
        )

    # -- JSON ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        ops = []
        for op in self.ops:
            entry: dict[str, Any] = {
                "name": op.name,
                "accesses": {str(a.storage): a.kind.value for a in op.accesses},
            }
            if op.outputs:
                entry["outputs"] = list(op.outputs)
            if op.duration_s is not None:
                entry["duration_s"] = op.duration_s
            ops.append(entry)
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "budget_bytes": self.budget_bytes,
            "d2h_bandwidth_gbps": self.d2h_bandwidth_gbps,
            "h2d_bandwidth_gbps": self.h2d_bandwidth_gbps,
            **self._disk_fields(),
            "storage_sizes": {str(s): n for s, n in sorted(self.storage_sizes.items())},
            "retained": sorted(self.retained),
            **({"held_until": {str(s): op for s, op in sorted(self.held_until.items())}}
               if self.held_until else {}),
            "ops": ops,
        }

    def _disk_fields(self) -> dict[str, Any]:
        """The disk tier's fields where they differ from their defaults (a trace without a
        disk tier writes the JSON it always wrote)."""
        fields: dict[str, Any] = {}
        if self.disk_budget_bytes:
            fields["disk_budget_bytes"] = self.disk_budget_bytes
        if self.disk_bandwidth_gbps != DEFAULT_DISK_BANDWIDTH_GBPS:
            fields["disk_bandwidth_gbps"] = self.disk_bandwidth_gbps
        return fields

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any) -> ActivationTrace:
        if not isinstance(data, Mapping):
            raise TraceFormatError("trace: expected a JSON object at the top level")
        if data.get("format") != TRACE_FORMAT:
            raise TraceFormatError(
                f"trace.format: expected {TRACE_FORMAT!r}, got {data.get('format')!r}"
            )
        if data.get("version") != TRACE_VERSION:
            raise TraceFormatError(
                f"trace.version: this build reads version {TRACE_VERSION}, "
                f"got {data.get('version')!r}"
            )
        for key in ("budget_bytes", "storage_sizes", "ops"):
            if key not in data:
                raise TraceFormatError(f"trace.{key}: required field is missing")
        _reject_unknown_fields(data, _TRACE_FIELDS, "trace")
        sizes = _parse_sizes(data["storage_sizes"], "trace.storage_sizes")
        raw_ops = data["ops"]
        if not isinstance(raw_ops, list):
            raise TraceFormatError("trace.ops: expected a list of op objects")
        ops = tuple(_op_from_dict(entry, index) for index, entry in enumerate(raw_ops))
        retained = data.get("retained", [])
        if not isinstance(retained, list):
            raise TraceFormatError("trace.retained: expected a list of storage ids")
        return cls(
            ops=ops,
            storage_sizes=sizes,
            budget_bytes=_parse_size(data["budget_bytes"], "trace.budget_bytes"),
            retained=_parse_retained(retained, "trace.retained"),
            d2h_bandwidth_gbps=_parse_bandwidth(data, "d2h_bandwidth_gbps"),
            h2d_bandwidth_gbps=_parse_bandwidth(data, "h2d_bandwidth_gbps"),
            disk_budget_bytes=_parse_size(data.get("disk_budget_bytes", 0),
                                          "trace.disk_budget_bytes"),
            disk_bandwidth_gbps=_parse_bandwidth(data, "disk_bandwidth_gbps",
                                                 DEFAULT_DISK_BANDWIDTH_GBPS),
            held_until=_parse_sizes(data.get("held_until", {}), "trace.held_until"),
        )

    @classmethod
    def from_json(cls, text: str) -> ActivationTrace:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise TraceFormatError(f"trace: not valid JSON ({error})") from None
        except RecursionError:
            raise TraceFormatError("trace: JSON nested too deeply to be a trace") from None
        return cls.from_dict(data)


# -- parsing helpers ---------------------------------------------------------------------


# A storage id written as text: optional minus sign, ASCII digits (``str.isdigit`` also
# accepts characters such as "²" that ``int`` rejects).
_SID_TEXT = re.compile(r"-?[0-9]+")


def _parse_sid(value: Any, where: str) -> StorageId:
    if isinstance(value, bool):
        raise TraceFormatError(f"{where}: storage id {value!r} is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _SID_TEXT.fullmatch(value.strip()):
        return int(value)
    raise TraceFormatError(f"{where}: storage id {value!r} is not an integer")


def _parse_sizes(sizes: Any, where: str) -> dict[StorageId, int]:
    """``{storage: bytes}``; two keys naming one storage ("1" and 1, "0" and "00") are
    rejected rather than silently merged."""
    if not isinstance(sizes, Mapping):
        raise TraceFormatError(f"{where}: expected a mapping storage id -> bytes")
    parsed: dict[StorageId, int] = {}
    for sid, size in sizes.items():
        storage = _parse_sid(sid, where)
        if storage in parsed:
            raise TraceFormatError(
                f"{where}: storage {storage} is listed twice (as {sid!r} and an earlier key); "
                "keep one entry per storage"
            )
        parsed[storage] = _parse_size(size, f"{where}[{sid!r}]")
    return parsed


def _parse_retained(retained: Any, where: str) -> frozenset[StorageId]:
    # A string is iterable, but "12" means neither storage 12 nor storages 1 and 2.
    if isinstance(retained, (str, bytes)) or not isinstance(retained, Iterable):
        raise TraceFormatError(f"{where}: expected a list of storage ids, got {retained!r}")
    return frozenset(_parse_sid(s, where) for s in retained)


def _parse_size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceFormatError(f"{where}: expected a non-negative integer, got {value!r}")
    return value


def _parse_bandwidth(
    data: Mapping[str, Any], key: str, default: float = DEFAULT_BANDWIDTH_GBPS
) -> float:
    value = data.get(key, default)
    if not _is_number(value) or not 0 < value < math.inf:
        raise TraceFormatError(f"trace.{key}: expected a positive finite number, got {value!r}")
    return float(value)


_TRACE_FIELDS = frozenset(
    {"format", "version", "budget_bytes", "d2h_bandwidth_gbps", "h2d_bandwidth_gbps",
     "disk_budget_bytes", "disk_bandwidth_gbps", "storage_sizes", "retained", "held_until",
     "ops"}
)
_OP_FIELDS = frozenset({"name", "accesses", "outputs", "duration_s"})


def _reject_unknown_fields(data: Mapping[Any, Any], known: frozenset[str], where: str) -> None:
    # A misspelt optional field ("retaind") would otherwise vanish silently, and with it
    # the storages that must survive the step.
    for key in data:
        if key not in known:
            raise TraceFormatError(
                f"{where}.{key}: unknown field in a version-{TRACE_VERSION} trace; "
                f"expected only {', '.join(sorted(known))}"
            )


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _access_kind(kind: Any, where: str) -> AccessKind:
    try:
        return AccessKind(kind)
    except ValueError:
        raise TraceFormatError(f"{where}: access kind {kind!r} is not 'R' or 'W'") from None


def _parse_accesses(accesses: Mapping[Any, Any], where: str) -> tuple[StorageAccess, ...]:
    parsed: dict[StorageId, AccessKind] = {}
    for sid, kind in accesses.items():
        storage = _parse_sid(sid, f"{where}.accesses")
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


def _op_from_dict(entry: Any, index: int) -> TraceOp:
    where = f"trace.ops[{index}]"
    if not isinstance(entry, Mapping):
        raise TraceFormatError(f"{where}: expected an object")
    _reject_unknown_fields(entry, _OP_FIELDS, where)
    accesses = entry.get("accesses")
    if not isinstance(accesses, Mapping):
        raise TraceFormatError(f"{where}.accesses: expected an object id -> 'R'|'W'")
    outputs = entry.get("outputs", [])
    if not isinstance(outputs, list):
        raise TraceFormatError(f"{where}.outputs: expected a list of storage ids")
    duration = entry.get("duration_s")
    if duration is not None and (not _is_number(duration) or not 0 <= duration < math.inf):
        raise TraceFormatError(
            f"{where}.duration_s: expected a finite number >= 0, got {duration!r}"
        )
    name = entry.get("name", f"op{index}")
    if not isinstance(name, str):
        raise TraceFormatError(f"{where}.name: expected a string, got {name!r}")
    return TraceOp(
        name=name,
        accesses=_parse_accesses(accesses, where),
        outputs=tuple(_parse_sid(s, f"{where}.outputs") for s in outputs),
        duration_s=None if duration is None else float(duration),
    )


def _validate(trace: ActivationTrace) -> None:
    if isinstance(trace.budget_bytes, bool) or not isinstance(trace.budget_bytes, int):
        raise TraceFormatError(f"trace.budget_bytes: expected an integer, got {trace.budget_bytes!r}")
    if trace.budget_bytes < 0:
        raise TraceFormatError(
            f"trace.budget_bytes: must be >= 0, got {trace.budget_bytes}"
        )
    if isinstance(trace.disk_budget_bytes, bool) or not isinstance(trace.disk_budget_bytes, int) \
            or trace.disk_budget_bytes < 0:
        raise TraceFormatError(
            f"trace.disk_budget_bytes: expected an integer >= 0 (0: no disk tier), got "
            f"{trace.disk_budget_bytes!r}"
        )
    for key in ("d2h_bandwidth_gbps", "h2d_bandwidth_gbps", "disk_bandwidth_gbps"):
        value = getattr(trace, key)
        if not _is_number(value) or not 0 < value < math.inf:
            raise TraceFormatError(f"trace.{key}: must be positive and finite, got {value!r}")
    for storage, size in trace.storage_sizes.items():
        _parse_size(size, f"trace.storage_sizes[{storage}]")
    accessed: set[StorageId] = set()
    for index, op in enumerate(trace.ops):
        storages = op.storages
        if len(set(storages)) != len(storages):
            raise TraceFormatError(f"trace.ops[{index}] ({op.name}): a storage is listed twice")
        for storage in storages:
            if storage not in trace.storage_sizes:
                raise TraceFormatError(
                    f"trace.ops[{index}] ({op.name}): storage {storage} has no entry in "
                    "storage_sizes; add its size in bytes"
                )
        for storage in op.outputs:
            if storage not in storages:
                raise TraceFormatError(
                    f"trace.ops[{index}] ({op.name}).outputs: storage {storage} is an output "
                    "but not among the op's accesses"
                )
        accessed.update(storages)
    for storage in sorted(trace.retained):
        if storage not in accessed:
            raise TraceFormatError(
                f"trace.retained: storage {storage} is retained but no op accesses it"
            )
    _validate_held(trace, accessed)


def _validate_held(trace: ActivationTrace, accessed: set[StorageId]) -> None:
    last: dict[StorageId, int] = {}
    for index, op in enumerate(trace.ops):
        for storage in op.storages:
            last[storage] = index
    for storage, op in sorted(trace.held_until.items()):
        where = f"trace.held_until[{storage}]"
        if storage not in accessed:
            raise TraceFormatError(f"{where}: storage {storage} is held but no op accesses it")
        if storage in trace.retained:
            raise TraceFormatError(
                f"{where}: storage {storage} is retained (held past the step); drop it here")
        if isinstance(op, bool) or not isinstance(op, int) or not last[storage] < op < trace.num_ops:
            raise TraceFormatError(
                f"{where}: expected an op index after the storage's last access "
                f"({last[storage]}) and before num_ops ({trace.num_ops}), got {op!r}"
            )
