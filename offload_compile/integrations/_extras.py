"""The trainer packages, imported where an integration needs them: the one place a
missing optional dependency becomes an error that names the extra to install."""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from hyper_offload.errors import OptionalDependencyError

__all__ = ["require"]


def require(package: str, *, extra: str, feature: str) -> ModuleType:
    """The module ``package``, imported for ``feature``.

    Raises :class:`OptionalDependencyError` (an ``ImportError``) naming ``extra`` when it
    is not installed.
    """
    try:
        return import_module(package)
    except ImportError as error:
        raise OptionalDependencyError(
            f"{feature} needs the {package!r} package, which is not installed; install it "
            f'with `pip install "hyper-offload[{extra}]"`'
        ) from error
