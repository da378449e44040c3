"""A fixed subset of the op-database sweep, in ``make test`` (``make sweep`` runs it all).

Each entry is one OpInfo sample chosen for a property a saved-tensor round trip must
keep: complex values and conjugate/negative bits (AOTAutograd saves ``aten._conj`` for a
complex multiply's backward), float views of complex bytes and back, FFTs, zero strides,
overlapping windows, storage offsets, permuted (channels-last) layouts, in-place ops on
activations, multi-output ops, bfloat16, reductions. Each runs through both doors at a
budget of 0 and must be bit for bit the run without hyper_offload, and (where ``moves``
names the door) must have moved bytes to the host: a pass that moved nothing proves
nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from .doors import DOORS, run_case
from .opdb import case_at

pytestmark = pytest.mark.filterwarnings("ignore:OffloadSession warmup")


@dataclass(frozen=True)
class Entry:
    """Sample ``sample`` of OpInfo ``op`` in ``dtype``; ``why`` it is here."""

    op: str
    dtype: str
    sample: int
    why: str
    variant: str = "function"
    moves: tuple[str, ...] = DOORS

    def __str__(self) -> str:
        variant = "" if self.variant == "function" else f"-{self.variant}"
        return f"{self.op}{variant}-{self.dtype}-{self.sample}"


C64, F32, BF16 = "complex64", "float32", "bfloat16"
SUBSET = (
    Entry("mul", C64, 1, "complex multiply: the backward reads conj of the saved operands"),
    Entry("sin", C64, 0, "complex unary: the backward reads conj(cos(x))"),
    Entry("matmul", C64, 2, "complex matmul: saved conj views of both operands"),
    Entry("conj", C64, 0, "the output is a conjugate view, saved by the loss"),
    Entry("resolve_neg", C64, 0, "negative-bit views"),
    Entry("view_as_real", C64, 0, "a float view of complex bytes"),
    Entry("view_as_complex", F32, 0, "a complex view of float bytes"),
    Entry("imag", C64, 0, "a float view at storage offset 1 with stride 2"),
    Entry("fft.rfft", F32, 1, "real-to-complex FFT"),
    Entry("fft.fft2", C64, 0, "2-D complex FFT (an FNet-style mixing layer)"),
    Entry("as_strided", F32, 4, "overlapping as_strided windows"),
    Entry("as_strided.partial_views", F32, 2, "as_strided reaching around a view at an offset",
          moves=("eager",)),
    Entry("expand", F32, 0, "zero strides"),
    Entry("unfold", F32, 2, "overlapping windows"),
    Entry("transpose", C64, 1, "a permuted complex view"),
    Entry("to", F32, 5, "channels_last memory format"),
    Entry("narrow", F32, 2, "a view at a storage offset"),
    Entry("select", C64, 0, "a complex view at a storage offset"),
    Entry("split", F32, 1, "multi-output views of one storage"),
    Entry("topk", F32, 0, "values and integer indices"),
    Entry("add", F32, 1, "in-place add on an activation", "inplace"),
    Entry("mul", C64, 1, "in-place complex multiply on an activation", "inplace"),
    Entry("sigmoid", BF16, 0, "in-place unary on an activation, bfloat16", "inplace"),
    Entry("nn.functional.layer_norm", BF16, 0, "bfloat16 normalization (saved mean/rstd)"),
    Entry("var_mean", F32, 1, "a multi-output reduction"),
    Entry("sort", BF16, 0, "values and integer indices, bfloat16"),
    Entry("amax", BF16, 1, "a bfloat16 reduction that saves its result"),
)


@pytest.fixture(scope="module", autouse=True)
def quiet() -> Iterator[None]:
    """Budget 0 is infeasible at every op by design: keep the backend's log quiet."""
    logger = logging.getLogger("hyper_offload")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("entry", SUBSET, ids=str)
def test_op_sample_is_bit_exact_at_budget_zero(entry: Entry, door: str) -> None:
    case = case_at(entry.op, getattr(torch, entry.dtype), entry.sample, entry.variant)
    result = run_case(case, door)
    where = f"{case.name} through the {door} door ({entry.why})"
    assert result.status == "passed", f"{where}: {result.status} ({result.skip}): {result.detail}"
    if door in entry.moves:
        assert result.moved, f"{where}: nothing moved to the host, so the case proves nothing"
