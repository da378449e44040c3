"""The device: which one a name means, how fast its links are, how long each op ran.

Everything goes through ``torch.accelerator`` and ``torch.get_device_module(device)``, so
the same code serves CUDA (and any other accelerator) and plain CPU. ``None`` names the
current accelerator if one is available, else CPU.

Transfer bandwidth probe and a device-aware op timer.

``profile_transfer_bandwidth`` measures D2H and H2D *separately* (PCIe and NVLink-C2C
links are asymmetric in practice) with a 16 MiB probe between device memory and pinned
host memory, and feeds the planner's ``ActivationTrace.d2h_bandwidth_gbps`` /
``h2d_bandwidth_gbps``. Unit: **GB/s, 10^9 bytes per second** (the trace's ``*_gbps``
fields use the same unit). Without an accelerator, or when the probe fails, it returns
the design's default of 16 each way with ``measured=False`` (and warns on failure) so
callers can always plan.

``DeviceTimer`` times work on the current stream of a device: timing events on an
accelerator (so it measures kernel time, not launch time), ``time.perf_counter`` on CPU.

How long each op of a step ran on its device: what the eager warmup plans with.

On CPU an op has run when its call returns, so the wall clock between its start and its
end is its duration. On an accelerator the call only *launches* the kernels: the wall
clock would measure the launch. There each op is bracketed by two timing events on the
current stream, and the elapsed times are read once, after the step (one synchronize,
not one per op: :class:`~hyper_offload.runtime.device.DeviceTimer` waits at every
``stop``, which would serialize the host with the device on every op). Durations are in
seconds, like ``TraceOp.duration_s``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

import torch

from hyper_offload.errors import ConfigurationError, OffloadRuntimeError
from hyper_offload.passes.ir.trace import DEFAULT_BANDWIDTH_GBPS


__all__ = [
    "DEFAULT_TRANSFER_BANDWIDTH",
    "DeviceLike",
    "DeviceTimer",
    "OpClock",
    "PROBE_BYTES",
    "TransferBandwidth",
    "device_module",
    "is_accelerator",
    "pin_memory_available",
    "profile_transfer_bandwidth",
    "require_usable",
    "resolve_device",
]


DeviceLike = torch.device | str | int | None


def resolve_device(device: DeviceLike = None) -> torch.device:
    """``device`` as a ``torch.device`` with an explicit index for accelerators.

    ``None`` means the current accelerator if one is available, else CPU. A bare
    ``int`` is an index on the current accelerator type.
    """
    accelerator = _current_accelerator()
    if device is None:
        if accelerator is None:
            return torch.device("cpu")
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    if isinstance(device, int):
        if accelerator is None:
            raise ConfigurationError(
                f"resolve_device({device}): an integer device index needs an accelerator, "
                "but torch.accelerator.is_available() is False; pass 'cpu' instead"
            )
        return torch.device(accelerator.type, device)
    resolved = torch.device(device)
    if is_accelerator(resolved) and resolved.index is None and torch.accelerator.is_available():
        return torch.device(resolved.type, torch.accelerator.current_device_index())
    return resolved


def require_usable(device: DeviceLike, where: str) -> torch.device:
    """``device`` resolved (:func:`resolve_device`), or :class:`ConfigurationError` naming
    it, ``where`` it was asked for and the fix when this process cannot move bytes there
    (``"cuda"`` on a machine, or a torch build, without CUDA; an index past the device
    count; ``"meta"``, which has no memory)."""
    if device is None:
        return resolve_device(None)
    try:
        resolved = torch.device(device) if isinstance(device, str) else device
    except RuntimeError as error:
        raise ConfigurationError(f"{where}: device={device!r} is no torch device ({error}); "
                                 "pass 'cpu', 'cuda', 'cuda:0', ...") from None
    if not isinstance(resolved, int) and torch.device(resolved).type == "meta":
        raise ConfigurationError(f"{where}: device='meta' has no memory to manage; pass the "
                                 "device the model's activations live on ('cpu', 'cuda', ...)")
    if is_accelerator(resolved):
        kind = torch.device(resolved).type if not isinstance(resolved, int) else None
        accelerator = _current_accelerator()
        if accelerator is None or (kind is not None and accelerator.type != kind):
            have = "none" if accelerator is None else f"{accelerator.type!r}"
            raise ConfigurationError(
                f"{where}: device={device!r}, but this process has no such accelerator "
                f"(torch {torch.__version__}, torch.accelerator: {have}); pass device='cpu', "
                "leave device unset (the current accelerator, else CPU), or install a torch "
                "build for that device"
            )
        index = resolved if isinstance(resolved, int) else torch.device(resolved).index
        count = torch.accelerator.device_count()
        if index is not None and not 0 <= index < count:
            raise ConfigurationError(
                f"{where}: device={device!r}, but this process sees {count} {accelerator.type} "
                f"device(s) (indices 0..{count - 1}); pass one of those"
            )
    return resolve_device(device)


def _current_accelerator() -> torch.device | None:
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


def is_accelerator(device: DeviceLike) -> bool:
    """True for device types that have their own memory (``cuda``, ``xpu``, ...), False
    for ``cpu`` and ``meta``. Says nothing about whether the device is usable here."""
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type not in ("cpu", "meta")


def pin_memory_available() -> bool:
    """Whether page-locked host memory can be allocated in this process.

    Pinning needs an accelerator runtime; the CPU build raises on ``pin_memory()``.
    """
    return torch.accelerator.is_available()


def device_module(device: torch.device) -> ModuleType:
    """``torch.cuda`` for a CUDA device, ``torch.xpu`` for XPU, ... ."""
    return torch.get_device_module(device)


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


class OpClock:
    """Times ops on ``device``: ``token = start()`` before an op, ``stop(token)`` after
    it, ``durations()`` (seconds, by token) once the step is done.

    Invariant: every token ``start`` returned has a duration after ``stop``; tokens
    count from 0 in start order.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = device_module(device) if is_accelerator(device) else None
        self._events = self._module is not None
        self._starts: list[Any] = []  # perf_counter floats, or timing events
        self._stops: dict[int, Any] = {}

    def __repr__(self) -> str:
        how = "timing events" if self._events else "wall clock"
        return f"OpClock({self.device}, {how}, {len(self._stops)} ops timed)"

    def start(self) -> int:
        self._starts.append(self._mark())
        return len(self._starts) - 1

    def stop(self, token: int) -> None:
        if not 0 <= token < len(self._starts) or token in self._stops:
            raise ConfigurationError(
                f"OpClock.stop({token}): not a started, unstopped token (started "
                f"{len(self._starts)}, stopped {len(self._stops)}); pair each start with one stop"
            )
        self._stops[token] = self._mark()

    def durations(self) -> dict[int, float]:
        """``{token: seconds}`` of every stopped op; on an accelerator this waits for the
        device once."""
        if not self._events:
            return {t: end - self._starts[t] for t, end in self._stops.items()}
        for end in self._stops.values():
            end.synchronize()  # the first pending one waits; the rest are done by then
        return {t: self._starts[t].elapsed_time(end) / 1e3 for t, end in self._stops.items()}

    def _mark(self) -> Any:
        if self._module is None:
            return time.perf_counter()
        event = self._module.Event(enable_timing=True)
        event.record(self._module.current_stream(self.device))
        return event
