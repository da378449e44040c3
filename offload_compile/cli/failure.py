"""One line for a model that fails under ``estimate`` or ``check``: the real cause.

torch wraps what a model's forward raises on fake tensors several times over (Dynamo's
``TorchRuntimeError`` "RuntimeError when making fake tensor call", around ``Unsupported``,
around the op's own ``RuntimeError``: "a and b must have same reduction dim, but got
[4, 63] X [64, 128]"), and its fake-tensor mode logs the whole traceback at ERROR before
raising. The command line prints the innermost exception of the chain and the line of
the model where it broke, and leaves the traceback to ``--debug``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

__all__ = ["add_debug_flag", "describe", "quiet_torch_tracebacks", "report_bad_input",
           "root_cause", "where"]

_TORCH_LOGGERS = ("torch._subclasses.fake_tensor",)
"""Loggers that print a failing op's whole traceback before the exception reaches us."""


def root_cause(error: BaseException) -> BaseException:
    """The innermost exception of ``error``'s chain: explicit causes (``raise ... from``),
    a ``BackendCompilerFailed``'s ``inner_exception``, and the context Dynamo's wrappers
    hide with ``from None`` (the op's own error); never the incidental context of other
    code (an error raised while handling another is its own cause)."""
    return list(_chain(error))[-1]


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and its causes (:func:`root_cause`'s rule), outermost first."""
    seen = set()
    while isinstance(error, BaseException) and id(error) not in seen:
        yield error
        seen.add(id(error))
        inner = error.__cause__ or getattr(error, "inner_exception", None)
        if inner is None and type(error).__module__.startswith("torch._dynamo"):
            inner = error.__context__
        error = inner


def where(error: BaseException) -> str | None:
    """``file:line: code`` of the frame where the model broke, from Dynamo's stack of the
    user code it traced, else the traceback of the cause: the innermost frame of the
    user's own code, else of a torch module's forward (``torch/nn/modules``); None when
    neither is there."""
    stack = next((s for e in _chain(error) if (s := getattr(e, "real_stack", None))), [])
    if not stack:
        stack = traceback.extract_tb(root_cause(error).__traceback__)
    torch_dir, own_dir = _torch_dir(), str(Path(__file__).resolve().parents[1])
    library = [d for d in (torch_dir, own_dir) if d is not None]
    user = [f for f in stack if not any(f.filename.startswith(d) for d in library)]
    modules = [f for f in stack if torch_dir is not None
               and f.filename.startswith(str(Path(torch_dir, "nn", "modules")))]
    if not (user or modules):
        return None
    frame = (user or modules)[-1]
    code = (frame.line or "").strip()
    return f"{_short(frame.filename)}:{frame.lineno}" + (f": {code}" if code else "")


def describe(error: BaseException) -> str:
    """``Type: message (at file:line: code)`` of the real cause, on one line."""
    cause = root_cause(error)
    message = " ".join(str(cause).split()) or "(no message)"
    at = where(error)
    return f"{type(cause).__name__}: {message}" + (f" (at {at})" if at else "")


@contextlib.contextmanager
def quiet_torch_tracebacks(debug: bool) -> Iterator[None]:
    """Without ``debug``: torch's loggers that print a failing op's traceback drop their
    ERROR records inside the block (a filter, removed after it: torch resets logger levels
    when it starts compiling, not filters); the error itself still comes."""
    if debug:
        yield
        return
    loggers = [logging.getLogger(name) for name in _TORCH_LOGGERS]
    for logger in loggers:
        logger.addFilter(_below_error)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_below_error)


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print the whole traceback (torch's too) before the "
                        "one-line message")


def report_bad_input(command: str, error: BaseException, debug: bool) -> None:
    """One line on stderr; with ``debug``, the whole chain of its cause first, as Python
    prints an uncaught exception."""
    if debug and error.__cause__ is not None:
        traceback.print_exception(error.__cause__, file=sys.stderr)
    print(f"hyper-offload {command}: error: {' '.join(str(error).split())}", file=sys.stderr)


def _torch_dir() -> str | None:
    torch = sys.modules.get("torch")
    return None if torch is None or torch.__file__ is None else str(Path(torch.__file__).parent)


def _short(filename: str) -> str:
    """A path relative to the working directory where it lies under it, torch's own files
    from ``torch/`` on, else as given."""
    path = Path(filename).resolve()
    torch_dir = _torch_dir()
    for base in (None if torch_dir is None else Path(torch_dir).parent, Path.cwd()):
        if base is not None and path.is_relative_to(base):
            return str(path.relative_to(base))
    return filename
