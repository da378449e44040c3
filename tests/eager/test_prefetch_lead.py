"""Eager reloads start ahead of their reads (the shared pipeline's prefetch placement),
and the replay still meets the budget and changes no bit.

The warmup plans through :func:`hyper_offload.passes.plan_residency` with earliest op 0,
so a reload's ``COPY_H2D`` sits some ops before the ``WAIT_H2D`` of the op that reads
it. Replay runs on two engines: the CPU one (copies complete at once) and the scripted
CUDA one of ``tests/runtime`` (a copy moves no byte until the compute stream waits for
it), where a read before the wait would see the freshly allocated, unfilled storage.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hyper_offload import OffloadConfig, OffloadSession, skip_offload
from hyper_offload.config import MIB
from hyper_offload.passes import required_bytes, resident_bytes_without_offload
from hyper_offload.passes.plan.planning import prefetch_leads
from hyper_offload.runtime import DeviceMemoryMeter, TransferEngine
from tests.runtime.scripted_cuda import ScriptedCudaEngine

from .models import CASES, assert_same_state, make_pair, train_step

INPUT = (8, 32, 32)  # activations, not the retained gradients, dominate the block's bytes

ENGINES: dict[str, Callable[[], TransferEngine | None]] = {
    "cpu": lambda: None,  # the session's own engine
    "scripted_cuda": ScriptedCudaEngine,
}


def _budget() -> int:
    """Well under the block's plain peak (reloads are forced), at or above what every op
    needs on its own (the plan is feasible)."""
    model, _, x = make_pair(CASES["transformer"], torch.float32, input_shape=INPUT)
    probe = OffloadSession(OffloadConfig())
    with probe:
        train_step(model, x, torch.optim.SGD(model.parameters(), lr=0.0), 0)
    assert probe.trace is not None
    peak = max(resident_bytes_without_offload(probe.trace))
    return max(max(required_bytes(probe.trace)), int(peak * 0.6))


@pytest.mark.parametrize("engine_name", sorted(ENGINES))
def test_transformer_reloads_lead_their_reads_and_replay_is_exact(engine_name: str) -> None:
    budget = _budget()
    model, ref, x = make_pair(CASES["transformer"], torch.float32, input_shape=INPUT)
    engine = ENGINES[engine_name]()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB), engine=engine)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    with session:  # warmup: record, evict online, plan
        loss = train_step(model, x, opt, 0)
    assert torch.equal(loss, train_step(ref, x, ref_opt, 0))
    assert_same_state(model, ref, f"{engine_name} warmup")
    schedule, report = session.schedule, session.report
    assert schedule is not None and report is not None and report.ok and report.feasible
    leads = [wait - copy for _, copy, wait in prefetch_leads(schedule)]
    assert leads, "the budget forced no reload: the test proves nothing"
    assert all(lead >= 0 for lead in leads)
    assert any(lead > 0 for lead in leads), f"every reload is issued at its read: {leads}"
    assert report.peak_resident_bytes <= budget

    for step in (1, 2):
        opt.step()
        ref_opt.step()
        meter = DeviceMemoryMeter("cpu")
        with meter:
            with session:  # replay: early COPY_H2D, WAIT_H2D at the read
                loss = train_step(model, x, opt, step)
        where = f"{engine_name} replay step {step}"
        assert torch.equal(loss, train_step(ref, x, ref_opt, step)), f"{where}: loss differs"
        assert_same_state(model, ref, where)
        stats = session.last_stats
        assert stats is not None and stats.phase == "replay"
        assert stats.demand_loads == 0, f"{where}: a read was not covered by a planned reload"
        assert stats.bytes_h2d == report.bytes_h2d > 0
        assert stats.resident_curve == list(report.resident_bytes)
        assert meter.curve() == list(report.resident_bytes)[:-1]  # the last: the step-end op
        assert stats.peak_resident_bytes == report.peak_resident_bytes <= budget
        assert meter.peak_bytes <= budget
    if isinstance(engine, ScriptedCudaEngine):
        assert engine.sim.violations == []
        assert engine.sim.stream_waits, "no WAIT_H2D reached the compute stream"


# ----------------------------------------------------------- a read the trace cannot see

N = 4096  # floats per tensor: 16 KiB


def _closure_step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` is idle while four temporaries live, then read twice: by an opaque region
    through a closure (the trace records only the region's argument ``s``) and by the
    final multiply (recorded). Each temporary is deleted after its last use (the warmup
    records where storages die: a variable that kept them would hold their bytes), and a
    narrow op before the region leaves room to reload ``a`` ahead of it."""
    a = x * 2
    t1 = x + 1
    t2 = t1 * 2
    t3 = t2 * 2
    t4 = t3 * 2
    s = t1 + t2
    del t1, t2
    s = s + t3
    del t3
    s = s + t4
    del t4
    s = s * 1.5

    @skip_offload
    def region(h: torch.Tensor) -> torch.Tensor:
        return h + a.sum()  # reads `a`: invisible to the trace

    r = region(s)
    return a * r, r


def test_an_untraced_read_waits_for_an_early_reload() -> None:
    """The region runs after the COPY_H2D of ``a`` and before its WAIT_H2D. On the
    scripted CUDA the copy has not moved a byte then: without the replay's wait the
    region would sum an unfilled storage."""
    x = torch.randn(N)
    expected = _closure_step(x)
    engine = ScriptedCudaEngine()
    budget = 4 * N * 4  # a cannot stay while t1..t4 and their sums live
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB), engine=engine)
    with session:
        got = _closure_step(x)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    names = [op.name for op in session.trace.ops]
    region_op = next(i for i, n in enumerate(names) if n.startswith("opaque:"))
    reloads = prefetch_leads(session.schedule)
    spans = [(copy, wait) for _, copy, wait in reloads if copy <= region_op < wait]
    assert spans, f"no reload spans the region (op {region_op}): {reloads}"
    for _ in range(2):
        with session:
            executor = session.executor
            got = _closure_step(x)
        assert all(torch.equal(g, e) for g, e in zip(got, expected))
        assert executor is not None and executor.early_reload_waits == len(spans)
        assert session.last_stats.demand_loads == 0
    assert engine.sim.violations == []
