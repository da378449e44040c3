"""Markdown table and tallies from ``benchmarks/recompute_mix.py`` JSON lines.

    python benchmarks/recompute_mix_table.py out/recompute_mix.jsonl > table.md

One row per ``recompute_mix`` line, in input order, then the tallies issue 17 asks
about: on how many rows the backend's exact choice is at most, and strictly below, the
best single strategy (offload only, torch's recompute only). Two kinds of row cannot be
strictly below, whatever the plan, and are counted apart:

* **infeasible for every strategy**: no partition's plan meets the budget (the largest
  ops' own operands are above it);
* **already at the compute floor**: offload only is predicted stall-free at the plain
  partition's compute, and no partition computes less than the plain one (recompute
  only adds ops), so nothing can be faster.

All step times are *predicted* (the benchmark's GPU-priced traces).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

LABELS = {
    "llama_7b_width_4_layers_seq4096": "Llama-7B width, 4 layers",
    "llama_1b_like_gqa_8_layers_seq8192": "Llama-1B-like GQA, 8 layers",
    "gpt2_small_b4_seq2048": "GPT-2-small shape",
}
COLUMNS = (
    "trace", "link", "budget", "offload only (ms)", "recompute only (ms, at budget)",
    "joint, any (ms, at budget)", "backend, exact (ms, how)", "backend recomputes (ops)",
    "any < best single", "exact < best single",
)


def _at(ms: float | None, budget: float | None) -> str:
    return "—" if ms is None else f"{ms} ({budget:g})"


def _how(r: dict[str, Any]) -> str:
    """How the exact backend recomputes: torch's partition at a budget, or the spliced
    backward of the default partition with ``n`` saved activations dropped."""
    if r["backend_ms"] is None:
        return "—"
    if r["backend_spliced"]:
        return f"{r['backend_ms']} (spliced {r['backend_spliced']})"
    return _at(r["backend_ms"], r["backend_memory_budget"])


def _verdict(le: bool | None, lt: bool | None) -> str:
    if le is None:
        return "—"
    return "yes" if lt else ("tie" if le else "slower")


def row(r: dict[str, Any]) -> list[str]:
    return [
        LABELS.get(r["model"], r["model"]), f"{r['link_gbps']:g} GB/s",
        f"{r['budget_fraction']:.0%}", "—" if r["offload_only_ms"] is None else str(r["offload_only_ms"]),
        _at(r["recompute_only_ms"], r["recompute_only_memory_budget"]),
        _at(r["joint_ms"], r["joint_memory_budget"]), _how(r),
        str(r["backend_recomputed_ops"] if r["backend_ms"] is not None else 0),
        _verdict(r["joint_le_best_single"], r["joint_strictly_lower"]),
        _verdict(r["backend_le_best_single"], r["backend_strictly_lower"]),
    ]


def tallies(records: list[dict[str, Any]]) -> dict[str, int]:
    """Row counts for the issue's two figures and the rows no plan can beat."""
    infeasible = [r for r in records if r["joint_ms"] is None and r["backend_ms"] is None]
    at_floor = [r for r in records if r["offload_only_ms"] is not None
                and r["offload_only_ms"] <= r["plain_compute_ms"]]
    return {
        "rows": len(records),
        "exact_le_best_single": sum(bool(r["backend_le_best_single"]) for r in records),
        "exact_strictly_lower": sum(bool(r["backend_strictly_lower"]) for r in records),
        "exact_slower": sum(r["backend_le_best_single"] is False for r in records),
        "any_strictly_lower": sum(bool(r["joint_strictly_lower"]) for r in records),
        "infeasible_for_every_strategy": len(infeasible),
        "offload_only_at_compute_floor": len(at_floor),
    }


def table(records: Iterable[dict[str, Any]]) -> str:
    records = [r for r in records if r.get("bench") == "recompute_mix"]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in records]
    counts = tallies(records)
    lines += ["", ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in counts.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args()
    records = [json.loads(line) for path in args.paths for line in open(path) if line.strip()]
    sys.stdout.write(table(records) + "\n")


if __name__ == "__main__":
    main()
