"""Run ``torch.compile``d modules inside an ``OffloadSession`` as compiled opaque ops.

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

import sys
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from .active import active_executor
from .opaque import OpenRegion, begin_region, end_region, opaque_name

__all__ = ["close_open_regions", "install_compiled_module_hooks"]

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
