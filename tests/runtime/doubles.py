"""Test doubles of the runtime: scripted transfer engines and events, bit helpers.

Plain classes and functions, imported by the runtime tests and by other folders'
(``from tests.runtime.doubles import DeferredEngine``); ``conftest.py`` hands them out
as fixtures.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hyper_offload.runtime.transfer import Transfer, TransferDirection, TransferEngine


class FakeEvent:
    """``query()`` is False until ``fire()`` (or ``synchronize()``); counts its callers."""

    def __init__(self, done: bool = False) -> None:
        self.is_done = done
        self.queries = 0
        self.synchronizes = 0

    def fire(self) -> None:
        self.is_done = True

    def query(self) -> bool:
        self.queries += 1
        return self.is_done

    def synchronize(self) -> None:
        self.synchronizes += 1
        self.is_done = True


class StreamWaitTransfer(Transfer):
    """A transfer whose ``wait()`` only orders a (simulated) compute stream, as on CUDA:
    the host does not block and the transfer stays in flight until its event fires."""

    waits = 0

    def wait(self, stream: object = None) -> None:
        self.waits += 1
        self._waited_streams.append(stream if stream is not None else self.issue_stream)


class DeferredEngine(TransferEngine):
    """Copies now, completes later: every transfer carries a pending :class:`FakeEvent`.

    ``records_streams=True`` mimics CUDA's ``record_stream``: like the real engine, the
    handle then keeps only the host-side tensor alive. ``stream_waits=True`` makes
    ``Transfer.wait()`` a stream wait that does not complete the transfer (CUDA); by
    default a wait on a pending CPU transfer blocks until it completes.
    """

    def __init__(self, *, records_streams: bool = False, stream_waits: bool = False) -> None:
        super().__init__("cpu")
        self.records_streams = records_streams
        self.stream_waits = stream_waits
        self.log: list[tuple[TransferDirection, FakeEvent, tuple[Transfer, ...]]] = []
        self.engine_syncs = 0

    def d2h(self, src: torch.Tensor, dst_host: torch.Tensor, *, after: Iterable[Transfer] = (), free_before_wait: bool = False) -> Transfer:
        return self._deferred(TransferDirection.D2H, src, dst_host, tuple(after))

    def h2d(self, src_host: torch.Tensor, dst: torch.Tensor, *, after: Iterable[Transfer] = (), free_before_wait: bool = False) -> Transfer:
        return self._deferred(TransferDirection.H2D, src_host, dst, tuple(after))

    def _deferred(self, direction, src, dst, after) -> Transfer:
        dst.copy_(src)
        event = FakeEvent()
        self.log.append((direction, event, after))
        nbytes = src.numel() * src.element_size()
        host_side = dst if direction is TransferDirection.D2H else src
        keepalive = (host_side,) if self.records_streams else (src, dst)
        kind = StreamWaitTransfer if self.stream_waits else Transfer
        return kind(
            direction, torch.device("cpu"), nbytes, event, keepalive,
            device_side_recorded=self.records_streams,
        )

    def fire_all(self) -> None:
        for _, event, _ in self.log:
            event.fire()

    def in_flight(self) -> bool:
        """Whether any copy this engine started has not completed."""
        return any(not event.is_done for _, event, _ in self.log)

    def synchronize(self) -> None:
        self.engine_syncs += 1
        self.fire_all()


class HalfEnqueuedEngine(DeferredEngine):
    """A CUDA-like :class:`DeferredEngine` whose copy in direction ``fail`` ("d2h" or
    "h2d") is enqueued (a pending event) and *then* raises, as a launch error after the
    memcpy reached the stream would. ``synchronize()`` completes what was enqueued."""

    def __init__(self, fail: str = "") -> None:
        super().__init__(records_streams=True, stream_waits=True)
        self.fail = fail

    def d2h(self, src: torch.Tensor, dst_host: torch.Tensor, *, after: Iterable[Transfer] = (), free_before_wait: bool = False) -> Transfer:
        transfer = super().d2h(src, dst_host, after=after)
        if self.fail == "d2h":
            raise RuntimeError("injected d2h failure after enqueue")
        return transfer

    def h2d(self, src_host: torch.Tensor, dst: torch.Tensor, *, after: Iterable[Transfer] = (), free_before_wait: bool = False) -> Transfer:
        transfer = super().h2d(src_host, dst, after=after)
        if self.fail == "h2d":
            raise RuntimeError("injected h2d failure after enqueue")
        return transfer


class FailingEngine(TransferEngine):
    """Raises from ``d2h`` / ``h2d`` while that direction is in ``fail_on``."""

    def __init__(self, fail_on: Iterable[str] = (), *, corrupt: bool = True) -> None:
        super().__init__("cpu")
        self.fail_on = set(fail_on)
        self.corrupt = corrupt
        self.engine_syncs = 0

    def d2h(self, src: torch.Tensor, dst_host: torch.Tensor, *, after: Iterable[Transfer] = (), free_before_wait: bool = False) -> Transfer:
        self._maybe_fail("d2h", dst_host)
        return super().d2h(src, dst_host, after=after, free_before_wait=free_before_wait)

    def h2d(self, src_host: torch.Tensor, dst: torch.Tensor, *, after: Iterable[Transfer] = (), free_before_wait: bool = False) -> Transfer:
        self._maybe_fail("h2d", dst)
        return super().h2d(src_host, dst, after=after, free_before_wait=free_before_wait)

    def _maybe_fail(self, direction: str, dst: torch.Tensor) -> None:
        if direction not in self.fail_on:
            return
        if self.corrupt and dst.numel():
            dst.view(torch.uint8)[: max(1, dst.numel() * dst.element_size() // 2)] = 0xAB
        raise RuntimeError(f"injected {direction} failure")

    def synchronize(self) -> None:
        self.engine_syncs += 1


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """A tensor of arbitrary bit patterns (NaN payloads, denormals included)."""
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``torch.equal`` treats NaN != NaN)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )
