"""Markdown table from ``benchmarks/anchors.py`` JSON lines.

    python benchmarks/anchors_table.py anchors.jsonl [more.jsonl ...] > table.md

One row per line, in input order. Lines of other benchmarks are skipped; a failed method
(``error``) gets a row that says so. Bytes are shown in MiB; ``n/a`` marks a figure the
device cannot give (compiled code's peak on CPU), ``ref`` the numerics references.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

COLUMNS = ("method", "peak step MiB", "saved at fwd end MiB", "budget MiB", "moved MiB/step",
           "step ratio", "ratio vs compile", "numerics equal", "notes")


def _mib(value: Any) -> str:
    return "n/a" if value is None else f"{value / (1 << 20):.2f}"


def _ratio(value: Any) -> str:
    return "" if value is None else f"{value:.2f}x"


def _notes(r: dict[str, Any]) -> str:
    notes = []
    if r.get("inner"):
        notes.append(f"inner={r['inner']}")
    if "checkpoint_blocks" in r:
        notes.append(f"{r['checkpoint_blocks']}/{r['layers']} blocks checkpointed")
    if r.get("feasible") is False:
        notes.append("budget infeasible: planned peak "
                     f"{_mib(r.get('planned_peak_bytes', r.get('predicted_peak_after')))} MiB")
    if "predicted_peak_after" in r:
        notes.append(f"predicted peak {_mib(r['predicted_peak_before'])} -> "
                     f"{_mib(r['predicted_peak_after'])} MiB")
    if "first_call_s" in r:
        notes.append(f"first call {r['first_call_s']:.1f} s")
    return "; ".join(notes)


def row(r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return [r["method"], *[""] * 6, "", "failed: " + " ".join(r["error"])[:120]]
    budget = r["budget_bytes"] if r.get("inner") is None else None
    numerics = {None: "ref", True: "yes", False: "**no**"}[r.get("numerics_equal")]
    budget_cell = _mib(budget) if budget is not None else f"{r['budget_fraction']:.2f} of region"
    return [r["method"], _mib(r.get("peak_step_bytes")), _mib(r.get("saved_bytes")), budget_cell,
            _mib(r.get("bytes_moved", 0)), _ratio(r.get("step_ratio")),
            _ratio(r.get("step_ratio_vs_compile")), numerics, _notes(r)]


def table(records: Iterable[dict[str, Any]]) -> str:
    rows = [row(r) for r in records if r.get("bench") == "anchors"]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def read(paths: Iterable[str]) -> list[dict[str, Any]]:
    records = []
    for path in paths:
        with open(path) if path != "-" else sys.stdin as f:
            records += [json.loads(line) for line in f if line.startswith("{")]
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="JSON-lines files ('-' for stdin)")
    sys.stdout.write(table(read(parser.parse_args(argv).paths)))


if __name__ == "__main__":
    main()
