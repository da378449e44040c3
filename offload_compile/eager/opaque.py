"""Opaque regions: a callable recorded as ONE virtual op (skip_offload, compiled modules).

Opaque regions: a Python callable recorded as ONE virtual op, forward and backward.

Design section 5.2. ``skip_offload``-decorated functions and ``torch.compile``d callables
inside a session run through :func:`run_opaque_region`::

    on_op_begin("opaque:<fn>", region inputs)          virtual op i (pre actions, guards)
    OpaqueRegionStart(marker, *inputs)  -> detached aliases of the inputs
    fn(...)                              inner ops: residency-guarded, not traced
    OpaqueRegionEnd(marker', *outputs)   -> detached aliases of the outputs
    on_op_end(outputs)                   virtual op i ends (outputs bound, post actions)

In backward the two autograd Functions bracket the region's gradient computation, which
becomes one virtual op too: ``OpaqueRegionEnd.backward`` begins it (its accesses are the
output gradients and the region's tracked inputs, which saved tensors inside the region
may read directly), ``OpaqueRegionStart.backward`` ends it (the input gradients are its
outputs). ``marker`` is a 0-d leaf that requires grad, threaded from Start to End, so
that Start's backward always runs after End's, even when no region input requires grad.

Why detached aliases: they share the storage (no copy, no extra bytes) but are not
autograd views, so the model may still modify a region's output in place, as it could
without the session. Outputs that do not require grad are marked non-differentiable.

Inside a region ops still pass :meth:`BaseExecutor.guard` (an offloaded storage read
through a closure is paged back, never read at 0 bytes), except in compiled callables,
which run with every dispatch mode disabled so that their compiled code executes: their
tensor arguments are paged in before the call.

``@hyper_offload.skip_offload``: keep a function out of offloading.

Under ``torch.compile`` the decorated function is a forced graph break
(``torch.compiler.disable``): it runs eagerly between two compiled regions, nothing
inside it is offloaded, and each compiled region is planned under the budget on its
own; ``torch._dynamo.explain`` lists the break. Eagerly, inside an active
``OffloadSession``, it runs as one virtual op (see :mod:`hyper_offload.eager.opaque`);
outside any session it is a plain call.

Run ``torch.compile``d modules inside an ``OffloadSession`` as compiled opaque ops.

While a ``TorchDispatchMode`` is active, Dynamo does not run compiled code: a compiled
module silently runs its original Python (TORCH_NOTES). The session therefore installs
two module-global hooks for the duration of each step; for an ``OptimizedModule``
(the result of ``torch.compile(module)``) they turn the call into one virtual op:

* forward pre-hook: :func:`~hyper_offload.eager.opaque.begin_region` (record the virtual op,
  page its inputs in, alias them through ``OpaqueRegionStart``, switch every dispatch
  mode off so that Dynamo runs the compiled code);
* forward hook (``always_call``): :func:`~hyper_offload.eager.opaque.end_region`.

For every other module both hooks return at once; they are module-level functions
(stable identity), so Dynamo, which traces them when it inlines ``_orig_mod``, compiles
once with and once without them and then never recompiles.

torch calls ``always_call`` hooks for an ``Exception`` only: a ``KeyboardInterrupt``
(any ``BaseException``) raised inside a compiled module skips the forward hook, which
left the dispatch modes switched off and the session unable to leave its mode (found by
the lifecycle state machine). The session closes such regions itself when the step
ends (:func:`close_open_regions`).

Limits: the global pre-hook sees positional arguments only, so a tensor passed to a
compiled module *by keyword* is neither aliased nor paged in; pass tensors positionally
or wrap the call in ``skip_offload``. ``module.compile()`` (in-place compilation) wraps
the hooks themselves, so it cannot be detected here: wrap such modules in
``skip_offload``. torch warns once that global hooks fire an extra time for an
``OptimizedModule``: that extra firing is exactly what these hooks use.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from hyper_offload.errors import ConfigurationTypeError
from hyper_offload.passes.ir.trace import StorageId
from hyper_offload.runtime.physical_buffer import byte_view

from .executor_base import BaseExecutor, active_executor

__all__ = [
    "OpaqueRegionEnd",
    "OpaqueRegionStart",
    "OpenRegion",
    "begin_region",
    "call_opaque",
    "close_open_regions",
    "end_region",
    "install_compiled_module_hooks",
    "is_compiled",
    "opaque_name",
    "run_opaque_region",
    "skip_offload",
]


def opaque_name(fn: Callable[..., Any]) -> str:
    """The virtual op's name: stable across steps (module + qualified name), and across
    a ``copy.deepcopy`` of a compiled module (which drops ``_torchdynamo_orig_callable``:
    its ``_orig_mod`` names it)."""
    inner = getattr(fn, "_orig_mod", None)
    if isinstance(inner, torch.nn.Module):
        return f"opaque:{type(inner).__module__}.{type(inner).__qualname__}"
    inner = getattr(fn, "_torchdynamo_orig_callable", fn)
    if isinstance(inner, torch.nn.Module):
        return f"opaque:{type(inner).__module__}.{type(inner).__qualname__}"
    module = getattr(inner, "__module__", None) or "?"
    qualname = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    return f"opaque:{module}.{qualname}"


class _Region:
    """One call of an opaque region: its executor, name and tracked input storages."""

    __slots__ = ("executor", "name", "input_sids", "input_keys", "held")

    def __init__(self, executor: BaseExecutor, name: str, input_sids: tuple[StorageId, ...]) -> None:
        self.executor = executor
        self.name = name
        self.input_sids = input_sids
        self.input_keys: frozenset[int] = frozenset()
        """``_cdata`` of the forward's input storages (alive while it runs)."""
        self.held: tuple[StorageId, int] | None = None
        """The id and bytes the warmup counts for what the region keeps (.plan_result)."""

    def backward_begin(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        executor = self.executor = self.executor.current()  # a warmup may have taken over
        if executor.closed or executor.opaque_depth or executor.failed:
            return  # backward outside the step (or nested, or unwinding): nothing to record
        if executor.grad_node is not None:
            executor.end_accumulation()
        reads = [g for g in grad_outputs if g is not None]
        with _disable_current_modes():
            for sid in self.input_sids:
                storage = executor.storage_of(sid)
                if storage is not None:
                    reads.append(byte_view(storage, 0))  # names the storage, reads nothing
        executor.on_op_begin(self.name + ".backward", tuple(reads), {})
        executor.opaque_depth += 1
        executor.backward_regions.append(self)

    def backward_end(self, grad_inputs: Sequence[torch.Tensor | None]) -> None:
        executor = self.executor = self.executor.current()
        if executor.closed or not executor.backward_regions or executor.backward_regions[-1] is not self:
            return
        executor.backward_regions.pop()
        executor.opaque_depth -= 1
        executor.on_op_end(tuple(g for g in grad_inputs if g is not None))
        executor.region_backward_end(self)


def _aliases(ctx: Any, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    out = tuple(t.detach() for t in tensors)
    frozen = [o for o, t in zip(out, tensors) if not t.requires_grad]
    if frozen:
        ctx.mark_non_differentiable(*frozen)
    return out


class OpaqueRegionStart(torch.autograd.Function):
    """Entry of a region: aliases its inputs; its backward ends the region's backward."""

    @staticmethod
    def forward(ctx: Any, region: _Region, marker: torch.Tensor, *inputs: torch.Tensor) -> Any:
        ctx.region = region
        return (marker.detach(), *_aliases(ctx, inputs))

    @staticmethod
    def backward(ctx: Any, grad_marker: Any, *grad_inputs: Any) -> Any:
        ctx.region.backward_end(grad_inputs)
        return (None, None, *grad_inputs)


class OpaqueRegionEnd(torch.autograd.Function):
    """Exit of a region: aliases its outputs; its backward begins the region's backward."""

    @staticmethod
    def forward(ctx: Any, region: _Region, marker: torch.Tensor, *outputs: torch.Tensor) -> Any:
        ctx.region = region
        ctx.marker_meta = (marker.shape, marker.dtype, marker.device)
        return _aliases(ctx, outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        ctx.region.backward_begin(grad_outputs)
        shape, dtype, device = ctx.marker_meta
        with _disable_current_modes():
            grad_marker = torch.zeros(shape, dtype=dtype, device=device)
        return (None, grad_marker, *grad_outputs)


def _split(value: Any) -> tuple[list[Any], Any, list[int]]:
    flat, spec = tree_flatten(value)
    return flat, spec, [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]


class OpenRegion:
    """A region between :func:`begin_region` and :func:`end_region` (forward)."""

    __slots__ = ("region", "marker", "modes_off")

    def __init__(self, region: _Region | None, marker: torch.Tensor | None, modes_off: Any) -> None:
        self.region = region
        self.marker = marker
        self.modes_off = modes_off


def begin_region(
    executor: BaseExecutor, name: str, inputs: Sequence[torch.Tensor], *, compiled: bool
) -> tuple[OpenRegion, tuple[torch.Tensor, ...]]:
    """Start virtual op ``name`` over ``inputs``; returns the open region and the input
    aliases the region's body must use. Nested inside another region, nothing is
    recorded (only a compiled body still gets the dispatch modes switched off)."""
    if executor.opaque_depth or executor.failed:
        modes_off = _disable_current_modes() if compiled else None
        if modes_off is not None:
            modes_off.__enter__()
        return OpenRegion(None, None, modes_off), tuple(inputs)
    if executor.grad_node is not None:
        executor.end_accumulation()
    executor.on_op_begin(name, tuple(inputs), {})
    executor = executor.current()  # a replay may hand the step to a warmup at this op
    region = _Region(executor, name, executor.storage_ids(inputs))
    region.input_keys = frozenset(
        t.untyped_storage()._cdata for t in inputs if t.layout is torch.strided)
    executor.opaque_depth += 1
    try:
        with _disable_current_modes():
            marker = torch.zeros((), requires_grad=True)
        marker_out, *aliases = OpaqueRegionStart.apply(region, marker, *inputs)
        modes_off = _disable_current_modes() if compiled else None
        if modes_off is not None:
            modes_off.__enter__()
    except BaseException:
        executor.opaque_depth -= 1
        raise
    return OpenRegion(region, marker_out, modes_off), tuple(aliases)


def end_region(open_region: OpenRegion, result: Any, *, failed: bool = False) -> Any:
    """Finish the region begun by :func:`begin_region`; returns ``result`` with its
    tensors replaced by aliases connected to the region's backward. ``failed``: the body
    raised; only restore the modes and the depth (the step is being aborted)."""
    if open_region.modes_off is not None:
        open_region.modes_off.__exit__(None, None, None)
    region = open_region.region
    if region is None:
        return result
    executor = region.executor
    try:
        if failed:
            return result
        out_flat, out_spec, out_where = _split(result)
        start = open_region.marker.grad_fn if open_region.marker is not None else None
        if start is not None:
            executor.region_forward_end(region, [out_flat[i] for i in out_where], start)
        if out_where and torch.is_grad_enabled():
            outs = OpaqueRegionEnd.apply(region, open_region.marker, *(out_flat[i] for i in out_where))
            for index, alias in zip(out_where, outs):
                out_flat[index] = alias
            result = tree_unflatten(out_flat, out_spec)
    finally:
        executor.opaque_depth -= 1
    return executor.on_op_end(result)


def run_opaque_region(
    executor: BaseExecutor,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str,
    *,
    compiled: bool,
) -> Any:
    """Run ``fn(*args, **kwargs)`` as one virtual op of ``executor`` (module docstring)."""
    flat, spec, where = _split((args, kwargs))
    open_region, aliases = begin_region(executor, name, [flat[i] for i in where], compiled=compiled)
    for index, alias in zip(where, aliases):
        flat[index] = alias
    call_args, call_kwargs = tree_unflatten(flat, spec)
    try:
        result = fn(*call_args, **call_kwargs)
    except BaseException:
        end_region(open_region, None, failed=True)
        raise
    return end_region(open_region, result)


def is_compiled(fn: Any) -> bool:
    """Whether ``fn`` is a ``torch.compile``d function or module (whose compiled code a
    dispatch mode would silently bypass)."""
    if isinstance(fn, torch._dynamo.eval_frame.OptimizedModule):
        return True
    if isinstance(fn, torch.nn.Module):
        return getattr(fn, "_compiled_call_impl", None) is not None  # module.compile()
    return hasattr(fn, "_torchdynamo_orig_callable")


def call_opaque(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Eager entry point of ``skip_offload``: a virtual op inside an active session, a
    plain call outside one. A compiled ``fn`` runs its compiled code either way."""
    executor = active_executor()
    if executor is None:
        return fn(*args, **kwargs)
    return run_opaque_region(executor, fn, args, kwargs, opaque_name(fn), compiled=is_compiled(fn))


F = TypeVar("F", bound=Callable[..., Any])


def skip_offload(fn: F) -> F:
    """Run ``fn`` without offloading, as one opaque op (see the module docstring).

    Also the way to keep a ``torch.compile``d function or module compiled inside an
    eager ``OffloadSession``: ``block = skip_offload(torch.compile(block))``.
    """
    if not callable(fn):
        raise ConfigurationTypeError(
            f"skip_offload: expected a function or method to decorate, got "
            f"{type(fn).__name__}; use it as @hyper_offload.skip_offload"
        )

    @functools.wraps(fn)
    def call_as_opaque_region(*args: Any, **kwargs: Any) -> Any:
        return call_opaque(fn, args, kwargs)

    return torch.compiler.disable(call_as_opaque_region, recursive=True)  # type: ignore[return-value]


_OPEN_ATTR = "_hyper_offload_open_regions"


class _NotLoaded:
    """Stands in for ``OptimizedModule`` until Dynamo is imported (nothing is compiled)."""


# ``torch._dynamo`` costs seconds to import; a process that never compiled anything has
# no OptimizedModule, so the class is looked up when a session installs its hooks.
# Bound once, never changed afterwards: the class itself, not configuration.
OptimizedModule: type = _NotLoaded


def _bind_optimized_module() -> bool:
    global OptimizedModule
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return False
    OptimizedModule = eval_frame.OptimizedModule
    return True


def _pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if not isinstance(module, OptimizedModule):
        return None
    executor = active_executor()
    if executor is None:
        return None
    where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    open_region, aliases = begin_region(
        executor, opaque_name(module), [args[i] for i in where], compiled=True
    )
    owner = executor.current()  # the step's executor once the region began
    stack: list[OpenRegion] = owner.__dict__.setdefault(_OPEN_ATTR, [])
    stack.append(open_region)
    new_args = list(args)
    for index, alias in zip(where, aliases):
        new_args[index] = alias
    return tuple(new_args)


def _post_hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    if not isinstance(module, OptimizedModule):
        return None
    executor = active_executor()
    stack = None if executor is None else executor.__dict__.get(_OPEN_ATTR)
    if not stack:
        return None
    open_region = stack.pop()
    # always_call: on an exception torch calls this hook with ``output=None``; restoring
    # the modes and the depth is all that is needed (the step is aborted).
    return end_region(open_region, output, failed=output is None)


def install_compiled_module_hooks() -> tuple[RemovableHandle, ...]:
    """Register the two hooks; the caller removes the handles at the end of the step.
    Without Dynamo loaded there is no compiled module, and no hook is installed."""
    if not _bind_optimized_module():
        return ()
    pre = register_module_forward_pre_hook(_pre_hook)
    post = register_module_forward_hook(_post_hook, always_call=True)
    return pre, post


def close_open_regions(executor: Any) -> None:
    """End the compiled regions of ``executor`` whose forward hook never ran (innermost
    first): restore the dispatch modes and the region depth. Only on the exception path."""
    stack: list[OpenRegion] = executor.__dict__.get(_OPEN_ATTR) or []
    while stack:
        end_region(stack.pop(), None, failed=True)
