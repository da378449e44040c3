"""How long each op of a step ran on its device: what the eager warmup plans with.

On CPU an op has run when its call returns, so the wall clock between its start and its
end is its duration. On an accelerator the call only *launches* the kernels: the wall
clock would measure the launch. There each op is bracketed by two timing events on the
current stream, and the elapsed times are read once, after the step (one synchronize,
not one per op: :class:`~hyper_offload.runtime.bandwidth.DeviceTimer` waits at every
``stop``, which would serialize the host with the device on every op). Durations are in
seconds, like ``TraceOp.duration_s``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hyper_offload.errors import ConfigurationError

from .device import device_module, is_accelerator

__all__ = ["OpClock"]


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
