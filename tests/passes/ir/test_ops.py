"""The ``hyper_offload::`` op declarations: the passes trace and lower them without loading
anything of the runtime, and an op run before its real kernel is registered says what to
import. What the real kernels do is ``tests/runtime/test_ops.py``'s; that importing them
makes the ops run is ``tests/runtime/test_package.py``'s."""

from __future__ import annotations

import ast
import sys
from importlib.util import find_spec
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hyper_offload.passes.ir import ops

from ...fresh import RUNTIME_LOADED, fresh_json


def test_importing_every_pass_loads_nothing_of_the_runtime() -> None:
    found = fresh_json(f"""
        import importlib, json, pkgutil, sys
        import hyper_offload.passes as passes
        imported = []
        # walk_packages recurses into every subpackage (ir/, fx/, pipeline/, ...).
        for info in pkgutil.walk_packages(passes.__path__, passes.__name__ + "."):
            importlib.import_module(info.name)
            imported.append(info.name)
        print(json.dumps({{"imported": imported, "runtime": {RUNTIME_LOADED}}}))
    """)
    imported = set(found["imported"])  # type: ignore[arg-type]
    # The walk really reached the op declarations, the FX passes (their users) and the
    # pipeline passes.
    assert {"hyper_offload.passes.ir.ops", "hyper_offload.passes.fx.graph_trace",
            "hyper_offload.passes.fx.lowering", "hyper_offload.passes.fx.lowering_check",
            "hyper_offload.passes.pipeline", "hyper_offload.passes.pipeline.swap"} <= imported
    assert found["runtime"] == []


def test_the_declarations_import_nothing_of_the_library_but_its_errors() -> None:
    # The module's own file (found without importing it), wherever the package is laid out.
    origin = find_spec("hyper_offload.passes.ir.ops").origin  # type: ignore[union-attr]
    assert origin is not None
    imported: list[str] = []
    for node in ast.walk(ast.parse(Path(origin).read_text())):
        if isinstance(node, ast.Import):
            imported.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import in the op declarations: {ast.dump(node)}"
            imported.append(node.module or "")
    assert imported  # the walk saw the imports (torch at least)
    # hyper_offload.errors is the bottom layer every module may import (stdlib only): the
    # declarations raise its classes, so ``except HyperOffloadError`` catches them too.
    tops = {name.split(".")[0] for name in imported if name != "hyper_offload.errors"}
    assert tops <= {"torch", "__future__"} | set(sys.stdlib_module_names), tops


def test_one_module_declares_every_op_of_the_namespace() -> None:
    declared = {op.name() for op in ops.ALL_OPS}
    assert declared == {f"hyper_offload::{name}" for name in (
        "copy_d2h", "copy_h2d", "wait_transfer", "release_host", "spill_to_disk",
        "load_from_disk", "release_disk", "hold", "materialize", "discard")}
    # Nothing else of the library defines an op in the namespace.
    for folder in ("offload_compile", "passes", "runtime"):
        for path in (Path(__file__).resolve().parents[3] / folder).rglob("*.py"):
            if path.name == "ops.py" and path.parent.name == "ir":
                continue
            text = path.read_text()
            assert "custom_op(" not in text and ".define(" not in text, path


def test_the_disk_ops_have_fake_kernels_and_effects() -> None:
    assert [str(op._schema) for op in ops.DISK_OPS] == [
        "hyper_offload::spill_to_disk(Tensor host) -> Tensor",
        "hyper_offload::load_from_disk(Tensor handle, SymInt[] size, SymInt[] stride, "
        "ScalarType dtype) -> Tensor",
        "hyper_offload::release_disk(Tensor handle, Tensor? after=None) -> ()",
        "hyper_offload::hold(Tensor[] tensors) -> ()",
    ]

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        host = ops.COPY_D2H(x)
        handle = ops.SPILL_TO_DISK(host)
        back = ops.LOAD_FROM_DISK(handle, [3, 4], [1, 3], torch.bfloat16)
        ops.RELEASE_DISK(handle, back)
        ops.HOLD([host, back])
        return back

    gm = make_fx(round_trip, tracing_mode="fake")(torch.randn(4, 3, dtype=torch.bfloat16).t())
    vals = {str(n.target): n.meta.get("val") for n in gm.graph.nodes if n.op == "call_function"}
    handle, back = vals["hyper_offload.spill_to_disk.default"], vals["hyper_offload.load_from_disk.default"]
    assert (handle.shape, handle.dtype, handle.device.type) == ((1,), torch.int64, "cpu")
    assert (back.shape, back.stride(), back.dtype, back.device.type) == (
        (3, 4), (1, 3), torch.bfloat16, "cpu")
    assert getattr(back.untyped_storage(), ops.HOST_LABEL, False)  # a host copy
    gm.graph.eliminate_dead_code()  # ordered effects: release and hold stay, unused as they are
    assert {ops.RELEASE_DISK, ops.HOLD} <= {n.target for n in gm.graph.nodes}


def test_the_recompute_barriers_have_fake_kernels_and_no_effects() -> None:
    def barriers(x: torch.Tensor) -> torch.Tensor:
        kept = ops.MATERIALIZE(x * 2)
        return kept + ops.DISCARD(x).sum()

    gm = make_fx(barriers, tracing_mode="fake")(torch.randn(4, 3))
    vals = {str(n.target): n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
    assert vals["hyper_offload.materialize.default"].shape == (4, 3)
    assert vals["hyper_offload.discard.default"].shape == (0,)
    # Unused, a barrier is dead code (no effects); the transfer ops never are.
    unused = make_fx(lambda x: (ops.MATERIALIZE(x), x + 1)[1], tracing_mode="fake")(torch.ones(2))
    unused.graph.eliminate_dead_code()
    assert all(n.target is not ops.MATERIALIZE for n in unused.graph.nodes)


def test_declarations_trace_without_the_runtime_and_say_what_to_import_to_run() -> None:
    found = fresh_json(f"""
        import json, sys
        import torch
        from torch.fx.experimental.proxy_tensor import make_fx
        from hyper_offload.passes.ir import ops as d

        def round_trip(x):
            host = d.WAIT_TRANSFER(d.COPY_D2H(x), x)
            back = d.WAIT_TRANSFER(d.COPY_H2D(host, x.device), host)
            d.RELEASE_HOST(host, back)
            return back * 2

        gm = make_fx(round_trip, tracing_mode="fake")(torch.randn(4, 3))
        traced = [str(n.target) for n in gm.graph.nodes if n.target in d.TRANSFER_OPS]
        errors = {{}}
        for op in (d.COPY_D2H, d.MATERIALIZE):
            try:
                op(torch.ones(2))
            except RuntimeError as exc:
                errors[op.name()] = str(exc)
        print(json.dumps({{"traced": traced, "errors": errors, "runtime": {RUNTIME_LOADED}}}))
    """)
    assert found["traced"] == [
        "hyper_offload.copy_d2h.default", "hyper_offload.wait_transfer.default",
        "hyper_offload.copy_h2d.default", "hyper_offload.wait_transfer.default",
        "hyper_offload.release_host.default",
    ]
    errors = found["errors"]
    assert set(errors) == {"hyper_offload::copy_d2h", "hyper_offload::materialize"}, (
        "an op ran without its real kernel and did not raise")
    for name, error in errors.items():  # type: ignore[union-attr]
        assert name in error and "import hyper_offload.runtime.ops" in error
    assert found["runtime"] == []
