"""The compile door's disk tier (issue 50), measured on CPU with aot_eager, region scope.

The 4-block model compiled whole at half its saved bytes on the device, with a host
budget of 1.5 MiB: without a disk tier the host budget binds (the plan keeps bytes on the
device past its budget); with one, the host copies that wait longest go to files and the
device budget holds. Every step is ``torch.equal`` to plain aot_eager, the host pool's
high-water mark stays within the host budget, and no file is left after a step, after a
step whose backward never ran, nor after one whose backward failed mid-way.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import hyper_offload
from hyper_offload.errors import ConfigurationError
from hyper_offload.passes.ir import ops

from .step_models import build, exact, train

HOST_MIB = 1.5
HOST = int(HOST_MIB * (1 << 20))


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.fixture(scope="module")
def reference():
    torch._dynamo.reset()
    model, step = build("whole", "aot_eager")
    return train(model, step, 1)[0]


def _backend(reference, **disk):
    torch._dynamo.reset()
    return hyper_offload.backend(
        inner_compiler="aot_eager", max_resident_activation_mb=reference.saved_bytes / 2 / (1 << 20),
        max_host_activation_mb=HOST_MIB, recompute="off", budget_scope="region", **disk)


@pytest.fixture(scope="module")
def spilling(reference, tmp_path_factory):
    """The backend with a disk tier, its compiled step, and the directory."""
    root = tmp_path_factory.mktemp("disk")
    backend = _backend(reference, max_disk_activation_mb=64, disk_dir=root,
                       disk_bandwidth_gbps=2.0)
    model, step = build("whole", backend)
    return backend, model, step, root


def test_the_disk_tier_lets_the_device_budget_hold_exactly(reference, spilling) -> None:
    backend, model, step, root = spilling
    budget = reference.saved_bytes // 2
    store = backend.runtime.disk.store
    for number in range(3):
        (result,) = train(model, step, 1)
        assert exact(result, reference), f"step {number} differs from plain aot_eager"
        assert result.saved_bytes <= budget  # measured: what the backward holds on the device
        store.synchronize()
        assert _files(root) == [], f"step {number} left files behind"
    (region,) = backend.reports
    assert region.binding == "device" and region.predicted_peak_after <= budget
    assert region.peak_host_bytes <= HOST
    pool = backend.runtime.pool.stats()
    assert pool.pinned_bytes_peak <= HOST and pool.pageable_fallbacks == 0  # measured
    assert backend.runtime.disk.bytes_to_disk == backend.runtime.disk.bytes_from_disk > 0
    assert store.stats().bytes_peak <= 64 << 20
    # Without the disk tier the host budget binds: the device holds more than its budget.
    plain = _backend(reference)
    model2, step2 = build("whole", plain)
    (held,) = train(model2, step2, 1)
    assert plain.reports[0].binding == "host" and held.saved_bytes > budget


def test_the_lowered_graphs_hold_spilled_copies_past_all_compute(spilling) -> None:
    """A spilled (forward) or released loaded (backward) host copy's pool buffer goes back
    to the pool early; each graph's last op reads them and every output, so the inner
    compiler cannot reuse them as scratch (Inductor did: test_inductor_is_exact...)."""
    backend, _, _, _ = spilling
    fw, bw = backend.regions[0].graphs
    for graph, source in ((fw.graph, ops.SPILL_TO_DISK), (bw.graph, ops.LOAD_FROM_DISK)):
        output = graph.find_nodes(op="output")[0]
        hold = output.prev
        assert hold.target is ops.HOLD
        held = set(hold.args[0])
        outputs = [n for n in output.args[0] if isinstance(n, torch.fx.Node)]
        assert {n for n in outputs if isinstance(n.meta.get("val"), torch.Tensor)} <= held
        copies = [n.args[0] if source is ops.SPILL_TO_DISK else n
                  for n in graph.nodes if n.target is source]
        assert copies and set(copies) <= held


@pytest.mark.extended
def test_inductor_is_exact_with_the_disk_tier(tmp_path: Path) -> None:
    """Inductor (deterministic) reuses dead buffers as scratch: the holds keep it off the
    host copies the disk tier gave back (without them ``verify`` caught a reload that
    differed from its D2H). One verified step, equal to plain Inductor."""
    torch.use_deterministic_algorithms(True)
    try:
        torch._dynamo.reset()
        model, step = build("whole", "inductor")
        plain = train(model, step, 1)[0]
        torch._dynamo.reset()
        backend = hyper_offload.backend(
            max_resident_activation_mb=plain.saved_bytes / 2 / (1 << 20),
            max_host_activation_mb=HOST_MIB, recompute="off", budget_scope="region",
            max_disk_activation_mb=64, disk_dir=tmp_path, disk_bandwidth_gbps=2.0, verify=True)
        model, step = build("whole", backend)
        (result,) = train(model, step, 1)
        assert exact(result, plain) and backend.runtime.disk.bytes_to_disk > 0
        assert result.saved_bytes <= plain.saved_bytes // 2
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_step_whose_backward_never_runs_or_fails_leaves_no_file(reference, spilling) -> None:
    backend, model, step, root = spilling
    store = backend.runtime.disk.store
    x = torch.randn(4, 128, 64, generator=torch.Generator().manual_seed(1))
    loss = step(x)  # the forward spilled: files exist until the graph goes
    store.synchronize()
    assert _files(root)
    del loss
    gc.collect()
    store.synchronize()
    assert _files(root) == [] and store.stats().files == 0
    # A backward whose second read fails (an I/O error injected on this store only).
    reads = []
    real_read = store.read

    def failing_read(*args, **kwargs):
        reads.append(args[0])
        if len(reads) == 2:
            raise OSError(5, "Input/output error (injected)")
        return real_read(*args, **kwargs)

    store.read = failing_read  # type: ignore[method-assign]
    try:
        loss = step(x)
        with pytest.raises(OSError, match="injected"):
            loss.backward()
    finally:
        del store.read
    del loss
    gc.collect()
    store.synchronize()
    assert _files(root) == [] and backend.runtime.pool.stats().pinned_bytes_in_use == 0
    model.zero_grad(set_to_none=True)
    (result,) = train(model, step, 1)  # and the next step is exact again
    assert exact(result, reference)


def test_the_disk_tier_needs_the_region_scope(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="budget_scope='region'"):
        hyper_offload.backend(max_disk_activation_mb=1, disk_dir=tmp_path)
    with pytest.raises(ConfigurationError, match="disk_dir"):
        hyper_offload.backend(max_disk_activation_mb=1, budget_scope="region")


def test_the_options_carry_the_disk_tier(tmp_path: Path) -> None:
    from hyper_offload.compiler.options import parse_backend_options

    options = parse_backend_options(dict(max_disk_activation_mb=3, disk_dir=str(tmp_path),
                                         disk_bandwidth_gbps=1.5, budget_scope="region"))
    assert options.config.disk_budget_bytes == 3 << 20 and options.disk_bandwidth_gbps == 1.5
    assert "max_disk_activation_mb=3" in options.cache_key()  # another tier recompiles
    assert parse_backend_options({}).disk_bandwidth_gbps is None
