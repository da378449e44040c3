"""Capture a model's partitioned forward/backward graphs on fake tensors.

:func:`capture_graphs` runs AOTAutograd directly on the module (no Dynamo: no guards,
no graph breaks, one region for the whole model) inside a ``FakeTensorMode``, so no
parameter, input or activation is ever allocated. Parameters may be real tensors or
meta tensors (a model built under ``torch.device("meta")``); either way AOTAutograd
sees fake tensors of the same device, shape and dtype.

The joint graph is partitioned exactly as the ``hyper_offload`` backend's
partitioner sees it for the same inner compiler:

* ``"inductor"``: Inductor's decomposition table, Inductor's joint-graph passes, then
  the stock ``min_cut_rematerialization_partition(compiler="inductor")`` (the backend's
  ``custom_partitioner_fn`` is called by the same ``compile_fx.partition_fn``);
* ``"aot_eager"``: no decompositions, the stock min-cut partition.

Nothing is compiled: the forward/backward "compilers" only keep the graphs. A
``partition`` hook replaces the stock call (``estimate`` runs the backend's recompute
search there, :func:`~.recompute.search.choose_partition`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

from hyper_offload.errors import ConfigurationError

__all__ = [
    "CapturedGraphs", "PartitionHook", "capture_graphs", "compile_graphs_only", "fake_inputs",
    "fake_module",
]

StockPartition = Callable[[fx.GraphModule], tuple[fx.GraphModule, fx.GraphModule]]
PartitionHook = Callable[
    [fx.GraphModule, StockPartition, int], tuple[fx.GraphModule, fx.GraphModule]
]
"""``hook(joint, stock, num_fwd_outputs)`` -> (forward, backward): ``stock(graph)`` is
the stock min-cut partition of a joint graph with this capture's arguments."""


@dataclass(frozen=True)
class CapturedGraphs:
    """The min-cut forward and backward graphs of one model, and how many of the
    forward's outputs are the model's (the rest are saved activations)."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    num_fwd_outputs: int


class _FlatOutputs(nn.Module):
    """The model as AOTAutograd on a module needs it, and as Dynamo hands it over.

    * The output (a loss, logits, a dict ...) is flattened into a tuple of leaves.
    * Each distinct parameter / buffer is one input (a fake twin: the model keeps its
      own tensors), in the model's order: a tied weight (GPT's embedding and head) is
      one primal whose gradient sums both uses, as in Dynamo's graph. The model is not a submodule (its names would list tied
      weights twice); the forward binds every name to its distinct tensor with
      ``torch.func.functional_call``.
    """

    def __init__(self, model: nn.Module, fake: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)
        self._names: dict[str, tuple[str, int]] = {}
        params: list[nn.Parameter] = []
        buffers: list[torch.Tensor] = []
        seen: dict[int, tuple[str, int]] = {}
        named = [("p", n, t) for n, t in model.named_parameters(remove_duplicate=False)]
        named += [("b", n, t) for n, t in model.named_buffers(remove_duplicate=False)]
        for kind, name, tensor in named:
            if id(tensor) not in seen:
                bucket = params if kind == "p" else buffers
                seen[id(tensor)] = (kind, len(bucket))
                bucket.append(fake(tensor))
            self._names[name] = seen[id(tensor)]
        self.params = nn.ParameterList(params)
        for index, buffer in enumerate(buffers):
            self.register_buffer(f"buffer{index}", buffer)
        self.num_static = len(params) + len(buffers)

    def forward(self, *args: Any) -> tuple[Any, ...]:
        bound = {
            name: self.params[i] if kind == "p" else getattr(self, f"buffer{i}")
            for name, (kind, i) in self._names.items()
        }
        output = torch.func.functional_call(self._model, bound, args)
        leaves, _ = tree_flatten(output)
        return tuple(leaves)


def resolve_trace_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    """The device the step is traced on: ``device``, else the parameters' device, and
    for a model on the meta device the current accelerator (CPU when there is none).

    Raises ``ConfigurationError`` for the meta device (kernels there are not the ones a real
    step runs) and for an accelerator this torch build cannot use (a fake CUDA tensor
    on a CPU-only build aborts the process inside torch).
    """
    if device is None:
        first = next(iter((*model.parameters(), *model.buffers())), None)
        device = first.device if first is not None else torch.device("cpu")
        if device.type == "meta":
            accelerator = torch.accelerator.current_accelerator(check_available=True)
            device = accelerator if accelerator is not None else torch.device("cpu")
    device = torch.device(device)
    if device.type == "meta":
        raise ConfigurationError(
            "hyper_offload.estimate: cannot trace on the meta device (its kernels are not "
            "the ones a training step runs). Fix: pass device='cuda' (or 'cpu') to trace the "
            "meta model as that device"
        )
    if device.type != "cpu":
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        if accelerator is None or accelerator.type != device.type:
            raise ConfigurationError(
                f"hyper_offload.estimate: cannot trace on {device}: this torch build or "
                f"machine has no {device.type} device, and fake {device.type} tensors need "
                "one. Fix: trace on device='cpu' (the step's shapes and saved tensors are "
                "the same for most models; pass throughput= to price ops as an accelerator)"
            )
    return device


def _fake(mode: Any, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake twin of ``tensor`` on ``device``: same shape, strides, dtype; no bytes
    (strides matter: a non-contiguous input changes which copies the graph makes)."""
    if tensor.device == device:
        fake = mode.from_tensor(tensor.detach(), static_shapes=True)
    else:
        meta = tensor.detach()
        if meta.device.type != "meta":
            meta = torch.empty_strided(
                tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta"
            )
        fake = mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(fake, requires_grad=tensor.requires_grad)
    return fake.requires_grad_(tensor.requires_grad) if tensor.is_leaf else fake


def capture_graphs(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    device: torch.device,
    inner_compiler: str = "inductor",
    partition: PartitionHook | None = None,
) -> CapturedGraphs:
    """Trace forward + backward of ``model(*example_inputs)`` on fake tensors on
    ``device`` and partition it (see the module docstring; ``partition`` replaces the
    stock partition). The model is not modified. Raises ``ConfigurationError`` when nothing in
    the step requires grad (no backward)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    captured: dict[str, Any] = {}
    mode = estimate_fake_mode()
    wrapper = _FlatOutputs(model, lambda t: _fake(mode, t, device))
    inputs = fake_inputs(mode, example_inputs, device)
    # Parameters and buffers come first among the joint graph's primals. Under Dynamo
    # the backend's partitioner learns they are static-lifetime inputs (so min-cut
    # saves the parameter, not a transpose of it); tell it the same here.
    partition_fn, decompositions, context = _partitioner(
        inner_compiler, captured, wrapper.num_static, partition
    )

    def keep(gm: fx.GraphModule, _inputs: Sequence[Any]) -> Callable[..., Any]:
        return gm

    with context(mode), mode, torch.enable_grad():
        aot_module_simplified(
            wrapper, inputs, fw_compiler=keep, bw_compiler=keep, inference_compiler=keep,
            partition_fn=partition_fn, decompositions=decompositions,
            keep_inference_input_mutations=True,
        )
    if "fw" not in captured:
        raise ConfigurationError(
            f"hyper_offload.estimate: {type(model).__name__}'s step has no backward (no "
            "parameter or input requires grad), so there are no saved activations to plan. "
            "Fix: estimate a training step (parameters with requires_grad=True)"
        )
    return CapturedGraphs(captured["fw"], captured["bw"], captured["num_fwd_outputs"])


def _partitioner(
    inner_compiler: str, captured: dict[str, Any], num_static: int, hook: PartitionHook | None
) -> tuple[Callable[..., Any], Any, Callable[[Any], Any]]:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def min_cut(gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        if inner_compiler == "inductor":
            kwargs.setdefault("compiler", "inductor")
        given = kwargs.get("static_lifetime_input_indices") or []
        kwargs["static_lifetime_input_indices"] = sorted({*given, *range(num_static)})
        def stock(joint: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        fw, bw = stock(gm) if hook is None else hook(gm, stock, kwargs["num_fwd_outputs"])
        captured.update(fw=fw, bw=bw, num_fwd_outputs=kwargs["num_fwd_outputs"])
        return fw, bw

    if inner_compiler != "inductor":
        return min_cut, None, lambda _mode: contextlib.nullcontext()

    from torch._inductor import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    def inductor_partition(gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        return compile_fx.partition_fn(gm, joint_inputs, partitioner_fn_override=min_cut, **kwargs)

    return inductor_partition, select_decomp_table(), _inductor_context


@contextlib.contextmanager
def _inductor_context(mode: Any) -> Any:
    """What Inductor's compile_fx sets around AOTAutograd: its fake mode, and effect
    tokens unlifted (the partition then sees the graphs Inductor's would)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.virtualized import V

    with V.set_fake_mode(mode), functorch_config.patch(unlift_effect_tokens=True):
        yield


def estimate_fake_mode() -> Any:
    """The fake mode an estimate traces in. Its ``ShapeEnv`` lets a data-dependent output
    size (``nonzero``, the rows an MoE expert gets) be an unbacked symbol, as Dynamo's does
    under ``capture_dynamic_output_shape_ops``, so it is planned at the bound torch derives
    (:mod:`hyper_offload.passes.fx.sizes`); inputs, parameters and every other size stay
    static (``_fake`` makes them with ``static_shapes=True``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # No scalar outputs: eager code reading a value (``.item()``) still raises torch's
    # DataDependentOutputException naming the op, rather than branching on a symbol.
    shape_env = ShapeEnv(allow_dynamic_output_shape_ops=True, allow_scalar_outputs=False)
    # Non-fake inputs allowed: torch's fake kernel of run_and_save_rng_state returns the
    # real generator state, which a checkpointed random op (SDPA counts as one) hands to
    # run_with_rng_state in the backward. Every parameter, buffer and input is made fake
    # before the step (fake_module, fake_inputs), so nothing else real reaches an op.
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env)


def fake_module(model: nn.Module, mode: Any, device: torch.device) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake twins on ``device``
    (shapes, strides, dtypes, ``requires_grad`` kept; tied weights stay tied): what a
    step on fake tensors runs. The model itself is not touched, and no bytes are
    allocated, even for a model on the meta device."""
    import copy

    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in memo:
            memo[id(tensor)] = _fake(mode, tensor, device)
    return copy.deepcopy(model, memo)


def fake_inputs(mode: Any, example_inputs: Sequence[Any], device: torch.device) -> list[Any]:
    """Fake twins on ``device`` of the tensors among ``example_inputs`` (others as given)."""
    return [_fake(mode, x, device) if isinstance(x, torch.Tensor) else x for x in example_inputs]


def compile_graphs_only(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    partitioner: Callable[..., Any],
    inner_compiler: str,
    inductor_patches: dict[str, Any],
) -> Callable[..., Any]:
    """A Dynamo region compiled as the backend compiles it, minus code generation.

    AOTAutograd runs with the decompositions and the partition pipeline of
    ``inner_compiler`` (for ``"inductor"``: Inductor's table, its joint-graph passes and
    then ``partitioner`` as its ``custom_partitioner_fn``, under the backend's Inductor
    settings), and the forward and backward graphs are kept as FX graphs: they run as
    written, on fake tensors too. For ``"aot_eager"`` this *is* the backend's compile."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    if inner_compiler != "inductor":
        return aot_autograd(
            fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partitioner,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    from torch._inductor import compile_fx
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    patches = {**inductor_patches, "custom_partitioner_fn": partitioner}
    with (inductor_config.patch(patches),
          _inductor_context(torch._guards.detect_fake_mode(example_inputs))):
        return aot_autograd(
            fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=compile_fx.partition_fn,
            decompositions=select_decomp_table(), keep_inference_input_mutations=True,
        )(gm, example_inputs)
