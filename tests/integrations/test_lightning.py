"""``HyperOffloadCallback`` (issue 51, item 2): Lightning through either door, automatic
and manual optimization, exact against the same Trainer without the library, within its
budget.

Runs ``examples/lightning_train.py``'s comparison on its GPT (2 layers, width 64, dropout
0.1, built from a config): plain Lightning first (compile door: the LightningModule
compiled in place by ``aot_eager`` alone), then with the callback, over 2 or 3 optimizer
steps of 2 accumulated batches (the step plan is in force from the second). Every batch's loss,
the gradients before every optimizer step and the final weights are ``torch.equal``.
"""

from __future__ import annotations

import pytest

from .conftest import load_example

MIB = float(1 << 20)


@pytest.fixture(scope="module")
def example(lightning_imported):
    return load_example("lightning_train")


def _logged(result) -> dict[str, float]:
    return {k: float(v) for k, v in result.trainer.callback_metrics.items() if "offload" in k}


def test_compile_door_automatic_optimization(example) -> None:
    result = example.compare("compile", inner_compiler="aot_eager", budget_fraction=0.5,
                             steps=2)
    assert result.plain.equal(result.offload)
    assert len(result.offload.losses) == 4 and len(result.offload.grads) == 2  # accumulation
    report = result.callback.report
    # Measured after every forward, the first step's (at the floor) included.
    assert result.measured_peak_bytes <= report.budget_bytes < result.plain_peak_bytes
    assert report.fits and report.moved_bytes > 0
    assert _logged(result)["offload_predicted_peak_mb"] == pytest.approx(report.peak_bytes / MIB)


def test_eager_door_automatic_optimization(example) -> None:
    """Each batch, accumulating or stepping, is one session step of the same ops: the
    session settles and replays one plan (issue 51: no manual optimization needed)."""
    result = example.compare("eager", budget_mb=1.0, steps=3)
    assert result.plain.equal(result.offload)
    assert len(result.offload.losses) == 6 and len(result.offload.grads) == 3
    session = result.callback.offload.session
    stats = session.last_stats
    assert stats.phase == "replay" and session.settled and session.steps == 6
    assert stats.peak_resident_bytes <= result.budget_bytes < result.plain_peak_bytes
    assert stats.bytes_d2h > 0 and not session.active
    assert _logged(result)["offload_measured_peak_mb"] == pytest.approx(
        stats.peak_resident_bytes / MIB)


def test_eager_door_manual_optimization(example) -> None:
    result = example.compare("eager", budget_mb=1.0, steps=3, manual=True)
    assert result.plain.equal(result.offload) and len(result.offload.grads) == 3
    session = result.callback.offload.session
    assert session.settled and session.last_stats.phase == "replay"
    assert session.last_stats.peak_resident_bytes <= result.budget_bytes
    assert session.last_stats.bytes_d2h > 0
