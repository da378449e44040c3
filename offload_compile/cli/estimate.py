"""``hyper-offload estimate MODULE:FACTORY --input-shape 1,4096 --budget-mb X``, and what
``check`` shares with it: loading the model, and one line for a model that fails.

Builds the model with ``FACTORY()`` (no arguments; build it on the meta device to spend
no memory), makes meta example inputs of the given shapes and dtypes, and prints
:func:`hyper_offload.estimate`'s report: will one training step fit under the budget?

``MODULE`` is a Python file (``examples/llama_model.py``: any argument ending in ``.py``
or containing a path separator; its folder is importable while it loads) or an
importable module name (``mypkg.models``).

``--tile-sequence auto`` (or a tile count) lets the backend split token-wise ops that set
a region's floor into tiles along the sequence (not bit-exact: the summary says so).

``--budget-scope step`` (the default, as the backend's) runs one step on fake tensors
through the backend and reports its step plan: the model's own compiled blocks stay
compiled on their own, graph breaks split it into regions, as in training; ``region``
plans the model as one region under the whole budget (with the recompute search).

Exit codes (as ``plan``): 0 the plan fits the budget; 1 the budget is infeasible (some
op's own live activations exceed it, or under the step scope the floor does: everything
movable moved; the report says the smallest feasible budget);
2 bad input (an unloadable target, a factory or forward that raises, a malformed shape
or dtype, a bad budget) with one line on stderr naming the cause (for a model that fails
on the inputs, the error of the op that failed and the model's line), the traceback only
with ``--debug``; 3 the planner produced a schedule the validator rejects (a bug: please
report it).

On a terminal, a progress line on stderr says what the estimate is doing (capturing,
partitioning region k, planning the step, the recompute search's partitions, pricing),
rewritten in place and erased at the end; piped or redirected, nothing but the report.

**A model that fails** (:func:`describe`): torch wraps what a model's forward raises on
fake tensors several times over (Dynamo's ``TorchRuntimeError`` "RuntimeError when making
fake tensor call", around ``Unsupported``, around the op's own ``RuntimeError``: "a and b
must have same reduction dim, but got [4, 63] X [64, 128]"), and its fake-tensor mode
logs the whole traceback at ERROR before raising. ``estimate`` and ``check`` print the
innermost exception of the chain and the line of the model where it broke, and leave the
traceback to ``--debug``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The trace IR's default link speed (torch-free), which the runtime's default bandwidth uses.
from hyper_offload.passes.ir.trace import DEFAULT_BANDWIDTH_GBPS

from hyper_offload.progress import note, progress_line


EXIT_OK, EXIT_INFEASIBLE, EXIT_BAD_INPUT, EXIT_INVALID_SCHEDULE = 0, 1, 2, 3


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "estimate",
        help="will a training step fit? trace a model on fake tensors and plan it",
        description="Trace one training step (forward + backward) of MODULE:FACTORY() on fake "
        "tensors (nothing is allocated), plan it under the budget like the compile backend "
        "(the whole step's plan by default), and report peaks, bytes moved, predicted "
        "exposed transfer time and the smallest feasible budget.",
    )
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="a .py file or importable module, and a function of no arguments "
                        "returning the nn.Module (e.g. examples/llama_model.py:llama_7b)")
    parser.add_argument("--input-shape", action="append", required=True, metavar="D0,D1,...",
                        help="shape of one positional input; repeat for several inputs")
    parser.add_argument("--input-dtype", action="append", default=None, metavar="DTYPE",
                        help="torch dtype of the inputs (e.g. int64, bfloat16): once for all "
                        "inputs or once per --input-shape; default float32")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-mb", type=float, help="device budget for activations, MiB")
    budget.add_argument("--budget-fraction", type=float,
                        help="budget as a fraction in (0, 1] of the peak without offload")
    parser.add_argument("--host-budget-mb", type=float, default=None,
                        help="host budget for offloaded activations, MiB per rank (default: "
                        "this machine's available memory / --local-world-size)")
    parser.add_argument("--local-world-size", type=int, default=None,
                        help="ranks sharing the host's memory, for the default host budget "
                        "(default: from torch.distributed, else 1)")
    parser.add_argument("--inner-compiler", choices=("inductor", "aot_eager"), default="inductor",
                        help="whose graphs to model (default inductor, as the backend)")
    parser.add_argument("--budget-scope", choices=("step", "region"), default="step",
                        help="step (default, as the backend): run one step on fake tensors "
                        "through the backend (the model's own compiled blocks stay so, graph "
                        "breaks split it) and report its step plan; region: the model as one "
                        "region under the whole budget")
    parser.add_argument("--layout", choices=("auto", "as_given", "per_block"), default="auto",
                        help="step scope: auto (default) estimates a model compiled whole that "
                             "repeats one block 8 times or more with each block compiled on its "
                             "own (one block planned, priced for every layer); as_given: as the "
                             "model is compiled; per_block: per block from 2 identical blocks")
    parser.add_argument("--recompute", choices=("auto", "off"), default="auto",
                        help="auto (default, as the backend): where offload alone stalls, also "
                        "search partitions that recompute more; off: torch's default partition")
    parser.add_argument("--tile-sequence", type=tile_sequence_arg, default="off",
                        metavar="off|auto|N",
                        help="sequence tiling: where a token-wise op (MLP, norm, LM head and "
                        "loss) sets the floor, split it into tiles recomputed in the backward; "
                        "auto: the fewest tiles that fit; NOT bit-exact (default off)")
    parser.add_argument("--device", default=None,
                        help="device to trace on (default: the model's; cuda or cpu for a "
                        "meta model, whichever this machine has)")
    parser.add_argument("--bandwidth-gbps", type=float,
                        default=DEFAULT_BANDWIDTH_GBPS,
                        help="host<->device copy bandwidth in GB/s, each way (default "
                        f"{DEFAULT_BANDWIDTH_GBPS:g})")
    parser.add_argument("--compute-tflops", type=float, default=None,
                        help="price ops at this many TFLOP/s, with --memory-gbps (default: the "
                        "traced device's roofline: 0.05 and 20 for CPU, 50 and 1000 for an "
                        "accelerator)")
    parser.add_argument("--memory-gbps", type=float, default=None,
                        help="price ops at this memory bandwidth in GB/s, with --compute-tflops")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_debug_flag(parser)
    parser.set_defaults(run=run)


class _BadInput(Exception):
    """A user error: printed as one line, exit code 2."""


def tile_sequence_arg(text: str) -> str | int:
    """``--tile-sequence``: off, auto or a tile count (the option validates the count)."""
    return int(text) if text.isdigit() else text


def load_factory(target: str) -> Any:
    """``MODULE:FACTORY`` -> the callable (see the module docstring)."""
    module_part, sep, name = target.rpartition(":")
    if not sep or not module_part or not name:
        raise _BadInput(f"{target!r} is not MODULE:FACTORY (e.g. examples/llama_model.py:llama_7b)")
    if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
        module = _load_file(Path(module_part))
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as error:
            raise _BadInput(f"cannot import {module_part}: {describe(error)}") from error
    factory = getattr(module, name, None)
    if not callable(factory):
        raise _BadInput(f"{module_part} has no callable {name!r}")
    return factory


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise _BadInput(f"cannot read {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"_hyper_offload_target_{uuid.uuid4().hex}", path)
    if spec is None or spec.loader is None:
        raise _BadInput(f"{path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # sibling imports of the file work while it loads
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise _BadInput(f"cannot load {path}: {describe(error)}") from error
    finally:
        sys.path.remove(folder)
        sys.modules.pop(spec.name, None)
    return module


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise _BadInput(f"--input-shape {text!r}: expected integers separated by commas, "
                        "e.g. 1,4096") from None
    if any(d < 0 for d in shape):
        raise _BadInput(f"--input-shape {text!r}: sizes must be >= 0")
    return shape


def parse_dtype(text: str) -> Any:
    import torch

    dtype = getattr(torch, text.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise _BadInput(f"--input-dtype {text!r} is not a torch dtype (e.g. int64, float32, bfloat16)")
    return dtype


def _inputs(args: argparse.Namespace) -> list[Any]:
    import torch

    shapes = [parse_shape(s) for s in args.input_shape]
    dtypes = [parse_dtype(d) for d in (args.input_dtype or ["float32"])]
    if len(dtypes) == 1:
        dtypes = dtypes * len(shapes)
    if len(dtypes) != len(shapes):
        raise _BadInput(f"{len(dtypes)} --input-dtype for {len(shapes)} --input-shape; give one "
                        "dtype for all inputs or one per input")
    return [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in zip(shapes, dtypes)]


def _throughput(args: argparse.Namespace) -> Any:
    """``--compute-tflops`` + ``--memory-gbps`` (together), or None: the traced
    device's roofline."""
    given = (args.compute_tflops, args.memory_gbps)
    if given == (None, None):
        return None
    if None in given:
        raise _BadInput("give --compute-tflops and --memory-gbps together (or neither, to price "
                        "ops with the traced device's roofline)")
    import math

    from hyper_offload.passes.fx.cost_model import DeviceThroughput

    for flag, value in zip(("--compute-tflops", "--memory-gbps"), given):
        if not 0 < value < math.inf:
            raise _BadInput(f"{flag} must be a finite number > 0, got {value:g}")
    return DeviceThroughput(flops_per_s=given[0] * 1e12, bytes_per_s=given[1] * 1e9)


def _check_flags(args: argparse.Namespace) -> None:
    """The numeric and device flags, checked here so that an error names the flag the
    user typed (``--budget-mb``), not the option it becomes (``max_resident_activation_mb``)."""
    import math

    if args.budget_mb is not None and not 0 <= args.budget_mb < math.inf:
        raise _BadInput(f"--budget-mb must be a finite number of MiB >= 0, got {args.budget_mb:g}")
    if args.budget_fraction is not None and not 0 < args.budget_fraction <= 1:
        raise _BadInput("--budget-fraction must be a number in (0, 1] (a fraction of the "
                        f"activation peak without offload), got {args.budget_fraction:g}")
    if args.host_budget_mb is not None and not 0 <= args.host_budget_mb < math.inf:
        raise _BadInput("--host-budget-mb must be a finite number of MiB >= 0 (per rank), got "
                        f"{args.host_budget_mb:g}")
    if args.local_world_size is not None and args.local_world_size < 1:
        raise _BadInput("--local-world-size must be a whole number of ranks >= 1, got "
                        f"{args.local_world_size}")
    if not 0 < args.bandwidth_gbps < math.inf:
        raise _BadInput("--bandwidth-gbps must be a finite number of GB/s > 0 (each way), got "
                        f"{args.bandwidth_gbps:g}")
    if args.device is not None:
        _check_device(args.device)


def _check_device(text: str) -> None:
    """``--device``: a torch device this machine can trace on (not meta: its kernels are not
    a training step's; not an accelerator this build lacks: fake tensors there abort)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise _BadInput(f"--device {text!r} is not a torch device (e.g. cpu, cuda)") from None
    if device.type == "meta":
        raise _BadInput("--device meta: cannot trace on the meta device (its kernels are not "
                        "the ones a training step runs); a meta model is traced as --device "
                        "cuda or --device cpu")
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if device.type != "cpu" and (accelerator is None or accelerator.type != device.type):
        raise _BadInput(f"--device {text}: this machine has no {device.type} device; use "
                        "--device cpu (and --compute-tflops/--memory-gbps to price ops as an "
                        "accelerator)")


def _estimate(args: argparse.Namespace) -> Any:
    note("loading torch and the compile door")
    from hyper_offload.compiler.estimate.fit import estimate

    _check_flags(args)

    options: dict[str, Any] = {"inner_compiler": args.inner_compiler, "recompute": args.recompute,
                               "budget_scope": args.budget_scope,
                               "tile_sequence": args.tile_sequence}
    if args.budget_fraction is not None:
        options["max_resident_activation_fraction"] = args.budget_fraction
    else:
        options["max_resident_activation_mb"] = args.budget_mb
    if args.host_budget_mb is not None:
        options["max_host_activation_mb"] = args.host_budget_mb
    if args.local_world_size is not None:
        options["local_world_size"] = args.local_world_size
    inputs = _inputs(args)
    throughput = _throughput(args)
    note(f"building {args.target}()")
    factory = load_factory(args.target)
    try:
        model = factory()
    except Exception as error:
        raise _BadInput(f"{args.target}() raised {describe(error)}") from error
    from hyper_offload.errors import HyperOffloadError
    from hyper_offload.passes import ScheduleError

    try:
        return estimate(model, inputs, device=args.device, bandwidth=args.bandwidth_gbps,
                        throughput=throughput, layout=args.layout, **options)
    except ScheduleError:  # a bug of the planner: exit 3
        raise
    except HyperOffloadError as error:  # our own refusal (ConfigurationError: no backward, ...)
        raise _BadInput(str(error)) from error
    except Exception as error:  # the model's own step fails on these inputs
        raise _BadInput(f"one step of {args.target} fails on {describe_inputs(args)}: "
                        f"{describe(error)}") from error


def describe_inputs(args: argparse.Namespace) -> str:
    """The inputs as the user gave them: ``--input-shape 4,63 (float32)``."""
    if not args.input_shape:
        return "its example inputs"
    shown = " ".join(f"--input-shape {shape}" for shape in args.input_shape)
    return f"{shown} ({', '.join(args.input_dtype or ['float32'])})"


def run(args: argparse.Namespace) -> int:
    from hyper_offload.passes import ScheduleError

    try:
        with quiet_torch_tracebacks(args.debug), progress_line("hyper-offload estimate"):
            report = _estimate(args)
    except _BadInput as error:
        report_bad_input("estimate", error, args.debug)
        return EXIT_BAD_INPUT
    except ScheduleError as error:
        print(f"hyper-offload estimate: error: the planner's schedule is invalid ({error}); "
              "this is a bug, please report it", file=sys.stderr)
        return EXIT_INVALID_SCHEDULE
    print(report.to_json() if args.json else report.summary())
    return EXIT_OK if report.fits else EXIT_INFEASIBLE


# ---------------------------------------------------------------- a model that fails, in one line

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
