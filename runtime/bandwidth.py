"""Transfer bandwidth probe and a device-aware op timer.

``profile_transfer_bandwidth`` measures D2H and H2D *separately* (PCIe and NVLink-C2C
links are asymmetric in practice) with a 16 MiB probe between device memory and pinned
host memory, and feeds the planner's ``ActivationTrace.d2h_bandwidth_gbps`` /
``h2d_bandwidth_gbps``. Unit: **GB/s, 10^9 bytes per second** (the trace's ``*_gbps``
fields use the same unit). Without an accelerator, or when the probe fails, it returns
the design's default of 16 each way with ``measured=False`` (and warns on failure) so
callers can always plan.

``DeviceTimer`` times work on the current stream of a device: timing events on an
accelerator (so it measures kernel time, not launch time), ``time.perf_counter`` on CPU.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from hyper_offload.errors import ConfigurationError, OffloadRuntimeError
from hyper_offload.passes.ir.trace import DEFAULT_BANDWIDTH_GBPS

from .device import DeviceLike, device_module, is_accelerator, resolve_device

__all__ = [
    "DEFAULT_TRANSFER_BANDWIDTH",
    "PROBE_BYTES",
    "DeviceTimer",
    "TransferBandwidth",
    "profile_transfer_bandwidth",
]

PROBE_BYTES = 16 << 20


@dataclass(frozen=True)
class TransferBandwidth:
    """Measured (or default) copy bandwidths in GB/s (10^9 bytes/s)."""

    d2h_gbps: float
    h2d_gbps: float
    measured: bool
    """False when these are the 16 GB/s defaults (no accelerator, or the probe failed)."""


DEFAULT_TRANSFER_BANDWIDTH = TransferBandwidth(
    DEFAULT_BANDWIDTH_GBPS, DEFAULT_BANDWIDTH_GBPS, measured=False
)


def profile_transfer_bandwidth(
    device: DeviceLike = None, *, probe_bytes: int = PROBE_BYTES, repeats: int = 3
) -> TransferBandwidth:
    """Measure D2H and H2D bandwidth of ``device`` (default: the current accelerator).

    Each direction is copied once to warm up, then ``repeats`` times; the fastest run
    counts (the others measure interference, not the link).
    """
    for name, value in (("probe_bytes", probe_bytes), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigurationError(
                f"profile_transfer_bandwidth: {name} must be an int > 0, got {value!r}"
            )
    if not torch.accelerator.is_available():
        return DEFAULT_TRANSFER_BANDWIDTH
    try:
        target = resolve_device(device)
        if not is_accelerator(target):
            return DEFAULT_TRANSFER_BANDWIDTH
        return _measure(target, probe_bytes, repeats)
    except Exception as exc:  # a failed probe must never stop training: plan with defaults
        warnings.warn(
            f"profile_transfer_bandwidth({device!r}): probe failed ({exc}); planning with the "
            f"default {DEFAULT_BANDWIDTH_GBPS} GB/s each way",
            RuntimeWarning,
            stacklevel=2,
        )
        return DEFAULT_TRANSFER_BANDWIDTH


def _measure(device: torch.device, probe_bytes: int, repeats: int) -> TransferBandwidth:
    on_device = torch.empty(probe_bytes, dtype=torch.uint8, device=device).fill_(1)
    host = torch.empty(probe_bytes, dtype=torch.uint8, pin_memory=True)
    d2h = _best_seconds(device, lambda: host.copy_(on_device, non_blocking=True), repeats)
    h2d = _best_seconds(device, lambda: on_device.copy_(host, non_blocking=True), repeats)
    return TransferBandwidth(probe_bytes / d2h / 1e9, probe_bytes / h2d / 1e9, measured=True)


def _best_seconds(device: torch.device, copy: Any, repeats: int) -> float:
    copy()  # warm-up: first copies pay for driver setup
    best = float("inf")
    for _ in range(repeats):
        with DeviceTimer(device) as timer:
            copy()
        best = min(best, timer.elapsed_s)
    if not best > 0:
        raise OffloadRuntimeError(
            f"bandwidth probe on {device}: measured a non-positive time {best}"
        )
    return best


class DeviceTimer:
    """Elapsed time of the work enqueued between ``start()`` and ``stop()``.

    Use as ``with DeviceTimer(dev) as t: ...; t.elapsed_s`` or ``t.start(); ...; t.stop()``.
    On an accelerator the interval is measured by timing events on the current stream;
    reading ``elapsed_s`` (or ``stop()``'s return value) waits for the end event.
    On CPU it is wall-clock ``perf_counter`` time. A timer can be restarted.
    """

    def __init__(self, device: DeviceLike = None) -> None:
        self.device = resolve_device(device)
        self._uses_events = is_accelerator(self.device)
        self._start: Any = None
        self._end: Any = None
        self._elapsed: float | None = None

    def start(self) -> DeviceTimer:
        self._elapsed = None
        self._end = None
        if self._uses_events:
            module = device_module(self.device)
            self._start = module.Event(enable_timing=True)
            self._end = module.Event(enable_timing=True)
            self._start.record(module.current_stream(self.device))
        else:
            self._start = time.perf_counter()
        return self

    def stop(self) -> float:
        """End the interval; returns the elapsed seconds."""
        if self._start is None:
            raise OffloadRuntimeError(
                "DeviceTimer.stop(): the timer was never started; call start() first"
            )
        if self._uses_events:
            self._end.record(device_module(self.device).current_stream(self.device))
            self._end.synchronize()
            self._elapsed = self._start.elapsed_time(self._end) / 1e3
        else:
            self._elapsed = time.perf_counter() - self._start
        self._start = None
        return self._elapsed

    @property
    def elapsed_s(self) -> float:
        if self._elapsed is None:
            raise OffloadRuntimeError(
                "DeviceTimer.elapsed_s: no completed interval; call start() and stop() (or use "
                "the timer as a context manager) before reading it"
            )
        return self._elapsed

    def __enter__(self) -> DeviceTimer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        timing = "unfinished" if self._elapsed is None else f"{self._elapsed * 1e3:.3f} ms"
        return f"DeviceTimer({self.device}, {timing})"
