"""Names of a package loaded on first access (PEP 562): the library's one implementation.

The doors import torch (Inductor, dispatch modes, ``torch.distributed.pipelining``) and
the runtime loads its submodules on demand; the root, the CLI and the pure passes must not
pay for that. So a package lists ``{name: module}`` in a module-level ``_LAZY`` table and
sets ``__getattr__ = lazy_getattr(__name__, _LAZY)``: the first read of ``name`` imports
``module`` (relative to the package, or absolute), and the value is then stored on the
package so later reads never come back here.

Invariant: a leaf of the import graph (the standard library only), so every layer, the
passes and the runtime included, may import it (``tests/integration/test_layout.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package`` that serves the names of ``table``."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(table[name], package), name)
        setattr(sys.modules[package], name, value)  # later reads skip __getattr__
        return value

    return __getattr__
