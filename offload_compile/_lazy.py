"""Names of a door package loaded on first access (PEP 562), one implementation for all.

The doors import torch (Inductor, dispatch modes, ``torch.distributed.pipelining``); the
root and the CLI must not pay for that, so a package lists ``{name: module}`` and gets a
module ``__getattr__`` that imports ``module`` (relative to the package, or absolute)
when ``name`` is first read. Nothing is cached here: ``import_module`` caches modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package`` that serves the names of ``table``."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(import_module(table[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
