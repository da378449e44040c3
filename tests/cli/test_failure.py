"""The one-line cause the command line prints for a model that fails (issue 51)."""

from __future__ import annotations

import pytest
import torch

from hyper_offload.cli.estimate import describe, root_cause


def _raised(function) -> BaseException:  # noqa: ANN001
    with pytest.raises(Exception) as raised:
        function()
    return raised.value


def test_the_cause_is_followed_but_not_an_incidental_context() -> None:
    def explicit() -> None:
        try:
            raise RuntimeError("inner")
        except RuntimeError as error:
            raise TypeError("outer") from error

    def incidental() -> None:
        try:
            {}["key"]
        except KeyError:
            raise ValueError("bad config")  # noqa: B904 (its own cause, on purpose)

    assert str(root_cause(_raised(explicit))) == "inner"
    error = _raised(incidental)
    assert root_cause(error) is error


def test_dynamo_hides_the_ops_error_and_the_line_names_it() -> None:
    # Dynamo's caches first: a Linear compiled earlier in this process at another size
    # (tests/cli/test_estimate.py's) makes Dynamo trace this call with a symbolic size.
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(64, 8))
    compiled = torch.compile(model, backend="aot_eager")
    error = _raised(lambda: compiled(torch.randn(4, 63)))
    assert "fake tensor call" in str(error)  # what torch says on top
    line = describe(error)
    assert line.startswith("RuntimeError: a and b must have same reduction dim, but got "
                           "[4, 63] X [64, 8]. (at torch/nn/modules/linear.py:"), line
    assert line.endswith(": return F.linear(input, self.weight, self.bias))"), line
    torch._dynamo.reset()
