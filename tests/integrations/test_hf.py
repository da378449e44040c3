"""``HyperOffloadTrainer`` (issue 51, item 2): Hugging Face ``Trainer`` through either
door, exact against the same Trainer without the library, within its budget.

Runs ``examples/hf_trainer.py``'s comparison on its GPT-2 (2 layers, width 64, built from
a config): 2 optimizer steps of 2 accumulated micro-batches each, plain Trainer first
(compile door: the model compiled in place by ``aot_eager`` alone), then
``HyperOffloadTrainer``. Every micro-batch's loss, the gradients before the last
optimizer step and the final weights are ``torch.equal``.
"""

from __future__ import annotations

import pytest

from .conftest import load_example

MIB = float(1 << 20)


@pytest.fixture(scope="module")
def example():
    return load_example("hf_trainer")


def test_compile_door_is_exact_within_its_budget(example) -> None:
    result = example.compare("compile", inner_compiler="aot_eager", budget_fraction=0.7)
    assert result.equal and len(result.offload.losses) == 4
    report = result.report
    # Measured: the device bytes the compiled backward held after every forward, the
    # first step (run at the floor) included, within the budget that plain exceeds.
    assert result.measured_peak_bytes <= report.budget_bytes < result.plain_peak_bytes
    assert report.fits and report.moved_bytes > 0  # predicted: the plan in force
    logged = [line for line in result.offload.log_history if "loss" in line]
    assert len(logged) == 2 and logged[-1]["offload_budget_mb"] == report.budget_bytes / MIB
    assert logged[-1]["offload_predicted_peak_mb"] == report.peak_bytes / MIB


def test_eager_door_is_exact_within_its_budget(example) -> None:
    result = example.compare("eager", budget_mb=0.55)
    assert result.equal and len(result.offload.losses) == 4
    stats, budget = result.report, result.budget_bytes
    assert stats.phase == "replay" and stats.settled
    assert stats.peak_resident_bytes <= budget < result.plain_peak_bytes
    assert stats.bytes_d2h > 0
    logged = [line for line in result.offload.log_history if "loss" in line]
    assert logged[-1]["offload_measured_peak_mb"] == stats.peak_resident_bytes / MIB


def test_accelerate_refuses_our_backend_names_and_we_refuse_its_compile(example, tmp_path) -> None:
    """Why the Trainer compiles the model itself: ``TrainingArguments(torch_compile_backend=
    ...)`` goes to accelerate's ``TorchDynamoPlugin``, which accepts only the names of its
    ``DynamoBackend`` enum (a registered name too); and ``torch_compile=True`` beside our
    door would compile the model a second time, with accelerate's backend."""
    import transformers

    from hyper_offload import ConfigurationError, register_backend
    from hyper_offload.integrations import HyperOffloadTrainer

    register_backend("hyper_offload_hf_test", max_resident_activation_mb=1)
    for name in ("hyper_offload", "hyper_offload_hf_test"):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                              report_to=[], torch_compile_backend=name)
        with pytest.raises(ValueError, match="is not a valid DynamoBackend"):
            transformers.Trainer(model=example.gpt2(layers=1), args=args)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                          torch_compile=True)
    with pytest.raises(ConfigurationError, match="torch_compile=True"):
        HyperOffloadTrainer(model=example.gpt2(layers=1), args=args)
