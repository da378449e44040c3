"""``hyper_offload.estimate`` on CUDA (marked ``gpu``; skipped without CUDA): a meta model
traced as CUDA gives the backend's figures for the real model on the GPU."""

from __future__ import annotations

import pytest
import torch

import hyper_offload
from examples.gpt_model import GPT, GPTConfig, random_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


_GPT = GPTConfig(layers=2, dim=256, heads=4, seq_len=256, vocab=512)


def test_meta_model_estimated_as_cuda_equals_the_backend_on_cuda() -> None:
    torch.manual_seed(0)
    model = GPT(_GPT).cuda().to(torch.bfloat16)
    idx, targets = random_batch(_GPT, 4, device="cuda")
    backend = hyper_offload.backend(max_resident_activation_fraction=0.5, budget_scope="region")
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(idx, targets).backward()
    (compiled,) = backend.reports
    with torch.device("meta"):
        meta = GPT(_GPT).to(torch.bfloat16)
    report = hyper_offload.estimate(
        meta, (idx.to("meta"), targets.to("meta")), max_resident_activation_fraction=0.5,
        bandwidth=backend.bandwidth(backend.regions[0].graphs[0]),  # the backend's measurement
        budget_scope="region",
    )
    assert report.device.startswith("cuda")
    for name in ("fw_nodes", "bw_nodes", "saved_activation_bytes", "predicted_peak_before",
                 "predicted_peak_after", "bytes_d2h", "transfers", "exposed_transfer_s"):
        assert getattr(report.region, name) == getattr(compiled, name), name
