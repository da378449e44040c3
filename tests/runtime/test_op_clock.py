"""OpClock: op durations in seconds, wall clock on CPU, timing events on a GPU."""

from __future__ import annotations

import time

import pytest
import torch

from hyper_offload.runtime.device import OpClock


def test_cpu_durations_are_the_wall_time_between_start_and_stop() -> None:
    clock = OpClock(torch.device("cpu"))
    short = clock.start()
    clock.stop(short)
    long = clock.start()
    time.sleep(0.02)
    clock.stop(long)
    durations = clock.durations()
    assert set(durations) == {short, long} and (short, long) == (0, 1)
    assert 0 <= durations[short] < 0.02 <= durations[long] < 1.0
    assert "wall clock, 2 ops timed" in repr(clock)


def test_a_token_is_stopped_once() -> None:
    clock = OpClock(torch.device("cpu"))
    token = clock.start()
    clock.stop(token)
    with pytest.raises(ValueError, match=r"OpClock.stop\(0\): not a started, unstopped token"):
        clock.stop(token)
    with pytest.raises(ValueError, match=r"OpClock.stop\(5\)"):
        clock.stop(5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_durations_time_the_kernel_not_the_launch() -> None:
    device = torch.device("cuda")
    clock = OpClock(device)
    token = clock.start()
    launched = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time; returns at once
    launch_s = time.perf_counter() - launched
    clock.stop(token)
    busy_s = clock.durations()[token]
    assert busy_s > 10 * launch_s and busy_s > 0.01, (busy_s, launch_s)
