"""matplotlib, imported on first use: the one place the optional dependency is resolved."""

from __future__ import annotations

from types import ModuleType

from hyper_offload.errors import PlotDependencyError

__all__ = ["PlotDependencyError", "require_matplotlib"]


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
