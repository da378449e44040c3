"""Transfer custom ops used against their rules: every misuse raises naming the op, the
rule and the fix, and changes nothing; a copy that fails leaves nothing in flight and the
valid copy where it was. The ops used as the lowering emits them: ``test_ops.py``."""

from __future__ import annotations

import threading

import pytest
import torch

from hyper_offload.errors import TransferFailedError, TransferMisuseError
from hyper_offload.runtime import ops
from hyper_offload.runtime.transfer import TransferEngine
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.transfer_context import TransferRuntime, current_transfer_runtime
from hyper_offload.runtime.transfer_records import HostCopyState


def test_ops_without_a_runtime_raise_naming_the_fix() -> None:
    with pytest.raises(
        TransferMisuseError, match=r"copy_d2h: no TransferRuntime is active.*wrap the forward pass"
    ):
        ops.copy_d2h(torch.ones(2))
    with pytest.raises(TransferMisuseError, match="no TransferRuntime is active"):
        current_transfer_runtime()


def test_runtime_is_scoped_to_its_context_not_to_other_threads(runtime: TransferRuntime) -> None:
    assert current_transfer_runtime() is runtime
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            ops.copy_d2h(torch.ones(2))
        except TransferMisuseError as exc:
            errors.append(exc)

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert len(errors) == 1 and runtime.transfers_pending == 0


def test_nested_runtimes_shadow_and_restore(runtime: TransferRuntime) -> None:
    inner = TransferRuntime(pool=PinnedMemoryPool(1 << 20))
    with inner:
        assert current_transfer_runtime() is inner
        host = ops.wait_transfer(ops.copy_d2h(torch.ones(2)))
        assert inner.host_state(host) is HostCopyState.VALID
        assert runtime.host_state(host) is None  # the outer runtime never saw it
        ops.release_host(host)
    assert current_transfer_runtime() is runtime


def test_waiting_on_something_never_started_or_twice(runtime: TransferRuntime) -> None:
    with pytest.raises(TransferMisuseError, match="never started, or was already waited"):
        ops.wait_transfer(torch.ones(3))
    src = torch.ones(3)
    host = ops.copy_d2h(src)
    ops.wait_transfer(host, src)
    with pytest.raises(TransferMisuseError, match="never started, or was already waited"):
        ops.wait_transfer(host, src)
    ops.release_host(host)


def test_keepalive_must_be_the_source(runtime: TransferRuntime) -> None:
    src = torch.ones(3)
    host = ops.copy_d2h(src)
    with pytest.raises(TransferMisuseError, match="keepalive .* is not the source of the copy_d2h"):
        ops.wait_transfer(host, keepalive=torch.ones(3))
    assert runtime.transfers_pending == 1  # the failed call changed nothing
    ops.wait_transfer(host, keepalive=src[1:])  # any view of the source is the source
    ops.release_host(host)


def test_a_second_backward_prefetches_and_releases_a_released_copy_again(
    runtime: TransferRuntime,
) -> None:
    # A retained graph's second backward runs the same copy_h2d / release_host again.
    src = torch.arange(3.0)
    host = ops.wait_transfer(ops.copy_d2h(src), src)
    for _ in range(2):
        back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
        ops.release_host(host, back)
        assert torch.equal(back, src) and runtime.host_state(host) is HostCopyState.RELEASED
    assert runtime.transfers_pending == 0 and runtime.pool.stats().buffers_in_use == 1
    del host
    assert runtime.pool.stats().buffers_in_use == 0  # returned once, at its death


def test_releasing_before_the_d2h_was_waited(runtime: TransferRuntime) -> None:
    src = torch.ones(3)
    host = ops.copy_d2h(src)
    with pytest.raises(
        TransferMisuseError, match="never waited.*wait_transfer\\(host, keepalive=source\\)"
    ):
        ops.release_host(host)
    assert runtime.host_state(host) is HostCopyState.FILLING
    ops.wait_transfer(host, src)
    ops.release_host(host)


def test_prefetching_or_releasing_a_tensor_that_is_not_a_host_copy(
    runtime: TransferRuntime,
) -> None:
    with pytest.raises(
        TransferMisuseError, match="copy_h2d: .* is not a host copy made by copy_d2h"
    ):
        ops.copy_h2d(torch.ones(3), "cpu")
    with pytest.raises(TransferMisuseError, match="release_host: .* is not a host copy"):
        ops.release_host(torch.ones(3))


def test_prefetch_from_a_filling_host_copy_is_ordered_after_the_d2h(
    runtime: TransferRuntime,
) -> None:
    src = torch.arange(10.0)
    host = ops.copy_d2h(src)
    back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
    ops.wait_transfer(host, src)
    assert torch.equal(back, src)
    ops.release_host(host, back)


def test_leaving_the_block_with_unwaited_transfers_raises_and_drains() -> None:
    rt = TransferRuntime(pool=PinnedMemoryPool(1 << 20))
    with pytest.raises(TransferMisuseError, match=r"1 transfer\(s\) were started but never waited"):
        with rt:
            ops.copy_d2h(torch.ones(4))
    assert rt.transfers_pending == 0
    with pytest.raises(ValueError, match="boom"):  # an exception in the block is not masked
        with rt:
            ops.copy_d2h(torch.ones(4))
            raise ValueError("boom")
    assert rt.transfers_pending == 0


class _FlakyEngine(TransferEngine):
    """A CPU engine whose next copy in one direction fails, as a broken DMA would."""

    def __init__(self, fail: str) -> None:
        super().__init__("cpu")
        self.fail = fail

    def d2h(self, src: torch.Tensor, dst_host: torch.Tensor, **kw: object):  # noqa: ANN201
        if self.fail == "d2h":
            self.fail = ""
            raise RuntimeError("injected D2H failure")
        return super().d2h(src, dst_host, **kw)

    def h2d(self, src_host: torch.Tensor, dst: torch.Tensor, **kw: object):  # noqa: ANN201
        if self.fail == "h2d":
            self.fail = ""
            raise RuntimeError("injected H2D failure")
        return super().h2d(src_host, dst, **kw)


def test_a_failing_d2h_returns_the_buffer_and_leaves_nothing_in_flight() -> None:
    pool = PinnedMemoryPool(1 << 20)
    with TransferRuntime(pool=pool, engines=[_FlakyEngine("d2h")]) as rt:
        with pytest.raises(TransferFailedError, match="device tensor is untouched") as info:
            ops.copy_d2h(torch.ones(8))
        assert "injected D2H failure" in str(info.value.__cause__)
        assert rt.transfers_pending == 0 and pool.stats().buffers_in_use == 0
        host = ops.wait_transfer(ops.copy_d2h(torch.ones(8)))  # the next try works
        ops.release_host(host)


def test_a_failing_h2d_keeps_the_host_copy_valid() -> None:
    with TransferRuntime(pool=PinnedMemoryPool(1 << 20), engines=[_FlakyEngine("h2d")]) as rt:
        src = torch.arange(8.0)
        host = ops.wait_transfer(ops.copy_d2h(src), src)
        with pytest.raises(TransferFailedError, match="host copy is untouched and still valid"):
            ops.copy_h2d(host, "cpu")
        assert rt.transfers_pending == 0 and rt.host_state(host) is HostCopyState.VALID
        back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
        assert torch.equal(back, src)
        ops.release_host(host, back)
