"""Every ``hyper_offload::`` op, declared: schemas, fake kernels, autograd, effects.

This is the vocabulary of lowered graphs, so it sits in the IR that every layer may
import: the FX passes emit and trace these ops without loading anything that moves
bytes, and :mod:`hyper_offload.runtime.ops` registers their real kernels. Ten ops:

* the four **transfer ops** (``copy_d2h``, ``copy_h2d``, ``wait_transfer``,
  ``release_host``) that the FX lowering emits (below);
* the three **disk tier ops** (``spill_to_disk(Tensor host) -> Tensor``, a one-element
  int64 handle naming the file; ``load_from_disk(Tensor handle, SymInt[] size, SymInt[]
  stride, ScalarType dtype) -> Tensor``, a fresh host copy that the next ``copy_h2d``
  of it waits to be read; ``release_disk(Tensor handle, Tensor? after=None) -> ()``),
  emitted where a schedule spills a host copy (:mod:`hyper_offload.runtime.disk_ops`
  shows the IR), and ``hold(Tensor[] tensors) -> ()``, a no-op at the end of a graph
  whose arguments stay alive until there: a host copy whose pool buffer went back to the
  pool early (spilled, or read back and released) must never become scratch memory of
  the inner compiler, which reuses a buffer once its last reader ran;
* the two **recompute barriers** of the spliced backward
  (:mod:`hyper_offload.compiler.recompute.splice`): ``materialize(Tensor value) ->
  Tensor``, a copy of ``value`` that Inductor runs as an extern kernel (stored rounded
  to its dtype, nothing fuses across it), and ``discard(Tensor value) -> Tensor``, an
  empty tensor that reads ``value`` from memory. Both are plain functional ops with no
  effects; tagged ``pt2_compliant_tag`` like any ``torch.library.custom_op``.

An async transfer is an op plus a wait op. The FX lowering emits, for a saved activation
``act`` that the plan offloads::

    host = hyper_offload.copy_d2h(act, dim_order, slot)      # forward, after act's last write
    host = hyper_offload.wait_transfer(host, keepalive=act)  # act's bytes live until here
    ...
    dev  = hyper_offload.copy_h2d(host, device)              # backward, early enough to hide it
    dev  = hyper_offload.wait_transfer(dev, keepalive=host)  # readers of dev use *this* value
    hyper_offload.release_host(host, after=dev)              # after the last copy_h2d of host

Schemas::

    copy_d2h(Tensor src, int[]? dim_order=None, int slot=-1) -> Tensor
                                                    new host tensor, host_layout(src, dim_order)
    copy_h2d(Tensor host, Device device) -> Tensor  new device tensor, dense_layout(host)
    wait_transfer(Tensor(a) tensor, Tensor? keepalive=None) -> Tensor(a)
    release_host(Tensor host, Tensor? after=None) -> ()

``dense_layout`` keeps the strides of a non-overlapping dense tensor (a transposed
activation comes back transposed, byte for byte) and packs anything else row-major.
``copy_d2h``'s ``dim_order`` (dims from the fastest-varying to the slowest) fixes the host
copy's layout instead: dense in that order, whatever strides the source has at run time.
The FX lowering always passes it, taken from the fake value the backward was planned on,
because an inner compiler may lay out an intermediate differently from its fake value
(Inductor fused a contiguous ``clone`` into a permuted buffer); the copy then gathers, and
the host copy is still exactly what the fake kernel promised. Fake and real kernels share
``host_layout``, so traced and real layouts agree exactly. ``slot`` names the copied
storage in its region's plan (the lowering passes the storage id, -1 for none): a step
plan (:mod:`hyper_offload.passes.plan.step`) may *keep* that slot of one invocation on
the device, and then the real kernel makes a device copy instead of a host one, which
every later op treats as the host copy (``copy_h2d`` hands it back without a transfer);
the values are the same bits either way. No op mutates an input. ``wait_transfer`` returns its input, and says so with the alias
annotation ``(a)``; readers of a transferred tensor consume the wait's *result*, so every
compiler sees a data edge from the wait to them and cannot hoist a read above it.
``keepalive`` is the tensor being copied: as an argument of the wait it stays alive (and
its buffer unreused) in the graph until the copy is known complete. ``after`` orders
``release_host`` after the wait of the last prefetch.

Dead-code elimination and ordering: all four ops are registered as ordered effects
(``torch.library._register_effectful_op``), so ``Graph.eliminate_dead_code`` never
removes them and AOTAutograd threads the non-aliasing three with effect tokens (whose
order Inductor keeps); on a torch without that API they fall back to
``torch.fx.has_side_effect``. Ops inserted into graphs after partitioning carry no
tokens: there the data edges (the wait's result, ``keepalive``, ``after``) order them.

Tracing: fake kernels make the ops traceable under FakeTensor, ``make_fx`` and
AOTAutograd. Functionalization refuses custom ops whose outputs alias inputs, so
``wait_transfer`` has its own Functionalize kernel: it runs the wait on the unwrapped
tensor (recording it in the graph) and returns the functional input, which is exactly
the op's meaning (an identity on values). Autograd treats the copy ops and the wait as
identities; gradients go back with a plain synchronous copy.

Invariant: this module imports torch and the standard library only, never anything of
``hyper_offload``, so the pure passes (:mod:`hyper_offload.passes`) can trace, lower and
check graphs holding these ops without loading the runtime. Everything an op needs to be
*traced* is here; what moves bytes is not. The real kernels of all ten live in
:mod:`hyper_offload.runtime.ops`, which registers them on ``REAL_KERNEL_KEY`` on import
(the compile backend imports it). Until then that key holds placeholder kernels that raise
an error naming the missing import, instead of the dispatcher's bare "could not run
with arguments from the 'CPU' backend"; the runtime drops them
(:func:`drop_placeholder_kernels`) just before registering its own, so no kernel is ever
overridden in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true

from hyper_offload.errors import ConfigurationError, TransferMisuseError

__all__ = [
    "ALL_OPS",
    "COPY_D2H",
    "COPY_H2D",
    "DISCARD",
    "DISK_OPS",
    "HOLD",
    "HOST_LABEL",
    "LOAD_FROM_DISK",
    "MATERIALIZE",
    "NAMESPACE",
    "REAL_KERNEL_KEY",
    "RELEASE_DISK",
    "RELEASE_HOST",
    "SPILL_TO_DISK",
    "TRANSFER_OPS",
    "WAIT_TRANSFER",
    "dense_layout",
    "dim_order_of",
    "host_layout",
]

NAMESPACE = "hyper_offload"

HOST_LABEL = "_hyper_offload_host_label"
"""The attribute that marks an ``UntypedStorage`` as host memory (set to True on the
storage object, whose Python object lives as long as the storage): the runtime labels
its host buffers (``runtime.memory_meter.label_host``) and ``copy_d2h``'s fake kernel its
fake host copies, so that a step run on fake tensors (``hyper_offload.estimate``) tells
host copies from device bytes exactly as a real step does."""

# FRAGMENT, not DEF: other modules of the library may add ops to the same namespace.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
# flexible_layout: Inductor hands every transfer op its tensor arguments as they are,
# never a re-laid-out copy. The wait's ``keepalive`` must be the very buffer the copy
# reads (a stride constraint would copy the source to a temporary that Inductor may reuse
# while the D2H still reads it), and the host copy's layout does not depend on the
# source's: ``copy_d2h`` lays it out by ``dim_order`` (issue 15, docs/architecture.md).
_FLEXIBLE = (torch.Tag.flexible_layout,)
_LIB.define(
    "copy_d2h(Tensor src, int[]? dim_order=None, int slot=-1) -> Tensor", tags=_FLEXIBLE
)
_LIB.define("copy_h2d(Tensor host, Device device) -> Tensor", tags=_FLEXIBLE)
_LIB.define(
    "wait_transfer(Tensor(a) tensor, Tensor? keepalive=None) -> Tensor(a)", tags=_FLEXIBLE
)
_LIB.define("release_host(Tensor host, Tensor? after=None) -> ()", tags=_FLEXIBLE)
# The disk tier (hyper_offload.runtime.disk_ops): a host copy to a file and back.
_LIB.define("spill_to_disk(Tensor host) -> Tensor", tags=_FLEXIBLE)
_LIB.define(
    "load_from_disk(Tensor handle, SymInt[] size, SymInt[] stride, ScalarType dtype) -> Tensor",
    tags=_FLEXIBLE,
)
_LIB.define("release_disk(Tensor handle, Tensor? after=None) -> ()", tags=_FLEXIBLE)
_LIB.define("hold(Tensor[] tensors) -> ()", tags=_FLEXIBLE)
# The recompute barriers: what torch.library.custom_op would define for them.
_LIB.define("materialize(Tensor value) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("discard(Tensor value) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))

COPY_D2H: torch._ops.OpOverload = torch.ops.hyper_offload.copy_d2h.default
COPY_H2D: torch._ops.OpOverload = torch.ops.hyper_offload.copy_h2d.default
WAIT_TRANSFER: torch._ops.OpOverload = torch.ops.hyper_offload.wait_transfer.default
RELEASE_HOST: torch._ops.OpOverload = torch.ops.hyper_offload.release_host.default
TRANSFER_OPS: tuple[torch._ops.OpOverload, ...] = (COPY_D2H, COPY_H2D, WAIT_TRANSFER, RELEASE_HOST)
"""Every transfer op (the lowering's vocabulary)."""
SPILL_TO_DISK: torch._ops.OpOverload = torch.ops.hyper_offload.spill_to_disk.default
LOAD_FROM_DISK: torch._ops.OpOverload = torch.ops.hyper_offload.load_from_disk.default
RELEASE_DISK: torch._ops.OpOverload = torch.ops.hyper_offload.release_disk.default
HOLD: torch._ops.OpOverload = torch.ops.hyper_offload.hold.default
DISK_OPS: tuple[torch._ops.OpOverload, ...] = (SPILL_TO_DISK, LOAD_FROM_DISK, RELEASE_DISK, HOLD)
"""The disk tier's ops (the lowering emits them where a schedule spills)."""
MATERIALIZE: torch._ops.OpOverload = torch.ops.hyper_offload.materialize.default
DISCARD: torch._ops.OpOverload = torch.ops.hyper_offload.discard.default
ALL_OPS: tuple[torch._ops.OpOverload, ...] = (*TRANSFER_OPS, *DISK_OPS, MATERIALIZE, DISCARD)
"""Every op of the namespace: each has a fake kernel here and a real one in the runtime."""

REAL_KERNEL_KEY = "CompositeExplicitAutograd"
"""The dispatch key of the real kernels. One kernel for every device: copy ops mix a host
and a device tensor, and per-device registrations would depend on which dispatch key wins."""


def dense_layout(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides of the dense copy the copy ops make of ``tensor``.

    ``tensor``'s own strides when it is non-overlapping and dense with at least one
    element (so the copy is a plain memcpy and keeps the layout); otherwise row-major
    contiguous strides. Used by the fake and the real kernels alike.
    """
    shape = tuple(tensor.shape)
    # A data-dependent size (an unbacked SymInt) cannot be guarded on: each test assumes
    # the general case when the fake metadata cannot decide it (guard_or_true), which is
    # the answer the real kernel gets for every size but 0 and 1, and those give the
    # same strides for the tensors the compile path copies (contiguous ones).
    if guard_or_true(tensor.numel() > 0):
        # Dense: the dims of size > 1, ordered by stride, tile memory without gaps.
        dims = sorted((d for d in range(tensor.dim()) if guard_or_true(shape[d] != 1)),
                      key=lambda d: _stride_order(tensor.stride(d)))
        expected = 1
        for d in dims:
            if guard_or_true(tensor.stride(d) != expected):
                break
            expected *= shape[d]
        else:
            return shape, tuple(tensor.stride())
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= torch.sym_max(size, 1)
    return shape, tuple(reversed(strides))


def _stride_order(stride: int | torch.SymInt) -> int:
    """A stride as a sort key: its value, a symbolic one's hint (0 without one)."""
    hint = stride.node.hint if isinstance(stride, torch.SymInt) else stride
    return int(hint) if hint is not None else 0


def dim_order_of(tensor: torch.Tensor) -> list[int]:
    """``tensor``'s dims from the fastest-varying (smallest stride) to the slowest.

    Ties (size-1 dims, whose strides mean nothing) put the later dim first, as a
    contiguous tensor has them. Symbolic strides are ordered by their size hints."""

    def key(dim: int) -> tuple[int, int]:
        return (_stride_order(tensor.stride(dim)), -dim)

    return sorted(range(tensor.dim()), key=key)


def host_layout(
    tensor: torch.Tensor, dim_order: list[int] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides of ``copy_d2h``'s host copy of ``tensor``: dense in
    ``dim_order``, or ``dense_layout(tensor)`` without one."""
    if dim_order is None:
        return dense_layout(tensor)
    shape = tuple(tensor.shape)
    if sorted(dim_order) != list(range(len(shape))):
        raise ConfigurationError(
            f"hyper_offload::copy_d2h: dim_order {list(dim_order)} is not a permutation of "
            f"the {len(shape)} dims of a {shape} tensor. Fix: pass dim_order_of(<fake value>)"
        )
    strides = [0] * len(shape)
    step = 1
    for dim in dim_order:
        strides[dim] = step
        step *= torch.sym_max(shape[dim], 1)
    return shape, tuple(strides)


# ---------------------------------------------------------------- placeholder kernels

# A library of its own, so that dropping it removes these kernels and nothing else.
_PLACEHOLDERS: torch.library.Library | None = torch.library.Library(NAMESPACE, "IMPL")


def _placeholder(op: torch._ops.OpOverload) -> Callable[..., NoReturn]:
    name = op.name()

    def kernel(*args: Any) -> NoReturn:
        raise TransferMisuseError(
            f"{name} ran without its real kernel: only the op declarations "
            "(hyper_offload.passes.ir.ops) are loaded, which can trace the op but "
            "not run it. Rule: a graph holding hyper_offload ops runs after "
            "`import hyper_offload.runtime.ops` (the compile backend imports it); its "
            "transfer ops also run inside `with TransferRuntime(pool=...)`. Fix: "
            "`import hyper_offload.runtime.ops` before running the graph"
        )

    return kernel


for _op in ALL_OPS:
    _PLACEHOLDERS.impl(_op.name().split("::")[1], _placeholder(_op), REAL_KERNEL_KEY)


def drop_placeholder_kernels() -> None:
    """Remove the placeholder kernels from ``REAL_KERNEL_KEY`` (idempotent).

    For :mod:`hyper_offload.runtime.ops` only, right before it registers the real kernels:
    registering over an existing kernel would make the dispatcher warn (once per process,
    hiding later overrides elsewhere).
    """
    global _PLACEHOLDERS
    if _PLACEHOLDERS is not None:
        # Library has no public unregister; _destroy is what torch.library's own scoped
        # libraries use to undo exactly the registrations of one Library object.
        _PLACEHOLDERS._destroy()
        _PLACEHOLDERS = None


# ---------------------------------------------------------------- fake kernels


@torch.library.register_fake(f"{NAMESPACE}::copy_d2h", lib=_LIB)
def _copy_d2h_fake(
    src: torch.Tensor, dim_order: list[int] | None = None, slot: int = -1
) -> torch.Tensor:
    shape, stride = host_layout(src, dim_order)
    host = torch.empty_strided(shape, stride, dtype=src.dtype, device="cpu")
    setattr(host.untyped_storage(), HOST_LABEL, True)  # a host copy, as the real kernel's
    return host


@torch.library.register_fake(f"{NAMESPACE}::copy_h2d", lib=_LIB)
def _copy_h2d_fake(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    shape, stride = dense_layout(host)
    return torch.empty_strided(shape, stride, dtype=host.dtype, device=device)


@torch.library.register_fake(f"{NAMESPACE}::wait_transfer", lib=_LIB)
def _wait_transfer_fake(
    tensor: torch.Tensor, keepalive: torch.Tensor | None = None
) -> torch.Tensor:
    return tensor


@torch.library.register_fake(f"{NAMESPACE}::release_host", lib=_LIB)
def _release_host_fake(host: torch.Tensor, after: torch.Tensor | None = None) -> None:
    return None


@torch.library.register_fake(f"{NAMESPACE}::spill_to_disk", lib=_LIB)
def _spill_to_disk_fake(host: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, device="cpu")  # the handle: the file's key


@torch.library.register_fake(f"{NAMESPACE}::load_from_disk", lib=_LIB)
def _load_from_disk_fake(
    handle: torch.Tensor, size: list[int], stride: list[int], dtype: torch.dtype
) -> torch.Tensor:
    host = torch.empty_strided(size, stride, dtype=dtype, device="cpu")
    setattr(host.untyped_storage(), HOST_LABEL, True)  # a host copy, as copy_d2h's
    return host


@torch.library.register_fake(f"{NAMESPACE}::release_disk", lib=_LIB)
def _release_disk_fake(handle: torch.Tensor, after: torch.Tensor | None = None) -> None:
    return None


@torch.library.register_fake(f"{NAMESPACE}::hold", lib=_LIB)
def _hold_fake(tensors: list[torch.Tensor]) -> None:
    return None


@torch.library.register_fake(f"{NAMESPACE}::materialize", lib=_LIB)
def _materialize_fake(value: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)


@torch.library.register_fake(f"{NAMESPACE}::discard", lib=_LIB)
def _discard_fake(value: torch.Tensor) -> torch.Tensor:
    return value.new_empty(0)


# ---------------------------------------------------------------- autograd: identities


def _save_source_device(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.source_device = inputs[0].device


def _copy_d2h_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return grad.to(ctx.source_device), None, None


def _copy_h2d_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad.to(ctx.source_device), None


torch.library.register_autograd(
    f"{NAMESPACE}::copy_d2h", _copy_d2h_backward, setup_context=_save_source_device, lib=_LIB
)
torch.library.register_autograd(
    f"{NAMESPACE}::copy_h2d", _copy_h2d_backward, setup_context=_save_source_device, lib=_LIB
)


class _WaitIdentity(torch.autograd.Function):
    """Autograd of ``wait_transfer``: identity. (``register_autograd`` only accepts ops
    without aliasing outputs, hence an explicit Function on the Autograd key.)"""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, keepalive: torch.Tensor | None) -> torch.Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            return WAIT_TRANSFER(tensor, keepalive)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _wait_transfer_autograd(
    tensor: torch.Tensor, keepalive: torch.Tensor | None = None
) -> torch.Tensor:
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _WaitIdentity.apply(tensor, keepalive)
    # No graph to record: return the input object itself (no extra view in traced graphs).
    with torch._C._AutoDispatchBelowAutograd():
        return WAIT_TRANSFER(tensor, keepalive)


def _wait_transfer_functionalize(
    tensor: torch.Tensor, keepalive: torch.Tensor | None = None
) -> torch.Tensor:
    # Run the wait on the unwrapped value (a tracer below records it, and the value's
    # proxy becomes the wait's output), then hand back the functional input unchanged:
    # for functionalization the wait is an identity, which is what it is.
    torch._sync(tensor)
    inner = torch._from_functional_tensor(tensor)
    inner_keepalive = None
    if keepalive is not None:
        torch._sync(keepalive)
        inner_keepalive = torch._from_functional_tensor(keepalive)
    functionalize = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
    with torch._C._ExcludeDispatchKeyGuard(functionalize):
        WAIT_TRANSFER(inner, inner_keepalive)
    return tensor


_LIB.impl("wait_transfer", _wait_transfer_autograd, "Autograd")
_LIB.impl("wait_transfer", _wait_transfer_functionalize, "Functionalize")


# ---------------------------------------------------------------- effects


def _mark_ordered_side_effects(op: torch._ops.OpOverload) -> None:
    register = getattr(torch.library, "_register_effectful_op", None)
    if register is None:  # older torch: at least keep the op from being eliminated
        torch.fx.node.has_side_effect(op)
        return
    from torch._library.effects import EffectType

    register(op, EffectType.ORDERED, lib=_LIB)


for _op in (*TRANSFER_OPS, *DISK_OPS):
    _mark_ordered_side_effects(_op)
