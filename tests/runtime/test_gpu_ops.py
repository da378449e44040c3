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


def _slow_compute(x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        x = torch.tanh(x @ x)
    return x


def test_reuse_of_the_source_after_its_wait_is_ordered_after_the_copy(
    runtime: TransferRuntime,
) -> None:
    # Twin on CPU: test_copy_stream.py::test_op_d2h_source_lives_until_its_wait_then_...
    # The D2H queues behind slow compute; the source is freed at the wait and its block
    # goes straight to the next same-size allocation, whose fill kernel is ordered after
    # the copy only because wait_transfer made the compute stream wait for it.
    nbytes = 256 * MIB
    a = torch.randn(4096, 4096, device="cuda")
    _slow_compute(a, 1)  # warm-up
    torch.cuda.empty_cache()  # src gets a block of its own, the intruder's exact fit
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    expected = src.cpu()
    torch.cuda.synchronize()
    _slow_compute(a, 10)
    host = ops.copy_d2h(src)
    del src  # still held by the pending copy: nothing is freed before the wait
    host = ops.wait_transfer(host)  # source freed here, on the compute stream
    intruder = torch.full((nbytes,), 0xEE, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    assert torch.equal(host, expected), "the fill overwrote bytes the D2H had not read"
    ops.release_host(host)
    del intruder
    assert runtime.stats().host_syncs == 0, runtime.stats()


def test_offload_frees_device_memory_at_the_wait_and_the_buffer_comes_back(
    runtime: TransferRuntime,
) -> None:
    act_mib = 96  # a size no other block of this test has, so reuse is unambiguous
    slow = torch.randn(4096, 4096, device="cuda")
    slow = slow @ slow / 4096  # warm-up: cuBLAS allocates its workspace before `base`
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no cached free block: act gets a segment of its own
    base = torch.cuda.memory_allocated()
    act = torch.randn(act_mib * MIB // 4, device="cuda")
    act_block = act.data_ptr()
    expected = act.cpu()
    for _ in range(8):  # keep the copy queued behind compute while we drop the source
        slow = slow @ slow / 4096
    host = ops.wait_transfer(ops.copy_d2h(act), act)
    del act
    # Nothing of ours keeps the activation allocated past its wait ...
    assert torch.cuda.memory_allocated() < base + act_mib * MIB
    # ... and its block is reusable at once: with record_stream it would stay reserved
    # for the copy stream until the queued copy ran, and this allocation would get
    # another block (a new segment: reserved memory grows).
    reuse = torch.empty(act_mib * MIB // 4, device="cuda")
    assert reuse.data_ptr() == act_block, (
        f"freed block not reused: max_memory_allocated {torch.cuda.max_memory_allocated()} B, "
        f"max_memory_reserved {torch.cuda.max_memory_reserved()} B"
    )
    reuse.fill_(float("nan"))  # ordered after the copy by the wait
    torch.cuda.synchronize()
    assert torch.equal(host, expected)
    del reuse
    ops.release_host(host)
    del host
    # The copy's handle held the host copy until it is seen complete: stats() looks.
    stats = runtime.stats().pool
    assert stats.buffers_in_use == 0 and stats.pinned_bytes_cached >= act_mib * MIB
    again = ops.copy_d2h(torch.randn(act_mib * MIB // 4, device="cuda"))
    assert runtime.pool.stats().hits == 1
    ops.release_host(ops.wait_transfer(again))
    assert runtime.stats().host_syncs == 0, runtime.stats()


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
