"""``PipelineSwapSession``: the run-scoped swap state of one rank's finalized order.

One session serves one schedule (one rank-local order). Each ``step()`` of the schedule
is one *generation*: :meth:`~PipelineSwapSession.begin` starts it,
:meth:`~PipelineSwapSession.end` (normal exit) or :meth:`~PipelineSwapSession.abort`
(exception) finishes it, and after either no group of that generation is left.

* **Eligible chunks** are the ``(stage, micro)`` keys that have a ``SWAP_LAUNCH_OFFLOAD``
  or a ``DW_LAUNCH_OFFLOAD`` in the order. Only their FWD leaves get a group
  (:meth:`~PipelineSwapSession.forward_scope`); every other FWD leaf runs with the no-window
  marker, so wrappers pass its tensors through and no group exists for it.
* **Group names** are ``pp_swap_run{generation}_s{stage}_m{micro}``.
* **Protection.** Before the FWD runs, the stage's parameters (sharded or FSDP-unsharded,
  by storage), buffers and the leaf's inputs (first-stage inputs, receive buffers, a
  same-rank predecessor's output) are protected; right after it, the FWD output and the
  loss root (:meth:`~PipelineSwapSession.protect`). Protected storages are never released.
* **dW state.** For a chunk with DW_* steps, right after its BWD_INPUT the group becomes
  the dW state (:meth:`SwapGroup.hold_weight_state`): the storages the retained graph
  still holds plus the gradients at the weight-path intermediates, never the input
  gradient being sent or the stage's inputs and output. The DW_* steps move it like
  the four activation steps.
* **Lifetime.** A group is closed right after its chunk's last backward leaf (BWD, or
  BWD_WEIGHT under dx/dw split), so its bytes die with autograd's saved tensors.
* **Bytes** move through one :class:`ResidencyManager` (copy engine + host pool) owned by
  the session for all generations; its pool is reused from step to step.
* **verify** (``True`` or ``"first_steps:N"``, :mod:`~hyper_offload.runtime.verify`):
  every storage a swap step moves is checked at its release (write after copy) and
  after its WAIT_LOAD (reload); a mismatch raises ``TransferIntegrityError`` naming the
  swap step.

The current swap group (a ``ContextVar``) and the saved-tensor hooks that use it.

Three situations, told apart by the context variable:

* inside an eligible FWD leaf: the chunk's :class:`SwapGroup` is current; wrapped code
  adds its saved tensors to it (``swap_wrapper``) or registers tensors explicitly
  (``swap_tensor_wrapper``);
* inside a FWD leaf that has no swap window (or a schedule without ``swap=True``):
  :data:`NO_WINDOW` is current; wrappers pass everything through silently;
* anywhere else (no pipeline step running): nothing is current; ``swap_tensor_wrapper``
  warns once per call site, ``swap_wrapper`` simply runs the wrapped code.

Every saved tensor packed while a group is current is packed as a :class:`SavedRef`
holding the tensor and the group; unpacking checks the group's residency first, so a
swapped-out activation read before its ``SWAP_WAIT_LOAD`` raises
:class:`~.swap_group.SwapStateError` instead of reading a 0-byte storage (which crashes
the process, TORCH_NOTES). ``ContextVar`` gives each thread its own value and restores
the outer value when a nested context exits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import count
from typing import Final

import torch

from hyper_offload.errors import ConfigurationError, TransferIntegrityError
from hyper_offload.passes.pipeline.meta_step import (
    BACKWARD_KINDS, MetaStep, SWAP_INDEX_OF, SWAP_PHASE_OF, StepKind, SwapPhase,
)

from ..device import resolve_device
from ..pinned_pool import PinnedMemoryPool
from ..residency import ResidencyManager
from ..transfer import TransferEngine
from ..verify import VerifySteps
from .swap_group import SwapGroup, SwapStateError, group_name, storage_keys

__all__ = [
    "NO_WINDOW",
    "PipelineSwapSession",
    "SavedRef",
    "current_group",
    "group_scope",
    "in_pipeline_forward",
    "saved_tensor_hooks",
    "swap_step_running",
    "swap_step_scope",
]


class _NoWindow:
    """Marker: a pipeline FWD leaf runs, but its chunk is not swapped."""

    def __repr__(self) -> str:
        return "NO_WINDOW"


NO_WINDOW: Final = _NoWindow()
_CURRENT: ContextVar[SwapGroup | _NoWindow | None] = ContextVar("hyper_offload_swap_group", default=None)


_SWAP_STEP: ContextVar[bool] = ContextVar("hyper_offload_swap_step", default=False)


def swap_step_running() -> bool:
    """True inside a ``PipelineSwapSchedule.step()`` that swaps (``swap=True``): its
    swap groups resize the chunks' storages themselves (the eager door refuses to plan
    the same storages)."""
    return _SWAP_STEP.get()


@contextmanager
def swap_step_scope(swapping: bool) -> Iterator[None]:
    """Mark the ``step()`` running in this context as swapping (or not)."""
    token = _SWAP_STEP.set(swapping)
    try:
        yield
    finally:
        _SWAP_STEP.reset(token)


def current_group() -> SwapGroup | None:
    """The swap group of the FWD leaf running in this context, if it is swapped."""
    value = _CURRENT.get()
    return value if isinstance(value, SwapGroup) else None


def in_pipeline_forward() -> bool:
    """True inside any pipeline FWD leaf (swapped or not)."""
    return _CURRENT.get() is not None


@contextmanager
def group_scope(group: SwapGroup | None) -> Iterator[None]:
    """Make ``group`` current (``None``: a FWD leaf without a swap window); nesting restores
    the outer value. Saved tensors packed inside are guarded by :func:`saved_tensor_hooks`."""
    token = _CURRENT.set(NO_WINDOW if group is None else group)
    try:
        if group is None:
            yield
        else:
            with saved_tensor_hooks(collect=False):
                yield
    finally:
        _CURRENT.reset(token)


class SavedRef:
    """What a pack hook returns: the saved tensor and the group that may own its storage."""

    __slots__ = ("tensor", "group")

    def __init__(self, tensor: torch.Tensor, group: SwapGroup) -> None:
        self.tensor = tensor
        self.group = group


def _unpack(saved: object) -> torch.Tensor:
    if isinstance(saved, SavedRef):
        saved.group.check_readable(saved.tensor, "backward (unpacking a saved tensor)")
        return saved.tensor
    assert isinstance(saved, torch.Tensor)
    return saved


def saved_tensor_hooks(
    *, collect: bool, policy_fn: Callable[[torch.Tensor], bool] | None = None, packed: bool = False
) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks for code running in the current group: every saved tensor is guarded on
    unpack; with ``collect`` the ones ``policy_fn`` accepts (all by default) join the group
    (parameters and protected storages never do, see ``SwapGroup.add``), in its packed
    buffer with ``packed`` (``group_swap=True``)."""

    def pack(tensor: torch.Tensor) -> object:
        group = current_group()
        if group is None:
            return tensor
        if collect and (policy_fn is None or policy_fn(tensor)):
            group.add(tensor, packed=packed)
        # Detached: an op's *output* arrives here with its grad_fn, which owns this saved
        # value; keeping the grad_fn would form a reference cycle (node → SavedRef →
        # tensor → node) that only the cyclic GC frees, so a chunk's activations would
        # outlive its backward. Autograd re-attaches the graph edge on unpack.
        return SavedRef(tensor.detach(), group)

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)


ChunkKey = tuple[int, int]
_DEFAULT_HOST_BYTES = 8 << 30


class PipelineSwapSession:
    """Swap groups of one rank's order across ``step()`` calls (see the module docstring)."""

    def __init__(
        self,
        order: Sequence[MetaStep],
        *,
        device: torch.device | str | None = None,
        pool: PinnedMemoryPool | None = None,
        engine: TransferEngine | None = None,
        verify: bool | str = False,
    ) -> None:
        self.device = resolve_device(device)
        self._verify = VerifySteps(verify)
        self.order = list(order)
        self.weight_swapped: frozenset[ChunkKey] = frozenset(
            step.chunk for step in self.order if step.kind is StepKind.DW_LAUNCH_OFFLOAD and step.chunk is not None
        )
        """Chunks whose dW state is swapped across their BWD_INPUT -> BWD_WEIGHT gap."""
        self.eligible: frozenset[ChunkKey] = frozenset(
            leaf.chunk for step in self.order for leaf in step.leaves()
            if leaf.kind is StepKind.SWAP_LAUNCH_OFFLOAD and leaf.chunk is not None
        ) | self.weight_swapped
        """Chunks that get a group: an activation window or a dW window is swapped."""
        self._last_backward = _last_backward_leaves(self.order)
        missing = sorted(self.eligible - set(self._last_backward))
        if missing:
            raise ConfigurationError(
                f"PipelineSwapSession: chunks {missing} have swap steps but no backward leaf in "
                "this order; swap needs a backward consumer (forward-only orders cannot swap)"
            )
        engine = engine if engine is not None else TransferEngine(self.device)
        # The swap door does not plan under a host budget (issue 44 covers the other
        # doors): past its default cap it keeps serving pageable memory, warned once.
        pool = pool if pool is not None else PinnedMemoryPool(_DEFAULT_HOST_BYTES,
                                                              pageable_fallback=True)
        self.manager = ResidencyManager(engine, pool)
        self.generation = 0
        self._groups: dict[ChunkKey, SwapGroup] = {}
        self._active = False
        self._sids = count()
        self._closed_copies = dict.fromkeys(_COPY_COUNTS, 0)  # what this generation's closed groups issued
        self.group_bytes: dict[ChunkKey, int] = {}
        """Bytes collected per chunk in the latest generation (what the cost model sizes)."""
        self.weight_bytes: dict[ChunkKey, int] = {}
        """Bytes of each chunk's dW state in the latest generation (dW-swapped chunks only)."""
        self.packed_bytes: dict[tuple[ChunkKey, SwapPhase], int] = {}
        """``((stage, micro), window) -> bytes`` moved packed (``group_swap=True``)."""

    # ------------------------------------------------------------------ generations

    def begin(self) -> int:
        """Start a new generation (one ``step()``); returns its number."""
        if self._active:
            raise SwapStateError(
                f"PipelineSwapSession: generation {self.generation} is still running; "
                "step() calls must not nest or overlap (finish or abort the previous one)"
            )
        if self._groups:
            raise SwapStateError(f"PipelineSwapSession: groups {self.live_groups()} outlived their step")
        self.generation += 1
        self._active = True
        self.manager.verify = self._verify.next_step
        self.group_bytes = {}
        self.weight_bytes = {}
        self.packed_bytes = {}
        self._closed_copies = dict.fromkeys(_COPY_COUNTS, 0)
        return self.generation

    def end(self) -> None:
        """Normal end of a generation: every group must have been consumed and closed."""
        leftover = [g for g in self._groups.values()]
        self._active = False
        self._verify.step_done(self.manager.verify)
        if leftover:
            for group in leftover:
                group.abort()
            self._groups.clear()
            raise SwapStateError(
                f"PipelineSwapSession: groups {[g.name for g in leftover]} were still open at the "
                "end of the step (their backward never ran); they were restored and dropped"
            )

    def abort(self) -> list[BaseException]:
        """Exception path: restore and drop every group of this generation (best effort).

        Returns the errors met while cleaning up, so the caller can attach them to the
        original exception instead of masking it."""
        errors: list[BaseException] = []
        for group in list(self._groups.values()):
            try:
                group.abort()
            except BaseException as exc:  # keep cleaning the others
                errors.append(exc)
        self._groups.clear()
        try:
            self.manager.sync_all_transfers()
            self.manager.reset()
        except BaseException as exc:
            errors.append(exc)
        self._active = False
        return errors

    # ------------------------------------------------------------------ FWD leaves

    @contextmanager
    def forward_scope(self, leaf: MetaStep, protected: Iterable[torch.Tensor]) -> Iterator[SwapGroup | None]:
        """Run a FWD leaf: its chunk's group is current if the chunk is eligible (the
        ``protected`` tensors never join it), else the no-window marker is."""
        self._require_active("forward_scope")
        key = leaf.chunk
        if leaf.kind is not StepKind.FWD or key is None:
            raise ConfigurationError(f"forward_scope: {leaf!r} is not a FWD leaf")
        if key not in self.eligible:
            with group_scope(None):
                yield None
            return
        if key in self._groups:
            raise SwapStateError(f"{self._groups[key].name}: FWD of this chunk ran twice in one step")
        group = SwapGroup(
            group_name(self.generation, *key), key, self.manager, self._sids,
            device=self.device, protected=storage_keys(protected),
        )
        self._groups[key] = group
        with group_scope(group):
            yield group
        self.group_bytes[key] = group.nbytes
        self.packed_bytes[(key, SwapPhase.ACTIVATIONS)] = group.packed_bytes()

    def protect(self, key: ChunkKey, tensors: Iterable[torch.Tensor]) -> None:
        """Protect the FWD output / loss root of chunk ``key`` (no-op for unswapped chunks)."""
        group = self._groups.get(key)
        if group is not None:
            group.protect(tensors)
            self.group_bytes[key] = group.nbytes
            self.packed_bytes[(key, SwapPhase.ACTIVATIONS)] = group.packed_bytes()

    # ------------------------------------------------------------------ swap steps

    def run_swap_step(self, step: MetaStep) -> None:
        """Execute one of the four swap steps for its chunk."""
        self._require_active(repr(step))
        group = self._groups.get(step.chunk)  # type: ignore[arg-type]
        if group is None:
            raise SwapStateError(
                f"{step!r}: chunk (stage {step.stage}, micro {step.micro}) has no live group in "
                f"generation {self.generation}; its FWD must run before its swap steps"
            )
        if step.kind not in SWAP_PHASE_OF:
            raise ConfigurationError(f"run_swap_step: {step!r} is not a swap step")
        action = _ACTIONS[SWAP_INDEX_OF[step.kind]]
        try:
            getattr(group, action)(SWAP_PHASE_OF[step.kind])
        except TransferIntegrityError as error:
            where = f"pipeline swap, {step.kind.value} of {group.name}"
            raise TransferIntegrityError(f"{where}: {error}", check=error.check,
                                         where=where) from error

    def after_compute(
        self,
        leaf: MetaStep,
        weight_state: Iterable[torch.Tensor] = (),
        protected: Iterable[torch.Tensor] = (),
    ) -> None:
        """After a backward leaf: a BWD_INPUT of a dW-swapped chunk hands the group its dW
        state (``weight_state``: the gradients at the weight-path intermediates;
        ``protected``: what must stay, e.g. the input gradient being sent); the chunk's
        last backward leaf closes the group."""
        key = leaf.chunk
        if key is None:
            return
        if leaf.kind is StepKind.BWD_INPUT and key in self.weight_swapped:
            group = self._groups.get(key)
            if group is None:
                raise SwapStateError(f"{leaf!r}: chunk {key} has dW swap steps but no live group (its FWD never ran)")
            group.hold_weight_state(weight_state, protected)
            self.weight_bytes[key] = group.resident_bytes()
            self.packed_bytes[(key, SwapPhase.WEIGHT_STATE)] = group.packed_bytes()
        if self._last_backward.get(key) != leaf.kind:
            return
        group = self._groups.pop(key, None)
        if group is not None:
            group.close()
            for name, value in _copy_counts(group).items():
                self._closed_copies[name] += value

    # ------------------------------------------------------------------ inspection

    @property
    def verified_steps(self) -> int:
        """Generations whose swap steps were checked (``verify``)."""
        return self._verify.verified

    def copies(self) -> dict[str, int]:
        """Engine copies and bytes the groups of the latest generation issued: ``d2h``,
        ``h2d`` (one per storage, or one per packed group with ``group_swap=True``) and
        ``bytes`` sent to the host."""
        counts = dict(self._closed_copies)
        for group in self._groups.values():
            for name, value in _copy_counts(group).items():
                counts[name] += value
        return counts

    def live_groups(self) -> list[str]:
        return [g.name for g in self._groups.values()]

    def group(self, key: ChunkKey) -> SwapGroup | None:
        return self._groups.get(key)

    def resident_bytes(self) -> int:
        """Device bytes held by the storages of every live group (real storage sizes)."""
        return sum(g.resident_bytes() for g in self._groups.values())

    def _require_active(self, what: str) -> None:
        if not self._active:
            raise SwapStateError(f"{what}: no step is running (call begin() first)")


_ACTIONS = ("launch_offload", "wait_offload", "launch_load", "wait_load")
_COPY_COUNTS = ("d2h", "h2d", "bytes")


def _copy_counts(group: SwapGroup) -> dict[str, int]:
    return {"d2h": group.d2h_copies, "h2d": group.h2d_copies, "bytes": group.moved_bytes}


def _last_backward_leaves(order: Sequence[MetaStep]) -> dict[ChunkKey, StepKind]:
    """chunk -> kind of its last backward leaf (BWD_WEIGHT after BWD_INPUT, else BWD/I)."""
    last: dict[ChunkKey, StepKind] = {}
    for step in order:
        for leaf in step.leaves():
            if leaf.kind in BACKWARD_KINDS and leaf.chunk is not None:
                last[leaf.chunk] = leaf.kind
    return last
