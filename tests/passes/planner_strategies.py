"""Hypothesis strategies shared by the planner tests."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from hyper_offload.passes import ActivationTrace, required_bytes, resident_bytes_without_offload

SIZES = [0, 1, 2, 3, 5, 8, 13, 40]


@st.composite
def traces(draw: st.DrawFn, max_ops: int = 24, max_storages: int = 10) -> ActivationTrace:
    """Random accesses (some in place), sizes (some zero), retained sets and budgets
    from 0 (everything infeasible) to above the no-offload peak (nothing to do)."""
    num_ops = draw(st.integers(0, max_ops))
    num_storages = draw(st.integers(1, max_storages))
    ops: list[dict[int, str]] = [{} for _ in range(num_ops)]
    sizes = {s: draw(st.sampled_from(SIZES)) for s in range(num_storages)}
    if num_ops:
        for storage in range(num_storages):
            touched = draw(st.lists(st.integers(0, num_ops - 1), max_size=6, unique=True))
            for op in touched:
                ops[op][storage] = draw(st.sampled_from("RRW"))
    accessed = sorted({s for op in ops for s in op})
    retained = draw(st.sets(st.sampled_from(accessed))) if accessed else set()
    trace = ActivationTrace.from_accesses(ops, sizes, budget_bytes=0, retained=retained)
    peak = max(resident_bytes_without_offload(trace), default=0)
    return trace.with_budget(draw(st.integers(0, peak + 3)))


@st.composite
def pressured_traces(draw: st.DrawFn, max_ops: int = 40, max_storages: int = 20) -> ActivationTrace:
    """Traces that need offload and leave the planner choices: the budget lies between
    the largest op's unavoidable bytes and the no-offload peak (when there is room)."""
    trace = draw(traces(max_ops, max_storages))
    need = max(required_bytes(trace), default=0)
    peak = max(resident_bytes_without_offload(trace), default=0)
    if peak <= need:
        return trace
    return trace.with_budget(draw(st.integers(need, peak - 1)))


def with_times(trace: ActivationTrace, durations: list[float], gbps: float) -> ActivationTrace:
    """``trace`` with these op durations and both links at ``gbps``."""
    return dataclasses.replace(
        trace,
        ops=tuple(dataclasses.replace(op, duration_s=d) for op, d in zip(trace.ops, durations)),
        d2h_bandwidth_gbps=gbps, h2d_bandwidth_gbps=gbps,
    )


@st.composite
def timed_pressured(draw: st.DrawFn) -> tuple[ActivationTrace, int, int | None]:
    """A pressured trace with op times and a link slow enough that copies matter, and a
    door: (earliest prefetch op, latest release op)."""
    trace = draw(pressured_traces(max_ops=24, max_storages=10))
    durations = draw(st.lists(st.floats(0, 1e-6), min_size=trace.num_ops, max_size=trace.num_ops))
    gbps = draw(st.sampled_from([1e-4, 1e-3, 1e-2]))  # 100 kB/s .. 10 MB/s: 1-100 µs a kB
    split = draw(st.integers(0, trace.num_ops))
    latest = draw(st.sampled_from([None, max(split - 1, 0)]))
    return with_times(trace, durations, gbps), split, latest
