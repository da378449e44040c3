"""What the runnable Python snippets of README.md and docs/*.md assume exists: tiny
models, loaders and process groups.

A document marks a ``python`` block runnable with an HTML comment right above it
(rendered nowhere, visible in the source; the convention: :mod:`.doc_blocks`)::

    <!-- runnable setup=classifier
      ".cuda()" => ""
    -->

``setup=NAME`` names a function below: a context manager yielding the names the snippet
uses but does not define (``MyModel``, ``loader``, ...), the smallest that make it run;
each following line is ``OLD => NEW``, two Python string literals: a substitution the
test applies before running the block (a tiny size for a 7B one, ``aot_eager`` where the
default Inductor would spend a minute of C++ compiles, ``cpu`` for ``cuda``). Every
substitution must match, so a snippet edited away from its marker fails the test.
A block that cannot run on CPU says why instead: ``<!-- not runnable: REASON -->``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hyper_offload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class _Classifier(nn.Module):
    """``MyModel``: 16 features -> 4 classes, one hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=generator), torch.randint(4, (8,), generator=generator))
            for _ in range(count)]


@contextlib.contextmanager
def classifier() -> Iterator[dict[str, Any]]:
    """``MyModel``, a two-batch ``loader``, ``loss_fn``, one batch ``x, y``, a ``model``."""
    torch.manual_seed(0)
    batches = _batches(2)
    x, y = batches[0]
    yield {"torch": torch, "hyper_offload": hyper_offload, "MyModel": _Classifier,
           "loader": batches, "loss_fn": nn.functional.cross_entropy, "x": x, "y": y,
           "model": _Classifier(),
           "session": hyper_offload.OffloadSession(
               hyper_offload.OffloadConfig(max_resident_activation_mb=0.001))}


class _Tokens(nn.Module):
    """``compiled(ids, labels)`` -> loss, for any length (no position table to outgrow)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.relu(self.embed(ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@contextlib.contextmanager
def lengths() -> Iterator[dict[str, Any]]:
    """A ``loader`` of token batches whose length changes, ``backend`` and ``compiled``."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    loader = [(torch.randint(64, (2, n), generator=generator),) * 2 for n in (24, 16, 32)]
    backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=0.01)
    yield {"torch": torch, "loader": loader, "backend": backend,
           "compiled": torch.compile(_Tokens(), backend=backend)}


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """A default process group of one gloo rank in this process (no workers)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@contextlib.contextmanager
def pipeline_stage() -> Iterator[dict[str, Any]]:
    """One rank, one stage: ``stage_model`` (with ``.blocks``), its stage, a batch of 16
    rows for 8 micro-batches, ``losses``; the names the verify fragment uses too."""
    from torch.distributed.pipelining import PipelineStage

    from hyper_offload.pipeline import PipelineSwapSchedule

    torch.manual_seed(0)
    with one_rank():
        stage_model = _Blocks()
        stage = PipelineStage(_Blocks(), 0, 1, torch.device("cpu"))
        yield {"torch": torch, "stage_model": stage_model, "stage_index": 0, "num_stages": 1,
               "device": torch.device("cpu"), "loss_fn": nn.functional.mse_loss,
               "x": torch.randn(16, 16), "y": torch.randn(16, 16), "losses": [],
               "model": _Blocks(), "stages": [stage], "n_micro": 8,
               "loss": nn.functional.mse_loss, "OffloadSession": hyper_offload.OffloadSession,
               "OffloadConfig": hyper_offload.OffloadConfig,
               "PipelineSwapSchedule": PipelineSwapSchedule}


@contextlib.contextmanager
def gpt2() -> Iterator[dict[str, Any]]:
    """A 1-layer GPT-2 from a config (no download), its ``config``, a ``dataset`` of 32
    rows, a ``loader`` of steps of two micro-batches, an ``optimizer``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                     n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(64, (32, 16), generator=torch.Generator().manual_seed(0))
    micro = [{"input_ids": ids[i:i + 2], "labels": ids[i:i + 2]} for i in range(0, 8, 2)]
    yield {"torch": torch, "hyper_offload": hyper_offload, "transformers": transformers,
           "config": config, "model": model,
           "dataset": [{"input_ids": row, "labels": row} for row in ids],
           "loader": [micro[:2], micro[2:]],
           "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}


@contextlib.contextmanager
def data_parallel() -> Iterator[dict[str, Any]]:
    """One gloo rank, a ``model``, and the wrappers the data-parallel snippet names."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    with one_rank():
        yield {"torch": torch, "hyper_offload": hyper_offload, "model": _Blocks(),
               "DistributedDataParallel": DistributedDataParallel}


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@contextlib.contextmanager
def tensor_parallel() -> Iterator[dict[str, Any]]:
    """One gloo rank as a 1 x 1 (dp, tp) mesh, a ``model`` with ``.layers`` and its TP
    ``plan`` (column then row parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    with one_rank():
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        plan = {f"layers.{i}.{name}": style() for i in range(2)
                for name, style in (("up", ColwiseParallel), ("down", RowwiseParallel))}
        yield {"torch": torch, "hyper_offload": hyper_offload, "model": _Layers(),
               "tp_mesh": mesh["tp"], "dp_mesh": mesh["dp"], "plan": plan,
               "parallelize_module": parallelize_module, "fully_shard": fully_shard}


@contextlib.contextmanager
def examples_path() -> Iterator[dict[str, Any]]:
    """``examples/`` importable, as README's estimate snippet imports ``llama_model``."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield {}
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.modules.pop("llama_model", None)


@contextlib.contextmanager
def complex_rope_llama() -> Iterator[dict[str, Any]]:
    """A tiny Llama with torchtitan's complex RoPE as ``model``, and ``tokens, targets``."""
    with examples_path():
        from llama_model import llama_tiny_complex_rope

        generator = torch.Generator().manual_seed(0)
        tokens, targets = (torch.randint(0, 64, (2, 16), generator=generator) for _ in range(2))
        yield {"hyper_offload": hyper_offload, "model": llama_tiny_complex_rope(),
               "tokens": tokens, "targets": targets}


@contextlib.contextmanager
def planned_trace() -> Iterator[dict[str, Any]]:
    """A ``trace`` and its ``schedule`` (the planning core snippet's), and a ``config``."""
    from hyper_offload.passes import ActivationTrace, GreedyResidencyPlanner

    trace = ActivationTrace.from_accesses([{0: "W"}, {1: "W"}, {1: "R"}, {0: "R"}],
                                          {0: 100, 1: 50}, budget_bytes=120)
    yield {"trace": trace, "schedule": GreedyResidencyPlanner().plan(trace),
           "config": hyper_offload.OffloadConfig()}
