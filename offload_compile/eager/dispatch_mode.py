"""``ActivationDispatchMode`` and the small, allocation-light helpers of the op hot path.

The mode is deliberately thin: every aten op that runs while an ``OffloadSession`` is
active goes to the current executor's :meth:`~OpDispatcher.dispatch`, which decides what
to record or which residency actions to run around the op. Inside ``__torch_dispatch__``
the mode is already popped from the mode stack, so the executor's ``func(*args)`` runs the
real kernel (and any mode entered *before* the session, such as a ``DeviceMemoryMeter``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map_only

__all__ = [
    "ActivationDispatchMode",
    "OpDispatcher",
    "PARAMETER_MEMORY",
    "device_test",
    "estimate_new_bytes",
    "flat_tensors",
    "owns_storage",
    "result_tensors",
    "tensor_leaves",
    "written_arguments",
]

_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE
_active_mode = torch._C._get_dispatch_mode


class OpDispatcher(Protocol):
    """What the mode forwards ops to (the executors of :mod:`.executor_base`)."""

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func(*args, **kwargs)`` with whatever the step does around it."""
        ...


class ActivationDispatchMode(TorchDispatchMode):
    """Forwards every op to ``executor.dispatch`` (design section 5.1).

    ``on_error(error, where)``: called when an op raised (its kernel, or the executor
    around it), before the error propagates unchanged: whether or not the user catches
    it, the step is then no trace to plan from."""

    def __init__(
        self, executor: OpDispatcher,
        on_error: Callable[[BaseException, str], None] | None = None,
    ) -> None:
        super().__init__()
        self.executor = executor
        self.on_error = on_error

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _active_mode(_FAKE_MODE) is not None:
            # Shape propagation on fake tensors (DTensor's sharding rules run ops, and
            # factories, under a FakeTensorMode): no device memory to track. Run the op
            # on the fake mode below; returning NotImplemented would fail, as FakeTensor
            # defers to an active fake mode.
            return func(*args, **(kwargs or {}))
        if func.namespace == "profiler":
            # record_function's enter and exit (a handle, no tensor) annotate a step and
            # come and go between steps of the same compute: Optimizer.zero_grad and
            # Optimizer.step record one each, so under gradient accumulation only some
            # micro-batches run them (Lightning calls zero_grad between forward and
            # backward); a profiler schedule records its active steps only. No part of
            # the step's trace.
            return func(*args, **(kwargs or {}))
        for tensor_type in types:
            if tensor_type.__torch_dispatch__ is not _PLAIN_DISPATCH:
                # A tensor subclass (DTensor, TwoTensor) unwraps itself first; its
                # inner ops come back here with plain tensors.
                return NotImplemented
        try:
            return self.executor.dispatch(func, args, kwargs or {})
        except BaseException as error:
            if self.on_error is not None:
                self.on_error(error, f"op {func}")
            raise


def owns_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a strided tensor over a storage of its own bytes.

    False for sparse layouts, for wrapper subclasses (DTensor, the functional
    collectives' ``AsyncCollectiveTensor``): a wrapper's
    ``untyped_storage()`` is a placeholder with no data, and its inner tensors reach the
    mode as plain tensors through the subclass's own dispatch, where they are tracked;
    and for an efficient zero tensor (``sgn``'s derivative of a real input, many a
    formula's zero gradient): its storage claims bytes but has no data, and copying it
    to the host read address 0 (a segmentation fault, found by the op database sweep).
    """
    return (tensor.layout is torch.strided and type(tensor).__torch_dispatch__ is _PLAIN_DISPATCH
            and not tensor._is_zerotensor())


def tensor_leaves(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's arguments or result, in pytree leaf order.

    Aten arguments nest at most lists/tuples of tensors (``cat``, ``_foreach_*``) and
    results are a tensor, a tuple or a list, so a short recursion beats ``tree_flatten``
    on the hot path and allocates nothing but the generator.
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list, dict)):
                yield from tensor_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensor_leaves(item)


def flat_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Tensor arguments of an aten op (top level and one list level), as a list: the
    replay hot path's cheaper :func:`tensor_leaves` (aten schemas nest no deeper)."""
    out: list[torch.Tensor] = []
    for value in args:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif type(value) is list or type(value) is tuple:
            out.extend(item for item in value if isinstance(item, torch.Tensor))
    if kwargs:
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif type(value) is list or type(value) is tuple:
                out.extend(item for item in value if isinstance(item, torch.Tensor))
    return out


def result_tensors(result: Any) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """Tensor leaves of an op result (a tensor, or a flat tuple/list of them)."""
    if isinstance(result, torch.Tensor):
        return (result,)
    if type(result) is tuple or type(result) is list:
        if all(isinstance(item, torch.Tensor) for item in result):
            return result
    return list(tensor_leaves(result))


def device_test(device: torch.device) -> Any:
    """A fast ``tensor -> bool`` "is on ``device``" for the hot path (``tensor.device``
    builds a new ``torch.device`` per call)."""
    if device.type == "cpu":
        return lambda t: t.is_cpu
    if device.type == "cuda" and torch.cuda.device_count() == 1:
        return lambda t: t.is_cuda
    return lambda t: t.device == device


def written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of every argument the op's schema marks as mutated
    (``Tensor(a!)``): the op WRITEs their storages. Non-aten callables write nothing."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        (position, argument.name)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


PARAMETER_MEMORY = frozenset({"fsdp"})
"""Namespaces of ops that make or fill parameters' memory (FSDP2's all-gather and
reduce-scatter buffers): what they create or touch is left untracked, in place."""


def argument_tensors(
    args: tuple[Any, ...], kwargs: dict[str, Any], writes: tuple[tuple[int, str], ...] | None
) -> list[tuple[torch.Tensor, bool]]:
    """An op's tensor arguments, each with whether the op writes it: the arguments its
    schema marks written (``writes``), or every one for a ``Work``-returning op
    (``writes is None``: ``recv_`` fills tensors its schema does not mark)."""
    if writes is None:
        return [(t, True) for t in tensor_leaves((args, kwargs))]
    written_pos = {p for p, _ in writes}
    written_names = {n for _, n in writes}
    tensors: list[tuple[torch.Tensor, bool]] = []
    for position, value in enumerate(args):
        tensors.extend((t, position in written_pos) for t in tensor_leaves(value))
    for key, value in kwargs.items():
        tensors.extend((t, key in written_names) for t in tensor_leaves(value))
    return tensors


def estimate_new_bytes(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> int:
    """Bytes of the storages ``func`` will allocate, from a run on meta tensors; 0 when the
    op has no meta kernel (data-dependent shapes, ops with side effects)."""
    def to_meta(t: torch.Tensor) -> torch.Tensor:
        if t.device != device or not owns_storage(t):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    with _disable_current_modes():
        try:
            meta_args, meta_kwargs = tree_map_only(torch.Tensor, to_meta, (args, kwargs))
            if "device" in meta_kwargs:  # factory ops (randn, empty, ...) allocate on meta
                meta_kwargs = {**meta_kwargs, "device": torch.device("meta")}
            meta_inputs = {t.untyped_storage()._cdata for t in tensor_leaves((meta_args, meta_kwargs)) if t.is_meta}
            if not meta_inputs and "device" not in meta_kwargs:
                return 0  # nothing would run on meta: never run the real kernel (RNG, cost)
            result = func(*meta_args, **meta_kwargs)
        except Exception:
            return 0
        seen: set[int] = set()
        total = 0
        for tensor in tensor_leaves(result):
            if not tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in meta_inputs or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total
