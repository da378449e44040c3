"""``check_schedule``: the one validator every planner and every lowering is judged by.

It simulates residency op by op under the action semantics of :mod:`..ir.schedule` and the
residency model of :mod:`..ir.trace`, and never trusts the planner's own bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from hyper_offload.errors import ScheduleError

from ..ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from ..ir.trace import AccessKind, ActivationTrace, StorageId
from .liveness import InfeasibleOp, infeasible_ops, required_bytes, storage_liveness


class Rule(str, Enum):
    """The rules a schedule can break; each names the fix in its violation message."""

    LENGTH_MISMATCH = "LENGTH_MISMATCH"
    UNKNOWN_STORAGE = "UNKNOWN_STORAGE"
    NOT_YET_CREATED = "NOT_YET_CREATED"
    ACCESS_NOT_RESIDENT = "ACCESS_NOT_RESIDENT"
    ACCESS_BEFORE_WAIT = "ACCESS_BEFORE_WAIT"
    D2H_NOT_RESIDENT = "D2H_NOT_RESIDENT"
    RELEASE_NOT_RESIDENT = "RELEASE_NOT_RESIDENT"
    RELEASE_WITHOUT_HOST_COPY = "RELEASE_WITHOUT_HOST_COPY"
    RELEASE_STALE_HOST_COPY = "RELEASE_STALE_HOST_COPY"
    RELEASE_RETAINED = "RELEASE_RETAINED"
    H2D_ALREADY_RESIDENT = "H2D_ALREADY_RESIDENT"
    H2D_WITHOUT_HOST_COPY = "H2D_WITHOUT_HOST_COPY"
    WAIT_WITHOUT_H2D = "WAIT_WITHOUT_H2D"
    HOST_RELEASE_WITHOUT_COPY = "HOST_RELEASE_WITHOUT_COPY"
    HOST_RELEASE_DURING_H2D = "HOST_RELEASE_DURING_H2D"
    HOST_RELEASE_STILL_NEEDED = "HOST_RELEASE_STILL_NEEDED"
    OVER_BUDGET = "OVER_BUDGET"
    TRANSIENT_OVER_BUDGET = "TRANSIENT_OVER_BUDGET"
    RETAINED_NOT_RESIDENT = "RETAINED_NOT_RESIDENT"
    DEVICE_NOT_RELEASED = "DEVICE_NOT_RELEASED"
    HOST_NOT_RELEASED = "HOST_NOT_RELEASED"
    H2D_NEVER_WAITED = "H2D_NEVER_WAITED"
    SPILL_WITHOUT_HOST_COPY = "SPILL_WITHOUT_HOST_COPY"
    SPILL_DURING_H2D = "SPILL_DURING_H2D"
    SPILL_FILE_HELD = "SPILL_FILE_HELD"
    LOAD_WITHOUT_DISK_COPY = "LOAD_WITHOUT_DISK_COPY"
    LOAD_HOST_HELD = "LOAD_HOST_HELD"
    DISK_RELEASE_WITHOUT_FILE = "DISK_RELEASE_WITHOUT_FILE"
    DISK_RELEASE_STILL_NEEDED = "DISK_RELEASE_STILL_NEEDED"
    DISK_OVER_BUDGET = "DISK_OVER_BUDGET"
    DISK_NOT_RELEASED = "DISK_NOT_RELEASED"

    def __repr__(self) -> str:
        return self.value


class Violation(NamedTuple):
    op_index: int
    storage: StorageId | None
    rule: Rule
    message: str

    def __str__(self) -> str:
        where = f"op {self.op_index}" + ("" if self.storage is None else f", storage {self.storage}")
        return f"{where}: [{self.rule.value}] {self.message}"


@dataclass(frozen=True)
class ScheduleReport:
    """What the simulation saw.

    ``resident_bytes[i]`` is the device bytes during op ``i`` (after its pre actions,
    before its post actions). ``peak_resident_bytes`` is the highest device bytes at any
    point, including inside a slot (a COPY_H2D that runs before a RELEASE_DEVICE of the
    same slot); it equals ``max(resident_bytes)`` when no slot peaks above its op.
    ``infeasible_ops`` are ops whose unavoidable bytes exceed the budget: being over
    budget there, up to those bytes, is not a violation. ``peak_host_bytes`` counts a
    host copy from its ``COPY_D2H`` (or ``LOAD_FROM_DISK``) to its ``RELEASE_HOST`` (or
    ``SPILL_TO_DISK``): only while it holds bytes. ``peak_disk_bytes`` counts a disk copy
    from its ``SPILL_TO_DISK`` to its ``RELEASE_DISK`` (never above
    ``trace.disk_budget_bytes``: ``DISK_OVER_BUDGET``); ``bytes_to_disk`` and
    ``bytes_from_disk`` are what the spills write and the loads read.
    """

    resident_bytes: tuple[int, ...]
    peak_resident_bytes: int
    budget_bytes: int
    bytes_d2h: int
    bytes_h2d: int
    num_transfers: int
    peak_host_bytes: int
    violations: tuple[Violation, ...]
    infeasible_ops: tuple[InfeasibleOp, ...] = field(default=())
    peak_disk_bytes: int = 0
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def feasible(self) -> bool:
        return not self.infeasible_ops

    @property
    def bytes_moved(self) -> int:
        return self.bytes_d2h + self.bytes_h2d

    def ops_over_budget(self) -> list[int]:
        return [i for i, b in enumerate(self.resident_bytes) if b > self.budget_bytes]

    def raise_if_invalid(self) -> None:
        if self.violations:
            shown = "\n  ".join(str(v) for v in self.violations[:20])
            more = len(self.violations) - 20
            raise ScheduleError(
                f"schedule breaks {len(self.violations)} rule(s):\n  {shown}"
                + (f"\n  ... and {more} more" if more > 0 else "")
            )

    def summary(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "feasible": self.feasible,
            "peak_resident_bytes": self.peak_resident_bytes,
            "budget_bytes": self.budget_bytes,
            "bytes_d2h": self.bytes_d2h,
            "bytes_h2d": self.bytes_h2d,
            "num_transfers": self.num_transfers,
            "peak_host_bytes": self.peak_host_bytes,
            "peak_disk_bytes": self.peak_disk_bytes,
            "bytes_to_disk": self.bytes_to_disk,
            "bytes_from_disk": self.bytes_from_disk,
            "ops_over_budget": len(self.ops_over_budget()),
            "infeasible_ops": [op._asdict() for op in self.infeasible_ops],
            "violations": [
                {"op_index": v.op_index, "storage": v.storage, "rule": v.rule.value, "message": v.message}
                for v in self.violations
            ],
        }


@dataclass
class _StorageState:
    size: int
    last_access: int
    retained: bool
    held_end: int
    """The last op during which the bytes must exist (``trace.held_end``)."""
    created: bool = False
    on_device: bool = False
    h2d_pending: bool = False
    host_allocated: bool = False
    host_valid: bool = False
    copied_since_write: bool = False
    disk_allocated: bool = False
    disk_valid: bool = False

    @property
    def has_copy(self) -> bool:
        """Whether a valid copy off the device exists (host or disk)."""
        return self.host_valid or self.disk_valid


class _Simulation:
    """Mutable state of one ``check_schedule`` run; lives only inside that call."""

    def __init__(self, trace: ActivationTrace) -> None:
        self.trace = trace
        self.states = {
            s: _StorageState(live.size, live.last, live.retained, trace.held_end(s))
            for s, live in storage_liveness(trace).items()
        }
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_host = 0
        self.bytes_d2h = 0
        self.bytes_h2d = 0
        self.transfers = 0
        self.disk_bytes = 0
        self.peak_disk = 0
        self.bytes_to_disk = 0
        self.bytes_from_disk = 0
        self.violations: list[Violation] = []
        # Device bytes may peak between two ops, inside post[i - 1] + pre[i] (a COPY_H2D
        # that runs before a RELEASE_DEVICE). The highest point of the current stretch
        # and the action that reached it; see ``check_between_ops``.
        self.peak_device = 0
        self.between_peak: tuple[int, int, StorageId, str] | None = None
        self.slot_name = "pre"
        # First op index whose accesses still lie ahead: ``op`` in pre actions, ``op + 1``
        # in post actions. Decides whether a storage is "needed later".
        self.cursor = 0

    def flag(self, op: int, storage: StorageId | None, rule: Rule, message: str) -> None:
        self.violations.append(Violation(op, storage, rule, message))

    def apply(self, op: int, action: ResidencyAction) -> None:
        state = self.states.get(action.storage)
        if state is None:
            self.flag(op, action.storage, Rule.UNKNOWN_STORAGE,
                      f"{action!r} names a storage no op of the trace accesses; drop the action")
            return
        if not state.created:
            self.flag(op, action.storage, Rule.NOT_YET_CREATED,
                      f"{action!r} runs before the storage's first access; move it later")
            return
        handler = {
            ActionKind.COPY_D2H: self._copy_d2h,
            ActionKind.RELEASE_DEVICE: self._release_device,
            ActionKind.COPY_H2D: self._copy_h2d,
            ActionKind.WAIT_H2D: self._wait_h2d,
            ActionKind.RELEASE_HOST: self._release_host,
            ActionKind.SPILL_TO_DISK: self._spill,
            ActionKind.LOAD_FROM_DISK: self._load,
            ActionKind.RELEASE_DISK: self._release_disk,
        }[action.kind]
        handler(op, action.storage, state)

    def _copy_d2h(self, op: int, sid: StorageId, st: _StorageState) -> None:
        if not st.on_device or st.h2d_pending:
            self.flag(op, sid, Rule.D2H_NOT_RESIDENT,
                      "COPY_D2H of a storage whose bytes are not on the device (released, or its "
                      "H2D not yet waited); copy it before releasing it")
            return
        if not st.host_allocated:
            self.host_bytes += st.size
            self.peak_host = max(self.peak_host, self.host_bytes)
        st.host_allocated = st.host_valid = True
        self.bytes_d2h += st.size
        self.transfers += 1

    def _release_device(self, op: int, sid: StorageId, st: _StorageState) -> None:
        if not st.on_device:
            self.flag(op, sid, Rule.RELEASE_NOT_RESIDENT,
                      "RELEASE_DEVICE of a storage not on the device; drop the duplicate release")
            return
        needed_later = st.last_access >= self.cursor
        if st.retained and not needed_later:
            self.flag(op, sid, Rule.RELEASE_RETAINED,
                      "RELEASE_DEVICE of a retained storage after its last access: it must stay "
                      "on the device past the step")
        held_later = st.held_end >= self.cursor  # a reference still reaches the bytes
        if (needed_later or held_later) and not st.has_copy:
            rule, why = (
                (Rule.RELEASE_STALE_HOST_COPY,
                 "its host copy predates a later write; issue COPY_D2H after the last write")
                if st.host_allocated
                else (Rule.RELEASE_WITHOUT_HOST_COPY, "it has no host copy; issue COPY_D2H first")
            )
            what = (f"read again at op {st.last_access}" if needed_later
                    else f"a reference holds until op {st.held_end}")
            self.flag(op, sid, rule, f"RELEASE_DEVICE loses data {what}: {why}")
        st.on_device = st.h2d_pending = False
        self.device_bytes -= st.size

    def _copy_h2d(self, op: int, sid: StorageId, st: _StorageState) -> None:
        if st.on_device:
            self.flag(op, sid, Rule.H2D_ALREADY_RESIDENT,
                      "COPY_H2D of a storage already on the device; drop it or release first")
            return
        if not st.host_valid:
            self.flag(op, sid, Rule.H2D_WITHOUT_HOST_COPY,
                      "COPY_H2D without a valid host copy (never copied, stale, or host released)"
                      + ("; its copy is on disk: LOAD_FROM_DISK it before the COPY_H2D"
                         if st.disk_valid else ""))
        st.on_device = st.h2d_pending = True
        self.device_bytes += st.size
        self.bytes_h2d += st.size
        self.transfers += 1
        self.peak_device = max(self.peak_device, self.device_bytes)
        if self.between_peak is None or self.device_bytes > self.between_peak[0]:
            self.between_peak = (self.device_bytes, op, sid, self.slot_name)

    def check_between_ops(self, allowance: int, at_op: int) -> None:
        """Flag a peak between two ops above ``allowance`` that the op after them
        (``at_op`` resident bytes) does not already show, then start a new stretch.

        A peak no higher than ``at_op`` needs no flag of its own: if it is over the
        allowance, so is the op, and OVER_BUDGET says so there.
        """
        if self.between_peak is not None:
            peak, op, sid, slot = self.between_peak
            if peak > allowance and peak > at_op:
                self.flag(op, sid, Rule.TRANSIENT_OVER_BUDGET,
                          f"COPY_H2D in the {slot} slot raises resident bytes to {peak}, above "
                          f"the allowance {allowance} between these ops, before later actions "
                          "free memory; put RELEASE_DEVICE before the COPY_H2D, or copy later")
        self.between_peak = None

    def _wait_h2d(self, op: int, sid: StorageId, st: _StorageState) -> None:
        if not st.h2d_pending:
            self.flag(op, sid, Rule.WAIT_WITHOUT_H2D,
                      "WAIT_H2D with no COPY_H2D in flight; issue COPY_H2D before the wait")
        st.h2d_pending = False

    def _release_host(self, op: int, sid: StorageId, st: _StorageState) -> None:
        if not st.host_allocated:
            self.flag(op, sid, Rule.HOST_RELEASE_WITHOUT_COPY,
                      "RELEASE_HOST of a storage with no host buffer; drop it")
            return
        if st.h2d_pending:
            self.flag(op, sid, Rule.HOST_RELEASE_DURING_H2D,
                      "RELEASE_HOST while an H2D from that buffer is in flight; WAIT_H2D first")
        if not st.on_device and not st.disk_valid and st.held_end >= self.cursor:
            what = (f"op {st.last_access} still reads it" if st.last_access >= self.cursor
                    else f"a reference holds it until op {st.held_end}")
            self.flag(op, sid, Rule.HOST_RELEASE_STILL_NEEDED,
                      f"RELEASE_HOST drops the only copy; {what}")
        st.host_allocated = st.host_valid = False
        self.host_bytes -= st.size

    # -- the disk tier ---------------------------------------------------------------

    def _spill(self, op: int, sid: StorageId, st: _StorageState) -> None:
        if not st.host_valid:
            self.flag(op, sid, Rule.SPILL_WITHOUT_HOST_COPY,
                      "SPILL_TO_DISK without a valid host copy to write (never copied, stale, or "
                      "host released); put it after the COPY_D2H that follows the last write")
            return
        if st.disk_allocated:
            self.flag(op, sid, Rule.SPILL_FILE_HELD,
                      "SPILL_TO_DISK of a storage that still has a disk file; RELEASE_DISK the "
                      "old file first, or RELEASE_HOST instead if the file is still valid")
            return
        if st.h2d_pending:
            self.flag(op, sid, Rule.SPILL_DURING_H2D,
                      "SPILL_TO_DISK frees the host buffer an H2D is still reading; WAIT_H2D first")
        st.host_allocated = st.host_valid = False
        self.host_bytes -= st.size
        st.disk_allocated = st.disk_valid = True
        self.disk_bytes += st.size
        self.bytes_to_disk += st.size
        self.peak_disk = max(self.peak_disk, self.disk_bytes)
        budget = self.trace.disk_budget_bytes
        if self.disk_bytes > budget:
            self.flag(op, sid, Rule.DISK_OVER_BUDGET,
                      f"SPILL_TO_DISK raises the disk tier's files to {self.disk_bytes} B, above "
                      f"its budget of {budget} B"
                      + (" (no disk tier: set OffloadConfig.max_disk_activation_mb)" if not budget
                         else "; release files earlier, or spill less"))

    def _load(self, op: int, sid: StorageId, st: _StorageState) -> None:
        if not st.disk_valid:
            self.flag(op, sid, Rule.LOAD_WITHOUT_DISK_COPY,
                      "LOAD_FROM_DISK without a valid disk copy (never spilled, stale, or "
                      "released); SPILL_TO_DISK after the COPY_D2H first, or drop the load")
            return
        if st.host_allocated:
            self.flag(op, sid, Rule.LOAD_HOST_HELD,
                      "LOAD_FROM_DISK while the storage still holds a host buffer; drop the load "
                      "(the host copy is there) or RELEASE_HOST first")
            return
        st.host_allocated = st.host_valid = True
        self.host_bytes += st.size
        self.peak_host = max(self.peak_host, self.host_bytes)
        self.bytes_from_disk += st.size

    def _release_disk(self, op: int, sid: StorageId, st: _StorageState) -> None:
        if not st.disk_allocated:
            self.flag(op, sid, Rule.DISK_RELEASE_WITHOUT_FILE,
                      "RELEASE_DISK of a storage with no disk file; drop it")
            return
        if st.disk_valid and not st.on_device and not st.host_valid and (
                st.held_end >= self.cursor):
            what = (f"op {st.last_access} still reads it" if st.last_access >= self.cursor
                    else f"a reference holds it until op {st.held_end}")
            self.flag(op, sid, Rule.DISK_RELEASE_STILL_NEEDED,
                      f"RELEASE_DISK drops the only copy; {what}: "
                      "LOAD_FROM_DISK it first, or release the file after its last reload")
        st.disk_allocated = st.disk_valid = False
        self.disk_bytes -= st.size

    def run_op(self, op: int) -> None:
        for storage, kind in self.trace.ops[op].accesses:
            st = self.states[storage]
            if not st.created:
                st.created = st.on_device = True
                self.device_bytes += st.size
            elif not st.on_device:
                self.flag(op, storage, Rule.ACCESS_NOT_RESIDENT,
                          f"{kind.name} of a storage not on the device; schedule COPY_H2D and "
                          "WAIT_H2D before this op")
            elif st.h2d_pending:
                self.flag(op, storage, Rule.ACCESS_BEFORE_WAIT,
                          f"{kind.name} while its COPY_H2D is still in flight; add WAIT_H2D before this op")
            if kind is AccessKind.WRITE:
                st.host_valid = st.disk_valid = False

    def finish(self) -> None:
        end = self.trace.num_ops
        for sid, st in sorted(self.states.items()):
            if st.h2d_pending:
                self.flag(end, sid, Rule.H2D_NEVER_WAITED, "COPY_H2D never waited; add WAIT_H2D")
            if st.retained and not st.on_device:
                self.flag(end, sid, Rule.RETAINED_NOT_RESIDENT,
                          "retained storage is not on the device at the end of the step")
            if not st.retained and st.on_device:
                self.flag(end, sid, Rule.DEVICE_NOT_RELEASED,
                          f"never released after its last access (op {st.last_access})"
                          + (f" nor its hold (op {st.held_end})" if st.held_end > st.last_access
                             else "") + "; add RELEASE_DEVICE there")
            if st.host_allocated:
                self.flag(end, sid, Rule.HOST_NOT_RELEASED,
                          "host buffer never released; add RELEASE_HOST after its last COPY_H2D")
            if st.disk_allocated:
                self.flag(end, sid, Rule.DISK_NOT_RELEASED,
                          "disk file never released (a file left behind by the step); add "
                          "RELEASE_DISK after its last LOAD_FROM_DISK")


def check_schedule(trace: ActivationTrace, schedule: ResidencySchedule) -> ScheduleReport:
    """Simulate ``schedule`` on ``trace``; report the bytes curve and every broken rule."""
    if schedule.num_ops != trace.num_ops:
        violation = Violation(0, None, Rule.LENGTH_MISMATCH,
                              f"schedule has {schedule.num_ops} op slots, trace has {trace.num_ops} ops; "
                              "plan the schedule from this trace")
        return ScheduleReport((), 0, trace.budget_bytes, 0, 0, 0, 0, (violation,))
    sim = _Simulation(trace)
    allowances = [max(trace.budget_bytes, need) for need in required_bytes(trace)]
    curve: list[int] = []
    for op in range(trace.num_ops):
        allowed = allowances[op]
        sim.cursor, sim.slot_name = op, "pre"
        for action in schedule.pre[op]:
            sim.apply(op, action)
        sim.run_op(op)
        curve.append(sim.device_bytes)
        # Between two ops (post[op - 1], pre[op]) either op's allowance may hold: no
        # schedule can be below op - 1's unavoidable bytes before it frees anything.
        sim.check_between_ops(max(allowances[max(op - 1, 0) : op + 1]), sim.device_bytes)
        if sim.device_bytes > allowed:
            sim.flag(op, None, Rule.OVER_BUDGET,
                     f"{sim.device_bytes} resident bytes exceed the budget {trace.budget_bytes}"
                     + (f" (and the op's unavoidable {allowed})" if allowed > trace.budget_bytes else "")
                     + "; offload more of what is live across this op")
        sim.cursor, sim.slot_name = op + 1, "post"
        for action in schedule.post[op]:
            sim.apply(op, action)
    if curve:
        sim.check_between_ops(allowances[-1], curve[-1])  # the last op's post slot
    sim.finish()
    return ScheduleReport(
        resident_bytes=tuple(curve),
        peak_resident_bytes=max(max(curve, default=0), sim.peak_device),
        budget_bytes=trace.budget_bytes,
        bytes_d2h=sim.bytes_d2h,
        bytes_h2d=sim.bytes_h2d,
        num_transfers=sim.transfers,
        peak_host_bytes=sim.peak_host,
        violations=tuple(sim.violations),
        infeasible_ops=tuple(infeasible_ops(trace)),
        peak_disk_bytes=sim.peak_disk,
        bytes_to_disk=sim.bytes_to_disk,
        bytes_from_disk=sim.bytes_from_disk,
    )
