"""``SwapGroup``: the saved activations of one pipeline chunk, and their four swap steps.

A group belongs to one ``(stage, micro)`` chunk of one ``step()`` (its *generation*) and is
named ``pp_swap_run{generation}_s{stage}_m{micro}``. It collects storages while the
chunk's FWD leaf runs (through the saved-tensor hooks of :mod:`.session`), then moves them
through a :class:`~hyper_offload.runtime.residency.ResidencyManager`:

====================  ==========================================  ================
step                  what the group does                         state after
====================  ==========================================  ================
(FWD leaf)            ``add``: bind each new storage once         ``COLLECTING``
SWAP_LAUNCH_OFFLOAD   ``copy_d2h`` of every storage               ``OFFLOADING``
SWAP_WAIT_OFFLOAD     ``release_device``: storages shrink to 0    ``OFFLOADED``
SWAP_LAUNCH_LOAD      ``copy_h2d``: storages grow back, H2D runs  ``LOADING``
SWAP_WAIT_LOAD        ``wait_h2d`` (stream wait), host copies     ``LOADED``
                      returned to the pool (gated by the copies),
                      bindings dropped: from here the bytes die
                      with autograd's saved tensors, one by one
                      as the backward frees them
(BWD_INPUT, dW swap)  ``hold_weight_state``: the members become    ``HELD``
                      the storages the retained graph still
                      holds, plus the gradients at the
                      weight-path intermediates
DW_LAUNCH_OFFLOAD,    the same four moves for the dW state        ``DW_OFFLOADING``
DW_WAIT_OFFLOAD,                                                  ... ``DW_LOADED``
DW_LAUNCH_LOAD,
DW_WAIT_LOAD
(last backward leaf)  ``close``                                   ``CLOSED``
====================  ==========================================  ================

Invariants:

* A storage joins at most one group, once (aliases and views are de-duplicated by the
  storage object). Protected storages (stage parameters, inputs, receive buffers, the
  FWD output, the loss) never join, and :meth:`~SwapGroup.protect` removes one that
  already joined.
* No host synchronisation on the normal path: launches enqueue copies, waits are stream
  waits (on CPU copies are synchronous, so every wait is already satisfied).
* :meth:`~SwapGroup.check_readable` refuses a member storage while the group is
  ``OFFLOADED`` or ``LOADING``: reading a 0-byte storage crashes the process
  (TORCH_NOTES), and reading a storage whose H2D has not been waited for reads garbage on
  an accelerator.
* :meth:`~SwapGroup.abort` is the exception path: it drains the copies, pages offloaded
  storages back (so no tensor is left without bytes) and returns every host buffer.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

import torch

from hyper_offload.errors import SwapStateError
from hyper_offload.passes.pipeline.meta_step import SwapPhase

from ..residency import ResidencyManager
from .packed_copy import PackedCopy

__all__ = ["GroupState", "SwapGroup", "SwapStateError", "group_name", "storage_keys"]


class GroupState(str, Enum):
    COLLECTING = "COLLECTING"
    OFFLOADING = "OFFLOADING"
    OFFLOADED = "OFFLOADED"
    LOADING = "LOADING"
    LOADED = "LOADED"
    # The dW state, held from BWD_INPUT to BWD_WEIGHT (dx/dw split orders only).
    HELD = "HELD"
    DW_OFFLOADING = "DW_OFFLOADING"
    DW_OFFLOADED = "DW_OFFLOADED"
    DW_LOADING = "DW_LOADING"
    DW_LOADED = "DW_LOADED"
    CLOSED = "CLOSED"

    def __repr__(self) -> str:
        return self.value


# States in which a member storage holds valid device bytes for the compute stream.
_READABLE = frozenset({
    GroupState.COLLECTING, GroupState.OFFLOADING, GroupState.LOADED, GroupState.HELD,
    GroupState.DW_OFFLOADING, GroupState.DW_LOADED, GroupState.CLOSED,
})
_AWAY = frozenset({GroupState.OFFLOADED, GroupState.LOADING, GroupState.DW_OFFLOADED, GroupState.DW_LOADING})
# The state each transition needs the group to be in, and the state it leaves behind, per
# window: the activations (FWD -> consumer) and the dW state (BWD_INPUT -> BWD_WEIGHT).
_TRANSITIONS = {
    SwapPhase.ACTIVATIONS: {
        "launch_offload": (GroupState.COLLECTING, GroupState.OFFLOADING),
        "wait_offload": (GroupState.OFFLOADING, GroupState.OFFLOADED),
        "launch_load": (GroupState.OFFLOADED, GroupState.LOADING),
        "wait_load": (GroupState.LOADING, GroupState.LOADED),
    },
    SwapPhase.WEIGHT_STATE: {
        "launch_offload": (GroupState.HELD, GroupState.DW_OFFLOADING),
        "wait_offload": (GroupState.DW_OFFLOADING, GroupState.DW_OFFLOADED),
        "launch_load": (GroupState.DW_OFFLOADED, GroupState.DW_LOADING),
        "wait_load": (GroupState.DW_LOADING, GroupState.DW_LOADED),
    },
}


def group_name(generation: int, stage: int, micro: int) -> str:
    """The physical group name of a chunk: ``pp_swap_run{generation}_s{stage}_m{micro}``."""
    return f"pp_swap_run{generation}_s{stage}_m{micro}"


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (shared by all its views)."""
    return tensor.untyped_storage()._cdata


def storage_keys(tensors: Iterable[object]) -> set[int]:
    """The storage identities of the strided tensors among ``tensors`` (others ignored):
    what a group must never move when they are protected."""
    return {storage_key(t) for t in tensors if isinstance(t, torch.Tensor) and t.layout is torch.strided}


@dataclass(eq=False)
class _Member:
    sid: int
    nbytes: int
    ref: weakref.ref[torch.UntypedStorage]
    tags: list[str] = field(default_factory=list)
    bound: bool = True
    """Bound in the residency manager (moved tensor by tensor)."""
    packed: bool = False
    """Moved in the group's one packed buffer (``group_swap=True``), never bound."""


class SwapGroup:
    """One chunk's swapped activations; see the module docstring for states and rules.

    ``sids`` hands out storage ids unique within the session's ``manager``.
    """

    def __init__(
        self,
        name: str,
        key: tuple[int, int],
        manager: ResidencyManager,
        sids: Iterable[int],
        *,
        device: torch.device,
        protected: Iterable[int] = (),
    ) -> None:
        self.name = name
        self.key = key
        self.manager = manager
        self.device = device
        self.state = GroupState.COLLECTING
        self._sids = iter(sids)
        self._members: dict[int, _Member] = {}  # storage key -> member
        self._protected: set[int] = set(protected)
        self._packed: PackedCopy | None = None  # the packed members' copy of this window
        self.d2h_copies = 0
        """Engine copies this group issued device -> host (one per storage, one per pack)."""
        self.h2d_copies = 0
        """Engine copies this group issued host -> device."""
        self.moved_bytes = 0
        """Bytes this group sent to the host (both windows)."""

    # ------------------------------------------------------------------ collection

    def add(self, tensor: torch.Tensor, tag: str | None = None, *, packed: bool = False) -> bool:
        """Join ``tensor``'s storage to the group; False when it is not eligible.

        ``packed`` (``group_swap=True``): the storage moves in the group's one packed host
        buffer, with a single copy each way for all packed members, instead of a copy
        of its own. Ineligible: parameters, protected storages, other devices,
        non-strided or zero-byte or non-resizable storages, and anything after
        collection ended.
        """
        if self.state is not GroupState.COLLECTING:
            raise SwapStateError(
                f"{self.name}: cannot add a tensor in state {self.state.value}; tensors join a "
                "group only while its chunk's FWD leaf runs (before SWAP_LAUNCH_OFFLOAD)"
            )
        return self._join(tensor, tag, packed)

    def _join(self, tensor: torch.Tensor, tag: str | None, packed: bool = False) -> bool:
        if not _swappable(tensor, self.device):
            return False
        key = storage_key(tensor)
        if key in self._protected:
            return False
        member = self._members.get(key)
        if member is None:
            sid = next(self._sids)
            storage = tensor.untyped_storage()
            if not packed:
                self.manager.bind(sid, _whole_storage(tensor))
            member = self._members[key] = _Member(
                sid, storage.nbytes(), weakref.ref(storage), bound=not packed, packed=packed
            )
        if tag is not None and tag not in member.tags:
            member.tags.append(tag)
        return True

    def protect(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never release these storages: drop them from the group if they joined already."""
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
                continue
            key = storage_key(tensor)
            self._protected.add(key)
            member = self._members.pop(key, None)
            if member is not None:
                if self.state is not GroupState.COLLECTING:
                    raise SwapStateError(
                        f"{self.name}: a storage was protected after SWAP_LAUNCH_OFFLOAD; "
                        "protect the FWD output and loss right after the FWD leaf"
                    )
                if member.bound:
                    self.manager.unbind(member.sid)

    def is_member(self, tensor: torch.Tensor) -> bool:
        return tensor.layout is torch.strided and storage_key(tensor) in self._members

    @property
    def nbytes(self) -> int:
        """Bytes of all member storages (their size when collected)."""
        return sum(m.nbytes for m in self._members.values())

    @property
    def num_storages(self) -> int:
        return len(self._members)

    def resident_bytes(self) -> int:
        """Bytes the member storages hold on the device right now (real storage sizes of
        the storages still alive)."""
        total = 0
        for member in self._members.values():
            storage = member.ref()
            total += 0 if storage is None else storage.nbytes()
        return total

    def packed_bytes(self) -> int:
        """Bytes of the packed members still alive (``group_swap=True``): the staging size."""
        alive = (m.ref() for m in self._members.values() if m.packed)
        return sum(st.nbytes() for st in alive if st is not None)

    def tags(self) -> list[str]:
        return [tag for m in self._members.values() for tag in m.tags]

    # ------------------------------------------------------------------ the four steps

    def launch_offload(self, phase: SwapPhase = SwapPhase.ACTIVATIONS) -> None:
        """SWAP_LAUNCH_OFFLOAD: start the D2H of every storage on the copy stream (ordered
        after the compute stream, i.e. after the FWD that produced the bytes)."""
        self._advance("launch_offload", phase)
        for member in self._bound():
            self.manager.copy_d2h(member.sid)
            self.d2h_copies += 1
            self.moved_bytes += member.nbytes
        storages = [m.ref() for m in self._ordered() if m.packed]
        storages = [st for st in storages if st is not None and st.nbytes() > 0]
        if storages:
            self._packed = PackedCopy(
                f"{self.name}[{phase.value}]", storages, self.manager.engine, self.manager.pool,
                self.device, verify=self.manager.verify,
            )
            self._packed.launch_offload()
            self.d2h_copies += self._packed.d2h_copies
            self.moved_bytes += self._packed.nbytes

    def wait_offload(self, phase: SwapPhase = SwapPhase.ACTIVATIONS) -> None:
        """SWAP_WAIT_OFFLOAD: free the device bytes (the allocator keeps them from reuse
        until the D2H is past, see ``TransferEngine``)."""
        self._advance("wait_offload", phase)
        for member in self._bound():
            self.manager.release_device(member.sid)
        if self._packed is not None:
            self._packed.wait_offload()

    def launch_load(self, phase: SwapPhase = SwapPhase.ACTIVATIONS) -> None:
        """SWAP_LAUNCH_LOAD: re-allocate each storage in place and start its H2D."""
        self._advance("launch_load", phase)
        for member in self._bound():
            self.manager.copy_h2d(member.sid)
            self.h2d_copies += 1
        if self._packed is not None:
            self._packed.launch_load()
            self.h2d_copies += self._packed.h2d_copies

    def wait_load(self, phase: SwapPhase = SwapPhase.ACTIVATIONS) -> None:
        """SWAP_WAIT_LOAD: make the compute stream wait for the H2Ds; host copies go back
        to the pool, reused only once the copies that read them completed."""
        self._advance("wait_load", phase)
        if self._packed is not None:
            self._packed.wait_load()  # drops its strong references: the bytes die with autograd's
            self._packed = None
        for member in self._bound():
            self.manager.wait_h2d(member.sid)
            self.manager.release_host(member.sid)
            # Holding the storage longer would keep every activation of the chunk alive
            # until its whole backward finished; autograd frees them one by one instead.
            self.manager.unbind(member.sid, synchronize=False)
            member.bound = False

    def hold_weight_state(self, extra: Iterable[torch.Tensor], protected: Iterable[torch.Tensor]) -> None:
        """Right after the chunk's BWD_INPUT: the group becomes the dW state (``HELD``).

        Its members become the member storages still alive — the saved activations that
        the retained graph keeps for BWD_WEIGHT (the others died with the nodes BWD_INPUT
        freed) — plus the ``extra`` tensors (the gradients at the weight-path
        intermediates). ``protected`` (the input gradient being sent, the output
        gradient, the stage's inputs and output) never join.
        """
        if self.state not in (GroupState.COLLECTING, GroupState.LOADED):
            raise SwapStateError(
                f"{self.name}: hold_weight_state in state {self.state.value}; it runs once, right after "
                "BWD_INPUT, when the chunk's activations are on the device"
            )
        for key, member in list(self._members.items()):
            if member.bound:
                # Drop the binding first, so that a storage only the binding kept alive dies
                # now instead of being carried to BWD_WEIGHT.
                self.manager.unbind(member.sid, synchronize=False)
                member.bound = False
            storage = member.ref()
            if storage is None or storage.nbytes() == 0:
                del self._members[key]
        keep = storage_keys(protected)
        self._protected |= keep
        for key, member in list(self._members.items()):
            if key in keep:
                del self._members[key]
                continue
            storage = member.ref()
            assert storage is not None
            if not member.packed:
                self.manager.bind(member.sid, _storage_view(storage))
                member.bound = True
        self.state = GroupState.HELD
        # A group_swap group moves its dW state packed too: one copy each way per window.
        packed = any(m.packed for m in self._members.values())
        for tensor in extra:
            self._join(tensor, None, packed)

    def close(self) -> None:
        """Drop every binding (after the chunk's last backward leaf, or for an unswapped
        group); the storages then live only as long as autograd keeps them."""
        if self.state in _AWAY:
            raise SwapStateError(
                f"{self.name}: closed in state {self.state.value}; its activations are not back "
                "on the device. Every swapped chunk needs SWAP_LAUNCH_LOAD and SWAP_WAIT_LOAD "
                "before its backward"
            )
        for member in self._ordered():
            if not member.bound:
                continue
            if self.manager.has_host_copy(member.sid):
                self.manager.release_host(member.sid)
            self.manager.unbind(member.sid, synchronize=False)
        self._members.clear()
        self.state = GroupState.CLOSED

    def abort(self) -> None:
        """Exception path: drain this group's copies, page offloaded bytes back, return host
        buffers, forget every binding. Never raises for a storage already unbound."""
        for member in self._ordered():
            if not member.bound or member.sid not in self.manager:
                continue
            buffer = self.manager.buffer(member.sid)
            buffer.synchronize()
            if not buffer.is_resident and buffer.has_host_copy:
                buffer.device_storage()  # synchronous reload: no tensor left without bytes
            buffer.synchronize()
            if buffer.has_host_copy:
                buffer.release_host()
            self.manager.unbind(member.sid)
        if self._packed is not None:
            packed, self._packed = self._packed, None
            packed.abort()  # reloads its members synchronously if they are on the host
        self._members.clear()
        self.state = GroupState.CLOSED

    # ------------------------------------------------------------------ guards

    def check_readable(self, tensor: torch.Tensor, where: str) -> None:
        """Raise :class:`SwapStateError` if ``tensor``'s storage is a member that is not on
        the device for the compute stream right now."""
        if not self.is_member(tensor):
            return
        member = self._members[storage_key(tensor)]
        packed_away = member.packed and self.state in (GroupState.OFFLOADING, GroupState.DW_OFFLOADING)
        if self.state in _READABLE and not packed_away:  # a packed member leaves at its launch
            return
        loading = self.state in (GroupState.LOADING, GroupState.DW_LOADING)
        where_bytes = "still loading" if loading else "on the host"
        raise SwapStateError(
            f"{where}: a saved activation of {self.name} was read while the group is "
            f"{self.state.value} (its bytes are {where_bytes}). "
            "Rule: a swapped chunk is read only after its SWAP_WAIT_LOAD. Fix: run the chunk's "
            "backward after SWAP_WAIT_LOAD (check the order with check_order)"
        )

    def _advance(self, action: str, phase: SwapPhase) -> None:
        need, then = _TRANSITIONS[phase][action]
        if self.state is not need:
            after = "the chunk's FWD" if phase is SwapPhase.ACTIVATIONS else "the chunk's BWD_INPUT (hold_weight_state)"
            raise SwapStateError(
                f"{self.name}: {action} needs state {need.value}, found {self.state.value} ({phase.value} window). "
                f"Rule: LAUNCH_OFFLOAD, WAIT_OFFLOAD, LAUNCH_LOAD, WAIT_LOAD run once each, in "
                f"that order, after {after}"
            )
        self.state = then

    def _ordered(self) -> list[_Member]:
        return sorted(self._members.values(), key=lambda m: m.sid)

    def _bound(self) -> list[_Member]:
        return [m for m in self._ordered() if m.bound]

    def __repr__(self) -> str:
        return f"SwapGroup({self.name}, {self.state.value}, {len(self._members)} storages, {self.nbytes} B)"


def _swappable(tensor: torch.Tensor, device: torch.device) -> bool:
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, torch.nn.Parameter):
        return False
    if tensor.layout is not torch.strided or type(tensor) is not torch.Tensor:
        return False  # subclasses (DTensor, FakeTensor, ...) own their storage elsewhere
    if _normalise(tensor.device) != _normalise(device):
        return False
    storage = tensor.untyped_storage()
    return storage.nbytes() > 0 and storage.resizable()


def _normalise(device: torch.device) -> torch.device:
    return torch.device("cpu") if device.type == "cpu" else device


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the whole storage: what the manager binds (byte copies)."""
    return _storage_view(tensor.untyped_storage())


def _storage_view(storage: torch.UntypedStorage) -> torch.Tensor:
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))
