"""Bandwidth probe defaults and argument checks; DeviceTimer on CPU."""

from __future__ import annotations

import time

import pytest
import torch

from hyper_offload.errors import OffloadRuntimeError
from hyper_offload.passes.ir.trace import DEFAULT_BANDWIDTH_GBPS
from hyper_offload.runtime.device import (
    DEFAULT_TRANSFER_BANDWIDTH,
    DeviceTimer,
    TransferBandwidth,
    profile_transfer_bandwidth,
)


def test_default_is_16_each_way_and_unmeasured() -> None:
    assert DEFAULT_TRANSFER_BANDWIDTH == TransferBandwidth(16.0, 16.0, measured=False)
    assert DEFAULT_BANDWIDTH_GBPS == 16.0


@pytest.mark.parametrize("device", [None, "cpu", "cuda"])
def test_probe_returns_default_without_an_accelerator(device) -> None:
    result = profile_transfer_bandwidth(device)
    if torch.accelerator.is_available() and device != "cpu":
        assert result.measured and result.d2h_gbps > 0 and result.h2d_gbps > 0
    else:
        assert result == DEFAULT_TRANSFER_BANDWIDTH


@pytest.mark.parametrize(
    "kwargs", [{"probe_bytes": 0}, {"probe_bytes": -1}, {"probe_bytes": 1.5}, {"repeats": 0}]
)
def test_probe_rejects_bad_arguments(kwargs) -> None:
    with pytest.raises(ValueError, match="must be an int > 0"):
        profile_transfer_bandwidth("cpu", **kwargs)


# The CPU timer reads perf_counter: each interval it measures lies within the interval
# the test brackets around it with the same clock, and contains the sleep inside it.
# No bound on how fast the machine is (issue 45: no wall-clock limits in tests).


def test_cpu_timer_measures_wall_time_as_context_manager() -> None:
    before = time.perf_counter()
    with DeviceTimer("cpu") as timer:
        time.sleep(0.02)
    after = time.perf_counter()
    assert 0.02 <= timer.elapsed_s <= after - before
    assert "ms" in repr(timer)


def test_cpu_timer_start_stop_and_restart() -> None:
    timer = DeviceTimer("cpu")
    timer.start()
    time.sleep(0.03)
    first = timer.stop()
    assert first >= 0.03 and timer.elapsed_s == first
    restarted = time.perf_counter()
    timer.start()
    second = timer.stop()
    # restarted: measures only the new interval, not the one before the restart
    assert 0 <= second <= time.perf_counter() - restarted


def test_timer_misuse_raises_naming_the_fix() -> None:
    timer = DeviceTimer("cpu")
    with pytest.raises(OffloadRuntimeError, match="call start\\(\\) and stop\\(\\)"):
        _ = timer.elapsed_s
    with pytest.raises(OffloadRuntimeError, match="never started"):
        timer.stop()
    timer.start()
    with pytest.raises(OffloadRuntimeError, match="call start\\(\\) and stop\\(\\)"):
        _ = timer.elapsed_s  # started but not stopped
    assert "unfinished" in repr(timer)
