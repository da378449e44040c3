"""Transfer ops on a real CUDA device: pinned buffers, async copies, races, compile."""

from __future__ import annotations

import time

import pytest
import torch

from hyper_offload.runtime import ops
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.transfer_context import TransferRuntime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1 << 20


@pytest.fixture
def runtime() -> TransferRuntime:
    with TransferRuntime(pool=PinnedMemoryPool(2048 * MIB)) as rt:
        yield rt
    torch.cuda.synchronize()


def test_round_trip_through_pinned_memory_is_bit_identical(runtime: TransferRuntime) -> None:
    src = torch.randn(513, 257, device="cuda", dtype=torch.bfloat16).t()
    host = ops.wait_transfer(ops.copy_d2h(src), src)
    back = ops.wait_transfer(ops.copy_h2d(host, "cuda"), host)
    ops.release_host(host, back)
    assert host.is_pinned() and back.device.type == "cuda"
    assert back.stride() == src.stride()
    assert torch.equal(back, src)


def test_freeing_the_source_right_after_an_async_d2h_does_not_corrupt_the_copy(
    runtime: TransferRuntime,
) -> None:
    src = torch.randn(64 * MIB // 4, device="cuda")
    expected = src.cpu()
    host = ops.copy_d2h(src)
    del src  # the allocator would love to hand these bytes out again right now
    junk = [torch.full((64 * MIB // 4,), 7.0, device="cuda") for _ in range(4)]
    ops.wait_transfer(host)
    torch.cuda.synchronize()
    assert torch.equal(host, expected)
    ops.release_host(host)
    del junk


def test_offload_frees_device_memory_at_the_wait_and_the_buffer_comes_back(
    runtime: TransferRuntime,
) -> None:
    slow = torch.randn(4096, 4096, device="cuda")
    slow = slow @ slow / 4096  # warm-up: cuBLAS allocates its workspace before `base`
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    act = torch.randn(64 * MIB // 4, device="cuda")
    expected = act.cpu()
    for _ in range(8):  # keep the copy queued behind compute while we drop the source
        slow = slow @ slow / 4096
    host = ops.wait_transfer(ops.copy_d2h(act), act)
    del act
    # The caching allocator holds the block for the copy stream (record_stream); nothing
    # of ours may keep the activation allocated until the host copy is released.
    assert torch.cuda.memory_allocated() < base + 64 * MIB
    torch.cuda.synchronize()
    assert torch.equal(host, expected)
    ops.release_host(host)
    del host
    stats = runtime.pool.stats()
    assert stats.pending_releases == 0 and stats.pinned_bytes_cached >= 64 * MIB
    again = ops.copy_d2h(torch.randn(64 * MIB // 4, device="cuda"))
    assert runtime.pool.stats().hits == 1
    ops.release_host(ops.wait_transfer(again))


def test_prefetched_data_is_intact_behind_slow_compute(runtime: TransferRuntime) -> None:
    src = torch.randn(16 * MIB // 4, device="cuda")
    host = ops.wait_transfer(ops.copy_d2h(src), src)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # slow kernels on the compute stream while the H2D is queued
        a = a @ a / 4096
    back = ops.copy_h2d(host, "cuda")
    back = ops.wait_transfer(back, host)
    checksum = (back - src).abs().max()  # runs on the compute stream after the wait
    ops.release_host(host, back)
    assert checksum.item() == 0.0


def test_copy_d2h_returns_before_the_copy_is_done(runtime: TransferRuntime) -> None:
    src = torch.randn(512 * MIB // 4, device="cuda")
    warm = ops.wait_transfer(ops.copy_d2h(src), src)  # first use allocates the pinned buffer
    ops.release_host(warm)
    del warm
    torch.cuda.synchronize()

    start = time.perf_counter()
    host = ops.copy_d2h(src)
    issued = time.perf_counter() - start
    assert runtime.pool.stats().hits == 1  # the warm buffer came back, no new pinning
    ops.wait_transfer(host, src)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    ops.release_host(host)
    # 512 MiB take >10 ms over PCIe; issuing them must not block on the copy.
    assert issued < total / 2, (issued, total)


def test_torch_compile_aot_eager_on_cuda_matches_eager(runtime: TransferRuntime) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        act = x.sin()
        host = ops.wait_transfer(ops.copy_d2h(act), act)
        back = ops.wait_transfer(ops.copy_h2d(host, x.device), host)
        ops.release_host(host, back)
        return (back * x).sum()

    x = torch.randn(256, 128, device="cuda")
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    step(x_eager).backward()
    torch.compile(step, backend="aot_eager", fullgraph=True)(x_compiled).backward()
    assert torch.equal(x_compiled.grad, x_eager.grad)
