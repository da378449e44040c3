"""Train a small GPT under a device-memory budget, and prove it changed nothing but memory.

For each mode the same model (same seed, same batches) is trained twice: once plainly
(the baseline) and once with hyper-offload, and every step's loss and every parameter's
gradient are compared with ``torch.equal``.

* ``--mode compile`` (default): ``torch.compile(model, backend="hyper_offload",
  options={...})`` against plain ``torch.compile`` with the same inner compiler, under
  ``torch.use_deterministic_algorithms(True)`` (plain Inductor on CPU is not run-to-run
  deterministic without it). Memory: ``torch.profiler``'s allocator events (host
  buffers told apart), bytes moved read from the transfer ops that ran, and the device
  bytes the compiled backward holds (``hyper_offload.runtime.saved_bytes``).
* ``--mode eager``: ``with OffloadSession(...)`` against the plain eager loop. Memory:
  ``DeviceMemoryMeter`` op by op (the session's own figures in ``session.last_stats``).
* ``--mode both``: compile, then eager (what ``make demo`` runs).

On CUDA (the default device when present) each step also reports
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``.

Output: one line per step (time, measured peak), a table per mode, and a PNG of device
bytes over the step for baseline and offload (needs matplotlib: ``pip install .[plot]``;
without it the plot is skipped with a note).

    python examples/train_gpt.py --mode both
    python examples/train_gpt.py --mode eager --budget-fraction 0.4 --layers 8
    python examples/train_gpt.py --inner-compiler inductor   # slow to compile on 2 cores
    python examples/train_gpt.py --budget-fraction 0.25 --link-gbps 1   # offload + recompute
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt_model, step_memory

from gpt_model import GPT, GPTConfig, random_batch  # noqa: E402
from step_memory import StepMemory, metered_step, profiled_step, timed_step  # noqa: E402

import hyper_offload  # noqa: E402
import hyper_offload.compiler  # noqa: E402
from hyper_offload.compiler import saved_device_bytes  # noqa: E402
from hyper_offload.passes import resident_bytes_without_offload  # noqa: E402

MIB = 1 << 20


@dataclass
class Run:
    """One training run: measured steps, timed steps, and what was compared."""

    name: str
    memory: list[StepMemory] = field(default_factory=list)
    timed_s: list[float] = field(default_factory=list)
    saved_bytes: list[int] = field(default_factory=list)
    results: list[tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=list, repr=False)
    equal: bool | None = None
    """Loss and every gradient of every step ``torch.equal`` to the baseline's."""

    @property
    def peak_bytes(self) -> int:
        return max(m.peak_bytes for m in self.memory)

    @property
    def step_s(self) -> float:
        """Fastest uninstrumented step (a shared machine's median mostly measures load)."""
        return min(self.timed_s) if self.timed_s else min(m.seconds for m in self.memory[1:] or self.memory)


@dataclass
class ModeResult:
    mode: str
    baseline: Run
    offload: Run
    budget_bytes: int
    rows: list[tuple[str, str, str]]
    reports: list[Any] = field(default_factory=list, repr=False)


@dataclass
class DemoResult:
    modes: list[ModeResult]
    table: str
    plot: Path | None


# ---------------------------------------------------------------------------- training


def _batches(config: GPTConfig, args: argparse.Namespace, device: torch.device) -> list[Any]:
    total = args.steps + args.timed_steps
    return [random_batch(config, args.batch, seed=args.seed + 1 + i, device=device) for i in range(total)]


def _model(config: GPTConfig, seed: int, device: torch.device) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).to(device)


def _record(run: Run, model: GPT, loss: torch.Tensor, reference: Run | None) -> None:
    """Keep (baseline) or compare (offload) this step's loss and gradients."""
    grads = [p.grad.detach().clone() for p in model.parameters()]
    got = (loss.detach().clone(), grads)
    if reference is None:
        run.results.append(got)
        return
    want = reference.results[len(run.results)]
    run.results.append(got)
    same = torch.equal(got[0], want[0]) and len(got[1]) == len(want[1]) and all(
        torch.equal(a, b) for a, b in zip(got[1], want[1])
    )
    run.equal = same if run.equal is None else run.equal and same


@dataclass
class _Trainer:
    """One of the two runs of a mode: its model, optimizer, step and instrument."""

    run: Run
    model: GPT
    step_fn: Callable[[Any], torch.Tensor]
    measure: Callable[..., Any]
    reference: Run | None
    first: str
    opt: torch.optim.Optimizer = field(init=False)

    def __post_init__(self) -> None:
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)


def _one_step(t: _Trainer, i: int, batch: Any, args: argparse.Namespace, device: torch.device) -> None:
    """Step ``i``: measured while ``i < args.steps``, then uninstrumented (timing)."""
    t.opt.zero_grad(set_to_none=True)
    if i < args.steps:
        loss, memory = t.measure(lambda: t.step_fn(batch), device)
        t.run.memory.append(memory)
        extra = f" ({t.first})" if i == 0 else ""
        cuda = (f", max_memory_allocated +{memory.allocator_peak_bytes / MIB:.2f} MiB"
                if memory.allocator_peak_bytes is not None else "")
        print(f"  {t.run.name:>9} step {i}: {memory.seconds:7.3f} s, peak {memory.peak_bytes / MIB:7.2f} MiB"
              f"{cuda}{extra}", flush=True)
    else:
        loss, seconds = timed_step(lambda: t.step_fn(batch), device)
        t.run.timed_s.append(seconds)
        print(f"  {t.run.name:>9} step {i}: {seconds:7.3f} s (timing step: no memory instrument)", flush=True)
    _record(t.run, t.model, loss, t.reference)
    t.opt.step()


def _lockstep(trainers: Sequence[_Trainer], batches: Sequence[Any], args: argparse.Namespace,
              device: torch.device) -> None:
    """Baseline step i, then offload step i: the two runs are timed in alternation, so load
    from other work on a shared machine hits both alike."""
    for i, batch in enumerate(batches):
        for trainer in trainers:
            _one_step(trainer, i, batch, args, device)


# ---------------------------------------------------------------------------- compile mode


@contextmanager
def _deterministic() -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


class _ReportCollector(logging.Handler):
    """Collects the ``RegionReport`` the backend logs (INFO, ``hyper_offload`` logger)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reports: list[Any] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:  # e.g. an infeasible budget: say so
            print(f"  warning: {record.getMessage()}", file=sys.stderr, flush=True)
        if record.args and isinstance(record.args, tuple) and isinstance(record.args[0], hyper_offload.compiler.RegionReport):
            self.reports.append(record.args[0])


@contextmanager
def _collect_reports() -> Iterator[_ReportCollector]:
    logger = logging.getLogger("hyper_offload")
    handler, level = _ReportCollector(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _compile_trainer(name: str, backend: str, options: dict[str, Any] | None, config: GPTConfig,
                     args: argparse.Namespace, device: torch.device, reference: Run | None) -> _Trainer:
    model = _model(config, args.seed, device)
    # Two compiled models live side by side: Dynamo guards each cache entry on its backend.
    compiled = torch.compile(model, backend=backend, options=options)
    run = Run(name)
    params = list(model.parameters())

    def step(batch: Any) -> torch.Tensor:
        idx, targets = batch
        loss = compiled(idx, targets)
        run.saved_bytes.append(saved_device_bytes(loss, exclude=[*params, idx, targets]))
        loss.backward()
        return loss

    def measure(fn: Callable[[], Any], device: torch.device) -> tuple[Any, StepMemory]:
        # gradients are the optimizer's memory, outside the activation budget
        return profiled_step(fn, device, params)

    return _Trainer(run, model, step, measure, reference, "compile + first step")


def run_compile(config: GPTConfig, args: argparse.Namespace, device: torch.device) -> ModeResult:
    options: dict[str, Any] = {"inner_compiler": args.inner_compiler, "recompute": args.recompute,
                               "budget_scope": args.budget_scope}
    if args.link_gbps is not None:
        options["transfer_bandwidth_gbps"] = args.link_gbps
    if args.budget_mb is not None:
        options["max_resident_activation_mb"] = args.budget_mb
    else:
        options["max_resident_activation_fraction"] = args.budget_fraction
    print(f"compile mode: torch.compile(model, backend='hyper_offload', options={options})")
    torch._dynamo.reset()
    with _deterministic(), _collect_reports() as collected:
        base = _compile_trainer("baseline", args.inner_compiler, None, config, args, device, None)
        off = _compile_trainer("offload", "hyper_offload", options, config, args, device, base.run)
        _lockstep([base, off], _batches(config, args, device), args, device)
    torch._dynamo.reset()
    baseline, offload = base.run, off.run
    reports = collected.reports
    budget = sum(r.budget_bytes for r in reports)
    rows = _common_rows(baseline, offload, budget)
    rows.insert(2, ("predicted peak (plan)", _mib(sum(r.predicted_peak_before for r in reports)),
                    _mib(sum(r.predicted_peak_after for r in reports))))
    rows.insert(3, ("saved for backward (device)", _mib(max(baseline.saved_bytes)), _mib(max(offload.saved_bytes))))
    rows.insert(4, ("host buffers (peak)", "-", _mib(max(m.host_peak_bytes for m in offload.memory))))
    moved = offload.memory[-1].bytes_d2h + offload.memory[-1].bytes_h2d
    rows.insert(5, ("bytes moved per step", "-", f"{_mib(moved)} (D2H {_mib(offload.memory[-1].bytes_d2h)})"))
    rows.insert(6, ("budget feasible", "-", "yes" if all(r.feasible for r in reports) else "no (best feasible peak)"))
    rows.insert(7, ("saved moved / ops recomputed", "-", " + ".join(
        f"{len(r.offloaded)} / {len(r.recompute.recomputed) if r.recompute else 0}" for r in reports)))
    searched = [r.recompute for r in reports if r.recompute is not None and r.recompute.searched]
    if searched:
        rows.insert(8, ("predicted step: offload only -> chosen", "-", " + ".join(
            f"{_ms(rc.offload_only_s)} -> {_ms(rc.joint_s)}" for rc in searched)))
    return ModeResult("compile", baseline, offload, budget, rows, reports)


# ---------------------------------------------------------------------------- eager mode


def run_eager(config: GPTConfig, args: argparse.Namespace, device: torch.device) -> ModeResult:
    batches = _batches(config, args, device)

    def plain_step(model: GPT) -> Callable[[Any], torch.Tensor]:
        def step(batch: Any) -> torch.Tensor:
            loss = model(*batch)
            loss.backward()
            return loss
        return step

    baseline, offload = Run("baseline"), Run("offload")
    stats: list[Any] = []
    sessions: list[Any] = []

    def budget_bytes() -> int:  # known once the baseline's step 0 was measured
        if args.budget_mb is not None:
            return int(args.budget_mb * MIB)
        return int(args.budget_fraction * baseline.peak_bytes)

    def session_step(inner: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
        def step(batch: Any) -> torch.Tensor:
            if not sessions:
                print(f"eager mode: OffloadSession(OffloadConfig(max_resident_activation_mb="
                      f"{budget_bytes() / MIB:.2f}))")
                sessions.append(hyper_offload.OffloadSession(
                    hyper_offload.OffloadConfig(max_resident_activation_mb=budget_bytes() / MIB),
                    device=device))
            with sessions[0]:
                loss = inner(batch)
            stats.append(sessions[0].last_stats)
            return loss
        return step

    with _deterministic():
        base_model, off_model = _model(config, args.seed, device), _model(config, args.seed, device)
        base = _Trainer(baseline, base_model, plain_step(base_model), metered_step, None, "plain eager")
        off = _Trainer(offload, off_model, session_step(plain_step(off_model)), metered_step, baseline,
                       "warmup: trace + online eviction, then plan")
        _lockstep([base, off], batches, args, device)
    session, budget = sessions[0], budget_bytes()
    report = session.report
    rows = _common_rows(baseline, offload, budget)
    if report is not None and session.trace is not None:
        plain = max(resident_bytes_without_offload(session.trace), default=0)
        rows.insert(2, ("predicted peak (plan)", _mib(plain), _mib(report.peak_resident_bytes)))
    last = stats[-1]
    rows.insert(3, ("host buffers (peak)", "-", _mib(last.pool.pinned_bytes_peak) if last.pool else "-"))
    rows.insert(4, ("bytes moved per step", "-", f"{_mib(last.bytes_d2h + last.bytes_h2d)} (D2H {_mib(last.bytes_d2h)})"))
    rows.insert(5, ("budget feasible", "-", "yes" if report is None or report.feasible else "no (best feasible peak)"))
    return ModeResult("eager", baseline, offload, budget, rows, [report])


# ---------------------------------------------------------------------------- table, plot


def _ms(seconds: float | None) -> str:
    return "infeasible" if seconds is None else f"{seconds * 1e3:.2f} ms (predicted)"


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.2f} MiB"


def _common_rows(baseline: Run, offload: Run, budget: int) -> list[tuple[str, str, str]]:
    rows = [
        ("peak activation memory (measured)", _mib(baseline.peak_bytes), _mib(offload.peak_bytes)),
        ("budget", "-", _mib(budget)),
        ("step time (fastest timing step)*", f"{baseline.step_s:.3f} s",
         f"{offload.step_s:.3f} s (x{offload.step_s / baseline.step_s:.2f})"),
        ("loss and gradients equal to baseline", "-", "yes" if offload.equal else "no"),
    ]
    cuda = [m.allocator_peak_bytes for m in offload.memory]
    if all(c is not None for c in cuda):
        rows.insert(1, ("max_memory_allocated (step delta)",
                        _mib(max(m.allocator_peak_bytes for m in baseline.memory)), _mib(max(cuda))))
    return rows


TIMING_NOTE = ("* fastest of the uninstrumented steps; baseline and offload steps alternate, yet on a "
               "machine shared with other work the ratio stays noisy")


def format_table(result: ModeResult) -> str:
    head = ("", "baseline", "hyper-offload")
    rows = [head, *result.rows]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{result.mode} mode"]
    for i, row in enumerate(rows):
        lines.append("  " + " | ".join(c.ljust(w) for c, w in zip(row, widths)))
        if i == 0:
            lines.append("  " + "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def write_plot(results: Sequence[ModeResult], path: Path) -> Path | None:
    """Device bytes over the last measured step, baseline vs offload, budget dashed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed (pip install .[plot]): plot skipped")
        return None
    figure = Figure(figsize=(6.5 * len(results), 4.2), layout="constrained")
    axes = figure.subplots(1, len(results), squeeze=False)[0]
    for ax, result in zip(axes, results):
        for run, colour in ((result.baseline, "grey"), (result.offload, "tab:blue")):
            xs, ys = zip(*run.memory[-1].curve)
            if result.mode == "compile":  # steps of different lengths: fraction of each
                xs = tuple(x / (max(xs) or 1.0) for x in xs)
            ax.step(xs, [y / MIB for y in ys], where="post", color=colour,
                    label=f"{'plain' if run is result.baseline else 'hyper-offload'} "
                          f"(peak {run.memory[-1].peak_bytes / MIB:.1f} MiB)")
        ax.axhline(result.budget_bytes / MIB, color="red", linestyle="--", label="budget")
        profiler = result.mode == "compile"
        ax.set_xlabel("time in the step (fraction of the step; torch.profiler's allocator events)"
                      if profiler else "op (execution order; DeviceMemoryMeter)")
        ax.set_ylabel("device bytes allocated by the step (MiB)")
        ax.set_title(f"{result.mode}: last measured step")
        ax.legend(loc="upper left", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("compile", "eager", "both"), default="compile")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-fraction", type=float, default=0.7,
                        help="budget as a fraction of the activation peak without offload (default 0.7)")
    budget.add_argument("--budget-mb", type=float, default=None, help="budget in MiB instead")
    p.add_argument("--inner-compiler", choices=("aot_eager", "inductor"), default="aot_eager",
                   help="compile mode's inner compiler (Inductor compiles take minutes on 2 cores)")
    p.add_argument("--recompute", choices=("auto", "off"), default="auto",
                   help="compile mode: let the backend also recompute where offload alone stalls (default auto)")
    # The demo compiles the whole model: one region run once per step, where the region's
    # own plan (with the recompute search) is the step's plan. Per-block compile, graph
    # breaks, DDP and FSDP2 need the backend's default, "step" (docs/compile.md, "One budget for
    # the whole step").
    p.add_argument("--budget-scope", choices=("region", "step"), default="region",
                   help="compile mode: the budget's scope (default region: the demo is one region)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="compile mode: price copies at this GB/s each way (default: the measured link)")
    p.add_argument("--steps", type=int, default=2, help="measured steps per run (the first compiles / warms up)")
    p.add_argument("--timed-steps", type=int, default=2, help="extra uninstrumented steps for the step time")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=Path("out/train_gpt_memory.png"))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step compiles or warms up)")
    if args.timed_steps < 0:
        p.error("--timed-steps must be >= 0")
    if args.budget_mb is None and not (0 < args.budget_fraction <= 1) or math.isnan(args.budget_fraction):
        p.error(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")
    if args.budget_mb is not None and not (0 <= args.budget_mb < math.inf):
        p.error(f"--budget-mb must be a finite number >= 0, got {args.budget_mb}")
    return args


def main(argv: Sequence[str] | None = None) -> DemoResult:
    args = parse_args(argv)
    device = torch.device(args.device)
    try:
        config = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, layers=args.layers,
                           dim=args.dim, heads=args.heads)
    except ValueError as error:
        raise SystemExit(f"train_gpt.py: {error}") from None
    print(f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq {args.seq_len}, "
          f"batch {args.batch}, vocab {args.vocab} on {device}")
    modes = ("compile", "eager") if args.mode == "both" else (args.mode,)
    results = [(run_compile if mode == "compile" else run_eager)(config, args, device) for mode in modes]
    table = "\n\n".join(format_table(r) for r in results) + "\n" + TIMING_NOTE
    print("\n" + table)
    plot = None if args.no_plot else write_plot(results, args.plot)
    if plot is not None:
        print(f"\nmemory over the step: {plot}")
    return DemoResult(results, table, plot)


if __name__ == "__main__":
    result = main()
    sys.exit(0 if all(m.offload.equal for m in result.modes) else 1)
