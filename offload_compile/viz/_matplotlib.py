"""matplotlib, imported on first use: the one place the optional dependency is resolved."""

from __future__ import annotations

from types import ModuleType

__all__ = ["PlotDependencyError", "require_matplotlib"]


class PlotDependencyError(ImportError):
    """matplotlib is not installed."""


def require_matplotlib(what: str) -> ModuleType:
    """The ``matplotlib`` package (with ``figure`` and ``patches`` loaded) for drawing ``what``.

    Raises :class:`PlotDependencyError` naming the extra to install when it is missing.
    """
    try:
        import matplotlib
        import matplotlib.figure
        import matplotlib.patches
    except ImportError as error:
        raise PlotDependencyError(
            f"drawing {what} needs matplotlib, which is not installed; install it with "
            "`pip install hyper-offload[plot]` (or `pip install matplotlib`)"
        ) from error
    return matplotlib
