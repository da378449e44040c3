"""Device bytes of the eager code between a step's compiled regions, measured in the step.

A model compiled block by block (the FSDP2 layout: ``torch.compile`` per block, the LM head
and the loss eager) runs code no region plans: the head, the cross-entropy and their
backwards. At long context that code sets the step's floor (the logits and the loss
backward over a 128K vocabulary). :class:`EagerMeter` measures it while the compile door
learns a step, in ``hyper_offload.estimate``'s fake step as in a real step run inside
``HyperOffloadBackend.measuring()``, with the same code: a ``TorchDispatchMode`` that lets Dynamo compile and run compiled code under it
(``ignore_compile_internals``: nothing recompiles, compiled regions run their own code),
counts only the ops run outside a region (the backend marks a region's forward, the step
recorder its backward) on tensors of the step's device (and, in a fake step, of the step's
own fake mode: Dynamo's compiles use theirs), and follows each new storage an op makes
until it dies (the runtime's
:class:`~hyper_offload.runtime.memory_meter.StorageLedger`). It writes a log;
:func:`between_regions` reads it back against the step's events as :class:`~hyper_offload.passes.plan.step.BetweenRegions`.

What is counted, as a region's trace counts it: every device storage eager code makes,
from the op that makes it to its death, and each op's own operands at that op. Not
counted: what autograd's engine made and the step leaves alive (gradients: the
optimizer's memory; a region's trace counts gradients 0 bytes too), a storage from the
moment it is handed to a region as an input (the region counts it: a block's input), and
what regions make (their traces count it). The step ends with the last region's
backward: eager code after that (an embedding's backward) is not in the plan.

Where it is pushed matters: Dynamo restores the dispatch keys a compiled call was
entered with when it returns (``torch._C._ForceDispatchKeyGuard`` in ``eval_frame``), so
a mode pushed from inside a compiled region stops seeing ops once that call returns. The
meter is therefore pushed by whoever runs the step, outside compiled code:
``hyper_offload.estimate``'s fake step, ``HyperOffloadBackend.measuring()`` around a real
one (and the trainer integrations, which run the step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hyper_offload.passes.fx.sizes import planning_size
from hyper_offload.passes.plan.step.model import BetweenRegions, StepEvent
from hyper_offload.runtime.memory_meter import StorageLedger

__all__ = ["EagerMeter", "between_regions"]

# Log entries (a key is a storage's id, unique in the meter's life): ("op", name,
# ((key, nbytes), ...), own_bytes), ("free", key), ("event", StepEvent), ("done", StepEvent).
_Entry = tuple[Any, ...]


class EagerMeter(TorchDispatchMode):
    """Logs the device storages eager ops make and free (module docstring).

    ``device``: the device planned (host tensors never count); ``fake_mode``: in a fake
    step, the step's fake mode (only its tensors count); None: real tensors. The log is a
    list appended to in program order (autograd's device threads run one node at a time)."""

    def __init__(self, device: torch.device, fake_mode: Any = None) -> None:
        super().__init__()
        self._fake_mode = fake_mode
        self._device = device
        self._inside = 0
        self._ids: StorageLedger[int] = StorageLedger(self._freed)
        """Live storages, each with the id it was logged under (an address is reused
        once its storage dies; an id never is)."""
        self._next_id = 0
        self._in_backward: set[int] = set()
        """Storages made while autograd's engine ran (a backward)."""
        self._counting = False
        self.log: list[_Entry] = []

    def __repr__(self) -> str:
        state = "counting" if self._counting else "idle"
        return f"EagerMeter({self._device}, {state}, {len(self.log)} entries)"

    supports_higher_order_operators = True
    """A checkpointed region's graph runs ``run_and_save_rng_state`` (a higher-order op)
    on the step's fake tensors under this mode: without this, torch refuses the op."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Dynamo compiles, and compiled code runs, under this mode (it only reads)

    # ------------------------------------------------------------------ step boundaries

    def start(self) -> None:
        """Push the meter and count from here (a new log)."""
        self.log, self._in_backward = [], set()
        self._ids.clear()
        self.__enter__()
        self._counting = True

    def stop(self) -> None:
        """Stop counting and pop the meter (its log stays: a step that ends later is
        laid against it)."""
        self._counting = False
        self.__exit__(None, None, None)

    @contextlib.contextmanager
    def region(self, args: Sequence[Any] = ()) -> Iterator[None]:
        """Around a region's forward: its ops are not eager code, and the eager storages
        among its ``args`` are the region's from here (it counts its inputs)."""
        self.hand_over(args)
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def enter(self) -> None:
        self._inside += 1

    def exit(self) -> None:
        self._inside = max(self._inside - 1, 0)

    def hand_over(self, values: Iterable[Any]) -> None:
        for value in values:
            if not isinstance(value, torch.Tensor):
                continue
            key = self._ids.get(value.untyped_storage())
            if key is not None:
                self.log.append(("free", key))

    def between(self, events: tuple[StepEvent, ...]) -> BetweenRegions:
        """The eager bytes of the step so far against its ``events``."""
        return between_regions(self.log, events, self._gradients())

    def event(self, event: StepEvent, *, done: bool = False) -> None:
        """The step recorded ``event`` (a forward after it ran, a backward as it starts;
        ``done``: it finished)."""
        if self._counting:
            self.log.append(("done" if done else "event", event))

    def _gradients(self) -> frozenset[int]:
        """Storages autograd's engine made that are still alive: the step's gradients."""
        alive = set(self._ids.records())
        return frozenset(key for key in self._in_backward if key in alive)

    # ------------------------------------------------------------------ counting

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._inside or not self._counting:
            return out
        outputs = [t for t in tree_flatten(out)[0] if self._counts(t)]
        if not outputs:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        read = {_address(t) for t in inputs}
        own = {_address(t): _nbytes(t)
               for t in (*(t for t in inputs if self._counts(t)), *outputs)}
        made = []
        backward = torch._C._current_graph_task_id() >= 0
        for tensor in outputs:
            storage = tensor.untyped_storage()
            if storage in self._ids or storage._cdata in read:
                continue  # a view or an in-place result (of any tensor): no new bytes
            key = self._next_id
            self._next_id += 1
            self._ids.add(storage, key)
            made.append((key, _nbytes(tensor)))
            if backward:
                self._in_backward.add(key)
        if made:
            name = getattr(getattr(func, "overloadpacket", func), "__name__", str(func))
            self.log.append(("op", name, tuple(made),
                             sum(own.values())))
        return out

    def _counts(self, value: Any) -> bool:
        if not isinstance(value, torch.Tensor) or value.is_sparse:
            return False
        if getattr(value, "fake_mode", None) is not self._fake_mode:
            return False
        device = value.device  # "cuda" names the current one: a tensor says "cuda:0"
        return device.type == self._device.type and self._device.index in (None, device.index)

    def _freed(self, key: int) -> None:
        """A followed storage died (the ledger's callback)."""
        self.log.append(("free", key))


def _nbytes(tensor: torch.Tensor) -> int:
    # A data-dependent size (nonzero's rows in eager code) counts at its bound, as a
    # region's plan counts it.
    return planning_size(tensor.untyped_storage().nbytes(), "an eager tensor between regions")


def _address(tensor: torch.Tensor) -> int:
    # The storage's address: stable while any tensor holds it; reused once it died (the
    # log names storages by ids, never by address).
    return tensor.untyped_storage()._cdata


def between_regions(
    log: Sequence[_Entry], events: Sequence[StepEvent], excluded: frozenset[int] = frozenset()
) -> BetweenRegions:
    """The eager bytes of ``log`` laid against ``events`` (the step's, in order; an event
    of the log that is not among them belongs to the gap it falls in). ``excluded``:
    storage keys not counted (gradients)."""
    wanted = {event: index for index, event in enumerate(events)}
    gaps = [0] * (len(events) + 1)
    ops = [""] * (len(events) + 1)
    op_bytes = [0] * (len(events) + 1)
    during = [0] * len(events)
    live: dict[int, int] = {}
    total, gap = 0, 0
    for entry in log:
        kind = entry[0]
        if kind == "op":
            _, name, made, own = entry
            for key, nbytes in made:
                if key not in excluded and key not in live:
                    live[key] = nbytes
                    total += nbytes
            if total > gaps[gap] or (total == gaps[gap] and not ops[gap]):
                gaps[gap], ops[gap], op_bytes[gap] = total, name, own
        elif kind == "free":
            total -= live.pop(entry[1], 0)
        elif entry[1] in wanted:
            index = wanted[entry[1]]
            if kind == "event":
                gap = index + 1
            else:
                during[index] = total
    return BetweenRegions(tuple(gaps), tuple(ops), tuple(op_bytes), tuple(during))
