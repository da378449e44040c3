"""OpInfo samples of torch's op database as tiny training steps.

For every OpInfo of ``op_db`` that supports autograd, in each of :data:`DTYPES` its CPU
backward supports, :func:`cases_for` yields up to ``max_samples`` of its sample inputs
(evenly spaced over the OpInfo's list, first and last included; generated under a fixed
seed, so a case is the same tensors in every process). :class:`OpModule` makes one
sample a module:

* every tensor of the sample that requires grad becomes an *activation*
  ``scale(x, p) = x * p``: ``p`` is a parameter of ones laid out like ``x``
  (``ones_like``), so the activation has exactly the sample's values (domains such as
  "symmetric positive definite" survive) and its strides (a sample that does not cover
  its storage densely, e.g. a view at an offset, is scaled over its whole storage and
  viewed again with its own sizes, strides and offset), while
  the op's saved tensors are produced inside the step and ``p``'s gradient is
  ``grad * conj(x)``, not a constant. ``scale`` is a custom op
  (``opdb_sweep::scale``), not ``aten.mul``: AOTAutograd's min-cut partitioner
  recomputes allow-listed pointwise ops such as ``mul`` in the backward from the
  inputs, which would leave the compile door nothing to move; an op outside its
  allow-list it never recomputes, so whatever the op under test needs of its input is
  a saved activation;
* the op runs on the activations (the OpInfo's function, or its in-place variant on a
  fresh activation), the sample's ``output_process_fn_grad`` is applied, and every
  floating or complex output with a gradient enters the loss as
  ``sum((real_view(o) * q).float() * w)``: ``real_view`` is ``o`` itself for a real
  output and ``view_as_real`` of the resolved tensor for a complex one (a float view of
  complex bytes), ``q`` a scalar parameter of ones (so autograd saves the output view,
  with its strides, offset and dtype, for ``q``'s gradient: the loss's own multiply
  exercises every view an op returns) and ``w`` a fixed random tensor per output, so
  the gradients differ from element to element;
* tensors that do not require grad (indices, targets, running statistics) are passed
  as they are; :class:`CaseInputs` restores their bytes before every step, so an op
  that writes into one (batch norm's running statistics) sees the same inputs each time.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

__all__ = [
    "DTYPES",
    "CaseInputs",
    "OpModule",
    "SparseSample",
    "SweepCase",
    "autograd_ops",
    "case_at",
    "cases_for",
    "dtype_name",
    "op_dtypes",
    "op_key",
    "spread",
]

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.complex64, torch.bfloat16)
SAMPLE_SEED = 41
"""Seed of the global RNG while an OpInfo generates its samples."""
WEIGHT_SEED = 7
"""Seed of the loss weights."""
VARIANTS = ("function", "inplace")


def op_key(op: Any) -> str:
    """``name`` or ``name.variant_test_name``: unique over ``op_db``."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def autograd_ops(patterns: Sequence[str] = ()) -> tuple[list[Any], int]:
    """The OpInfos of ``op_db`` that support autograd (those whose :func:`op_key` or
    name matches one of the ``fnmatch`` ``patterns``, or all), and the size of ``op_db``."""
    from torch.testing._internal.common_methods_invocations import op_db

    def wanted(op: Any) -> bool:
        return not patterns or any(
            fnmatch.fnmatchcase(op_key(op), p) or fnmatch.fnmatchcase(op.name, p)
            for p in patterns
        )

    return [op for op in op_db if op.supports_autograd and wanted(op)], len(op_db)


def op_dtypes(op: Any, wanted: Sequence[torch.dtype] = DTYPES) -> list[torch.dtype]:
    """Those of ``wanted`` whose forward and backward the OpInfo supports on CPU."""
    forward = op.supported_dtypes("cpu")
    backward = op.supported_backward_dtypes("cpu")
    return [d for d in wanted if d in forward and d in backward]


def spread(count: int, limit: int) -> list[int]:
    """``min(count, limit)`` indices evenly spaced over ``range(count)``, the first and
    the last included (``limit <= 0``: all)."""
    if limit <= 0 or count <= limit:
        return list(range(count))
    if limit == 1:
        return [0]
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)})


@dataclass(frozen=True)
class SweepCase:
    """One sample of one OpInfo in one dtype; ``index`` is its position in the
    OpInfo's sample list, ``variant`` "function" or "inplace"."""

    op: Any
    dtype: torch.dtype
    index: int
    sample: Any
    variant: str = "function"

    @property
    def name(self) -> str:
        return f"{op_key(self.op)}/{self.variant}/{dtype_name(self.dtype)}/{self.index}"


def cases_for(
    op: Any, dtype: torch.dtype, max_samples: int, variant: str = "function"
) -> list[SweepCase]:
    """Up to ``max_samples`` cases of ``op`` in ``dtype`` (module docstring). Raises
    whatever the OpInfo's sample generator raises."""
    if variant not in VARIANTS:
        raise ValueError(f"cases_for: variant {variant!r} is not one of {VARIANTS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SAMPLE_SEED)
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=True))
    return [
        SweepCase(op, dtype, i, samples[i], variant) for i in spread(len(samples), max_samples)
    ]


def case_at(key: str, dtype: torch.dtype, index: int, variant: str = "function") -> SweepCase:
    """The case of sample ``index`` of the OpInfo whose :func:`op_key` is ``key``."""
    ops = [op for op in autograd_ops([key])[0] if op_key(op) == key]
    if len(ops) != 1:
        raise LookupError(f"case_at: {len(ops)} autograd OpInfos of op_db are named {key!r}")
    cases = cases_for(ops[0], dtype, 0, variant)
    if not 0 <= index < len(cases):
        raise IndexError(f"case_at: {key} has {len(cases)} samples in {dtype}, not {index + 1}")
    return cases[index]


class CaseInputs:
    """The sample's tensors, detached, as the module's call arguments; ``restore()``
    writes back the bytes every storage had when the case was built."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = tuple(tensors)
        storages = {id(t.untyped_storage()): t.untyped_storage() for t in self.tensors}
        self._saved = [(s, s.clone()) for s in storages.values()]

    def restore(self) -> None:
        for storage, saved in self._saved:
            storage.copy_(saved)


@torch.library.custom_op("opdb_sweep::scale", mutates_args=())
def scale(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``x * p`` (module docstring: why a custom op)."""
    return x * p


@scale.register_fake
def _scale_fake(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return x * p


def _scale_setup(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _scale_backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
    (x,) = ctx.saved_tensors
    return None, grad * x.conj()  # as aten.mul's derivative for ``other``


scale.register_autograd(_scale_backward, setup_context=_scale_setup)


class SparseSample(Exception):
    """The sample has a sparse (non-strided) tensor among its inputs or outputs: the
    harness makes activations and losses of strided tensors only."""


def _require_strided(tensors: Sequence[torch.Tensor], where: str) -> None:
    layouts = sorted({str(t.layout) for t in tensors if t.layout != torch.strided})
    if layouts:
        raise SparseSample(f"an {where} has layout {', '.join(layouts)}")


def _covers_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is dense, without overlap, and spans its whole storage from offset 0."""
    return (
        t.storage_offset() == 0 and is_non_overlapping_and_dense(t)
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _scale_parameter(t: torch.Tensor, flat: bool) -> nn.Parameter:
    """Ones laid out like ``t``; for a ``flat`` one, ones over ``t``'s whole storage."""
    if not flat:
        return nn.Parameter(torch.ones_like(t))
    return nn.Parameter(torch.ones(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype))


def _activation(t: torch.Tensor, p: torch.Tensor, flat: bool) -> torch.Tensor:
    """``scale(t, p)``; a ``flat`` one scales ``t``'s whole storage and takes ``t``'s view
    of it, so a sample that is a view (a storage offset, gaps, overlap) keeps its layout
    and an ``as_strided`` sample can still reach the bytes around it."""
    if not flat:
        return scale(t, p)
    whole = scale(t.as_strided((p.numel(),), (1,), 0), p)
    return whole.as_strided(t.size(), t.stride(), t.storage_offset())


def _real_view(out: torch.Tensor) -> torch.Tensor:
    """A real tensor holding ``out``'s values (complex: the resolved ``view_as_real``)."""
    if out.is_complex():
        return torch.view_as_real(out.resolve_conj().resolve_neg())
    return out


def _differentiable(out: Any) -> bool:
    return isinstance(out, torch.Tensor) and (out.is_floating_point() or out.is_complex())


class OpModule(nn.Module):
    """One case as a module: ``module(*inputs.tensors)`` returns the loss (module
    docstring). Building it runs the op once without grad, for the loss weights'
    shapes: a sample that raises in plain eager raises here."""

    def __init__(self, case: SweepCase) -> None:
        super().__init__()
        sample = case.sample
        tensors: list[torch.Tensor] = []
        names: list[str] = []
        self._call = _template((sample.input, sample.args, sample.kwargs), tensors, names, "")
        _require_strided(tensors, "input")
        self._grad = [t.requires_grad for t in tensors]
        self.inputs = CaseInputs([t.detach() for t in tensors])
        graded = [t.detach() for t in tensors if t.requires_grad]
        self._flat = [not _covers_storage(t) for t in graded]
        self.scales = nn.ParameterList(_scale_parameter(t, flat) for t, flat in zip(graded, self._flat))
        self._scale_names = tuple(n for n, g in zip(names, self._grad) if g)
        self._fn = case.op.op if case.variant == "function" else case.op.inplace_variant
        if self._fn is None:
            raise ValueError(f"{case.name}: the OpInfo has no in-place variant")
        self._inplace = case.variant == "inplace"
        self._process = sample.output_process_fn_grad
        with torch.no_grad():
            outputs = self._outputs(self.inputs.tensors)
        _require_strided([o for o in outputs if isinstance(o, torch.Tensor)], "output")
        generator = torch.Generator().manual_seed(WEIGHT_SEED)
        self.out_scales = nn.ParameterDict()
        for i, out in enumerate(outputs):
            if _differentiable(out):
                real = _real_view(out)
                self.register_buffer(f"w{i}", torch.randn(real.shape, generator=generator))
                self.out_scales[str(i)] = nn.Parameter(torch.ones((), dtype=real.dtype))

    def graded(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter with the tensor it scales: ``input``, ``args[1]``, ...,
        ``output[0]``, ... (the names failures report)."""
        inputs = list(zip(self._scale_names, self.scales))
        return inputs + [(f"output[{i}]", q) for i, q in self.out_scales.items()]

    def _outputs(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The op's flattened outputs on the activations built from ``tensors``."""
        scales = iter(zip(self.scales, self._flat))
        values = [
            _activation(tensor, *next(scales)) if needs_grad else tensor
            for tensor, needs_grad in zip(tensors, self._grad)
        ]
        first, args, kwargs = _fill(self._call, values)
        if self._inplace and not first.requires_grad:
            first = first.clone()  # never write into the case's inputs
        return _flatten(self._process(self._fn(first, *args, **kwargs)))

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor | None = None
        for i, out in enumerate(self._outputs(tensors)):
            if _differentiable(out) and out.requires_grad:
                weight = getattr(self, f"w{i}")
                scaled = _real_view(out) * self.out_scales[str(i)]  # saves the output
                term = (scaled.to(weight.dtype) * weight).sum()
                loss = term if loss is None else loss + term
        if loss is None:
            return torch.zeros(())  # no output has a gradient: the caller skips the case
        return loss


@dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th tensor goes in a sample's (input, args, kwargs)."""

    index: int


_HEADS = ("input", "args", "kwargs")


def _template(value: Any, tensors: list[torch.Tensor], names: list[str], path: str) -> Any:
    """``value`` with every tensor replaced by a :class:`_Slot` (the tensors and their
    names, e.g. ``args[1]``, ``kwargs['weight']``, appended in order). Plain recursion,
    not ``torch.utils._pytree``: Dynamo traces :func:`_fill` on every compile, and
    through pytree that costs about a second per case."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        names.append(path)
        return _Slot(len(tensors) - 1)
    if isinstance(value, (list, tuple)):
        items = [
            _template(v, tensors, names, _HEADS[i] if path == "" else f"{path}[{i}]")
            for i, v in enumerate(value)
        ]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _template(v, tensors, names, f"{path}[{k!r}]") for k, v in value.items()}
    return value


def _fill(template: Any, values: Sequence[torch.Tensor]) -> Any:
    """The inverse of :func:`_template`, with ``values`` for the tensors."""
    if isinstance(template, _Slot):
        return values[template.index]
    if isinstance(template, list):
        return [_fill(t, values) for t in template]
    if isinstance(template, tuple):
        return tuple(_fill(t, values) for t in template)
    if isinstance(template, dict):
        return {k: _fill(v, values) for k, v in template.items()}
    return template


def _flatten(out: Any) -> list[Any]:
    """An op's outputs as a flat list (tuples, lists and torch.return_types nest)."""
    if isinstance(out, (list, tuple)):
        return [leaf for item in out for leaf in _flatten(item)]
    return [out]


def iter_cases(
    ops: Sequence[Any], dtypes: Sequence[torch.dtype], max_samples: int, variant: str
) -> Iterator[tuple[Any, torch.dtype, list[SweepCase] | Exception]]:
    """``(op, dtype, cases)`` for every op and supported dtype; ``cases`` is the
    exception when the OpInfo cannot make its samples."""
    for op in ops:
        for dtype in op_dtypes(op, dtypes):
            if variant == "inplace" and op.inplace_variant is None:
                continue
            try:
                yield op, dtype, cases_for(op, dtype, max_samples, variant)
            except Exception as error:  # noqa: BLE001 - recorded as a skip with its reason
                yield op, dtype, error
