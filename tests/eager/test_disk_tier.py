"""The eager door's disk tier (issue 50): under a host budget that binds, the host copies
that wait longest go to files in ``disk_dir``. Every step is bit-exact against the plain
model, the host pool never holds more than the host budget (its high-water mark), the
device holds no more than without the disk tier, and no file is left after a step, a
failed step or an interrupted one."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest
import torch

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.config import MIB
from hyper_offload.passes import GreedyResidencyPlanner, plan_residency, required_bytes

from .models import CASES, assert_same_state, make_pair, plain_peak_bytes, train_step


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _run(config: OffloadConfig, root: Path, steps: int = 3) -> OffloadSession:
    """``steps`` steps of the transformer case against the plain model: loss, every
    gradient and parameter equal; no file in ``root`` after any step."""
    model, ref, x = make_pair(CASES["transformer"], torch.float32)
    session = OffloadSession(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(steps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with session:
                loss = train_step(model, x, opt, step)
        assert _files(root) == [], f"step {step} left files behind"
        ref_loss = train_step(ref, x, ref_opt, step)
        assert torch.equal(loss, ref_loss), f"step {step}: loss differs"
        assert_same_state(model, ref, f"step {step}")
        opt.step()
        ref_opt.step()
    return session


@pytest.fixture(scope="module")
def budgets() -> tuple[float, float]:
    """(device budget, host budget) in MiB: the device budget is the step's floor (what
    its largest op needs, above half the plain peak), the host budget half of what that
    device budget asks the host to hold: the host budget binds."""
    model, _, x = make_pair(CASES["transformer"], torch.float32)
    warm = OffloadSession(OffloadConfig(max_resident_activation_mb=plain_peak_bytes(model, x) / 2 / MIB,
                                        max_host_activation_mb=1024))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with warm:
            train_step(model, x, torch.optim.SGD(model.parameters(), lr=0.05), 0)
    assert warm.trace is not None
    trace = warm.trace.with_budget(max(required_bytes(warm.trace)))
    free = plan_residency(trace, GreedyResidencyPlanner(), where="test")
    assert free.binding == "device"
    return trace.budget_bytes / MIB, free.peak_host_bytes // 2 / MIB


def test_the_disk_tier_holds_what_the_host_cannot_exactly(
    budgets: tuple[float, float], tmp_path: Path
) -> None:
    device, host = budgets
    without = _run(OffloadConfig(max_resident_activation_mb=device, max_host_activation_mb=host),
                   tmp_path, steps=2)
    config = OffloadConfig(max_resident_activation_mb=device, max_host_activation_mb=host,
                           max_disk_activation_mb=64, disk_dir=tmp_path / "spill",
                           disk_bandwidth_gbps=2.0)
    session = _run(config, tmp_path, steps=2)
    stats, last = session.pool.stats(), session.last_stats
    assert last is not None and last.disk is not None
    assert last.bytes_to_disk > 0 and last.bytes_from_disk == last.bytes_to_disk
    assert stats.pinned_bytes_peak <= session.host_budget_bytes  # measured high-water
    assert stats.pageable_fallbacks == 0 and last.demand_loads == 0
    assert last.peak_resident_bytes < without.last_stats.peak_resident_bytes  # type: ignore[union-attr]
    assert last.disk.bytes_peak <= config.disk_budget_bytes
    plan = session._plan
    assert plan is not None and plan.report.ok and plan.report.bytes_to_disk == last.bytes_to_disk


def test_a_failing_step_leaves_no_file_and_no_host_buffer(
    budgets: tuple[float, float], tmp_path: Path
) -> None:
    device, host = budgets
    config = OffloadConfig(max_resident_activation_mb=device, max_host_activation_mb=host,
                           max_disk_activation_mb=64, disk_dir=tmp_path, disk_bandwidth_gbps=2.0)
    model, _, x = make_pair(CASES["transformer"], torch.float32)
    session = OffloadSession(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with session:  # warmup: the plan spills
            train_step(model, x, opt, 0)
    assert session.schedule is not None and session.report.bytes_to_disk > 0  # type: ignore[union-attr]
    for error in (RuntimeError("injected"), KeyboardInterrupt()):
        spilled = []

        def hook(grad: torch.Tensor) -> torch.Tensor:
            # The backward starts, the forward's spills are on disk: fail here.
            spilled.append(len(_files(tmp_path)))
            raise error

        with pytest.raises(type(error)):
            with session:  # train_step's ops, with the hook
                torch.manual_seed(1001)
                opt.zero_grad(set_to_none=True)
                loss = model(x)
                loss.register_hook(hook)
                loss.backward()
        assert spilled and spilled[0] > 0, "the failure came before any spill"
        assert _files(tmp_path) == [], f"{error!r} left files behind"
        assert session.pool.stats().pinned_bytes_in_use == 0
        assert session.manager.transfers_in_flight() == 0
    # The session still works after both failures, exactly as before.
    with session:
        train_step(model, x, opt, 1)
    assert _files(tmp_path) == [] and session.last_stats.bytes_to_disk > 0  # type: ignore[union-attr]


def test_the_session_directory_goes_with_the_session(tmp_path: Path) -> None:
    session = OffloadSession(OffloadConfig(max_disk_activation_mb=1, disk_dir=tmp_path,
                                           disk_bandwidth_gbps=1.0))
    assert session.disk is not None and session.disk.path.parent == tmp_path
    assert list(tmp_path.iterdir()) == [session.disk.path]
    del session
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_the_config_validates_the_disk_tier(tmp_path: Path) -> None:
    from hyper_offload.errors import ConfigurationError

    assert OffloadConfig().disk_budget_bytes == 0  # off by default
    assert OffloadConfig(max_disk_activation_mb=0).disk_budget_bytes == 0
    on = OffloadConfig(max_disk_activation_mb=2, disk_dir=tmp_path / "new" / "dir")
    assert on.disk_budget_bytes == 2 * MIB and not (tmp_path / "new").exists()  # not created
    cases = {
        "disk_dir is None": dict(max_disk_activation_mb=1),
        "not a directory": dict(max_disk_activation_mb=1, disk_dir=tmp_path / "file"),
        "no existing parent|not writable": dict(max_disk_activation_mb=1,
                                                disk_dir=tmp_path / "file" / "below"),
        "finite number of MiB": dict(max_disk_activation_mb=-1, disk_dir=tmp_path),
        "GB/s > 0": dict(disk_bandwidth_gbps=0.0),
    }
    (tmp_path / "file").write_text("")
    for message, kwargs in cases.items():
        with pytest.raises(ConfigurationError, match=message):
            OffloadConfig(**kwargs)
    with pytest.raises(ConfigurationError, match="os.PathLike"):
        OffloadConfig(max_disk_activation_mb=1, disk_dir=3)  # type: ignore[arg-type]
    # The bandwidth: given, or measured once on the directory (a positive figure).
    assert OffloadConfig(disk_bandwidth_gbps=3.5).disk_bandwidth() == 3.5
    assert on.disk_bandwidth() > 0 and (tmp_path / "new" / "dir").is_dir()
