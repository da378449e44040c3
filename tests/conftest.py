"""Test-session settings shared by every test directory.

AOTAutograd's cache is off for the session (and for the worker processes tests spawn):
with it, a test that compiles a model another test already compiled is served the
compiled code without running our partitioner, so its lowered graphs
(``regions[i].graphs``) and everything a test inspects of one compile depend on test
order. The cached path is tested on purpose, with the cache on, in
``tests/compiler/test_warm_restart.py`` (in-process and across processes).

Under ``pytest-xdist`` (``make test`` runs two workers on two cores) each worker keeps
torch to one intra-op thread: two workers with two threads each on two cores spin
against each other. Every numerics test compares runs made in the same process, so the
thread count is the reference's too.

``one_rank``: a default process group of one gloo rank in this process (a
``HashStore``), for tests of collectives that need no worker processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch._functorch import config as functorch_config

AUTOGRAD_CACHE_ENV = "TORCHINDUCTOR_AUTOGRAD_CACHE"


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker
        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def no_autograd_cache() -> Iterator[None]:
    previous = os.environ.get(AUTOGRAD_CACHE_ENV)
    os.environ[AUTOGRAD_CACHE_ENV] = "0"
    with functorch_config.patch(enable_autograd_cache=False):
        yield
    if previous is None:
        del os.environ[AUTOGRAD_CACHE_ENV]
    else:
        os.environ[AUTOGRAD_CACHE_ENV] = previous


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    if dist.is_initialized():  # pragma: no cover - another test left a group behind
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
