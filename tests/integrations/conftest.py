"""Fixtures of the trainer integrations' tests.

``import lightning`` replaces ``torch.compile`` for the whole process
(``lightning.fabric.wrappers``: a wrapper that deep-copies the keyword arguments of every
compile of a module). Tests that need Lightning take ``lightning_imported``, which puts
the plain function back after the module's tests, so that what a later test module in
the same worker compiles does not depend on test order.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def lightning_imported() -> Iterator[ModuleType]:
    plain = getattr(torch.compile, "__wrapped__", torch.compile)
    lightning = importlib.import_module("lightning")
    if torch.compile is plain:  # imported for an earlier module, whose fixture undid it
        from lightning.fabric import wrappers

        torch.compile = wrappers._capture_compile_kwargs(plain)  # what its import does
    assert torch.compile.__wrapped__ is plain
    try:
        yield lightning
    finally:
        torch.compile = plain


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (its own folder importable, as when run)."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module
