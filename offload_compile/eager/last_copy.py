"""``LastCopies``: the replay drops a storage's last copy only once nothing can read it.

A plan frees a storage's bytes for good (``RELEASE_DEVICE`` of a storage with no host
copy, ``RELEASE_HOST`` of an offloaded one) after the last op that uses it: its last
access, or the end of its hold (``ActivationTrace.held_until``: the warmup saw the last
reference die there). In a step that runs its warmup's ops, nothing references the
storage at the next op any more. In a step that does not (a branch that reads an early
activation again, a layer unfrozen so autograd now saves its input, a hook that keeps an
output), something still does, and dropping the bytes would leave it a 0-byte storage:
a later read found "device and host copies were both released" every step, and a kernel
reading it would crash the process (TORCH_NOTES).

So a planned last-copy drop is deferred to the start of the next op
(:meth:`~LastCopies.defer`, :meth:`~LastCopies.settle`): by then the step's own references
are gone in a step that matches its warmup, and the drop happens before the op allocates
(the resident curve stays the plan's). A storage still referenced there is *kept*: its
bytes go to the host instead (as the plan counted them freed, the device curve stays the
plan's; on the device if the host budget has no room), and a later read of it is the
divergence the replay reports (:meth:`~LastCopies.first_read`): it hands the step to a
warmup, before any kernel touches it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import NamedTuple

from hyper_offload.passes.ir.schedule import ActionKind, ResidencyAction
from hyper_offload.passes.ir.trace import StorageId
from hyper_offload.runtime import ResidencyManager
from hyper_offload.runtime.physical_buffer import BufferState

__all__ = ["LastCopies", "Settled", "drop_if_unreferenced"]


class Settled(NamedTuple):
    """What :meth:`LastCopies.settle` did: bytes kept on the device that the plan counts
    freed, bytes copied to the host, and the storages kept (newly) this time."""

    kept_on_device: int
    copied: int
    kept: tuple[StorageId, ...]


class LastCopies:
    """Deferred last-copy drops of one replay step and the storages kept instead.

    Invariant: a storage in :attr:`pending` has the drop named there still to do, and
    is bound in ``manager``; a storage in :attr:`kept` was referenced where its plan
    frees it, and its bytes exist (device or host) until the end of the step."""

    def __init__(self, manager: ResidencyManager) -> None:
        self.manager = manager
        self.pending: dict[StorageId, tuple[ActionKind, int]] = {}
        """Storage -> (the planned drop, the op after which the plan runs it)."""
        self.kept: dict[StorageId, int] = {}
        """Storage -> the op after which its plan dropped it; still referenced there."""

    def __bool__(self) -> bool:
        return bool(self.pending)

    def is_last_copy(self, action: ResidencyAction) -> bool:
        """Whether ``action`` frees the only copy of its storage's bytes."""
        kind = action.kind
        if kind is ActionKind.RELEASE_DEVICE:
            return self.manager.state(action.storage) is BufferState.DEVICE
        if kind is ActionKind.RELEASE_HOST:
            return self.manager.state(action.storage) is BufferState.HOST
        return False

    def defer(self, action: ResidencyAction, op: int) -> None:
        """Drop now if nothing references the storage, else at the next
        :meth:`~LastCopies.settle`."""
        if self.manager.buffer(action.storage).referenced():
            self.pending[action.storage] = (action.kind, op)
        else:
            self.manager.apply(action)

    def settle(self, reading: Collection[int] = ()) -> Settled:
        """Run the pending drops whose storage nothing references any more; keep the
        others (module docstring). ``reading``: ``_cdata`` of the storages the op about
        to run reads: one of those is kept on the device (the read is reported)."""
        manager = self.manager
        kept_on_device = copied = 0
        kept = []
        for sid, (kind, op) in self.pending.items():
            buffer = manager.buffer(sid)
            if not buffer.referenced():
                manager.apply(ResidencyAction(kind, sid))
                continue
            self.kept[sid] = op
            kept.append(sid)
            if kind is ActionKind.RELEASE_HOST:
                continue  # the host copy stays; a read pages it back
            if buffer.storage._cdata not in reading and manager.pool.has_room(buffer.nbytes):
                manager.copy_d2h(sid)
                manager.release_device(sid)
                copied += buffer.nbytes
            else:
                kept_on_device += buffer.nbytes
        self.pending.clear()
        return Settled(kept_on_device, copied, tuple(kept))

    def first_read(self, sids: Iterable[StorageId | None]) -> tuple[StorageId, int] | None:
        """The first of ``sids`` (an op's inputs) that was kept, with the op after which
        its plan dropped it (a read of it is a read after what its warmup recorded as its
        last use); None if none was."""
        for sid in sids:
            if sid is not None and sid in self.kept:
                return sid, self.kept[sid]
        return None

    def still_referenced(self) -> list[StorageId]:
        """Kept storages something still references (at the end of the step: the step
        keeps tensors its warmup saw freed)."""
        manager = self.manager
        return [sid for sid in self.kept
                if sid in manager and manager.buffer(sid).referenced()]


def drop_if_unreferenced(manager: ResidencyManager, sid: StorageId) -> None:
    """A storage moved off the device outside the plan (an online eviction, a kept last
    copy) that nothing references any more: drop both copies (at the end of a step)."""
    if sid in manager and not manager.is_resident(sid) and not manager.buffer(sid).referenced():
        if manager.has_host_copy(sid):
            manager.release_host(sid)
        manager.unbind(sid)
