"""The ``hyper-offload`` command: one module per subcommand.

``plan`` and ``pp-order`` are JSON planning jobs; every subcommand module imports torch
(and the rest of the library) only inside its ``run``, so ``import hyper_offload.cli`` and
``hyper-offload --help`` stay cheap.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
