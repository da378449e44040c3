"""The sweep harness judges what it claims to: equality with NaN, the first mismatch,
skips with their reasons (a nondeterministic op is never "passed"), a planted difference
between the plain run and the session's is a failure, and the summary's counts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.testing._internal.opinfo.core import SampleInput
from torch.utils._python_dispatch import _get_current_dispatch_mode

from hyper_offload.eager.executor_base import current_session

from .doors import MODE_CAUSE, CaseResult, run_case
from .exact import StepResult, first_mismatch, same
from .opdb import OpModule, SweepCase, spread
from .summary import summarize

pytestmark = pytest.mark.filterwarnings("ignore:OffloadSession warmup")


@dataclass
class FakeOp:
    """The part of an OpInfo the harness reads."""

    name: str
    op: Any
    variant_test_name: str = ""
    inplace_variant: Any = None


def _case(fn: Any, sample: SampleInput | None = None) -> SweepCase:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
    return SweepCase(FakeOp("fake", fn), torch.float32, 0, sample or SampleInput(x))


def test_same_is_bitwise_with_nan_equal_at_the_same_positions() -> None:
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert same(a, a.clone())
    assert not same(a, torch.tensor([1.0, 2.0, float("nan")]))
    assert not same(a, torch.tensor([1.0, float("nan"), 3.0 + 2**-20]))
    assert not same(a, a.double())
    assert same(None, None) and not same(a, None)


def test_first_mismatch_names_the_first_differing_gradient() -> None:
    loss = torch.tensor(1.0)
    ref = StepResult(loss, (("grad[input]", torch.ones(3)), ("grad[args[0]]", torch.ones(2))))
    got = StepResult(loss, (("grad[input]", torch.ones(3)), ("grad[args[0]]", torch.tensor([1.0, 1.5]))))
    mismatch = first_mismatch(ref, got, step=1)
    assert mismatch is not None and mismatch.tensor == "grad[args[0]]"
    assert mismatch.step == 1 and mismatch.max_abs_diff == 0.5
    assert first_mismatch(ref, ref, step=0) is None


def test_spread_keeps_first_and_last() -> None:
    assert spread(10, 4) == [0, 3, 6, 9]
    assert spread(3, 4) == [0, 1, 2] and spread(5, 0) == [0, 1, 2, 3, 4] and spread(7, 1) == [0]


def test_the_module_keeps_a_view_samples_layout_and_values() -> None:
    base = torch.arange(20.0)
    view = base[3:].as_strided((3, 2), (1, 4), 5).requires_grad_()
    seen: list[torch.Tensor] = []
    module = OpModule(_case(lambda x: seen.append(x) or x.exp(), SampleInput(view)))
    module(*module.inputs.tensors)
    assert seen[-1].stride() == (1, 4) and seen[-1].storage_offset() == 5
    assert seen[-1].requires_grad and torch.equal(seen[-1].detach(), view.detach())


def test_a_seeded_random_op_is_judged_and_a_nondeterministic_one_is_skipped() -> None:
    random = run_case(_case(lambda x: x * torch.rand_like(x)), "eager")
    assert random.status == "passed" and random.moved
    counter = itertools.count(1)
    drifting = run_case(_case(lambda x: x * next(counter)), "eager")
    assert drifting.status == "skipped" and drifting.skip == "nondeterministic"


def test_a_sample_that_raises_in_plain_eager_is_skipped_with_its_error() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad sample")

    result = run_case(_case(broken), "eager")
    assert result.status == "skipped" and result.skip == "sample_error"
    assert "ValueError: bad sample" in result.detail


def test_a_sparse_input_is_skipped_as_such_not_as_a_sample_error() -> None:
    sparse = torch.eye(3).to_sparse().requires_grad_()
    result = run_case(_case(lambda x: x.to_dense() * 2, SampleInput(sparse)), "eager")
    assert result.status == "skipped" and result.skip == "sparse"


def test_a_difference_under_the_session_is_a_failure_of_the_library() -> None:
    # A planted bug: the op computes something else while a session is active. The
    # harness must call it a failure, name the tensor, and blame the library.
    def planted(x: torch.Tensor) -> torch.Tensor:
        return x * (3.0 if current_session() is not None else 2.0)

    result = run_case(_case(planted), "eager")
    assert result.status == "failed" and result.mismatch is not None
    assert result.mismatch["tensor"] == "loss" and result.mismatch["step"] == 0
    assert result.cause == ""


def test_a_difference_any_dispatch_mode_makes_is_a_failure_with_that_cause() -> None:
    # torch takes other formulas while any TorchDispatchMode is active (complex cumprod,
    # pinverse): still a failure of the eager door, with the cause the sweep measured.
    def mode_sensitive(x: torch.Tensor) -> torch.Tensor:
        return x * (3.0 if _get_current_dispatch_mode() is not None else 2.0)

    result = run_case(_case(mode_sensitive), "eager")
    assert result.status == "failed" and result.cause == MODE_CAUSE


def test_summary_counts_per_door_and_dtype_and_lists_what_was_not_exercised() -> None:
    results = [
        CaseResult("a", "function", "float32", 0, "eager", moved_bytes=8),
        CaseResult("a", "function", "float32", 1, "eager"),
        CaseResult("b", "function", "complex64", 0, "eager", "skipped", "nondeterministic"),
        CaseResult("c", "function", "bfloat16", 0, "eager", "failed", detail="step 0: loss differs"),
        CaseResult("e", "function", "complex64", 0, "eager", "failed", cause=MODE_CAUSE),
    ]
    summary = summarize(results, op_db_size=9, autograd_ops=["a", "b", "c", "d", "e"],
                        no_dtype=["d"], config={})
    totals = summary["doors"]["eager"]["totals"]
    assert (totals["samples"], totals["passed"], totals["passed_nothing_moved"]) == (5, 2, 1)
    assert totals["skipped_by_reason"] == {"nondeterministic": 1} and totals["failed"] == 2
    assert totals["failed_by_cause"] == {"library": 1, MODE_CAUSE: 1}
    assert totals["ops_exercised"] == 3 and totals["exercised_fraction"] == 0.6
    assert summary["doors"]["eager"]["not_exercised"] == {"b": {"nondeterministic": 1}, "d": {"no_dtype": 1}}
    assert summary["doors"]["eager"]["by_dtype"]["float32"]["ops_moved"] == 1
    assert [(f["op"], f["cause"]) for f in summary["failures"]] == [("c", "library"),
                                                                     ("e", MODE_CAUSE)]
