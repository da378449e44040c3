"""The eager code between compiled regions counts (issue 44).

With each block compiled on its own (the FSDP2 layout) and the LM head and loss eager,
the estimate counted the eager code as holding nothing: per-block 4 layers x 128K
Llama-3-8B "fit" 57,344 MiB with a floor of 33,552.5 MiB while the step needs
192,384.5 MiB (the cross-entropy's backward over the vocabulary). The fake step now
measures the eager code (:mod:`hyper_offload.compiler.step.meter`), the step plan lays
it out between the regions, and the report names the op that sets the floor. A real step
measures it the same way inside ``backend.measuring()``: the same floor, to the byte."""

from __future__ import annotations

import pytest
import torch

import hyper_offload
from examples.llama_model import Llama, LlamaConfig
from hyper_offload.compiler.step.meter import between_regions
from hyper_offload.passes.plan.step import Invocation, StepEvent, StepEventKind

MIB = 1 << 20
SEQ = 256
# A large vocabulary for the width: the loss sets the floor, as at long context.
_CONFIG = LlamaConfig(vocab=2048, dim=32, layers=2, heads=4, kv_heads=2, hidden=64,
                      max_seq_len=SEQ)


def _llama(per_block: bool, loss_chunks: int = 1) -> Llama:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**{**_CONFIG.__dict__, "loss_chunks": loss_chunks}))
    if per_block:  # torch.compile per block; the embedding, head and loss stay eager
        for index, layer in enumerate(model.layers):
            model.layers[index] = torch.compile(layer)
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, _CONFIG.vocab, (1, SEQ), generator=generator) for _ in "xy")


def _estimate(model: Llama, budget: float = 64.0) -> hyper_offload.EstimateReport:
    return hyper_offload.estimate(model, _inputs(), budget=budget, inner_compiler="aot_eager",
                                  recompute="off")


@pytest.fixture(scope="module")
def floors() -> dict[str, hyper_offload.EstimateReport]:
    return {"whole": _estimate(_llama(False)), "per_block": _estimate(_llama(True))}


def test_the_per_block_floor_is_the_whole_models(floors) -> None:
    whole, per_block = floors["whole"], floors["per_block"]
    # Within 2%: what the eager final norm and head save for their backward (the hidden
    # states, in fp32 and bf16) is moved to the host at the whole model's floor, and held
    # on the device by eager code, which no plan moves. Before: 5x lower (the regions alone).
    assert whole.min_feasible_budget_bytes <= per_block.min_feasible_budget_bytes
    assert per_block.min_feasible_budget_bytes == pytest.approx(
        whole.min_feasible_budget_bytes, rel=0.02)
    regions_alone = per_block.step.regions_floor_bytes
    assert regions_alone * 4 < per_block.min_feasible_budget_bytes


def test_a_budget_between_the_regions_floor_and_the_steps_does_not_fit(floors) -> None:
    per_block = floors["per_block"]
    floor, regions_alone = per_block.min_feasible_budget_bytes, per_block.step.regions_floor_bytes
    between = _estimate(_llama(True), budget=(floor + regions_alone) / 2 / MIB)
    assert not between.fits and between.peak_with_plan == floor
    enough = _estimate(_llama(True), budget=floor / MIB)
    assert enough.fits and enough.peak_with_plan <= floor


def test_the_floor_names_the_loss_backward_and_what_lowers_it(floors) -> None:
    per_block, whole = floors["per_block"], floors["whole"]
    op = per_block.floor_op
    assert op.region is None and "log_softmax_backward" in op.op  # eager code
    # its own operands: the log-probabilities, their gradient and the loss gradient
    assert op.op_bytes == 3 * SEQ * _CONFIG.vocab * 4
    assert whole.floor_op.region == 0 and "bw:" in whole.floor_op.op
    text = per_block.summary()
    assert "loss_chunks" in text and "outside every compiled region" in text
    assert "eager code between compiled regions: counted" in text
    assert per_block.to_dict()["floor_op_bytes"] == op.op_bytes


def test_a_chunked_loss_lowers_the_per_block_floor(floors) -> None:
    chunked = _estimate(_llama(True, loss_chunks=4))
    unchunked = floors["per_block"].min_feasible_budget_bytes
    # One chunk's logits at a time (the checkpoint recomputes them in the backward).
    assert chunked.min_feasible_budget_bytes < unchunked / 2


def test_a_real_step_measures_the_eager_code_inside_measuring(floors) -> None:
    model = _llama(False)
    backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=64,
                                    recompute="off")
    torch._dynamo.reset()
    for index, layer in enumerate(model.layers):
        model.layers[index] = torch.compile(layer, backend=backend)
    model(*_inputs()).backward()  # not measured: what the regions hold
    report = backend.step_report
    assert not report.eager_measured and report.regions_floor_bytes is None
    assert "eager code between compiled regions: not counted" in str(report)
    model.zero_grad(set_to_none=True)
    inputs = _inputs()  # made before the step: the estimate's are given too
    with backend.measuring():
        model(*inputs).backward()
    report = backend.step_report
    assert report.eager_measured and "counted (measured" in str(report)
    # The estimate's fake step measures the same eager code: the same floor, to the byte.
    assert report.floor_peak_bytes == floors["per_block"].min_feasible_budget_bytes
    assert report.floor_op == floors["per_block"].floor_op
    # Later steps of the shape reuse the measured figure.
    model.zero_grad(set_to_none=True)
    model(*_inputs()).backward()
    assert backend.step_report.eager_measured


def _event(kind: StepEventKind, ordinal: int) -> StepEvent:
    return StepEvent(kind, Invocation(0, ordinal))


def test_between_regions_reads_the_log_against_the_steps_events() -> None:
    f0, b0 = _event(StepEventKind.FORWARD, 0), _event(StepEventKind.BACKWARD, 0)
    log = [
        ("op", "embedding", ((1, 10),), 12),     # gap 0: 10 B, handed to the region
        ("free", 1),
        ("event", f0), ("done", f0),
        ("op", "mm", ((2, 100),), 110),          # gap 1: the head's logits
        ("op", "softmax", ((3, 100),), 200),     # 200 B live: the gap's peak
        ("free", 2),
        ("op", "grad", ((4, 50), (5, 7)), 57),   # 5: a parameter's .grad, not counted
        ("free", 3),
        ("event", b0),
        ("free", 4),                             # the tangent, consumed by the backward
        ("done", b0),
        ("op", "late", ((6, 1),), 1),            # gap 2
    ]
    found = between_regions(log, (f0, b0), excluded=frozenset({5}))
    assert found.gap_bytes == (10, 200, 1)
    assert found.gap_ops == ("embedding", "softmax", "late")
    assert found.gap_op_bytes == (12, 200, 1)
    assert found.during_bytes == (0, 0)
    # an event the step dropped (its graph died) belongs to the gap it falls in
    merged = between_regions(log, (b0,), excluded=frozenset({5}))
    assert merged.gap_bytes == (200, 1) and merged.during_bytes == (0,)
