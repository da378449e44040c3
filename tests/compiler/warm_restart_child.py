"""One process of the warm-restart test: plain Inductor and ``hyper_offload`` (Inductor)
compile the same tiny MLP and run one step; prints one JSON line.

Run by ``test_warm_restart.py`` twice with one shared ``TORCHINDUCTOR_CACHE_DIR``: the
second process must be served from the cache and still offload, exactly.
"""

from __future__ import annotations

import json

import torch
from torch._dynamo.utils import counters

import hyper_offload
from hyper_offload.runtime.saved_bytes import saved_device_bytes


def _step(backend: object) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    loss = torch.compile(net, backend=backend)(torch.randn(32, 64)).pow(2).mean()
    saved = saved_device_bytes(loss, exclude=list(net.parameters()))
    loss.backward()
    return [loss.detach()] + [p.grad for p in net.parameters()], saved


def main() -> None:
    torch.use_deterministic_algorithms(True)
    plain, plain_saved = _step("inductor")
    hits_before = counters["aot_autograd"]["autograd_cache_hit"]
    backend = hyper_offload.backend(max_resident_activation_fraction=0.5)
    ours, ours_saved = _step(backend)
    (region,) = backend.regions
    print(json.dumps({
        "from_cache": region.from_cache,
        "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"] - hits_before,
        "offloaded": list(region.planned.report.offloaded) if region.planned else None,
        "saved_device_bytes": ours_saved,
        "plain_saved_device_bytes": plain_saved,
        "host_buffers_in_use": backend.runtime.pool.stats().buffers_in_use,
        "equal": all(map(torch.equal, plain, ours)),
    }))


if __name__ == "__main__":
    main()
