"""Device bytes of the eager code between a step's compiled regions, measured on fake tensors.

A model compiled block by block (the FSDP2 layout: ``torch.compile`` per block, the LM head
and the loss eager) runs code no region plans: the embedding, the head, the cross-entropy
and their backwards. At long context that code sets the step's floor (the logits and the
loss backward over a 128K vocabulary). :class:`EagerMeter` measures it in
``hyper_offload.estimate``'s fake step: a ``TorchDispatchMode`` (it lets Dynamo compile
under it: ``ignore_compile_internals``) that sees every op, counts only those run outside
a region (the backend marks a region's forward, the step recorder its backward) on tensors
of the step's own fake mode (Dynamo's compiles use theirs), and follows each new device
storage an op makes until it dies (a weak reference). It writes a log; :func:`between_regions`
reads it back against the step's events as :class:`~.step_model.BetweenRegions`.

What is counted, as a region's trace counts it: every device storage eager code makes,
from the op that makes it to its death (saved for an eager backward or not), and each
op's own operands at that op. Not counted: storages that end the step as a parameter's
``.grad`` (the optimizer's memory; a region's trace counts gradients 0 bytes too), a
storage from the moment it is handed to a region as an input (the region counts it: a
block's input), and what regions make (their own traces count it). The step is planned
when its last region's backward ends: eager code after that (an embedding's backward) is
not in the plan.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hyper_offload.passes.fx.sizes import planning_size

from .step_model import BetweenRegions, StepEvent

__all__ = ["EagerMeter", "between_regions"]

# Log entries (a key is a storage's id, unique in the meter's life): ("op", name,
# ((key, nbytes), ...), own_bytes), ("free", key), ("event", StepEvent), ("done", StepEvent).
_Entry = tuple[Any, ...]


class EagerMeter(TorchDispatchMode):
    """Logs the device storages eager ops make and free (module docstring).

    ``mode``: the step's fake mode (only its tensors count); ``device``: the device
    planned (host tensors never count); ``parameters``: whose ``.grad`` is not counted.
    The log is a list appended to in program order (autograd's device threads run one
    node at a time)."""

    def __init__(self, mode: Any, device: torch.device, parameters: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._mode = mode
        self._device = device
        self._parameters = tuple(parameters)
        self._inside = 0
        self._ids: dict[int, int] = {}
        """Live storages: address -> the id it was logged under (an address is reused
        once its storage dies; an id never is)."""
        self._next_id = 0
        self.log: list[_Entry] = []

    supports_higher_order_operators = True
    """A checkpointed region's graph runs ``run_and_save_rng_state`` (a higher-order op)
    on the step's fake tensors under this mode: without this, torch refuses the op."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Dynamo compiles under this mode (it only reads)

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
            if isinstance(value, torch.Tensor) and _address(value) in self._ids:
                self.log.append(("free", self._ids[_address(value)]))

    def new_step(self) -> None:
        """Forget the log: a step starts (storages alive now are no step's)."""
        self.log = []

    def between(self, events: tuple[StepEvent, ...]) -> BetweenRegions:
        """The eager bytes of the step so far against its ``events``."""
        grads = frozenset(self._ids[_address(p.grad)] for p in self._parameters
                          if p.grad is not None and _address(p.grad) in self._ids)
        return between_regions(self.log, events, grads)

    def event(self, event: StepEvent, *, done: bool = False) -> None:
        """The step recorded ``event`` (a forward after it ran, a backward as it starts;
        ``done``: it finished)."""
        self.log.append(("done" if done else "event", event))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._inside:
            return out
        outputs = [t for t in tree_flatten(out)[0] if self._counts(t)]
        if not outputs:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        read = {_address(t) for t in inputs}
        own = {_address(t): _nbytes(t)
               for t in (*(t for t in inputs if self._counts(t)), *outputs)}
        made = []
        for tensor in outputs:
            address = _address(tensor)
            if address in self._ids or address in read:
                continue  # a view or an in-place result (of any tensor): no new bytes
            storage = tensor.untyped_storage()
            key = self._ids[address] = self._next_id
            self._next_id += 1
            made.append((key, _nbytes(tensor)))
            weakref.finalize(storage, self._freed, address, key)
        if made:
            name = getattr(getattr(func, "overloadpacket", func), "__name__", str(func))
            self.log.append(("op", name, tuple(made),
                             sum(own.values())))
        return out

    def _counts(self, value: Any) -> bool:
        if not isinstance(value, torch.Tensor) or getattr(value, "fake_mode", None) is not self._mode:
            return False
        device = value.device  # "cuda" names the current one: a tensor says "cuda:0"
        return device.type == self._device.type and self._device.index in (None, device.index)

    def _freed(self, address: int, key: int) -> None:
        if self._ids.get(address) == key:
            del self._ids[address]
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
    storage keys not counted (those that ended as a parameter's ``.grad``)."""
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
