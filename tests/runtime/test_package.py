"""The runtime package loads lazily, exports what its docstring says, and importing
:mod:`hyper_offload.runtime.ops` makes every ``hyper_offload`` op run.

Import effects are process-wide, so every check that depends on what is (not) loaded runs
in a fresh interpreter (``-W error``: an import that warns, e.g. a kernel overridden in
place, fails too). The ops' behaviour once the real kernels are loaded is covered by
``test_ops.py`` and ``test_ops_misuse.py``; here only that loading them makes a round trip
work. The declarations themselves are ``tests/passes/ir/test_ops.py``'s.
"""

from __future__ import annotations

from importlib import import_module

import hyper_offload.errors
import hyper_offload.runtime as runtime

from ..fresh import RUNTIME_LOADED, fresh_json

#: Helpers that live in their defining submodule only (runtime/__init__.py's docstring).
NOT_EXPORTED = (
    "BufferState",
    "COPY_D2H",
    "COPY_H2D",
    "DeviceTimer",
    "HostCopyState",
    "HostSyncCounter",
    "PhysicalBuffer",
    "RELEASE_HOST",
    "SyncReason",
    "TRANSFER_OPS",
    "WAIT_TRANSFER",
    "bucket_bytes",
    "current_transfer_runtime",
    "dense_layout",
    "pinned_cost",
)


def test_importing_the_runtime_package_loads_no_submodule() -> None:
    found = fresh_json(f"""
        import json, sys
        import hyper_offload.runtime
        print(json.dumps({{"runtime": {RUNTIME_LOADED}, "torch": "torch" in sys.modules}}))
    """)
    assert found == {"runtime": ["hyper_offload.runtime"], "torch": False}


def test_a_public_name_loads_its_own_submodule_only_on_first_access() -> None:
    found = fresh_json(f"""
        import json, sys
        import hyper_offload.runtime as runtime
        before = {RUNTIME_LOADED}
        runtime.DEFAULT_TRANSFER_BANDWIDTH
        print(json.dumps({{"before": before, "after": {RUNTIME_LOADED},
                          "cached": "DEFAULT_TRANSFER_BANDWIDTH" in vars(runtime)}}))
    """)
    assert found["before"] == ["hyper_offload.runtime"]
    after = found["after"]
    assert "hyper_offload.runtime.device" in after  # type: ignore[operator]
    for unrelated in ("residency", "transfer_context", "pinned_pool", "ops", "memory_meter"):
        module = f"hyper_offload.runtime.{unrelated}"
        assert module not in after, module  # type: ignore[operator]
    assert found["cached"] is True  # later reads skip the lazy __getattr__


def test_every_public_name_resolves_to_its_defining_module() -> None:
    errors = [name for name in runtime.__all__ if name not in runtime._LAZY]
    assert errors and all(name.endswith(("Error", "Warning")) for name in errors)
    for name in runtime.__all__:
        defining = (hyper_offload.errors if name in errors
                    else import_module(runtime._LAZY[name], runtime.__name__))
        assert getattr(runtime, name) is getattr(defining, name), name
    namespace: dict[str, object] = {}
    exec("from hyper_offload.runtime import *", namespace)  # noqa: S102
    assert set(runtime.__all__) <= set(namespace)


def test_helpers_are_not_exported_from_the_package() -> None:
    for name in NOT_EXPORTED:
        assert name not in runtime.__all__, name
        assert not hasattr(runtime, name), name


_ROUND_TRIP_AFTER = """
    import json, sys
    import torch
    {load}
    from hyper_offload.passes.ir.ops import (
        COPY_D2H, COPY_H2D, DISCARD, MATERIALIZE, RELEASE_HOST, WAIT_TRANSFER)
    from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
    from hyper_offload.runtime.transfer_context import TransferRuntime

    x = torch.randn(4, 3, requires_grad=True)
    with TransferRuntime(pool=PinnedMemoryPool(1 << 20)):
        act = x.sin()
        host = WAIT_TRANSFER(COPY_D2H(act), act)
        back = WAIT_TRANSFER(COPY_H2D(host, x.device), host)
        RELEASE_HOST(host, back)
        (back * 2).sum().backward()
    with torch.no_grad():
        kept = MATERIALIZE(act)
        barriers = (torch.equal(kept, act) and kept.data_ptr() != act.data_ptr()
                    and DISCARD(act).shape == (0,))
    print(json.dumps({{"exact": torch.equal(back, act) and torch.equal(x.grad, 2 * x.cos()),
                      "barriers": barriers, "ops": "hyper_offload.runtime.ops" in sys.modules}}))
"""


def test_importing_ops_registers_the_real_kernels_without_warnings() -> None:
    # -W error: replacing the placeholders in place would raise the dispatcher's warning.
    found = fresh_json(_ROUND_TRIP_AFTER.format(load="import hyper_offload.runtime.ops"))
    assert found == {"exact": True, "barriers": True, "ops": True}


def test_the_compile_backend_registers_the_real_kernels() -> None:
    backend = "import hyper_offload.compiler.backend"
    found = fresh_json(_ROUND_TRIP_AFTER.format(load=backend))
    assert found == {"exact": True, "barriers": True, "ops": True}
