"""The residency schedule: what to move, and when, around each op of a trace, and the
limits a plan's actions keep (per-storage op limits, host buffer sizes).

A planner turns an :class:`~.trace.ActivationTrace` into a
:class:`ResidencySchedule`; lowerings (FX rewrite, eager replay) apply it; and
``check_schedule`` judges it. Actions run in list order.

Action semantics (the validator simulates exactly these):

* ``COPY_D2H s``       start copying device storage ``s`` to a host buffer. The host copy
  is valid until ``s`` is written again.
* ``RELEASE_DEVICE s`` free the device storage ``s`` (the runtime keeps the bytes alive
  until an in-flight D2H of them completes).
* ``COPY_H2D s``       allocate ``s`` on the device and start filling it from its valid host
  copy. The bytes count as resident from this point on.
* ``WAIT_H2D s``       make compute wait for the pending H2D of ``s``; an op may read ``s``
  only after this.
* ``RELEASE_HOST s``   return the host buffer of ``s`` to the pool.
* ``SPILL_TO_DISK s``  start writing the valid host copy of ``s`` to a file of the disk
  tier (once the D2H that fills it has completed) and give its host buffer back (the
  runtime returns it once the write completes). The disk copy is valid until ``s`` is
  written again; the host holds no bytes of ``s`` from here on.
* ``LOAD_FROM_DISK s`` take a host buffer and start reading ``s``'s disk copy into it; a
  ``COPY_H2D s`` after it first waits for that read (the rule that orders a load before
  its reload: no wait action of its own). The file stays until ``RELEASE_DISK``.
* ``RELEASE_DISK s``   remove the disk copy of ``s`` (after the read of a load from it).

``pre[i]`` runs before op ``i``; ``post[i]`` after it.

JSON format, version 1::

    {"format": "hyper-offload.schedule", "version": 1, "num_ops": 3,
     "pre":  {"2": ["COPY_H2D 0", "WAIT_H2D 0"]},
     "post": {"0": ["COPY_D2H 0", "RELEASE_DEVICE 0"], "2": ["RELEASE_DEVICE 0", "RELEASE_HOST 0"]}}

**Op limits** that may differ per storage: where a reload may start, where a release may
go. A compile region's trace has one limit for every storage: no reload before the first
backward op, no release after the last forward op (a region's backward graph cannot run
a copy before it starts; its forward graph must have freed its bytes by its end). A
*step* laid out as one trace (several regions and invocations, :mod:`..plan.step.layout`)
has one such pair per invocation, so each storage has its own. :data:`OpLimit` is either
form: an ``int`` (every storage) or a mapping from storage to op (a storage it does not
name has no limit: the caller's default).

**What an offloaded storage costs on the host**: the bytes of the buffer that holds it.
The runtime's host pool (:mod:`hyper_offload.runtime.pinned_pool`) serves every request
from a power-of-two size bucket, so a plan that counts raw storage bytes under-counts
what the host really holds (up to 2x). Planners that keep a host budget count
:func:`host_bucket_bytes` instead; the pool imports the same function, so the two can
never disagree. Pure: no torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, Union

from hyper_offload.errors import TraceFormatError

from .trace import StorageId, TraceFormatError

SCHEDULE_FORMAT = "hyper-offload.schedule"
SCHEDULE_VERSION = 1
_SCHEDULE_FIELDS = frozenset({"format", "version", "num_ops", "pre", "post"})
# ASCII digits only: ``str.isdigit`` also accepts "²", which ``int`` rejects.
_OP_INDEX_TEXT = re.compile(r"[0-9]+")


class ActionKind(str, Enum):
    COPY_D2H = "COPY_D2H"
    RELEASE_DEVICE = "RELEASE_DEVICE"
    COPY_H2D = "COPY_H2D"
    WAIT_H2D = "WAIT_H2D"
    RELEASE_HOST = "RELEASE_HOST"
    SPILL_TO_DISK = "SPILL_TO_DISK"
    LOAD_FROM_DISK = "LOAD_FROM_DISK"
    RELEASE_DISK = "RELEASE_DISK"

    def __repr__(self) -> str:
        return self.value


class ResidencyAction(NamedTuple):
    """One action on one storage; ``repr`` is ``"COPY_D2H 3"`` and parses back."""

    kind: ActionKind
    storage: StorageId

    def __repr__(self) -> str:
        return f"{self.kind.value} {self.storage}"

    @classmethod
    def from_str(cls, text: str) -> ResidencyAction:
        parts = text.split()
        if len(parts) != 2 or parts[0] not in ActionKind.__members__:
            raise TraceFormatError(
                f"schedule action {text!r}: expected '<KIND> <storage>' with KIND one of "
                f"{', '.join(ActionKind.__members__)}"
            )
        try:
            storage = int(parts[1])
        except ValueError:
            raise TraceFormatError(f"schedule action {text!r}: storage is not an integer") from None
        return cls(ActionKind(parts[0]), storage)


Actions = tuple[ResidencyAction, ...]

DISK_ACTIONS = frozenset({ActionKind.SPILL_TO_DISK, ActionKind.LOAD_FROM_DISK,
                          ActionKind.RELEASE_DISK})
"""The actions of the disk tier (a schedule without them never touches a disk)."""


@dataclass(frozen=True)
class ResidencySchedule:
    """Per-op action lists. Invariant: ``len(pre) == len(post) == num_ops``."""

    pre: tuple[Actions, ...]
    post: tuple[Actions, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pre", tuple(tuple(a) for a in self.pre))
        object.__setattr__(self, "post", tuple(tuple(a) for a in self.post))
        if len(self.pre) != len(self.post):
            raise TraceFormatError(
                f"ResidencySchedule: pre has {len(self.pre)} slots but post has "
                f"{len(self.post)}; both need one slot per op"
            )

    @property
    def num_ops(self) -> int:
        return len(self.pre)

    @classmethod
    def empty(cls, num_ops: int) -> ResidencySchedule:
        return cls(pre=((),) * num_ops, post=((),) * num_ops)

    @classmethod
    def from_slots(
        cls,
        num_ops: int,
        pre: Mapping[int, Iterable[ResidencyAction]],
        post: Mapping[int, Iterable[ResidencyAction]],
    ) -> ResidencySchedule:
        """Build from sparse ``{op_index: actions}`` mappings."""
        for name, slots in (("pre", pre), ("post", post)):
            for index in slots:
                if not 0 <= index < num_ops:
                    raise TraceFormatError(
                        f"ResidencySchedule.{name}[{index}]: op index out of range [0, {num_ops})"
                    )
        return cls(
            pre=tuple(tuple(pre.get(i, ())) for i in range(num_ops)),
            post=tuple(tuple(post.get(i, ())) for i in range(num_ops)),
        )

    def actions(self) -> Iterable[tuple[int, str, ResidencyAction]]:
        """Every action as ``(op_index, "pre" | "post", action)`` in execution order."""
        for index in range(self.num_ops):
            for action in self.pre[index]:
                yield index, "pre", action
            for action in self.post[index]:
                yield index, "post", action

    def count(self, kind: ActionKind) -> int:
        return sum(1 for _, _, a in self.actions() if a.kind is kind)

    def __repr__(self) -> str:
        lines = [f"ResidencySchedule(num_ops={self.num_ops})"]
        for index in range(self.num_ops):
            if self.pre[index]:
                lines.append(f"  pre  {index:>5}: {', '.join(map(repr, self.pre[index]))}")
            if self.post[index]:
                lines.append(f"  post {index:>5}: {', '.join(map(repr, self.post[index]))}")
        return "\n".join(lines)

    # -- JSON --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        def sparse(slots: Sequence[Actions]) -> dict[str, list[str]]:
            return {str(i): [repr(a) for a in acts] for i, acts in enumerate(slots) if acts}

        return {
            "format": SCHEDULE_FORMAT,
            "version": SCHEDULE_VERSION,
            "num_ops": self.num_ops,
            "pre": sparse(self.pre),
            "post": sparse(self.post),
        }

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any) -> ResidencySchedule:
        if not isinstance(data, Mapping) or data.get("format") != SCHEDULE_FORMAT:
            raise TraceFormatError(f"schedule.format: expected {SCHEDULE_FORMAT!r}")
        if data.get("version") != SCHEDULE_VERSION:
            raise TraceFormatError(
                f"schedule.version: this build reads version {SCHEDULE_VERSION}, "
                f"got {data.get('version')!r}"
            )
        for key in data:
            if key not in _SCHEDULE_FIELDS:
                raise TraceFormatError(
                    f"schedule.{key}: unknown field; expected only {', '.join(sorted(_SCHEDULE_FIELDS))}"
                )
        num_ops = data.get("num_ops")
        if isinstance(num_ops, bool) or not isinstance(num_ops, int) or num_ops < 0:
            raise TraceFormatError(f"schedule.num_ops: expected an integer >= 0, got {num_ops!r}")
        slots: dict[str, dict[int, list[ResidencyAction]]] = {}
        for name in ("pre", "post"):
            raw = data.get(name, {})
            if not isinstance(raw, Mapping):
                raise TraceFormatError(f"schedule.{name}: expected an object op -> actions")
            parsed: dict[int, list[ResidencyAction]] = {}
            for key, actions in raw.items():
                if not _OP_INDEX_TEXT.fullmatch(str(key)) or not isinstance(actions, list):
                    raise TraceFormatError(
                        f"schedule.{name}[{key!r}]: expected op index -> list of actions"
                    )
                if int(key) in parsed:  # "0" and "00": one slot, two lists
                    raise TraceFormatError(
                        f"schedule.{name}[{key!r}]: op {int(key)} is listed twice; merge its actions"
                    )
                parsed[int(key)] = [ResidencyAction.from_str(str(a)) for a in actions]
            slots[name] = parsed
        try:
            return cls.from_slots(num_ops, slots["pre"], slots["post"])
        except ValueError as error:
            raise TraceFormatError(str(error)) from None

    @classmethod
    def from_json(cls, text: str) -> ResidencySchedule:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise TraceFormatError(f"schedule: not valid JSON ({error})") from None
        return cls.from_dict(data)


# -- limits ----------------------------------------------------------------------------

MIN_BUCKET_BYTES = 1 << 10
MAX_BUCKET_BYTES = 1 << 31


def host_bucket_bytes(nbytes: int) -> int:
    """Capacity of the host buffer that serves a request of ``nbytes``.

    A power of two in ``[MIN_BUCKET_BYTES, MAX_BUCKET_BYTES]``, or ``nbytes`` itself for
    requests above ``MAX_BUCKET_BYTES`` (a dedicated buffer of exactly that size).
    """
    if nbytes > MAX_BUCKET_BYTES:
        return nbytes
    return max(MIN_BUCKET_BYTES, 1 << max(0, nbytes - 1).bit_length())


OpLimit = Union[int, Mapping[StorageId, int]]
"""One op for every storage, or one per storage (see the module docstring)."""


def op_limit(limit: OpLimit | None, storage: StorageId, default: int) -> int:
    """``limit`` for ``storage``: the int itself, the mapping's entry, else ``default``."""
    if limit is None:
        return default
    if isinstance(limit, int):
        return limit
    return limit.get(storage, default)
