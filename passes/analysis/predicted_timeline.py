"""The one timeline model: when each op and each copy of a plan would run, from the
trace's op durations and its D2H/H2D bandwidths. Pure: data in, data out.
:func:`predict_timeline` runs a whole schedule; :class:`TimelineSimulator` is the same
model one slot at a time, for passes that decide as they walk.

The model is the runtime's (``runtime/transfer.py``, ``runtime/physical_buffer.py``):

* **One compute stream.** Ops run back to back in trace order; op ``i`` takes
  ``trace.ops[i].duration_s``. **The one default** for an op without a duration
  (:func:`op_durations`): ``default_op_duration_s`` if given, else the mean of the
  trace's known durations, else :data:`DEFAULT_OP_DURATION_S`. Every pass that prices
  time uses it: the release placement, the time ranking, the stall bound, the pipeline's
  choice among proposals, the region report, ``estimate`` and the Chrome trace.
* **One copy stream, serial.** A ``COPY_D2H`` / ``COPY_H2D`` is *issued* when the compute
  stream reaches its slot (the copy stream first waits for compute up to there) and
  *starts* when it is issued **and** the copy stream is free; it lasts
  ``bytes / bandwidth`` (GB/s = 1e9 bytes per second). D2H and H2D share the stream
  (the runtime's one copy stream). With ``copy_streams=2`` each direction has its own
  serial stream, as separate copy engines would run them; an H2D of a storage then also
  starts no earlier than the end of that storage's latest D2H (the runtime orders it
  with the D2H's event).
* **WAIT_H2D blocks compute.** The compute stream stops until the storage's latest H2D
  has finished: that stall is the *exposed* transfer time. By default nothing else waits
  for a copy (the residency manager's RELEASE_DEVICE frees under ``record_stream``;
  RELEASE_HOST is deferred by events). With ``release_waits_for_d2h=True`` a
  RELEASE_DEVICE also stalls compute until that storage's D2H has finished: the compile
  lowering's ``wait_transfer`` sits there (passes/fx/lowering.py).
* **One disk channel, serial** (the disk tier, ``trace.disk_bandwidth_gbps``): a
  ``SPILL_TO_DISK`` starts when issued, the channel is free **and** the storage's latest
  D2H has ended (it writes what that copy filled); a ``LOAD_FROM_DISK`` when issued, the
  channel is free and the storage's latest spill has ended. Each lasts ``bytes /
  disk bandwidth``. A ``COPY_H2D`` of a storage whose load has not ended **blocks
  compute** until it has (the runtime's host thread waits for the read before it issues
  the copy): that stall counts as exposed time, like a WAIT_H2D's. ``RELEASE_DISK`` takes
  no time.
* Actions of a slot run in slot order at the slot's time: ``pre[i]`` before op ``i``,
  ``post[i]`` after it.

Invariants of the result: compute spans (ops and waits) never overlap and appear in
execution order; transfer spans of one copy stream never overlap each other; every transfer starts at or
after its issue time; each wait ends exactly when its H2D ends (and is only recorded
when it stalls compute); ``compute_end_s`` = sum of op durations + exposed wait time;
disk spans never overlap each other and every H2D starts after its storage's load ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

from hyper_offload.errors import ConfigurationError, TraceFormatError

from ..ir.schedule import ActionKind, ResidencySchedule
from ..ir.trace import ActivationTrace, StorageId

__all__ = [
    "DEFAULT_OP_DURATION_S",
    "InstantMark",
    "TimelineSimulator",
    "OpSpan",
    "PredictedTimeline",
    "TransferSpan",
    "WaitSpan",
    "op_durations",
    "op_start_times",
    "predict_timeline",
]

DEFAULT_OP_DURATION_S = 1e-6
"""Used for ops without a duration when the trace has no duration at all."""


class OpSpan(NamedTuple):
    """Op ``index`` runs on the compute stream over ``[start_s, end_s)``."""

    index: int
    name: str
    start_s: float
    end_s: float
    estimated: bool  # True when the duration was defaulted, not from the trace

    def __repr__(self) -> str:
        return f"op {self.index} {self.name} [{self.start_s:.3g}, {self.end_s:.3g})"


class TransferSpan(NamedTuple):
    """A copy of ``nbytes`` of ``storage`` on the copy stream (the disk channel for the
    disk tier's kinds) over ``[start_s, end_s)``, issued at ``issue_s`` from slot ``slot``
    (``"pre"``/``"post"``) of op ``op_index``."""

    kind: ActionKind  # COPY_D2H or COPY_H2D; SPILL_TO_DISK or LOAD_FROM_DISK on the disk
    storage: StorageId
    nbytes: int
    op_index: int
    slot: str
    issue_s: float
    start_s: float
    end_s: float

    def __repr__(self) -> str:
        return f"{_SHORT[self.kind]} s{self.storage} [{self.start_s:.3g}, {self.end_s:.3g})"


_SHORT = {ActionKind.COPY_D2H: "D2H", ActionKind.COPY_H2D: "H2D",
          ActionKind.SPILL_TO_DISK: "spill", ActionKind.LOAD_FROM_DISK: "load"}


class WaitSpan(NamedTuple):
    """Compute stalled over ``[start_s, end_s)`` at op ``op_index``'s slot, waiting for
    ``storage``'s copy (its H2D; its D2H only with ``release_waits_for_d2h``; its load
    from disk at a COPY_H2D)."""

    storage: StorageId
    op_index: int
    slot: str
    start_s: float
    end_s: float
    kind: ActionKind = ActionKind.COPY_H2D  # the copy waited for

    def __repr__(self) -> str:
        return f"wait {_SHORT[self.kind]} s{self.storage} [{self.start_s:.3g}, {self.end_s:.3g})"


class InstantMark(NamedTuple):
    """A RELEASE_DEVICE / RELEASE_HOST / RELEASE_DISK at ``time_s`` (takes no time)."""

    kind: ActionKind
    storage: StorageId
    op_index: int
    slot: str
    time_s: float


@dataclass(frozen=True)
class PredictedTimeline:
    """The timeline of one step under a schedule; see the module docstring."""

    ops: tuple[OpSpan, ...]
    transfers: tuple[TransferSpan, ...]
    waits: tuple[WaitSpan, ...]
    releases: tuple[InstantMark, ...]
    default_op_duration_s: float
    disk: tuple[TransferSpan, ...] = ()
    """Spills and loads on the disk channel, in issue order (empty without a disk tier)."""

    @property
    def compute_end_s(self) -> float:
        """When the last op finishes (compute time plus exposed waits)."""
        return self.ops[-1].end_s if self.ops else 0.0

    @property
    def end_s(self) -> float:
        """When the step is done: compute, every copy and every disk read or write finished."""
        last_copy = max((t.end_s for t in (*self.transfers, *self.disk)), default=0.0)
        return max(self.compute_end_s, last_copy)

    @property
    def exposed_transfer_s(self) -> float:
        """Compute time lost waiting for copies."""
        return sum(w.end_s - w.start_s for w in self.waits)

    @property
    def compute_s(self) -> float:
        return sum(op.end_s - op.start_s for op in self.ops)

    def summary(self) -> dict[str, float | int]:
        return {
            "predicted_step_s": self.end_s,
            "compute_s": self.compute_s,
            "exposed_transfer_s": self.exposed_transfer_s,
            "copy_stream_busy_s": sum(t.end_s - t.start_s for t in self.transfers),
            "num_transfers": len(self.transfers),
            "disk_busy_s": sum(t.end_s - t.start_s for t in self.disk),
            "ops_with_default_duration": sum(op.estimated for op in self.ops),
        }


def predict_timeline(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    default_op_duration_s: float | None = None,
    release_waits_for_d2h: bool = False,
    copy_streams: int = 1,
) -> PredictedTimeline:
    """Predict when every op, copy and wait of ``schedule`` runs (see module docstring).

    ``default_op_duration_s`` is the duration of ops without one; ``None`` means the mean
    of the trace's known durations, or :data:`DEFAULT_OP_DURATION_S` if none is known.
    ``release_waits_for_d2h`` models a lowering that waits for a D2H where it frees the
    device bytes (the compile path); the default models the residency manager.
    ``copy_streams``: 1 (D2H and H2D share one serial stream, as the runtime does) or 2
    (one serial stream per direction).
    Raises ``TraceFormatError`` naming the op when the schedule does not fit the trace or a
    WAIT_H2D has no COPY_H2D before it (run ``check_schedule`` for the full diagnosis).
    """
    if schedule.num_ops != trace.num_ops:
        raise TraceFormatError(
            f"predict_timeline: the schedule has {schedule.num_ops} op slots but the trace has "
            f"{trace.num_ops} ops; plan this trace, or load the schedule made for it"
        )
    simulator = TimelineSimulator(
        trace, default_op_duration_s=default_op_duration_s,
        release_waits_for_d2h=release_waits_for_d2h, copy_streams=copy_streams,
    )
    for index in range(trace.num_ops):
        simulator.run_slot(schedule.pre[index], index, "pre")
        simulator.run_op(index)
        simulator.run_slot(schedule.post[index], index, "post")
    return simulator.timeline()


def op_durations(trace: ActivationTrace, default_op_duration_s: float | None = None) -> list[float]:
    """Each op's duration as every pass here prices it: ``duration_s``, else the default
    (``default_op_duration_s``; ``None``: the mean of the known durations, or
    :data:`DEFAULT_OP_DURATION_S` when none is known)."""
    default = _default_duration(trace, default_op_duration_s)
    return [default if op.duration_s is None else op.duration_s for op in trace.ops]


def op_start_times(trace: ActivationTrace, default_op_duration_s: float | None = None) -> list[float]:
    """When each op starts on a stall-free step (``num_ops + 1`` entries: the last is when
    compute ends), priced by :func:`op_durations`."""
    return [0.0, *accumulate(op_durations(trace, default_op_duration_s))]


def _default_duration(trace: ActivationTrace, given: float | None) -> float:
    if given is not None:
        if not given >= 0:
            raise ConfigurationError(f"predict_timeline: default_op_duration_s must be >= 0, got {given!r}")
        return given
    known = [op.duration_s for op in trace.ops if op.duration_s is not None]
    return sum(known) / len(known) if known else DEFAULT_OP_DURATION_S


class TimelineSimulator:
    """The timeline model, one slot at a time: what :func:`predict_timeline` runs, and
    what a pass that decides while it walks (the release placement) drives itself.

    Call ``run_slot(pre[i])``, ``run_op(i)``, ``run_slot(post[i])`` for ``i`` in order;
    ``clock`` is the compute stream's time, ``d2h_end(s)`` when ``s``'s latest D2H ends.
    """

    def __init__(
        self,
        trace: ActivationTrace,
        *,
        default_op_duration_s: float | None = None,
        release_waits_for_d2h: bool = False,
        copy_streams: int = 1,
    ) -> None:
        if copy_streams not in (1, 2):
            raise ConfigurationError(
                f"predict_timeline: copy_streams must be 1 (one shared copy stream) or 2 (one "
                f"per direction), got {copy_streams!r}"
            )
        self.trace = trace
        self.default_op_duration_s = _default_duration(trace, default_op_duration_s)
        self.ops: list[OpSpan] = []
        self.release_waits_for_d2h = release_waits_for_d2h
        self.copy_streams = copy_streams
        self.clock = 0.0  # compute stream
        self.copy_free: dict[ActionKind, float] = {}  # copy stream (per direction if 2)
        self.d2h_end_s: dict[StorageId, float] = {}  # end of each storage's latest D2H
        self.transfers: list[TransferSpan] = []
        self.waits: list[WaitSpan] = []
        self.releases: list[InstantMark] = []
        self.last_h2d: dict[StorageId, TransferSpan] = {}
        self.pending_d2h: dict[StorageId, TransferSpan] = {}
        self.disk: list[TransferSpan] = []
        self.disk_free = 0.0
        self.spill_end_s: dict[StorageId, float] = {}
        self.loading: dict[StorageId, TransferSpan] = {}  # loads no H2D has waited for

    def run_op(self, index: int) -> None:
        """Op ``index`` runs on the compute stream (ops must come in trace order)."""
        op = self.trace.ops[index]
        duration = self.default_op_duration_s if op.duration_s is None else op.duration_s
        start = self.clock
        self.clock += duration
        self.ops.append(OpSpan(index, op.name, start, self.clock, op.duration_s is None))

    def d2h_end(self, storage: StorageId) -> float | None:
        """When the latest D2H of ``storage`` issued so far ends (None: none issued)."""
        return self.d2h_end_s.get(storage)

    def pending_copy_end(self, storage: StorageId) -> float | None:
        """When the D2H a RELEASE_DEVICE of ``storage`` would now wait for ends (None: no
        D2H of it since its last release)."""
        copy = self.pending_d2h.get(storage)
        return None if copy is None else copy.end_s

    def timeline(self) -> PredictedTimeline:
        return PredictedTimeline(
            tuple(self.ops), tuple(self.transfers), tuple(self.waits), tuple(self.releases),
            self.default_op_duration_s, tuple(self.disk),
        )

    def run_slot(self, actions: tuple, index: int, slot: str) -> None:  # noqa: ANN001
        for action in actions:
            kind, storage = action.kind, action.storage
            if kind in (ActionKind.COPY_D2H, ActionKind.COPY_H2D):
                load = self.loading.pop(storage, None) if kind is ActionKind.COPY_H2D else None
                if load is not None:
                    self._stall_until(load, index, slot)  # the host waits for the read
                self._issue(kind, storage, index, slot)
            elif kind is ActionKind.WAIT_H2D:
                self._wait(storage, index, slot)
            elif kind in (ActionKind.SPILL_TO_DISK, ActionKind.LOAD_FROM_DISK):
                self._disk(kind, storage, index, slot)
            elif kind is ActionKind.RELEASE_DISK:
                self.releases.append(InstantMark(kind, storage, index, slot, self.clock))
            else:
                d2h = self.pending_d2h.pop(storage, None)
                if kind is ActionKind.RELEASE_DEVICE and d2h is not None and self.release_waits_for_d2h:
                    self._stall_until(d2h, index, slot)
                self.releases.append(InstantMark(kind, storage, index, slot, self.clock))

    def _issue(self, kind: ActionKind, storage: StorageId, index: int, slot: str) -> None:
        nbytes = self.trace.storage_sizes[storage]
        gbps = (
            self.trace.d2h_bandwidth_gbps if kind is ActionKind.COPY_D2H
            else self.trace.h2d_bandwidth_gbps
        )
        stream = kind if self.copy_streams == 2 else ActionKind.COPY_D2H
        start = max(self.clock, self.copy_free.get(stream, 0.0))
        if kind is ActionKind.COPY_H2D:
            start = max(start, self.d2h_end_s.get(storage, 0.0))  # only matters with 2 streams
        end = start + nbytes / (gbps * 1e9)
        span = TransferSpan(kind, storage, nbytes, index, slot, self.clock, start, end)
        self.copy_free[stream] = end
        self.transfers.append(span)
        if kind is ActionKind.COPY_H2D:
            self.last_h2d[storage] = span
        else:
            self.pending_d2h[storage] = span
            self.d2h_end_s[storage] = end

    def _disk(self, kind: ActionKind, storage: StorageId, index: int, slot: str) -> None:
        """A spill or a load on the serial disk channel (module docstring)."""
        nbytes = self.trace.storage_sizes[storage]
        after = (self.d2h_end_s if kind is ActionKind.SPILL_TO_DISK
                 else self.spill_end_s).get(storage, 0.0)
        start = max(self.clock, self.disk_free, after)
        end = start + nbytes / (self.trace.disk_bandwidth_gbps * 1e9)
        span = TransferSpan(kind, storage, nbytes, index, slot, self.clock, start, end)
        self.disk_free = end
        self.disk.append(span)
        if kind is ActionKind.SPILL_TO_DISK:
            self.spill_end_s[storage] = end
        else:
            self.loading[storage] = span

    def _wait(self, storage: StorageId, index: int, slot: str) -> None:
        h2d = self.last_h2d.get(storage)
        if h2d is None:
            raise TraceFormatError(
                f"predict_timeline: {slot}[{index}] WAIT_H2D {storage} has no COPY_H2D of "
                f"storage {storage} before it; check the schedule with check_schedule"
            )
        self._stall_until(h2d, index, slot)

    def _stall_until(self, copy: TransferSpan, index: int, slot: str) -> None:
        """Compute waits for ``copy``; a wait is recorded only when it stalls."""
        if copy.end_s > self.clock:
            self.waits.append(WaitSpan(copy.storage, index, slot, self.clock, copy.end_s, copy.kind))
            self.clock = copy.end_s
