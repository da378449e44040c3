"""Lightning with hyper-offload, and proof that it changed nothing but memory.

A small GPT (``gpt_model.py``, built from a config; dropout on) in a LightningModule is
trained twice with the same seed, data and ``Trainer`` settings (gradient accumulation
over 2 batches): once by plain Lightning (for the compile door, the module compiled in
place by the inner compiler alone) and once with
``hyper_offload.integrations.HyperOffloadCallback``. Every batch's loss, the gradients
before each optimizer step and the final weights are compared with ``torch.equal``; the
budget is checked against what was *measured* (compile door: the device bytes the
compiled backward holds after each forward; eager door: the session's peak of resident
activation bytes) and the step report is printed.

    python examples/lightning_train.py                      # compile door, Inductor inside
    python examples/lightning_train.py --inner-compiler aot_eager
    python examples/lightning_train.py --door eager         # automatic optimization
    python examples/lightning_train.py --door eager --manual

Needs the ``lightning`` extra (``pip install "hyper-offload[lightning]"``). With Inductor
the runs use ``torch.use_deterministic_algorithms(True)`` (plain Inductor on CPU is not
run-to-run deterministic without it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt_model

from gpt_model import GPT, GPTConfig, random_batch  # noqa: E402

from hyper_offload.compiler import saved_device_bytes
from hyper_offload.passes import resident_bytes_without_offload  # noqa: E402
from hyper_offload.integrations import HyperOffloadCallback, OffloadArguments  # noqa: E402

CONFIG = GPTConfig(vocab=64, seq_len=32, layers=2, dim=64, heads=2, dropout=0.1)


@dataclass
class Run:
    """What one Lightning run did, as measured."""

    losses: list[torch.Tensor] = field(default_factory=list)
    saved_bytes: list[int] = field(default_factory=list)
    """Compile door: device bytes the compiled backward held after each forward."""
    grads: list[list[torch.Tensor]] = field(default_factory=list)
    """Gradients before each optimizer step."""
    weights: list[torch.Tensor] = field(default_factory=list)

    def equal(self, other: Run) -> bool:
        pairs = [(self.losses, other.losses), (self.weights, other.weights),
                 *zip(self.grads, other.grads)]
        return len(self.grads) == len(other.grads) > 0 and all(
            len(a) == len(b) > 0 and all(map(torch.equal, a, b)) for a, b in pairs)


class LitGPT(pl.LightningModule):
    """The GPT as users write a LightningModule; ``manual``: manual optimization."""

    def __init__(self, manual: bool = False, measure_saved: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(CONFIG)
        self.automatic_optimization = not manual
        self.measure_saved = measure_saved
        self.run = Run()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(idx, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(*batch)
        self.run.losses.append(loss.detach().clone())
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        self._keep_grads()
        optimizer.step()
        return loss

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.measure_saved:  # compile door: what the compiled backward holds now
            self.run.saved_bytes.append(saved_device_bytes(loss, exclude=self.parameters()))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.automatic_optimization:
            self._keep_grads()

    def _keep_grads(self) -> None:
        self.run.grads.append([p.grad.detach().clone() for p in self.parameters()])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(batches: int, batch: int = 4) -> DataLoader:
    pairs = [random_batch(CONFIG, batch, seed=1 + i) for i in range(batches)]
    dataset = TensorDataset(torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]))
    return DataLoader(dataset, batch_size=batch, shuffle=False)


def train(callback: HyperOffloadCallback | None, *, door: str, inner_compiler: str,
          steps: int, manual: bool) -> tuple[Run, pl.Trainer]:
    """One run; ``callback`` None: plain Lightning (compiled by ``inner_compiler`` alone
    for the compile door)."""
    pl.seed_everything(0, verbose=False)
    module = LitGPT(manual=manual, measure_saved=door == "compile")
    if callback is None and door == "compile":
        module.compile(backend=inner_compiler)  # the layout the callback compiles
    accumulate = 1 if manual else 2
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, accumulate_grad_batches=accumulate,
        callbacks=[] if callback is None else [callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(module, data(steps * accumulate))
    module.run.weights = [p.detach().clone() for p in module.parameters()]
    return module.run, trainer


@dataclass
class Comparison:
    door: str
    plain: Run
    offload: Run
    callback: HyperOffloadCallback
    trainer: pl.Trainer

    @property
    def budget_bytes(self) -> int:
        report, session = self.callback.report, self.callback.offload.session
        return report.budget_bytes if self.door == "compile" else session.config.budget_bytes

    @property
    def measured_peak_bytes(self) -> int:
        """Compile door: the most saved bytes after a forward; eager: the session's peak."""
        if self.door == "compile":
            return max(self.offload.saved_bytes)
        return self.callback.report.peak_resident_bytes

    @property
    def plain_peak_bytes(self) -> int:
        """The same figure without the library: compile door, measured on the plain run;
        eager door, the traced step's peak with every activation resident."""
        if self.door == "compile":
            return max(self.plain.saved_bytes)
        return max(resident_bytes_without_offload(self.callback.offload.session.trace))


def compare(door: str, *, inner_compiler: str = "inductor", budget_mb: float | None = None,
            budget_fraction: float | None = None, steps: int = 3,
            manual: bool = False) -> Comparison:
    """Train plainly, then with the callback; what both did."""
    callback = HyperOffloadCallback(OffloadArguments(
        offload_door=door, inner_compiler=inner_compiler, max_resident_activation_mb=budget_mb,
        max_resident_activation_fraction=budget_fraction))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(door == "compile" and inner_compiler == "inductor")
    try:
        torch._dynamo.reset()  # each run compiles afresh
        plain, _ = train(None, door=door, inner_compiler=inner_compiler, steps=steps, manual=manual)
        torch._dynamo.reset()
        ours, trainer = train(callback, door=door, inner_compiler=inner_compiler, steps=steps,
                              manual=manual)
    finally:
        torch.use_deterministic_algorithms(previous)
    return Comparison(door, plain, ours, callback, trainer)


def main(argv: Sequence[str] | None = None) -> Comparison:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--door", choices=("compile", "eager"), default="compile")
    parser.add_argument("--inner-compiler", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--manual", action="store_true", help="manual optimization")
    parser.add_argument("--budget-mb", type=float, default=None,
                        help="device budget in MiB (eager default 1.0)")
    parser.add_argument("--budget-fraction", type=float, default=None,
                        help="compile door: budget as a fraction of the step's peak (default 0.5)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    args = parser.parse_args(argv)
    budget_mb, fraction = args.budget_mb, args.budget_fraction
    if budget_mb is None and fraction is None:
        budget_mb, fraction = (None, 0.5) if args.door == "compile" else (1.0, None)
    result = compare(args.door, inner_compiler=args.inner_compiler, budget_mb=budget_mb,
                     budget_fraction=fraction, steps=args.steps, manual=args.manual)
    print(result.callback.report)
    how = "manual" if args.manual else "automatic"
    print(f"\n{args.door} door, {how} optimization, {len(result.offload.losses)} batches: losses, "
          f"gradients and final weights torch.equal to plain Lightning: "
          f"{result.plain.equal(result.offload)}")
    logged = {k: float(v) for k, v in result.trainer.callback_metrics.items() if "offload" in k}
    print(f"measured peak {result.measured_peak_bytes} B (without the library: "
          f"{result.plain_peak_bytes} B) for a budget of "
          f"{result.budget_bytes} B; logged: {logged}")
    return result


if __name__ == "__main__":
    sys.exit(0 if (lambda r: r.plain.equal(r.offload))(main()) else 1)
