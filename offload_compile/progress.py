"""Progress: what long work is doing now (an estimate of an 8B model takes about 40 s:
capturing, partitioning region k, planning the step, pricing ...), and the command
line's one-line display of it.

Library code calls :func:`note` when a stage begins. Nothing is printed or logged: a
note reaches only a listener installed with :func:`listening` around the work. The
listener lives in a :class:`~contextvars.ContextVar`, so there is no global state, and a
thread or task that did not install one hears nothing.

The command line installs :func:`progress_line`: a :class:`ProgressLine` that rewrites
one line of the terminal in place. Only when the stream is a terminal: piped or
redirected into a log, nothing is written (a log keeps the report, not a trail of
carriage returns). Nothing goes through ``logging``.

Invariant: imports the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TextIO

__all__ = ["Listener", "ProgressLine", "listening", "note", "progress_line"]

Listener = Callable[[str], None]
"""Called with a short description of the stage that begins (lower case, no period)."""

_LISTENER: ContextVar[Listener | None] = ContextVar("hyper_offload_progress", default=None)


def note(stage: str) -> None:
    """Tell the listener, if any, that ``stage`` begins (cheap when nobody listens)."""
    listener = _LISTENER.get()
    if listener is not None:
        listener(stage)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Send every :func:`note` made inside the block (in this context) to ``listener``."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


_CLEAR = "\r\x1b[2K"
"""Back to the first column, then erase the line (ANSI, as every terminal emulator reads it)."""


class ProgressLine:
    """Writes ``"{prefix}: {stage} ({seconds} s)"`` over the previous line of ``stream``,
    cut to the terminal's width (a wrapped line could not be rewritten in place).
    Invariant: after :meth:`clear` the line is empty and the cursor in its first column."""

    def __init__(self, stream: TextIO, prefix: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stream, self._prefix, self._clock = stream, prefix, clock
        self._started = clock()
        self._shown = False

    def __call__(self, stage: str) -> None:
        text = f"{self._prefix}: {stage} ({self._clock() - self._started:.0f} s)"
        self._stream.write(_CLEAR + text[: _width(self._stream) - 1])
        self._stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            self._stream.write(_CLEAR)
            self._stream.flush()
            self._shown = False


def _width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, OSError, ValueError):  # no file descriptor, or not a terminal
        return 80


@contextlib.contextmanager
def progress_line(prefix: str, stream: TextIO | None = None) -> Iterator[None]:
    """Show the library's progress notes on ``stream`` (default stderr) while the block
    runs, if it is a terminal; the line is erased when the block ends, however it ends."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        yield
        return
    line = ProgressLine(stream, prefix)
    try:
        with listening(line):
            yield
    finally:
        line.clear()
