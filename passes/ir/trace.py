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

The end of the step as an op: lets a plan offload retained storages in their last gap.

Under the residency model of :mod:`.trace`, a retained storage (a gradient, an output)
must be on the device after the last op, and nothing between its last access and the
end of the step may move it: ``required_bytes`` counts it there, so a step whose
gradients are a large share of its bytes cannot be planned under a budget that a step
moving them out and back can meet (the eager warmup's online eviction met it; a plan could not).

A door that can run actions *after* the step's last op (the eager replay, at the end of
its ``with`` block) appends :data:`STEP_END`: one op that reads every retained storage.
Each retained storage's stretch from its last access to the end of the step is then an
ordinary gap; a planner may offload it, the reload runs before :data:`STEP_END`, and
``check_schedule`` judges it like any other. Nothing else changes: a trace without the
op is planned as before, so a door that cannot reload at its end (the compile door,
whose graph outputs leave with the graph) never gets such a plan.

Example: ops ``0: W0``, ``1: R0``, ``2..9`` unrelated, storage 0 retained. Without the
end op storage 0 is pinned over ops 2..9; with it (op 10 reads 0) the gap 1 -> 10 is a
candidate: ``post[1]: COPY_D2H 0, RELEASE_DEVICE 0``, ``pre[10]: COPY_H2D 0, WAIT_H2D 0``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hyper_offload.errors import TraceFormatError

from .trace_op import (
    AccessKind, StorageAccess, StorageId, TRACE_FORMAT, TRACE_VERSION, TraceOp, is_number,
    op_from_dict, parse_accesses, parse_sid, reject_unknown_fields,
)

__all__ = [
    "AccessKind",
    "ActivationTrace",
    "BACKWARD_GRAPH",
    "DEFAULT_BANDWIDTH_GBPS",
    "DEFAULT_DISK_BANDWIDTH_GBPS",
    "FORWARD_GRAPH",
    "STEP_END",
    "StorageAccess",
    "StorageId",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "TraceOp",
    "has_step_end",
    "with_step_end",
]


DEFAULT_BANDWIDTH_GBPS = 16.0
DEFAULT_DISK_BANDWIDTH_GBPS = 2.0
"""The disk tier's bandwidth when none was measured or given: a conservative NVMe SSD
(sequential writes of a few GB/s; the doors measure the real directory once,
``runtime.disk_bandwidth``)."""

FORWARD_GRAPH, BACKWARD_GRAPH = "fw", "bw"
"""Graph tags of a compile-path trace: :mod:`..fx.graph_trace` names each op ``"<tag>:<node>"``
(forward ops first), a JSON dump keeps the names, and
:func:`..plan.planning.backward_start` reads where the backward begins from them."""


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
                TraceOp(name=f"op{index}", accesses=parse_accesses(accesses, where))
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
        reject_unknown_fields(data, _TRACE_FIELDS, "trace")
        sizes = _parse_sizes(data["storage_sizes"], "trace.storage_sizes")
        raw_ops = data["ops"]
        if not isinstance(raw_ops, list):
            raise TraceFormatError("trace.ops: expected a list of op objects")
        ops = tuple(op_from_dict(entry, index) for index, entry in enumerate(raw_ops))
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


def _parse_sizes(sizes: Any, where: str) -> dict[StorageId, int]:
    """``{storage: bytes}``; two keys naming one storage ("1" and 1, "0" and "00") are
    rejected rather than silently merged."""
    if not isinstance(sizes, Mapping):
        raise TraceFormatError(f"{where}: expected a mapping storage id -> bytes")
    parsed: dict[StorageId, int] = {}
    for sid, size in sizes.items():
        storage = parse_sid(sid, where)
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
    return frozenset(parse_sid(s, where) for s in retained)


def _parse_size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceFormatError(f"{where}: expected a non-negative integer, got {value!r}")
    return value


def _parse_bandwidth(
    data: Mapping[str, Any], key: str, default: float = DEFAULT_BANDWIDTH_GBPS
) -> float:
    value = data.get(key, default)
    if not is_number(value) or not 0 < value < math.inf:
        raise TraceFormatError(f"trace.{key}: expected a positive finite number, got {value!r}")
    return float(value)


_TRACE_FIELDS = frozenset(
    {"format", "version", "budget_bytes", "d2h_bandwidth_gbps", "h2d_bandwidth_gbps",
     "disk_budget_bytes", "disk_bandwidth_gbps", "storage_sizes", "retained", "held_until",
     "ops"}
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
        if not is_number(value) or not 0 < value < math.inf:
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


STEP_END = "step_end"
"""Name of the op that reads every retained storage at the end of the step."""


def with_step_end(trace: ActivationTrace) -> ActivationTrace:
    """``trace`` with :data:`STEP_END` appended (duration 0, no outputs): it reads every
    retained storage. Invariant: the other ops, sizes, holds and the budget are
    unchanged, so the result's ``num_ops`` is ``trace.num_ops + 1``."""
    end = TraceOp(
        name=STEP_END,
        accesses=tuple(StorageAccess(s, AccessKind.READ) for s in sorted(trace.retained)),
        duration_s=0.0,
    )
    return dataclasses.replace(trace, ops=(*trace.ops, end))


def has_step_end(trace: ActivationTrace) -> bool:
    """Whether the trace's last op is :data:`STEP_END`."""
    return bool(trace.ops) and trace.ops[-1].name == STEP_END
