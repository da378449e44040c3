"""Warm restarts (issue 18, point 4): a second process with the same Inductor cache
directory is served our regions from AOTAutograd's cache, and they still offload,
exactly. (Before, a per-region nonce in the partitioner's ``uuid()`` kept every cache
from serving them, and the runtime was installed only by the partitioner.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch._functorch import config as functorch_config

import hyper_offload
from tests.conftest import AUTOGRAD_CACHE_ENV

from .compile_models import deterministic  # noqa: F401 (autouse)

CHILD = Path(__file__).with_name("warm_restart_child.py")


def _run(cache_dir: Path) -> dict[str, object]:
    # The suite turns AOTAutograd's cache off (tests/conftest.py); these processes use it.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), AUTOGRAD_CACHE_ENV: "1"}
    done = subprocess.run(
        [sys.executable, str(CHILD)], env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_is_served_from_the_cache_and_still_offloads(tmp_path: Path) -> None:
    cold, warm = _run(tmp_path), _run(tmp_path)
    assert cold["from_cache"] is False and cold["aot_cache_hits"] == 0
    assert warm["from_cache"] is True and warm["aot_cache_hits"] == 1  # no partitioner ran
    for run in (cold, warm):
        assert run["equal"], run  # loss and every gradient equal plain Inductor's
        assert run["offloaded"], run
        # Bytes on the device: the offloaded activations are not held there.
        assert run["saved_device_bytes"] < run["plain_saved_device_bytes"], run
        assert run["host_buffers_in_use"] == 0, run
    assert warm["offloaded"] == cold["offloaded"]  # the plan came back with the code
    assert warm["saved_device_bytes"] == cold["saved_device_bytes"]


def test_in_one_process_an_identical_region_is_served_with_its_plan() -> None:
    torch._dynamo.reset()
    x = torch.randn(32, 64)
    runs = []
    with functorch_config.patch(enable_autograd_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
            backend = hyper_offload.backend(max_resident_activation_fraction=0.5)
            torch.compile(net, backend=backend)(x).pow(2).mean().backward()
            runs.append((backend, [p.grad for p in net.parameters()]))
    (first_backend, first_grads), (second_backend, second_grads) = runs
    first, second = first_backend.regions[0], second_backend.regions[0]
    assert second.from_cache and second.graphs is None  # no partitioner ran
    assert second.planned.report == first.planned.report and second.planned.report.offloaded
    assert all(map(torch.equal, first_grads, second_grads))
    assert second_backend.runtime.pool.stats().buffers_in_use == 0
