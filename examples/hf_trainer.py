"""Hugging Face ``Trainer`` with hyper-offload, and proof that it changed nothing but memory.

A GPT-2 built from a config (nothing downloaded) is trained twice with the same seed,
data and ``TrainingArguments``: once by plain ``transformers.Trainer`` (for the compile
door, with the model compiled in place by the inner compiler alone) and once by
``hyper_offload.integrations.HyperOffloadTrainer``. Every micro-batch's loss, the
gradients of the last optimizer step and the final weights are compared with
``torch.equal``; the budget is checked against what was *measured* (compile door: the
device bytes the compiled backward holds after each forward; eager door: the session's
peak of resident activation bytes) and the step report is printed.

    python examples/hf_trainer.py                          # compile door, Inductor inside
    python examples/hf_trainer.py --inner-compiler aot_eager
    python examples/hf_trainer.py --door eager --budget-mb 0.55

Needs the ``hf`` extra (``pip install "hyper-offload[hf]"``). With Inductor the runs use
``torch.use_deterministic_algorithms(True)``: plain Inductor on CPU is not run-to-run
deterministic without it, so neither would the comparison be.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from hyper_offload.compiler import saved_device_bytes
from hyper_offload.passes import resident_bytes_without_offload
from hyper_offload.integrations import HyperOffloadTrainer, OffloadArguments

MIB = float(1 << 20)


@dataclass
class Run:
    """What one Trainer run did, as measured."""

    losses: list[torch.Tensor] = field(default_factory=list)
    """Every micro-batch's loss, in order (as ``compute_loss`` returned it)."""
    saved_bytes: list[int] = field(default_factory=list)
    """Compile door: device bytes the compiled backward held after each forward."""
    grads: list[torch.Tensor] = field(default_factory=list)
    """Gradients just before the last optimizer step."""
    weights: list[torch.Tensor] = field(default_factory=list)
    log_history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Comparison:
    door: str
    plain: Run
    offload: Run
    report: Any
    """The step report (compile door: predicted ``StepReport``; eager: measured ``StepStats``)."""
    budget_bytes: int
    trainer: Any = field(repr=False, default=None)
    """The ``HyperOffloadTrainer`` that ran."""

    @property
    def equal(self) -> bool:
        pairs = [(self.plain.losses, self.offload.losses), (self.plain.grads, self.offload.grads),
                 (self.plain.weights, self.offload.weights)]
        return all(len(a) == len(b) > 0 and all(map(torch.equal, a, b)) for a, b in pairs)

    @property
    def measured_peak_bytes(self) -> int:
        """Compile door: the most saved bytes after a forward; eager: the session's peak."""
        if self.door == "compile":
            return max(self.offload.saved_bytes)
        return self.report.peak_resident_bytes

    @property
    def plain_peak_bytes(self) -> int:
        """The same figure without the library: compile door, measured on the plain run;
        eager door, the traced step's peak with every activation resident."""
        if self.door == "compile":
            return max(self.plain.saved_bytes)
        return max(resident_bytes_without_offload(self.trainer.offload.session.trace))


def gpt2(layers: int = 2, width: int = 64, vocab: int = 64, seq: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width,
                                     n_layer=layers, n_head=2, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    # GPT-2's class name names no loss, so its loss property warns once, inside the
    # compiled forward (a graph break on the first call and a recompile after it).
    model.loss_type = "ForCausalLM"
    return model


def dataset(rows: int, vocab: int = 64, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


class _Recording:
    """Keeps every micro-batch's loss (and, compiled, the saved bytes it left)."""

    run: Run
    measure_saved: bool

    def compute_loss(self, model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]
        self.run.losses.append(loss.detach().clone())
        if self.measure_saved:
            self.run.saved_bytes.append(saved_device_bytes(loss, exclude=model.parameters()))
        return loss


class _Grads(transformers.TrainerCallback):
    def __init__(self, run: Run) -> None:
        self.run = run

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.grads = [p.grad.detach().clone() for p in kwargs["model"].parameters()]


class PlainTrainer(_Recording, transformers.Trainer):
    pass


class OffloadTrainer(_Recording, HyperOffloadTrainer):
    pass


def training_arguments(output_dir: str, steps: int) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, seed=0, use_cpu=True, report_to=[],
        save_strategy="no", logging_steps=1, dataloader_num_workers=0, disable_tqdm=True,
    )


def train(offload: OffloadArguments | None, *, door: str, inner_compiler: str,
          steps: int) -> tuple[Run, Any]:
    """One Trainer run; ``offload`` None: plain Trainer (compiled by ``inner_compiler``
    alone for the compile door). Returns the run and the trainer."""
    run, model = Run(), gpt2()
    with tempfile.TemporaryDirectory() as output_dir:
        kwargs: dict[str, Any] = dict(model=model, args=training_arguments(output_dir, steps),
                                      train_dataset=dataset(4 * steps), callbacks=[_Grads(run)])
        if offload is None:
            if door == "compile":
                model.compile(backend=inner_compiler)  # the same layout, without the library
            trainer: Any = PlainTrainer(**kwargs)
        else:
            trainer = OffloadTrainer(offload=offload, **kwargs)
        trainer.run, trainer.measure_saved = run, door == "compile"
        trainer.train()
    run.weights = [p.detach().clone() for p in model.parameters()]
    run.log_history = trainer.state.log_history
    return run, trainer


@contextlib.contextmanager
def deterministic(on: bool) -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def compare(door: str, *, inner_compiler: str = "inductor", budget_mb: float | None = None,
            budget_fraction: float | None = None, steps: int = 2) -> Comparison:
    """Train plainly, then with the library; what both did."""
    offload = OffloadArguments(offload_door=door, inner_compiler=inner_compiler,
                               max_resident_activation_mb=budget_mb,
                               max_resident_activation_fraction=budget_fraction)
    torch._dynamo.reset()  # a fresh process's compile for each run (no shared code cache)
    with deterministic(door == "compile" and inner_compiler == "inductor"):
        plain, _ = train(None, door=door, inner_compiler=inner_compiler, steps=steps)
        torch._dynamo.reset()
        ours, trainer = train(offload, door=door, inner_compiler=inner_compiler, steps=steps)
    report = trainer.offload_report
    budget = report.budget_bytes if door == "compile" else trainer.offload.session.config.budget_bytes
    return Comparison(door, plain, ours, report, budget, trainer)


def main(argv: Sequence[str] | None = None) -> Comparison:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--door", choices=("compile", "eager"), default="compile")
    parser.add_argument("--inner-compiler", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--budget-mb", type=float, default=None,
                        help="device budget in MiB (eager default 0.55)")
    parser.add_argument("--budget-fraction", type=float, default=None,
                        help="compile door: budget as a fraction of the step's peak (default 0.7)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (2 micro-batches each)")
    args = parser.parse_args(argv)
    budget_mb, fraction = args.budget_mb, args.budget_fraction
    if budget_mb is None and fraction is None:
        budget_mb, fraction = (None, 0.7) if args.door == "compile" else (0.55, None)
    result = compare(args.door, inner_compiler=args.inner_compiler, budget_mb=budget_mb,
                     budget_fraction=fraction, steps=args.steps)
    print(result.report)
    print(f"\n{args.door} door, {len(result.offload.losses)} micro-batches: losses, last "
          f"gradients and final weights torch.equal to plain Trainer: {result.equal}")
    print(f"measured peak {result.measured_peak_bytes} B (without the library: "
          f"{result.plain_peak_bytes} B) for a budget of "
          f"{result.budget_bytes} B; logged: "
          f"{ {k: v for k, v in result.offload.log_history[0].items() if 'offload' in k} }")
    return result


if __name__ == "__main__":
    sys.exit(0 if main().equal else 1)
