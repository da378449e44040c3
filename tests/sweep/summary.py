"""Counts over sweep results: per door, overall and per dtype, and the failures.

An op is *exercised* in a door when at least one of its samples was judged there (passed
or failed, not skipped); ``ops_moved`` counts the exercised ops with at least one judged
sample whose run moved bytes to the host (a pass that moved nothing proves nothing about
the library, so ``passed_nothing_moved`` counts those apart). Ops of ``op_db``'s autograd
set that no door could run (no float32/complex64/bfloat16 support on CPU, or every
sample skipped) are listed under ``not_exercised`` with their skip reasons.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .doors import CaseResult

__all__ = ["counts", "summarize"]

NO_DTYPE = "no_dtype"
"""Reason for an op that supports none of the swept dtypes on CPU (forward and backward)."""


def counts(results: Sequence[CaseResult]) -> dict[str, Any]:
    """Samples, passed (and of those, how many moved nothing), skipped per reason,
    failed, and the ops run / exercised / exercised with bytes moved."""
    judged = [r for r in results if r.status != "skipped"]
    return {
        "samples": sum(1 for r in results if r.sample >= 0),
        "passed": sum(1 for r in results if r.status == "passed"),
        "passed_nothing_moved": sum(1 for r in results if r.status == "passed" and not r.moved),
        "skipped": sum(1 for r in results if r.status == "skipped"),
        "skipped_by_reason": dict(sorted(Counter(r.skip for r in results if r.skip).items())),
        "failed": sum(1 for r in results if r.status == "failed"),
        "failed_by_cause": dict(sorted(Counter(
            r.cause or "library" for r in results if r.status == "failed").items())),
        "ops_run": len({r.op for r in results}),
        "ops_exercised": len({r.op for r in judged}),
        "ops_moved": len({r.op for r in judged if r.moved}),
        "moved_bytes": sum(r.moved_bytes for r in results),
    }


def _not_exercised(
    results: Sequence[CaseResult], autograd_ops: Iterable[str], no_dtype: Iterable[str]
) -> dict[str, dict[str, int]]:
    """For each autograd op with no judged sample: its skip reasons and their counts."""
    judged = {r.op for r in results if r.status != "skipped"}
    reasons: dict[str, Counter[str]] = {}
    for r in results:
        if r.op not in judged and r.skip:
            reasons.setdefault(r.op, Counter())[r.skip] += 1
    for op in no_dtype:
        reasons.setdefault(op, Counter())[NO_DTYPE] += 1
    return {op: dict(reasons.get(op, Counter({"not_run": 1})))
            for op in sorted(autograd_ops) if op not in judged}


def _door_summary(
    results: Sequence[CaseResult], autograd_ops: Sequence[str], no_dtype: Sequence[str]
) -> dict[str, Any]:
    totals = counts(results)
    totals["exercised_fraction"] = round(totals["ops_exercised"] / max(len(autograd_ops), 1), 4)
    dtypes = sorted({r.dtype for r in results})
    return {
        "totals": totals,
        "by_dtype": {d: counts([r for r in results if r.dtype == d]) for d in dtypes},
        "not_exercised": _not_exercised(results, autograd_ops, no_dtype),
    }


def _failure(r: CaseResult) -> dict[str, Any]:
    return {
        "op": r.op, "variant": r.variant, "dtype": r.dtype, "sample": r.sample, "door": r.door,
        "detail": r.detail, "mismatch": r.mismatch, "moved_bytes": r.moved_bytes,
        "cause": r.cause or "library",
    }


def summarize(
    results: Sequence[CaseResult],
    *,
    op_db_size: int,
    autograd_ops: Sequence[str],
    no_dtype: Sequence[str],
    config: Mapping[str, Any],
) -> dict[str, Any]:
    """The JSON summary ``make sweep`` writes (module docstring)."""
    doors = sorted({r.door for r in results})
    return {
        "config": dict(config),
        "ops": {"op_db": op_db_size, "autograd": len(autograd_ops), NO_DTYPE: list(no_dtype)},
        "doors": {
            door: _door_summary([r for r in results if r.door == door], autograd_ops, no_dtype)
            for door in doors
        },
        "failures": [_failure(r) for r in results if r.status == "failed"],
    }
