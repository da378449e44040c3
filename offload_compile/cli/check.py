"""``hyper-offload check MODULE:FACTORY [--input-shape 2,16 ...] [--door compile|eager]``.

Runs :func:`hyper_offload.check` on the user's own model: a few training steps without
the library and with everything movable moved, compared bit for bit. ``FACTORY()``
returns the model, or ``(model, example_inputs)``; with the model alone, the inputs are
random tensors of ``--input-shape`` / ``--input-dtype`` (integers drawn below
``--int-high``, e.g. token ids under the vocabulary size).

``--tile-sequence auto`` (or a tile count) also trains once with sequence tiling, which
is not bit-exact, and prints the largest absolute and relative deviation of the loss and
of each gradient from plain training; the verdict stays the exact check's.

Exit codes: 0 PASS; 1 FAIL (the first mismatch and the saved tensors responsible are
printed), NOTHING MOVED or NOT DETERMINISTIC (the check could not judge); 2 bad input,
one line on stderr.
"""

from __future__ import annotations

import argparse
from typing import Any

from hyper_offload.progress import note, progress_line

from .estimate import (
    _BadInput, add_debug_flag, describe, describe_inputs, load_factory, parse_dtype, parse_shape,
    quiet_torch_tracebacks, report_bad_input, tile_sequence_arg,
)


EXIT_PASS, EXIT_NOT_PASSED, EXIT_BAD_INPUT = 0, 1, 2


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "check",
        help="is hyper-offload bit-exact on your model? train a few steps with and without it",
        description="Train MODULE:FACTORY() for a few steps without hyper-offload and with "
        "every movable saved activation moved, compare the loss and every gradient bit for "
        "bit, and name the first mismatch and the saved tensor(s) responsible.",
    )
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="a .py file or importable module, and a function of no arguments "
                        "returning the model or (model, example_inputs)")
    parser.add_argument("--input-shape", action="append", default=None, metavar="D0,D1,...",
                        help="shape of one positional input when FACTORY returns the model "
                        "alone; repeat for several inputs")
    parser.add_argument("--input-dtype", action="append", default=None, metavar="DTYPE",
                        help="torch dtype of the inputs: once for all or once per input "
                        "(default float32)")
    parser.add_argument("--int-high", type=int, default=2,
                        help="integer inputs are drawn from [0, INT_HIGH) (default 2)")
    parser.add_argument("--door", choices=("compile", "eager"), default="compile",
                        help="which door to check (default compile)")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("--inner-compiler", choices=("aot_eager", "inductor"),
                        default="aot_eager", help="the compile door's inner compiler")
    parser.add_argument("--tile-sequence", type=tile_sequence_arg, default="off",
                        metavar="off|auto|N",
                        help="also train with sequence tiling (not bit-exact) and print its "
                        "deviation from plain training per gradient (default off)")
    add_debug_flag(parser)
    parser.set_defaults(run=run)


def _random_inputs(args: argparse.Namespace) -> tuple[Any, ...]:
    import torch

    if not args.input_shape:
        raise _BadInput(f"{args.target}() returned a model without example inputs; pass "
                        "--input-shape (and --input-dtype), or return (model, inputs)")
    shapes = [parse_shape(s) for s in args.input_shape]
    dtypes = [parse_dtype(d) for d in (args.input_dtype or ["float32"])]
    dtypes = dtypes * len(shapes) if len(dtypes) == 1 else dtypes
    if len(dtypes) != len(shapes):
        raise _BadInput(f"{len(dtypes)} --input-dtype for {len(shapes)} --input-shape; give one "
                        "dtype for all inputs or one per input")
    generator = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(shape, generator=generator).to(dtype) if dtype.is_floating_point
        else torch.randint(0, args.int_high, shape, generator=generator, dtype=dtype)
        for shape, dtype in zip(shapes, dtypes)
    )


def _problem(args: argparse.Namespace) -> tuple[Any, tuple[Any, ...]]:
    from torch import nn

    factory = load_factory(args.target)
    try:
        built = factory()
    except Exception as error:
        raise _BadInput(f"{args.target}() raised {describe(error)}") from error
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        return built[0], tuple(built[1])
    if isinstance(built, nn.Module):
        return built, _random_inputs(args)
    raise _BadInput(f"{args.target}() returned {type(built).__name__}; expected an nn.Module "
                    "or (module, example_inputs)")


def _check(args: argparse.Namespace, check: Any) -> Any:
    """``check`` on the problem; the model failing without the library is bad input."""
    from hyper_offload.errors import CheckUsageError

    note(f"building {args.target}()")
    model, inputs = _problem(args)
    try:
        return check(model, inputs, door=args.door, steps=args.steps,
                     inner_compiler=args.inner_compiler,
                     options={"tile_sequence": args.tile_sequence})
    except CheckUsageError:
        raise
    except Exception as error:  # the model itself fails without the library
        raise _BadInput(f"training {args.target} on {describe_inputs(args)} without "
                        f"hyper-offload fails: {describe(error)}") from error


def run(args: argparse.Namespace) -> int:
    from hyper_offload.errors import CheckUsageError

    try:
        with quiet_torch_tracebacks(args.debug), progress_line("hyper-offload check"):
            note("loading torch and the library")
            from hyper_offload.exactness.check import check

            report = _check(args, check)
    except (_BadInput, CheckUsageError) as error:
        report_bad_input("check", error, args.debug)
        return EXIT_BAD_INPUT
    print(report)
    return EXIT_PASS if report.passed else EXIT_NOT_PASSED
