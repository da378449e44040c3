"""Op declarations apart from the runtime: passes stay pure, the package loads lazily.

Import effects are process-wide, so every check that depends on what is (not) loaded runs
in a fresh interpreter (``-W error``: an import that warns, e.g. a kernel overridden in
place, fails too). The ops' behaviour once the real kernels are loaded is covered by
``test_ops.py``; here only that loading them makes a round trip work.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path

import hyper_offload.runtime as runtime

REPO = Path(__file__).resolve().parents[2]

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


def _fresh(code: str) -> dict[str, object]:
    """Run ``code`` in a new interpreter; it prints one JSON object as its last line."""
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


_RUNTIME_LOADED = (
    "sorted(m for m in sys.modules if m == 'hyper_offload.runtime'"
    " or m.startswith('hyper_offload.runtime.'))"
)


def test_importing_every_pass_loads_only_the_op_declarations_of_the_runtime() -> None:
    found = _fresh(f"""
        import importlib, json, pkgutil, sys
        import hyper_offload.passes as passes
        imported = []
        # walk_packages recurses into passes/pipeline/ (and any later subpackage).
        for info in pkgutil.walk_packages(passes.__path__, passes.__name__ + "."):
            importlib.import_module(info.name)
            imported.append(info.name)
        print(json.dumps({{"imported": imported, "runtime": {_RUNTIME_LOADED}}}))
    """)
    imported = set(found["imported"])  # type: ignore[arg-type]
    # The walk really reached the FX passes (the op users) and the pipeline passes.
    assert {"hyper_offload.passes.fx_trace", "hyper_offload.passes.fx_lowering",
            "hyper_offload.passes.fx_schedule", "hyper_offload.passes.pipeline",
            "hyper_offload.passes.pipeline.swap"} <= imported
    assert found["runtime"] == ["hyper_offload.runtime", "hyper_offload.runtime.op_declarations"]


def test_importing_the_runtime_package_loads_no_submodule() -> None:
    found = _fresh(f"""
        import json, sys
        import hyper_offload.runtime
        print(json.dumps({{"runtime": {_RUNTIME_LOADED}, "torch": "torch" in sys.modules}}))
    """)
    assert found == {"runtime": ["hyper_offload.runtime"], "torch": False}


def test_a_public_name_loads_its_own_submodule_only_on_first_access() -> None:
    found = _fresh(f"""
        import json, sys
        from hyper_offload.runtime import DataLostError
        print(json.dumps({{"runtime": {_RUNTIME_LOADED}}}))
    """)
    assert found["runtime"] == ["hyper_offload.runtime", "hyper_offload.runtime.errors"]


def test_every_public_name_resolves_to_its_defining_module() -> None:
    assert sorted(runtime.__all__) == sorted(runtime._LAZY)
    for name in runtime.__all__:
        defining = import_module(runtime._LAZY[name], runtime.__name__)
        assert getattr(runtime, name) is getattr(defining, name), name
    namespace: dict[str, object] = {}
    exec("from hyper_offload.runtime import *", namespace)  # noqa: S102
    assert set(runtime.__all__) <= set(namespace)


def test_helpers_are_not_exported_from_the_package() -> None:
    for name in NOT_EXPORTED:
        assert name not in runtime.__all__, name
        assert not hasattr(runtime, name), name


def test_op_declarations_import_nothing_of_the_library() -> None:
    # The module's own file (found without importing it), wherever the package is laid out.
    origin = find_spec("hyper_offload.runtime.op_declarations").origin  # type: ignore[union-attr]
    assert origin is not None
    path = Path(origin)
    imported: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import in op_declarations: {ast.dump(node)}"
            imported.append(node.module or "")
    assert imported  # the walk saw the imports (torch at least)
    tops = {name.split(".")[0] for name in imported}
    assert tops <= {"torch", "__future__"} | set(sys.stdlib_module_names), tops


def test_declarations_trace_without_the_runtime_and_say_what_to_import_to_run() -> None:
    found = _fresh(f"""
        import json, sys
        import torch
        from torch.fx.experimental.proxy_tensor import make_fx
        from hyper_offload.runtime import op_declarations as d

        def round_trip(x):
            host = d.WAIT_TRANSFER(d.COPY_D2H(x), x)
            back = d.WAIT_TRANSFER(d.COPY_H2D(host, x.device), host)
            d.RELEASE_HOST(host, back)
            return back * 2

        gm = make_fx(round_trip, tracing_mode="fake")(torch.randn(4, 3))
        traced = [str(n.target) for n in gm.graph.nodes if n.target in d.TRANSFER_OPS]
        try:
            d.COPY_D2H(torch.ones(2))
            error = None
        except RuntimeError as exc:
            error = str(exc)
        print(json.dumps({{"traced": traced, "error": error, "runtime": {_RUNTIME_LOADED}}}))
    """)
    assert found["traced"] == [
        "hyper_offload.copy_d2h.default", "hyper_offload.wait_transfer.default",
        "hyper_offload.copy_h2d.default", "hyper_offload.wait_transfer.default",
        "hyper_offload.release_host.default",
    ]
    error = found["error"]
    assert isinstance(error, str), "an op ran without its real kernel and did not raise"
    assert "hyper_offload::copy_d2h" in error and "import hyper_offload.runtime.ops" in error
    assert found["runtime"] == ["hyper_offload.runtime", "hyper_offload.runtime.op_declarations"]


_ROUND_TRIP_AFTER = """
    import json, sys
    import torch
    {load}
    from hyper_offload.runtime.op_declarations import COPY_D2H, COPY_H2D, RELEASE_HOST, WAIT_TRANSFER
    from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
    from hyper_offload.runtime.transfer_context import TransferRuntime

    x = torch.randn(4, 3, requires_grad=True)
    with TransferRuntime(pool=PinnedMemoryPool(1 << 20)):
        act = x.sin()
        host = WAIT_TRANSFER(COPY_D2H(act), act)
        back = WAIT_TRANSFER(COPY_H2D(host, x.device), host)
        RELEASE_HOST(host, back)
        (back * 2).sum().backward()
    print(json.dumps({{"exact": torch.equal(back, act) and torch.equal(x.grad, 2 * x.cos()),
                      "ops": "hyper_offload.runtime.ops" in sys.modules}}))
"""


def test_importing_ops_registers_the_real_kernels_without_warnings() -> None:
    # -W error: replacing the placeholders in place would raise the dispatcher's warning.
    found = _fresh(_ROUND_TRIP_AFTER.format(load="import hyper_offload.runtime.ops"))
    assert found == {"exact": True, "ops": True}


def test_the_compile_backend_registers_the_real_kernels() -> None:
    found = _fresh(_ROUND_TRIP_AFTER.format(load="import hyper_offload.compiler.dynamo_backend"))
    assert found == {"exact": True, "ops": True}
