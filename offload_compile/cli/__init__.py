"""The ``hyper-offload`` command: its parser, and one module per subcommand.

``plan`` and ``pp-order`` are JSON planning jobs; every subcommand module imports torch
(and the rest of the library) only inside its ``run``, so ``import hyper_offload.cli`` and
``hyper-offload --help`` stay cheap.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import check, estimate, plan, pp_order

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyper-offload",
        description="Activation offloading for PyTorch: plan, inspect and validate schedules, "
        "and estimate whether a model's training step fits.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan.register(commands)
    pp_order.register(commands)
    estimate.register(commands)
    check.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))
