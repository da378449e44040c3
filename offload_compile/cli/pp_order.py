"""``hyper-offload pp-order``: print (or plot) every rank's pipeline-parallel step order.

Builds the finalized rank-local orders with the pipeline passes (compute + P2P → FSDP →
transport → swap), checks them with ``check_order``, and prints them one compute slot per
line, followed by the predicted peak of resident activations with and without swap.
``--send-mb`` also counts each chunk's sent output and input gradient, released where the
executor releases them (once the ranks' orders prove the peer has them;
``--wait-sends-at-end``: at the end of the step).

Swap choice: ``--swap`` applies the design document's gap rule (every chunk with
``gap >= --min-gap``); ``--cost-aware`` (implies ``--swap``) swaps only the eligible chunks
whose copies hide behind compute and that lower the rank's peak (see
``hyper_offload.passes.pipeline.swap_cost``); it needs ``--activation-mb``.

Exit codes: 0 ok; 2 bad input (one line on stderr, never a traceback); 3 the passes built
an order that ``check_order`` rejects (a bug: please report it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hyper_offload.passes.pipeline.build import SCHEDULES, TRANSPORTS, build_rank_orders
from hyper_offload.passes.pipeline.check_order import check_order
from hyper_offload.passes.pipeline.meta_step import SEND_KINDS, MetaStep, StepKind, SwapPhase
from hyper_offload.passes.pipeline.residency import StageFootprint, StageFootprints, peak_bytes
from hyper_offload.passes.pipeline.execution import send_releases
from hyper_offload.passes.pipeline.swap import MIN_SWAP_GAP, find_swap_chunks, find_weight_windows, strip_swap_steps
from hyper_offload.passes.pipeline.swap_cost import (
    SwapCostModel,
    SwapCostReport,
    plan_rank_swaps,
)

MIB = 1 << 20
EXIT_OK, EXIT_BAD_INPUT, EXIT_INVALID_ORDER = 0, 2, 3
_V_SHAPED = ("zbv", "dualpipev")
_COST_OPTIONS = ("d2h_gbps", "h2d_gbps", "fwd_ms", "bwd_ms", "target_peak_mb")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "pp-order",
        help="print every rank's pipeline-parallel step order (with swap steps)",
        description="Build each rank's finalized pipeline order (compute, P2P, FSDP, swap) "
        "for a schedule and print it, as JSON, or as a timeline picture.",
    )
    parser.add_argument("--schedule", required=True, choices=SCHEDULES)
    parser.add_argument("--ranks", type=int, required=True, help="pipeline ranks R")
    parser.add_argument("--stages-per-rank", type=int, default=None,
                        help="virtual stages per rank V (default: 2 for zbv/dualpipev, else 1)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches M")
    parser.add_argument("--fsdp", action="store_true", help="inject FSDP unshard/reshard steps")
    parser.add_argument("--transport", choices=TRANSPORTS, default="plain", help="P2P transport")
    parser.add_argument("--dxdw", action="store_true", help="split backward into dx (I) and dw (W)")
    parser.add_argument("--overlap", action="store_true", help="fuse B/F pairs into OVERLAP_B_F")
    parser.add_argument("--swap", action="store_true", help="inject swap steps (gap rule)")
    parser.add_argument("--min-gap", type=int, default=MIN_SWAP_GAP,
                        help=f"compute slots between a chunk's F and B to swap it (default {MIN_SWAP_GAP})")
    cost = parser.add_argument_group("cost-aware swap (--cost-aware)")
    cost.add_argument("--cost-aware", action="store_true",
                      help="swap only chunks whose copies hide and that lower the peak (implies --swap)")
    cost.add_argument("--activation-mb", type=float, default=None,
                      help="activation MiB per chunk (peaks are reported in chunks without it)")
    cost.add_argument("--weight-state-mb", type=float, default=None,
                      help="dW-state MiB per chunk under dx/dw split, BWD_INPUT -> BWD_WEIGHT "
                           "(default: the activation size)")
    cost.add_argument("--send-mb", type=float, default=None,
                      help="MiB of each chunk's sent output and of its sent input gradient "
                           "(default 0: sends are not counted)")
    cost.add_argument("--wait-sends-at-end", action="store_true",
                      help="price sends as waited at the end of the step, not once proven received")
    cost.add_argument("--d2h-gbps", type=float, default=None, help="device-to-host GB/s (default 20)")
    cost.add_argument("--h2d-gbps", type=float, default=None, help="host-to-device GB/s (default 20)")
    cost.add_argument("--fwd-ms", type=float, default=None, help="forward ms per chunk (default 10)")
    cost.add_argument("--bwd-ms", type=float, default=None,
                      help="backward ms per chunk (default 20; dx and dw take half each)")
    cost.add_argument("--target-peak-mb", type=float, default=None,
                      help="stop swapping once a rank's peak is at most this many MiB")
    parser.add_argument("--rank", type=int, default=None, help="print this rank only")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=Path, default=None,
                        help="draw every rank's timeline to this file (.png, .svg, .pdf)")
    parser.set_defaults(run=run)


class _BadInput(Exception):
    """A user error: printed as one line, exit code 2."""


def run(args: argparse.Namespace) -> int:
    try:
        _validate(args)
        plain, orders, reports = _build(args)
        if args.plot is not None:
            _plot(orders, args)
    except _BadInput as error:
        _error(str(error))
        return EXIT_BAD_INPUT
    violations = [
        v for rank, order in orders.items()
        for v in check_order(order, rank=rank, min_gap=args.min_gap, reference=plain[rank],
                             **_expected_swaps(args, reports, rank))
    ]
    shown = {r: o for r, o in orders.items() if args.rank is None or r == args.rank}
    peaks = _peaks(orders, args) if args.swap else {}
    _emit(json.dumps(_as_json(args, shown, peaks, reports)) if args.json else _human(args, shown, peaks, reports))
    if violations:
        _error(f"check_order rejects the built order ({len(violations)} violations), first: "
               f"{violations[0]}; this is a bug, please report it")
        return EXIT_INVALID_ORDER
    return EXIT_OK


def _emit(text: str) -> None:
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (e.g. `| head`): stop quietly, and keep the interpreter's final
        # flush from failing on the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _error(message: str) -> None:
    print(f"hyper-offload pp-order: error: {' '.join(message.split())}", file=sys.stderr)


def _validate(args: argparse.Namespace) -> None:
    if args.stages_per_rank is None:
        args.stages_per_rank = 2 if args.schedule in _V_SHAPED else 1
    for flag, value in (("--ranks", args.ranks), ("--stages-per-rank", args.stages_per_rank),
                        ("--microbatches", args.microbatches)):
        if value < 1:
            raise _BadInput(f"{flag} must be >= 1, got {value}")
    if args.min_gap < 2:
        raise _BadInput(f"--min-gap must be >= 2, got {args.min_gap} (at gap 1 no slot holds the offload wait)")
    if args.rank is not None and not 0 <= args.rank < args.ranks:
        raise _BadInput(f"--rank {args.rank} is not a rank of this pipeline; expected 0..{args.ranks - 1}")
    if args.cost_aware:
        args.swap = True
        if args.activation_mb is None:
            raise _BadInput("--cost-aware needs --activation-mb (activation MiB per chunk)")
    else:
        given = [f"--{name.replace('_', '-')}" for name in _COST_OPTIONS if getattr(args, name) is not None]
        if given:
            raise _BadInput(f"{', '.join(given)} only apply with --cost-aware")
    if args.send_mb is not None and args.activation_mb is None:
        raise _BadInput("--send-mb needs --activation-mb (peaks are in bytes once sends are sized)")
    for name in ("activation_mb", "target_peak_mb", "send_mb"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise _BadInput(f"--{name.replace('_', '-')} must be >= 0, got {value:g}")
    for name in ("d2h_gbps", "h2d_gbps", "fwd_ms", "bwd_ms"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise _BadInput(f"--{name.replace('_', '-')} must be > 0, got {value:g}")


_Orders = dict[int, list[MetaStep]]


def _build(args: argparse.Namespace) -> tuple[_Orders, _Orders, dict[int, SwapCostReport]]:
    """The orders without swap steps, the final orders, and the cost reports (if cost-aware)."""
    options: dict[str, Any] = dict(
        num_ranks=args.ranks, stages_per_rank=args.stages_per_rank, num_microbatches=args.microbatches,
        fsdp=args.fsdp, transport=args.transport, min_gap=args.min_gap,
        dxdw_split=args.dxdw, overlap=args.overlap,
    )
    try:
        plain = build_rank_orders(args.schedule, swap=False, **options)
        if not args.cost_aware:
            final = build_rank_orders(args.schedule, swap=True, **options) if args.swap else plain
            return plain, final, {}
        reports = plan_rank_swaps(
            plain, sizes=_sizes(args, plain), cost=_cost_model(args), min_gap=args.min_gap,
            target_peak_bytes=None if args.target_peak_mb is None else int(args.target_peak_mb * MIB),
            release_sends=not args.wait_sends_at_end,
        )
        only = {rank: report.chosen for rank, report in reports.items()}
        weight_only = {rank: report.chosen_weight for rank, report in reports.items()}
        final = build_rank_orders(args.schedule, swap=True, swap_only=only, weight_swap_only=weight_only, **options)
        return plain, final, reports
    except ValueError as error:  # the passes' errors name the rule and the fix
        raise _BadInput(f"{args.schedule}: {error}") from None


def _sizes(args: argparse.Namespace, orders: Mapping[int, Sequence[MetaStep]]) -> StageFootprints:
    """Each stage's footprint from the flags. With ``--send-mb`` a stage that sends its
    output (SEND_F) holds it from its FWD, and one that sends its input gradient (SEND_B)
    holds that from its backward, both until the send is released."""
    per_chunk = 1 if args.activation_mb is None else int(args.activation_mb * MIB)
    weight = per_chunk if args.weight_state_mb is None else int(args.weight_state_mb * MIB)
    base = StageFootprint(activations=per_chunk, weight_state=weight)
    send = 0 if args.send_mb is None else int(args.send_mb * MIB)
    if not send:
        return StageFootprints(default=base)
    sends: dict[int, set[StepKind]] = {}
    for order in orders.values():
        for leaf in (leaf for step in order for leaf in step.leaves()):
            if leaf.kind in SEND_KINDS:
                sends.setdefault(leaf.stage, set()).add(leaf.kind)  # type: ignore[arg-type]
    per_stage = {}
    for stage, kinds in sends.items():
        output = send if StepKind.SEND_F in kinds else 0
        grad = send if StepKind.SEND_B in kinds else 0
        per_stage[stage] = replace(
            base, forward_resident=output, weight_resident=output + grad, tail_bytes=output + grad,
            sent_output=output, sent_grad=grad,
        )
    return StageFootprints(per_stage=per_stage, default=base)


def _cost_model(args: argparse.Namespace) -> SwapCostModel:
    model: dict[str, Any] = {}
    if args.d2h_gbps is not None:
        model["d2h_bytes_per_s"] = args.d2h_gbps * 1e9
    if args.h2d_gbps is not None:
        model["h2d_bytes_per_s"] = args.h2d_gbps * 1e9
    seconds: dict[StepKind, float] = {}
    if args.fwd_ms is not None:
        seconds[StepKind.FWD] = args.fwd_ms / 1e3
    if args.bwd_ms is not None:
        seconds[StepKind.BWD] = args.bwd_ms / 1e3
        seconds[StepKind.BWD_INPUT] = seconds[StepKind.BWD_WEIGHT] = args.bwd_ms / 2e3
    return SwapCostModel(step_seconds=seconds, **model)


def _expected_swaps(
    args: argparse.Namespace, reports: Mapping[int, SwapCostReport], rank: int
) -> dict[str, Collection[tuple[int, int]] | None]:
    """What check_order must find swapped, per window (its ``swapped`` and
    ``weight_swapped``): nothing, every eligible window (None), or the cost model's choice."""
    if not args.swap:
        return {"swapped": (), "weight_swapped": ()}
    if not args.cost_aware:
        return {"swapped": None, "weight_swapped": None}
    return {"swapped": reports[rank].chosen, "weight_swapped": reports[rank].chosen_weight}


def _swapped_chunks(order: Sequence[MetaStep]) -> set[tuple[int, int]]:
    return {s.chunk for s in order if s.kind is StepKind.SWAP_LAUNCH_OFFLOAD and s.chunk is not None}


def _peaks(orders: Mapping[int, Sequence[MetaStep]], args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    sizes = _sizes(args, orders)
    releases = {} if args.wait_sends_at_end else send_releases(orders)
    unit = "chunks" if args.activation_mb is None else "bytes"
    result = {}
    for rank, order in orders.items():
        plain = strip_swap_steps(order)
        chunks = find_swap_chunks(plain, min_gap=args.min_gap)
        weight_windows = find_weight_windows(plain, min_gap=args.min_gap)
        released = releases.get(rank)
        result[rank] = {
            "without": peak_bytes(order, sizes, swapped=(), weight_swapped=(), releases=released),
            "with": peak_bytes(order, sizes, releases=released),
            "unit": unit,
            "swapped": len(_swapped_chunks(order)),
            "eligible": sum(c.eligible for c in chunks),
            "chunks": len(chunks),
            "weight_swapped": sum(s.kind is StepKind.DW_LAUNCH_OFFLOAD for s in order),
            "weight_eligible": sum(c.eligible for c in weight_windows),
            "weight_windows": len(weight_windows),
        }
    return result


def _plot(orders: Mapping[int, Sequence[MetaStep]], args: argparse.Namespace) -> None:
    from hyper_offload.passes.pipeline.timeline import TimelineError, build_timeline
    from hyper_offload.viz import PlotDependencyError, plot_timeline

    try:
        path = plot_timeline(build_timeline(orders), args.plot, title=_headline(args))
    except (PlotDependencyError, TimelineError) as error:
        raise _BadInput(str(error)) from None
    except (OSError, ValueError) as error:  # unwritable path, unknown image format
        raise _BadInput(f"cannot write {args.plot}: {error}") from None
    print(f"hyper-offload pp-order: wrote timeline to {path}", file=sys.stderr)


def _headline(args: argparse.Namespace) -> str:
    parts = [
        f"{args.schedule}: {args.ranks} ranks x {args.stages_per_rank} stage(s)/rank, {args.microbatches} micro-batches",
        f"transport {args.transport}",
    ]
    if args.fsdp:
        parts.append("FSDP")
    if args.dxdw:
        parts.append("dx/dw split")
    if args.overlap:
        parts.append("overlap B/F")
    if args.swap:
        rule = "cost-aware" if args.cost_aware else "gap rule"
        parts.append(f"swap: {rule}, min gap {args.min_gap}")
    return "; ".join(parts)


def _as_json(args: argparse.Namespace, orders: Mapping[int, Sequence[MetaStep]],
             peaks: Mapping[int, dict[str, Any]], reports: Mapping[int, SwapCostReport]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "schedule": args.schedule,
        "ranks": args.ranks,
        "stages_per_rank": args.stages_per_rank,
        "microbatches": args.microbatches,
        "fsdp": args.fsdp,
        "transport": args.transport,
        "dxdw": args.dxdw,
        "overlap": args.overlap,
        "swap": "cost-aware" if args.cost_aware else ("gap" if args.swap else None),
        "min_gap": args.min_gap,
        "orders": {str(rank): [repr(step) for step in order] for rank, order in orders.items()},
    }
    if peaks:
        result["peaks"] = {str(rank): peaks[rank] for rank in orders}
    if reports:
        result["cost"] = {
            str(rank): {
                "chosen": [list(key) for key in reports[rank].chosen],
                "chosen_weight": [list(key) for key in reports[rank].chosen_weight],
                "rejected": [
                    {"stage": r.stage, "micro": r.micro, "reason": r.reason.value, "detail": r.detail,
                     "window": r.phase.value}
                    for r in reports[rank].rejected
                ],
            }
            for rank in orders
        }
    return result


def _human(args: argparse.Namespace, orders: Mapping[int, Sequence[MetaStep]],
           peaks: Mapping[int, dict[str, Any]], reports: Mapping[int, SwapCostReport]) -> str:
    lines = [_headline(args)]
    for rank, order in orders.items():
        stages = sorted({leaf.stage for s in order if s.is_compute_slot for leaf in s.leaves()})
        slots = sum(s.is_compute_slot for s in order)
        lines.append("")
        lines.append(f"rank {rank} (stage{'s' if len(stages) > 1 else ''} "
                     f"{', '.join(map(str, stages))}): {len(order)} steps, {slots} compute slots")
        lines.extend(_order_lines(order))
        if rank in peaks:
            lines.append(_peak_line(peaks[rank]))
        if rank in reports:
            lines.extend(_cost_lines(reports[rank]))
    return "\n".join(lines)


def _order_lines(order: Sequence[MetaStep]) -> list[str]:
    """One line per compute slot, with the non-compute steps that follow it on that line."""
    rows: list[tuple[str, str, list[str]]] = [("", "", [])]
    for step in order:
        if step.is_compute_slot:
            rows.append((str(len(rows) - 1), repr(step), []))
        else:
            rows[-1][2].append(repr(step))
    if not rows[0][2]:
        rows.pop(0)
    width = max([len(compute) for _, compute, _ in rows] + [len("compute")])
    header = f"  {'slot':>4}  {'compute':<{width}}  then, up to the next compute slot"
    return [header] + [f"  {slot:>4}  {compute:<{width}}  {' '.join(rest)}".rstrip() for slot, compute, rest in rows]


def _peak_line(peak: Mapping[str, Any]) -> str:
    def amount(value: int) -> str:
        return f"{value} chunks" if peak["unit"] == "chunks" else f"{value / MIB:,.1f} MiB"

    before, after = peak["without"], peak["with"]
    change = f" ({(after - before) / before:+.1%})" if before else ""
    weight = (f", dW state of {peak['weight_swapped']} of {peak['weight_windows']} "
              f"({peak['weight_eligible']} eligible)" if peak["weight_windows"] else "")
    return (f"  swapped {peak['swapped']} of {peak['chunks']} chunks ({peak['eligible']} eligible){weight}; "
            f"predicted peak {amount(before)} -> {amount(after)}{change}")


def _cost_lines(report: SwapCostReport) -> list[str]:
    by_reason: dict[str, list[str]] = {}
    for rejected in report.rejected:
        suffix = "" if rejected.phase is SwapPhase.ACTIVATIONS else "w"
        by_reason.setdefault(rejected.reason.value, []).append(f"{rejected.stage}:{rejected.micro}{suffix}")
    kept = "; ".join(f"{reason} {' '.join(keys)}" for reason, keys in sorted(by_reason.items()))
    chosen = " ".join(f"{s}:{m}" for s, m in report.chosen) or "none"
    lines = [f"  cost-aware: swapped (stage:micro) {chosen}"]
    if report.chosen_weight:
        weight = " ".join(f"{s}:{m}" for s, m in report.chosen_weight)
        lines.append(f"  cost-aware: dW state swapped (stage:micro) {weight}")
    return [*lines, f"  kept resident: {kept or 'none'}"]
