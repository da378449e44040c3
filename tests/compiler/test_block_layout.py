"""Identical blocks estimated per block (issue 44, item 4): which runs are found, and that
the per-block estimate is exactly the backend's step plan for that layout.

The timing claim (Llama-3-8B x 128K planned in under a minute) is measured by
``benchmarks/estimate_llama.py --model llama3_8b ...``, not here (no timed tests).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch import nn

import hyper_offload
from hyper_offload.compiler.estimate.step_scope import compile_per_block, repeated_blocks
from hyper_offload.compiler.estimate.step_scope import block_run_for

from .step_models import Block, Stack, assert_estimate_is_the_step_plan, batch, train

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

_MIB = float(1 << 20)


def test_a_run_of_identical_blocks_is_found_and_blocks_that_differ_are_not() -> None:
    model = Stack(layers=4)
    run = repeated_blocks(model)
    assert run is not None and run.container is model.layers
    assert run.names == ("0", "1", "2", "3") and run.block_type == "Block"
    # A block of another width, or with a differing plain attribute, is left out (it
    # would be a region of its own kind, with nothing to share); two of them are a second
    # kind. A weight shared between two blocks: one tensor, no run.
    wider = Stack(layers=4)
    wider.layers[2] = Block(d=32)
    assert repeated_blocks(wider).names == ("0", "1", "3")
    flagged = Stack(layers=4)
    flagged.layers[1].norm.eps = flagged.layers[2].norm.eps = 1e-3
    run2 = repeated_blocks(flagged)
    assert run2.names == ("0", "1", "2", "3") and run2.kinds == 2
    assert run2.describe() == "4 identical (in 2 kinds) Block in layers, compiled per block"
    flagged.layers[3].norm.eps = 1e-2
    assert repeated_blocks(flagged).names == ("1", "2")
    tied = Stack(layers=4)
    tied.layers[3].up.weight = tied.layers[0].up.weight
    assert repeated_blocks(tied) is None
    # The longest run wins; a model its owner compiled is estimated as given.
    nested = nn.Sequential(Stack(layers=2), nn.ModuleList(Block() for _ in range(3)))
    assert repeated_blocks(nested).path == "1"
    assert block_run_for(model, "auto") is None  # 4 < 8 blocks: as given
    assert block_run_for(model, "per_block") == run and block_run_for(model, "as_given") is None
    assert block_run_for(Stack(layers=8), "auto") is not None
    compiled = Stack(layers=8)
    compiled.layers[0] = torch.compile(compiled.layers[0], backend="eager")
    assert block_run_for(compiled, "per_block") is None


def test_the_per_block_estimate_is_the_backends_step_plan_for_that_layout() -> None:
    """One block region invoked per layer, the head compiled around it: the estimate with
    ``layout="per_block"`` equals a real step of the model compiled that way."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = Stack(layers=4)
    eager = copy.deepcopy(reference)
    plain = train(eager, torch.compile(eager, backend="aot_eager"), 1)[0]
    budget = int(0.5 * plain.saved_bytes)
    backend = hyper_offload.backend(inner_compiler="aot_eager",
                                    max_resident_activation_mb=budget / _MIB)
    model = copy.deepcopy(reference)
    step = compile_per_block(model, repeated_blocks(model),
                             lambda m: torch.compile(m, backend=backend))
    results = [train(model, step, 1, measure=backend if n == 0 else None)[0] for n in range(3)]
    assert all(torch.equal(r.loss, plain.loss) for r in results)
    report = backend.step_report
    regions = {p.invocation.region for p in report.invocations}
    ordinals = [p.invocation.ordinal for p in report.invocations]
    # The first block (its input is a leaf) and the other three share two graphs.
    assert len(report.invocations) >= 4 and max(ordinals) >= 2 and len(regions) <= 3
    estimate = hyper_offload.estimate(
        reference, (batch(),), layout="per_block", inner_compiler="aot_eager",
        max_resident_activation_mb=budget / _MIB,
        bandwidth=backend.bandwidth(backend.regions[0].graphs[0]),
    )
    assert estimate.layout == "4 identical Block in layers, compiled per block"
    assert "compiled 4 identical Block" in estimate.summary()
    assert_estimate_is_the_step_plan(
        reference, (batch(),), backend, layout="per_block", inner_compiler="aot_eager",
        max_resident_activation_mb=budget / _MIB,
    )


def test_per_block_saves_what_the_whole_graph_saves_and_names_what_differs() -> None:
    """A Llama of 4 identical blocks (tiny widths): estimated per block, one block region
    serves every layer and the step saves exactly the bytes the whole graph saves (the
    same partition per block); what differs is where regions meet (a block's input and
    output are its caller's), which moves the peaks by a few percent here."""
    sys.path.insert(0, str(EXAMPLES))
    from llama_model import Llama, LlamaConfig

    config = LlamaConfig(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, hidden=64,
                         max_seq_len=64)
    torch.manual_seed(0)
    model = Llama(config)
    tokens = torch.randint(0, 64, (2, 32))
    whole, blocks = (
        hyper_offload.estimate(model, (tokens, tokens), max_resident_activation_fraction=0.5,
                               layout=layout)
        for layout in ("as_given", "per_block")
    )
    assert whole.layout == "as given" and len(whole.step.invocations) == 1
    block_regions = [p.invocation for p in blocks.step.invocations if p.invocation.region == 1]
    assert [i.ordinal for i in block_regions] == [0, 1, 2, 3]
    assert (blocks.to_dict()["saved_activation_bytes"]
            == whole.to_dict()["saved_activation_bytes"])
    assert blocks.to_dict()["fw_ops"] < whole.to_dict()["fw_ops"] / 2  # one block captured
    for name in ("peak_without_offload", "min_feasible_budget_bytes"):
        a, b = getattr(whole, name), getattr(blocks, name)
        assert abs(a - b) <= 0.15 * a, f"{name}: whole graph {a}, per block {b}"


def test_an_unknown_layout_is_refused_naming_the_choices() -> None:
    import pytest

    from hyper_offload.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="layout must be one of auto, as_given, per_block"):
        hyper_offload.estimate(Stack(layers=2), (batch(),), layout="blocks")
