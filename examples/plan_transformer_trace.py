"""Plan activation offload for a transformer-shaped training step, end to end on CPU.

Builds the activation trace of a decoder stack (forward saves activations per layer,
backward reads them in reverse), plans it under a budget with the default planner,
checks the schedule with the independent validator and prints what it moves. It also
writes the trace as JSON so that you can run the CLI on it (``make demo`` runs this
script after the training demo; ``make setup`` puts the CLI in ``.venv/bin``):

    .venv/bin/python examples/plan_transformer_trace.py --layers 24 --budget-fraction 0.3
    .venv/bin/hyper-offload plan out/transformer_trace.json --budget-mb 600
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hyper_offload.passes import (
    ActivationTrace,
    GreedyResidencyPlanner,
    check_schedule,
    resident_bytes_without_offload,
)

MIB = 1 << 20


def decoder_step_trace(
    layers: int, seq: int, hidden: int, *, bytes_per_elem: int = 2
) -> tuple[list[dict[int, str]], dict[int, int]]:
    """Accesses of one forward + backward over ``layers`` blocks (storage ids are ints)."""
    act = seq * hidden * bytes_per_elem
    mlp = 4 * act
    ops: list[dict[int, str]] = []
    sizes: dict[int, int] = {}
    saved: list[tuple[int, int, int]] = []
    sid = 0

    def new(size: int) -> int:
        nonlocal sid
        sid += 1
        sizes[sid] = size
        return sid

    x = new(act)
    ops.append({x: "W"})                               # embedding output
    for _ in range(layers):
        attn, up, out = new(act), new(mlp), new(act)
        ops.append({x: "R", attn: "W"})                # attention (saves its input/output)
        ops.append({attn: "R", up: "W"})               # MLP up-projection + activation
        ops.append({up: "R", out: "W"})                # MLP down-projection
        saved.append((x, attn, up))
        x = out
    loss_grad = new(act)
    ops.append({x: "R", loss_grad: "W"})               # loss and its gradient
    grad = loss_grad
    for x_in, attn, up in reversed(saved):
        g_up, g_attn, g_in = new(mlp), new(act), new(act)
        ops.append({grad: "R", up: "R", g_up: "W"})
        ops.append({g_up: "R", attn: "R", g_attn: "W"})
        ops.append({g_attn: "R", x_in: "R", g_in: "W"})
        grad = g_in
    ops.append({grad: "R"})                            # gradient reaches the embedding
    return ops, sizes


def cli_command() -> str:
    """How to call ``hyper-offload`` from here: the script installed beside this
    interpreter (``.venv/bin/hyper-offload`` after ``make setup``), else the name alone."""
    script = Path(sys.executable).parent / "hyper-offload"
    if not script.exists():
        return "hyper-offload"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:  # the interpreter lives outside the working directory
        return str(script)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--budget-fraction", type=float, default=0.3,
                        help="budget as a fraction of the peak without offload")
    parser.add_argument("--out", type=Path, default=Path("out/transformer_trace.json"))
    args = parser.parse_args()

    ops, sizes = decoder_step_trace(args.layers, args.seq, args.hidden)
    unplanned = ActivationTrace.from_accesses(ops, sizes, budget_bytes=0)
    peak = max(resident_bytes_without_offload(unplanned))
    trace = unplanned.with_budget(int(peak * args.budget_fraction))

    schedule = GreedyResidencyPlanner().plan(trace)
    report = check_schedule(trace, schedule)
    report.raise_if_invalid()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(trace.to_json())

    print(f"trace: {trace.num_ops} ops, {len(sizes)} storages -> {args.out}")
    print(f"peak without offload : {peak / MIB:10.1f} MiB")
    print(f"budget               : {trace.budget_bytes / MIB:10.1f} MiB")
    print(f"peak with schedule   : {report.peak_resident_bytes / MIB:10.1f} MiB "
          f"({'feasible' if report.feasible else 'INFEASIBLE'}, validator: "
          f"{'ok' if report.ok else 'violations'})")
    print(f"moved                : D2H {report.bytes_d2h / MIB:.1f} MiB, "
          f"H2D {report.bytes_h2d / MIB:.1f} MiB in {report.num_transfers} transfers")
    print(f"try the CLI          : {cli_command()} plan {args.out} "
          f"--budget-mb {trace.budget_bytes / MIB:.0f}")


if __name__ == "__main__":
    main()
