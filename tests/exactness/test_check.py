"""``hyper_offload.check`` (issue 41, item 7): a user runs it on their own model and sees
PASS, or the first mismatch and the saved tensor responsible.

The planted bug is the one complex RoPE met: the reload of ``conj(freqs_cis)`` handed to
the backward without its conjugate bit. It is planted twice: with the lowering's own
check on (the compile fails loudly, and the bisection still names the tensor), and with
that check off too, so that only the numbers show it (what a silent bug looks like).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hyper_offload
from hyper_offload.exactness import Verdict
from hyper_offload.passes.fx import lowering, lowering_check, saved

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fft_mixing_model import fft_mixer_tiny  # noqa: E402
from llama_model import llama_tiny_complex_rope  # noqa: E402

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def _llama_check(**kwargs: object) -> hyper_offload.exactness.CheckReport:
    return hyper_offload.check(llama_tiny_complex_rope(), (TOKENS, TOKENS),
                               loss_fn=lambda loss: loss, **kwargs)


def _drop_conj(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: rebuild saved tensors without their conjugate bit."""

    def without_conj(value: torch.Tensor, base: torch.Tensor) -> tuple[saved.RebuildStep, ...]:
        steps = saved.rebuild_steps(value, base)
        return tuple(s for s in steps if s.target is not torch.ops.aten._conj.default)

    monkeypatch.setattr(lowering, "rebuild_steps", without_conj)


def _is_conj_view(found: hyper_offload.exactness.SavedTensor) -> bool:
    return "conjugate bit" in found.description and "complex64" in found.description


def test_a_planted_conjugate_bit_bug_is_found_and_the_conj_view_named(monkeypatch):
    _drop_conj(monkeypatch)
    monkeypatch.setattr(lowering_check, "check_reloads", lambda bw, fx_trace: None)
    report = _llama_check()
    assert report.verdict is Verdict.FAIL and not report.error
    assert report.mismatch is not None and report.mismatch.step == 1
    assert report.mismatch.max_abs_diff > 0
    assert report.responsible and all(_is_conj_view(t) for t in report.responsible)
    assert report.moved_storages > len(report.responsible)  # narrowed, not everything
    assert "FAIL" in str(report) and "conjugate bit" in str(report)


def test_with_the_lowering_check_on_the_planted_bug_fails_loudly_and_is_named(monkeypatch):
    _drop_conj(monkeypatch)
    report = _llama_check()
    assert report.verdict is Verdict.FAIL
    assert "check_reloads" in report.error and "conj True != False" in report.error
    assert report.responsible and all(_is_conj_view(t) for t in report.responsible)


def _fft_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, 16, 32, generator=generator), torch.randint(0, 8, (2, 16),
                                                                     generator=generator)


@pytest.mark.parametrize("door", ["compile", "eager"])
@pytest.mark.parametrize("name", ["complex_rope_llama", "fft_mixer"])
def test_the_library_is_exact_on_complex_rope_and_fft_mixing_models(name, door):
    """torchtitan's complex RoPE (a saved conj view) and FNet/GFNet mixing (complex
    activations), everything movable moved, two steps with an optimizer step between."""
    if name == "complex_rope_llama":
        report = _llama_check(door=door)
    else:
        report = hyper_offload.check(fft_mixer_tiny(), _fft_inputs(), door=door,
                                     loss_fn=lambda loss: loss)
    assert report.verdict is Verdict.PASS, str(report)
    assert report.moved_storages > 0 and report.moved_bytes > 0
    assert report.runs == 3 and report.mismatch is None and not report.responsible


def test_a_model_with_nothing_to_move_is_not_called_a_pass():
    model = torch.nn.Linear(8, 8)  # saves only its input: no activation
    report = hyper_offload.check(model, (torch.randn(4, 8),))
    assert report.verdict is Verdict.NOTHING_MOVED and report.moved_storages == 0


def test_a_model_that_is_not_deterministic_without_the_library_is_not_judged():
    calls = iter(range(100))

    class Drifting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).tanh() * float(next(calls))  # another value on every call

    report = hyper_offload.check(Drifting(), (torch.randn(4, 8),), door="eager")
    assert report.verdict is Verdict.NOT_DETERMINISTIC and report.runs == 2
    assert report.mismatch is not None and report.mismatch.step == 1


def test_check_leaves_the_model_and_the_callers_settings_alone():
    model = llama_tiny_complex_rope()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    hyper_offload.check(model, (TOKENS, TOKENS), loss_fn=lambda loss: loss, door="eager")
    assert torch.equal(torch.rand(3), expected)  # the caller's RNG stream is untouched
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert not torch.are_deterministic_algorithms_enabled()


def test_bad_arguments_name_the_fix():
    with pytest.raises(hyper_offload.HyperOffloadError, match="door must be one of"):
        hyper_offload.check(torch.nn.Linear(2, 2), (torch.randn(1, 2),), door="pipeline")

    class Classes(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).argmax(-1)  # nothing to differentiate

    with pytest.raises(hyper_offload.HyperOffloadError, match="loss_fn"):
        hyper_offload.check(Classes(2, 2), (torch.randn(1, 2),))


def test_the_command_line_check_passes_on_the_example_models(capsys):
    from hyper_offload.cli import main

    examples = Path(__file__).resolve().parents[2] / "examples"
    code = main(["check", f"{examples / 'fft_mixing_model.py'}:fft_mixer_tiny",
                 "--input-shape", "2,16,32", "--input-shape", "2,16",
                 "--input-dtype", "float32", "--input-dtype", "int64", "--int-high", "8"])
    out = capsys.readouterr().out
    assert code == 0 and "compile door" in out and ": PASS" in out, out
    code = main(["check", f"{examples / 'fft_mixing_model.py'}:fft_mixer_tiny"])
    assert code == 2 and "--input-shape" in capsys.readouterr().err


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 16))


@pytest.mark.parametrize("door", ["compile", "eager"])
def test_check_does_not_warn_about_the_budget_it_chose(door, caplog, recwarn):
    """Issue 51: ``check`` runs the door at budget 0 (everything movable moved), under the
    floor of every model, and then warned at length to raise that budget. The doors still
    warn a user who sets such a budget (the first run below, outside ``check``)."""
    from hyper_offload.exactness.runs import Problem, offload_compile, offload_eager, train

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    door_at_0 = offload_compile("aot_eager", {}) if door == "compile" else offload_eager({})
    with caplog.at_level("WARNING", logger="hyper_offload"):
        train(Problem(_mlp(), (x,), lambda out: out.pow(2).sum(), 1), door_at_0)
    warned = [r for r in caplog.records if "budget" in r.getMessage()] + [
        w for w in recwarn if issubclass(w.category, hyper_offload.OffloadBudgetWarning)]
    assert warned, "the door at budget 0 no longer warns: this test proves nothing"
    caplog.clear()
    recwarn.clear()
    with caplog.at_level("WARNING", logger="hyper_offload"):
        report = hyper_offload.check(_mlp(), (x,), door=door)
    assert report.verdict is Verdict.PASS
    assert [r.getMessage() for r in caplog.records] == []
    assert [str(w.message) for w in recwarn
            if issubclass(w.category, hyper_offload.HyperOffloadWarning)] == []


def test_the_command_line_check_names_a_model_that_fails_on_its_inputs(capsys, tmp_path):
    """Issue 51: one line naming the op's own error (the shape mismatch), not Dynamo's
    "RuntimeError when making fake tensor call"."""
    from hyper_offload.cli import main

    (tmp_path / "models.py").write_text(
        "import torch\n\ndef mlp():\n    return torch.nn.Sequential(torch.nn.Linear(64, 8))\n")
    assert main(["check", f"{tmp_path / 'models.py'}:mlp", "--input-shape", "4,63"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fake tensor call" not in err, err
    assert "on --input-shape 4,63 (float32) without hyper-offload fails: RuntimeError: a and " \
           "b must have same reduction dim, but got [4, 63] X [64, 8]" in err
